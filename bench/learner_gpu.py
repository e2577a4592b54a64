"""The learner's update on one GPU, variant against variant, on the same batches (issue 21, item 3).

    python3 bench/learner_gpu.py --model /tmp/gpu-vs-trl/models/qwen3-4b --prompts 1 \
        --variants eager_shared,eager,graphs --out $OUT/learner-4b-1.json
    python3 bench/learner_gpu.py --model ... --prompts 4 --variants eager,fused,graphs,graphs_fused

Each variant is the PolicyLearner that the Ray Train worker runs, with configs/gpu-bench.yaml's
learner section and a few overrides:
- ``eager_shared``: the CUDA path as it was before issue 21: the group's prompt shared
  (share_prompt_prefix), no graphs;
- ``eager``: no shared prefix, no graphs;
- ``graphs``: the update's forward and backward captured as CUDA graphs (learner/graphed.py);
- ``fsdp2``, ``fsdp2_offload``: learner.strategy=fsdp2 (learner/fsdp.py) on a one-rank process group
  (nccl on a GPU, gloo on CPU), the second with FSDP2's CPU offload of the sharded base;
  ``fsdp2_compiled``: ``fsdp2`` with its layers compiled (learner.compile_layers=true);
- ``fused``, ``graphs_fused``: ``eager`` and ``graphs`` with peft's LoRA layers run as one autograd
  function each and A, B cast to bf16 once per step (learner/fused_lora.py, issue 34); the others
  set learner.fused_lora=false, since its 'auto' is on for a CUDA worker;
- ``compiled``: ``eager`` with each decoder layer compiled (learner.compile_layers, its 'auto' on
  one CUDA worker): inductor's fused norms, RoPE, activations and LoRA scale-and-add; the first
  step holds the compile;
- ``packed``: ``eager`` with each micro-batch's rows as one unpadded row (learner.pack_sequences,
  issue 35 item 3): what the block-diagonal mask costs, or, with ``--response-min`` below
  ``--response-len`` (rows of different lengths), what the padding it drops saved.
The batches are random tokens in GRPO groups of G=8, with the bench's shape: ~200 prompt and 384
response tokens (each row's response drawn from [--response-min, --response-len]; all equal by
default). A step counts what learner/worker.py counts as update_actor, the adapter's
export included. The first ``--warmup`` steps hold the graph capture and are left out.

Checks: ``graphs`` and the fused variants must end where ``eager`` ends from the same init on the same batches
(relative distance of the adapters, against the noise floor of eager against eager_shared,
which differ only in summation order). ``--profile`` adds one profiled step per variant: the
device's busy time against the step's wall time, and the ops that keep it busy.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

if sys.path and Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
    sys.path[0] = str(Path(__file__).resolve().parents[1])

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = {
    "eager_shared": {"share_prompt_prefix": True, "cuda_graphs": False, "fused_lora": False, "compile_layers": False},
    "eager": {"share_prompt_prefix": False, "cuda_graphs": False, "fused_lora": False, "compile_layers": False},
    "graphs": {"share_prompt_prefix": False, "cuda_graphs": True, "fused_lora": False, "compile_layers": False},
    "fused": {"share_prompt_prefix": False, "cuda_graphs": False, "fused_lora": True, "compile_layers": False},
    # issue 35 item 3: each micro-batch's rows as one unpadded row (learner.pack_sequences); beside
    # ``eager`` it says what the block-diagonal mask costs or the padding saved
    "packed": {"share_prompt_prefix": False, "cuda_graphs": False, "fused_lora": False, "compile_layers": False, "pack_sequences": True},
    # learner.compile_layers: every decoder layer through torch.compile (learner/compiled_layers.py), over
    # peft's LoRA layers (the config refuses it over the fused ones; bench/results/gpu-2026-12-04-a69f1ae)
    "compiled": {"share_prompt_prefix": False, "cuda_graphs": False, "fused_lora": False, "compile_layers": True},
    "graphs_fused": {"share_prompt_prefix": False, "cuda_graphs": True, "fused_lora": True, "compile_layers": False},
    # ``compiled`` with checkpointing forced off and on: on an H100's half (42.5 GB) the memory plan
    # (learner/memory_plan.py, whose estimate is eager's) checkpointed at 4B 4x8, where the compiled
    # learner's plain peak on an H200 (~31.5 GiB) would fit (bench/results/gpu-2026-12-06-h100-fp8):
    # what checkpointing costs there, and the plain path's peak
    "compiled_plain": {"share_prompt_prefix": False, "cuda_graphs": False, "fused_lora": False, "compile_layers": True,
                       "gradient_checkpointing": False},
    "compiled_ckpt": {"share_prompt_prefix": False, "cuda_graphs": False, "fused_lora": False, "compile_layers": True,
                      "gradient_checkpointing": True},
    # issue 35: the base sharded by FSDP2 over a one-rank process group (the code path a Ray Train
    # worker runs under learner.strategy=fsdp2); its s/step beside ``eager`` is what sharding costs
    "fsdp2": {"share_prompt_prefix": False, "cuda_graphs": False, "fused_lora": False, "compile_layers": False, "strategy": "fsdp2"},
    "fsdp2_offload": {"share_prompt_prefix": False, "cuda_graphs": False, "fused_lora": False, "compile_layers": False, "strategy": "fsdp2",
                      "fsdp_cpu_offload": True},
    # ``fsdp2`` with the sharded layers compiled (their gathers stay outside the graph): against
    # ``fsdp2``, whether compiling pays for the lab's sharded path too, where auto leaves it off
    "fsdp2_compiled": {"share_prompt_prefix": False, "cuda_graphs": False, "fused_lora": False, "compile_layers": True,
                       "strategy": "fsdp2"},
}


def learner_config(model: str, prompts: int, overrides: dict, cpu: bool, memory_budget_gib: float | None = None):
    import yaml

    from config import RunConfig

    tree = yaml.safe_load((ROOT / "configs" / "gpu-bench.yaml").read_text())
    tree["model"]["name_or_path"] = model
    tree["trainer"]["prompts_per_step"] = prompts
    tree["learner"].update(overrides)
    if memory_budget_gib is not None:  # the memory plan's budget as on another GPU
        tree["learner"]["memory_budget_gib"] = memory_budget_gib
    if cpu:
        tree["learner"]["use_gpu"] = False
        tree["model"]["dtype"] = "float32"
    return RunConfig.model_validate(tree)


def batches(n: int, prompts: int, vocab: int, prompt_len: int, response_len: int, response_min: int | None = None):
    from bench.synthetic import grouped_batch

    lo = response_len if response_min is None else response_min
    return [grouped_batch(prompts * 8, 8, prompt_len, (lo, response_len), vocab, seed=100 + k,
                          rollout_logprob=-12.0) for k in range(n)]


KERNEL_KINDS = (  # (kind, substrings of the kernel's name), first match wins
    ("attention", ("flash", "fmha", "attention", "sdpa")),
    ("gemm", ("gemm", "nvjet", "cutlass", "xmma", "matmul", "splitk", "cublas")),
    ("inductor", ("triton_",)),
    ("copy/cast", ("copy", "memcpy", "memset", "cast", "fill")),
    ("reduce", ("reduce", "norm", "softmax", "logsumexp")),
    ("elementwise", ("elementwise", "vectorized", "unrolled")),
)


def kernel_kind(name: str) -> str:
    """A kernel's kind by its name (cuBLAS' nvjet/xmma GEMMs, FlashAttention, inductor's triton
    kernels, ATen's elementwise and reductions), to see which kind holds an update's time."""
    low = name.lower()
    return next((kind for kind, keys in KERNEL_KINDS if any(k in low for k in keys)), "other")


def profile_step(policy, batch, gpu: bool) -> dict:
    """One step under torch.profiler: wall, the device's busy time (its kernels' sum), top ops."""
    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if gpu else [])
    t = time.perf_counter()
    with profile(activities=acts) as prof:
        policy.step(batch)
        policy.payload(policy.step_count + 1)  # the export, as the worker does after every step
        if gpu:
            torch.cuda.synchronize()
    wall = time.perf_counter() - t
    attr = "self_device_time_total" if gpu else "self_cpu_time_total"
    avgs = prof.key_averages()
    # On a GPU the device's own events only (kernels, copies): an ATen op and a compiled graph's
    # launch on the host carry their kernels' device time too, and a label its range on the
    # device's timeline, so a sum over every event counts a kernel two or three times.
    device_events = [e for e in avgs if getattr(e, attr, 0.0) > 0 and (not gpu or (
        e.device_type != DeviceType.CPU and not getattr(e, "is_user_annotation", False)
        and not e.key.startswith("cp.")))]
    busy = sum(getattr(e, attr, 0.0) for e in device_events)
    kernels = sum(e.count for e in device_events)
    top = sorted(device_events, key=lambda e: getattr(e, attr, 0.0), reverse=True)[:10]
    # The learner's own labels (record_function "cp.*" in learner/policy.py and passes.py): the
    # host's time inside each, which includes its waits on the device (a sync at the grad norm,
    # the metrics, the export's copy), and the device time of the kernels each launched.
    # On a GPU each label comes twice (its host range and its range on the device's timeline):
    # the larger of each figure is the label's.
    parts: dict[str, dict] = {}
    for e in avgs:
        if e.key.startswith("cp."):
            part = parts.setdefault(e.key, {"calls": 0, "host_ms": 0.0, "device_ms": 0.0})
            part["calls"] = max(part["calls"], e.count)
            part["host_ms"] = max(part["host_ms"], e.cpu_time_total / 1e3)
            part["device_ms"] = max(part["device_ms"], getattr(e, "device_time_total", 0.0) / 1e3)
    kinds: dict[str, float] = {}  # where the device's time goes, by kind of kernel
    for e in device_events if gpu else ():
        kind = kernel_kind(e.key)
        kinds[kind] = kinds.get(kind, 0.0) + getattr(e, attr, 0.0) / 1e3
    return {"wall_s": wall, "device_busy_s": busy / 1e6 if gpu else None, "ops_with_time": kernels,
            "parts": parts, "kinds_ms": dict(sorted(kinds.items(), key=lambda kv: -kv[1])),
            "top": [{"name": e.key[:70], "ms": getattr(e, attr, 0.0) / 1e3, "calls": e.count} for e in top]}


def one_rank_group(gpu: bool) -> None:
    """A process group of this process alone, as a one-worker Ray Train job has (fsdp2 needs one)."""
    import os

    import torch.distributed as dist

    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29531")
        dist.init_process_group("nccl" if gpu else "gloo", rank=0, world_size=1)


def run_variant(name: str, args, data) -> tuple[dict, dict]:
    import torch

    from learner.lora import adapter_state_dict
    from learner.policy import PolicyLearner
    from model.adapter import adapter_version

    gpu = torch.cuda.is_available() and not args.cpu
    cfg = learner_config(str(args.model), args.prompts, VARIANTS[name], args.cpu, args.memory_budget_gib)
    if gpu:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    if cfg.learner.strategy == "fsdp2":
        one_rank_group(gpu)
    t = time.perf_counter()
    policy = PolicyLearner.for_run(cfg, device="cuda" if gpu else "cpu")
    load_s = time.perf_counter() - t
    def adapter_now() -> dict:  # fsdp2 holds shards: gather the full tensors, as the worker does
        full = policy.full_adapter()
        return {k: v.detach().cpu() for k, v in full.items()} if full is not None else adapter_state_dict(policy.peft_model)

    init = {k: v.clone() for k, v in adapter_now().items()}  # CPU tensors are views
    steps, exports, metrics = [], [], []
    for batch in data:
        t = time.perf_counter()
        m, phases = policy.step(batch)
        e = time.perf_counter()
        policy.payload(adapter_version(policy.step_count), policy.full_adapter())  # every step, as the worker does
        if gpu:
            torch.cuda.synchronize()
        steps.append(time.perf_counter() - t)
        exports.append(time.perf_counter() - e)
        metrics.append(m)
    final = adapter_now()
    row = {"variant": name, "load_s": load_s, "steps_s": steps,
           "update_s": statistics.median(steps[args.warmup:]) if len(steps) > args.warmup else None,
           "export_s": statistics.median(exports[args.warmup:]) if len(exports) > args.warmup else None,
           "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if gpu else None,
           "loss": [m["loss"] for m in metrics], "grad_norm": [m["grad_norm"] for m in metrics],
           "ppl_ratio": [m["ppl_ratio"] for m in metrics], "cuda_graphs": [m["learner_cuda_graphs"] for m in metrics],
           "stats": policy.stats()}
    if args.profile:
        row["profile"] = profile_step(policy, data[-1], gpu)
    del policy
    if cfg.learner.strategy == "fsdp2":
        import torch.distributed as dist

        dist.destroy_process_group()
    return row, {"init": init, "final": final}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, required=True, help="a model dir (bench/gpu_vs_trl.py builds them)")
    ap.add_argument("--prompts", type=int, default=1, help="groups of 8 per step")
    ap.add_argument("--variants", default="eager_shared,eager,graphs,fused",
                    help=f"comma-separated, of {', '.join(VARIANTS)}")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--prompt-len", type=int, default=200)
    ap.add_argument("--response-len", type=int, default=384)
    ap.add_argument("--response-min", type=int, default=None,
                    help="shortest response (drawn uniformly up to --response-len); default: all --response-len")
    ap.add_argument("--memory-budget-gib", type=float, default=None,
                    help="learner.memory_budget_gib for every variant: the memory plan's budget of another GPU, "
                         "e.g. 39.58 (42.5 GB: half an H100 80GB HBM3, what a half-GPU learner gets there)")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--cpu", action="store_true", help="dry run on CPU (a tiny model, short rows)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    from bench.synthetic import relative_gap
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(str(args.model)).vocab_size
    data = batches(args.steps, args.prompts, vocab, args.prompt_len, args.response_len, args.response_min)
    rows, states = [], {}
    for name in args.variants.split(","):
        try:
            row, states[name] = run_variant(name, args, data)
        except Exception as err:  # noqa: BLE001 - record it, go on with the next variant
            import traceback

            traceback.print_exc()
            row = {"variant": name, "error": f"{type(err).__name__}: {err}"[:500]}
        rows.append(row)
        print(f"[learner] {json.dumps({k: v for k, v in row.items() if k not in ('profile', 'stats')})}", flush=True)
    checks = {}
    if "eager" in states:
        base = states["eager"]
        moved = {k: base["final"][k].float() - base["init"][k].float() for k in base["final"]}
        for name, st in states.items():
            if name != "eager":
                checks[f"{name}_vs_eager"] = relative_gap(st["final"], base["final"], moved)
    doc = {"model": str(args.model), "prompts": args.prompts, "rows": rows, "checks": checks}
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(doc, indent=1))
    # fused: the LoRA forwards that ran fused / through peft's path (a graph replay counts none)
    print(f"{'variant':<14} {'update s':>9} {'export s':>9} {'steps s':<40} {'peak GiB':>8} {'fused/peft':>12} "
          f"{'checkpointed':>12}")
    for r in rows:
        steps = ", ".join(f"{x:.3f}" for x in r.get("steps_s", []))
        upd = f"{r['update_s']:.3f}" if r.get("update_s") is not None else r.get("error", "-")[:60]
        peak = f"{r['peak_gib']:.1f}" if r.get("peak_gib") else "-"
        exp = f"{r['export_s']:.3f}" if r.get("export_s") is not None else "-"
        fl = (r.get("stats") or {}).get("fused_lora")
        fused = f"{fl['fused_forwards']}/{fl['peft_forwards']}" if fl else "-"
        ckpt = (r.get("stats") or {}).get("gradient_checkpointing", "-")  # as the last step ran (the plan's choice)
        print(f"{r['variant']:<14} {upd:>9} {exp:>9} {steps:<40} {peak:>8} {fused:>12} {str(ckpt):>12}")
        if "profile" in r:
            p = r["profile"]
            busy = f"{p['device_busy_s']:.3f}" if p["device_busy_s"] is not None else "-"
            print(f"{'':<14} profiled step: wall {p['wall_s']:.3f} s, device busy {busy} s, {p['ops_with_time']} ops")
            for name, part in sorted(p.get("parts", {}).items(), key=lambda kv: -kv[1]["host_ms"]):
                print(f"{'':<16} {name:<18} x{part['calls']:<4} host {part['host_ms']:8.1f} ms"
                      f"  device {part['device_ms']:8.1f} ms")
            if p.get("kinds_ms"):
                print(f"{'':<16} by kind: " + ", ".join(f"{k} {v:.1f} ms" for k, v in p["kinds_ms"].items()))
            for op in p["top"][:8]:
                print(f"{'':<16} {op['name'][:48]:<48} x{op['calls']:<6} {op['ms']:8.1f} ms")
    print("adapter distance (relative to eager's movement):", json.dumps({k: f"{v:.2e}" for k, v in checks.items()}))
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
