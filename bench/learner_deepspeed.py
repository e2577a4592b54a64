"""DeepSpeed ZeRO-2 (learner.strategy=deepspeed) against the plain path on one GPU: the same update, and
the seconds, tokens/s and peak memory of each. GPU hosts only (DeepSpeed is GPU-only here).

    python bench/learner_deepspeed.py --steps 3 --out bench/results/learner-deepspeed.md

Both learners start from the same seeded LoRA init on the same random Qwen3-0.6B-shaped base
(bf16, built here: nothing is downloaded; LoRA r=32 on all linear layers, fp32 adapter weights)
and train on the same batches (groups of --group-size rows sharing one prompt). The check is the
adapter's movement: ||delta_ds - delta_plain|| / ||delta_plain|| after --steps updates.

What "the same" can mean is set by the run itself: a third learner, plain again but accumulating
over micro-batches of half the size (the same mathematics, another summation order), measures
the noise floor of the dtype. LoRA's B starts at 0, so A's first gradients are tiny and Adam's
m/sqrt(v) turns their rounding noise into full-size steps: in bf16 the floor is percents, not
1e-6. DeepSpeed passes when its difference is within max(--tolerance, 2 x that floor).

Resume: the DeepSpeed learner saves a checkpoint after step --steps // 2 (its ZeRO optimizer
partitions under deepspeed/); a new DeepSpeed learner resumed from it trains the remaining steps
on the same batches and must end on the same adapter as the uninterrupted one: within 1e-5 of
the adapter's movement in float32; in bfloat16, where GPU kernels (flash-attention's backward)
are not bit-reproducible and Adam amplifies that, within the measured noise floor.
Exits 1 when a check fails.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

# This folder holds scripts named like our packages; put the repo root first on sys.path.
if sys.path and Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from bench.synthetic import grouped_batch, l2, relative_gap  # noqa: E402

for _k, _v in {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}.items():
    os.environ.setdefault(_k, _v)


def build_model(out: Path, vocab: int, seed: int) -> Path:
    import torch
    from transformers import Qwen3ForCausalLM

    from model.base import qwen3_shape_config

    if (out / "config.json").exists():
        return out
    torch.manual_seed(seed)
    Qwen3ForCausalLM(qwen3_shape_config(vocab, pad=0)).save_pretrained(out, safe_serialization=True)
    return out


def run_config(args, model_dir: Path, deepspeed: bool, micro_batch_size: int):
    from config import RunConfig

    return RunConfig.model_validate({
        "seed": args.seed,
        "model": {"name_or_path": str(model_dir), "dtype": args.dtype},
        "learner": {"use_gpu": True, "strategy": "deepspeed" if deepspeed else "ddp", "lr": args.lr, "micro_batch_size": micro_batch_size,
                    "lora": {"r": 32, "alpha": 64, "target_modules": "all-linear"}},
        "rollout": {"max_tokens": args.response_len},
        "trainer": {"steps": args.steps},
    })


def run(args, model_dir: Path, deepspeed: bool, micro_batch_size: int, label: str,
        save_at: int | None = None, ckpt: Path | None = None, resume_from: Path | None = None) -> dict:
    import torch

    from learner.lora import adapter_state_dict
    from learner.policy import PolicyLearner

    cfg = run_config(args, model_dir, deepspeed, micro_batch_size)
    torch.cuda.reset_peak_memory_stats()
    learner = PolicyLearner.for_run(cfg, device="cuda:0", resume_from=resume_from)
    init = {k: v.float().cpu() for k, v in adapter_state_dict(learner.peft_model).items()}
    rows, seconds = [], []
    for k in range(learner.step_count, args.steps):
        batch = grouped_batch(args.sequences, args.group_size, args.prompt_len, (args.response_len // 4, args.response_len),
                              args.vocab, 100 + k, rollout_logprob=-10.8)
        torch.cuda.synchronize()
        t = time.perf_counter()
        metrics, phases = learner.step(batch)
        torch.cuda.synchronize()
        seconds.append(time.perf_counter() - t)
        rows.append({"step": k + 1, "loss": metrics["loss"], "grad_norm": metrics["grad_norm"],
                     "ppl_ratio": metrics["ppl_ratio"], "tokens": metrics["total_tokens"]})
        if save_at is not None and k + 1 == save_at:
            learner.save_checkpoint(ckpt, data_position={"bench": k + 1})
    final = {k: v.float().cpu() for k, v in adapter_state_dict(learner.peft_model).items()}
    out = {
        "mode": label,
        "final": final,
        "delta": {k: final[k] - init[k] for k in final},
        "init": init,
        "rows": rows,
        "s_per_step": statistics.median(seconds[1:] or seconds),
        "tokens_per_s": rows[-1]["tokens"] / statistics.median(seconds[1:] or seconds),
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30,
    }
    del learner
    torch.cuda.empty_cache()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--sequences", type=int, default=16)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--response-len", type=int, default=384)
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="base model dtype")
    ap.add_argument("--tolerance", type=float, default=0.01,
                    help="relative difference of the adapter deltas always accepted (see the noise floor)")
    ap.add_argument("--model-dir", type=Path, default=Path("/tmp/counterpoint-qwen3-shape"))
    ap.add_argument("--out", type=Path, default=None, help="also write the tables as markdown")
    args = ap.parse_args()

    import torch
    import torch.distributed as dist

    if not torch.cuda.is_available():
        print("error: no CUDA device; DeepSpeed is GPU-only here", file=sys.stderr)
        return 2
    for k, v in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29517", "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}.items():
        os.environ.setdefault(k, v)
    dist.init_process_group("nccl")
    torch.cuda.set_device(0)
    model_dir = build_model(args.model_dir, args.vocab, args.seed)
    mb = args.group_size
    plain = run(args, model_dir, False, mb, f"plain, micro-batch {mb}")
    noise = run(args, model_dir, False, max(1, mb // 2), f"plain, micro-batch {max(1, mb // 2)} (noise floor)")
    half = max(1, args.steps // 2)
    ckpt = Path(tempfile.mkdtemp(prefix="cp-ds-ckpt-")) / f"step_{half}"
    ds = run(args, model_dir, True, mb, f"deepspeed zero-2, micro-batch {mb}", save_at=half, ckpt=ckpt)
    resumed = run(args, model_dir, True, mb, "deepspeed zero-2, resumed", resume_from=ckpt)
    dist.destroy_process_group()
    resume_rel = relative_gap(resumed["final"], ds["final"], ds["delta"])
    ckpt_files = sorted(str(p.relative_to(ckpt)) for p in ckpt.rglob("*") if p.is_file())

    def rel_diff(other: dict) -> tuple[float, float]:
        """(||d_other - d_plain|| / ||d_plain||, cosine(d_other, d_plain)) over all adapter tensors."""
        norms = l2(plain["delta"]) * l2(other["delta"])
        dot = sum(float((other["delta"][k] * plain["delta"][k]).sum()) for k in plain["delta"])
        return relative_gap(other["delta"], plain["delta"], plain["delta"]), (dot / norms if norms > 0 else float("nan"))

    same_init = all(torch.equal(plain["init"][k], r["init"][k]) for r in (noise, ds) for k in plain["init"])
    rel, cos = rel_diff(ds)
    floor, floor_cos = rel_diff(noise)
    bound = max(args.tolerance, 2 * floor)
    import deepspeed
    import transformers

    lines = [
        f"# DeepSpeed ZeRO-2 vs plain learner, one GPU ({torch.cuda.get_device_name(0)})",
        "",
        f"`python bench/learner_deepspeed.py --steps {args.steps} --dtype {args.dtype}` — Qwen3-0.6B-shaped "
        f"random base ({args.dtype}), "
        f"LoRA r=32 all-linear, {args.sequences} x ({args.prompt_len} + <= {args.response_len}) tokens per step, "
        f"groups of {args.group_size}; torch {torch.__version__}, transformers {transformers.__version__}, "
        f"deepspeed {deepspeed.__version__}.",
        "",
        "| mode | s/step (median after the first) | tokens/s | peak GiB |",
        "|---|---|---|---|",
    ]
    for r in (plain, noise, ds):
        lines.append(f"| {r['mode']} | {r['s_per_step']:.3f} | {r['tokens_per_s']:.0f} | {r['peak_gib']:.2f} |")
    lines += ["", "| step | loss plain | loss ds | grad_norm plain | grad_norm ds | ppl_ratio plain | ppl_ratio ds |",
              "|---|---|---|---|---|---|---|"]
    for a, b in zip(plain["rows"], ds["rows"]):
        lines.append(f"| {a['step']} | {a['loss']:.6f} | {b['loss']:.6f} | {a['grad_norm']:.5f} | {b['grad_norm']:.5f} "
                     f"| {a['ppl_ratio']:.5f} | {b['ppl_ratio']:.5f} |")
    resume_bound = 1e-5 if args.dtype == "float32" else max(1e-5, floor)
    resume_ok = resume_rel <= resume_bound and [r["step"] for r in resumed["rows"]] == list(range(half + 1, args.steps + 1))
    ok = same_init and rel <= bound and resume_ok
    lines += ["", f"- same init adapter in all three: {same_init}",
              f"- noise floor (plain, half micro-batch vs plain): relative {floor:.3e}, cosine {floor_cos:.6f}",
              f"- deepspeed vs plain: relative {rel:.3e}, cosine {cos:.6f}; bound max({args.tolerance}, 2 x floor) "
              f"= {bound:.3e}: {'OK' if rel <= bound else 'FAIL'}",
              f"- resume: checkpoint after step {half} ({', '.join(ckpt_files)}); resumed learner ran steps "
              f"{[r['step'] for r in resumed['rows']]}; ||final_resumed - final_straight|| / ||delta|| = "
              f"{resume_rel:.3e} (bound {resume_bound:.1e}): {'OK' if resume_ok else 'FAIL'}"]
    text = "\n".join(lines)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
