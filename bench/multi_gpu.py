"""Measure a distributed run: s/step with its phase breakdown, update_weights seconds, generation
tokens/s per rollout replica (one GPU or a share of one; a CPU replica on CPU hosts), learner
tokens/s and MFU, peak memory per GPU and which processes held it; write them with the command.

    python bench/multi_gpu.py --config configs/multi-gpu.yaml [--set k=v ...] \
        [--out bench/results/multi-gpu.md]

On a multi-GPU host this runs `configs/multi-gpu.yaml` unchanged (rollout replicas and learner
workers on distinct GPUs through Ray resources), on two GPUs `configs/multi-gpu-2gpu.yaml`
(bench/multi_gpu_device.sh runs its three placements on a lent host); on CPU hosts run the
stand-in `configs/multi-gpu-cpu.yaml` (2 learner workers over gloo, 2 rollout replicas).

Learner MFU counts 4 x (weights of every linear layer, the output head included) FLOPs per token
the update computes (forward 2N, backward to the activations 2N: the base is frozen, LoRA's own
terms and attention scores are left out), tokens = each group's prompt once (learner.share_prompt_
prefix) + every response, over update_actor seconds x learner GPUs x --peak-tflops.

Checks, written with the figures (exit 1 when one fails):
- every sample of step k was generated with adapter version k (sync mode): each replica that
  answered held the step's adapter (the step's `update_weights` waits for all of them);
- ppl_ratio within 1 +- 0.05 on every step;
- with more than one learner worker, unless --no-ddp-check: the learner alone, with the config's model and placement, takes the
  same update with N workers and with 1 worker on the same global batches (random tokens in
  groups). The tolerance is measured, not assumed: 1 worker with half the micro-batch (same
  mathematics, another summation order) gives the dtype's noise floor; N workers must be
  within max(1e-4, 2 x floor) of 1 worker, relative to the adapter's movement.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# bench/ holds scripts named like our packages (learner.py, rollout.py): run as a script, this
# folder would come first on sys.path and shadow them. Put the repo root there instead.
if sys.path and Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
    sys.path[0] = str(REPO)
PHASES = ("gen", "score", "old_log_prob", "ref", "adv", "update_actor", "update_weights", "save_checkpoint")


def gpu_memory_sampler(stop: threading.Event, peaks: dict[int, float]) -> None:
    """Peak used MiB per GPU, sampled from nvidia-smi every second (all processes on it)."""
    while not stop.is_set():
        try:
            out = subprocess.run(["nvidia-smi", "--query-gpu=index,memory.used", "--format=csv,noheader,nounits"],
                                 capture_output=True, text=True, timeout=10).stdout
        except (FileNotFoundError, subprocess.TimeoutExpired):
            return
        for line in out.strip().splitlines():
            idx, used = (x.strip() for x in line.split(","))
            peaks[int(idx)] = max(peaks.get(int(idx), 0.0), float(used))
        stop.wait(1.0)


def gpu_process_sampler(stop: threading.Event, held: dict[tuple[int, str], float]) -> None:
    """Peak MiB per (GPU index, process title) from nvidia-smi's compute apps: where Ray put what."""
    def query(what: str) -> list[list[str]]:
        out = subprocess.run(["nvidia-smi", f"--query-{what}", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=10).stdout
        return [[x.strip() for x in line.split(",")] for line in out.strip().splitlines() if line.strip()]

    try:
        index = {uuid: int(i) for i, uuid in query("gpu=index,uuid")}
    except (FileNotFoundError, subprocess.TimeoutExpired, ValueError):
        return
    while not stop.is_set():
        try:
            for uuid, pid, used in query("compute-apps=gpu_uuid,pid,used_memory"):
                try:
                    # Ray retitles a worker per task (RolloutReplica.handle_request...): keep the actor.
                    title = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode().split(".")[0][:60]
                except OSError:
                    title = ""
                title = title or f"pid {pid} (gone before it was read)"
                key = (index.get(uuid, -1), title)
                held[key] = max(held.get(key, 0.0), float(used))
        except (subprocess.TimeoutExpired, ValueError):
            pass
        stop.wait(2.0)


def matmul_weights(model_cfg: dict) -> int:
    """Weights of every nn.Linear of the model (the output head included), built on the meta device."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from config.rollout import ModelConfig
    from model.base import resolve_model

    conf = AutoConfig.from_pretrained(str(resolve_model(ModelConfig(**model_cfg))))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(conf)
    return sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))


def computed_tokens(run: Path, shared_prefix: bool) -> dict[int, int]:
    """Tokens the learner's update runs per step: each group's prompt once when the prefix is
    shared (else once per row), plus every response."""
    out: dict[int, int] = {}
    for path in sorted(run.glob("round_*/*.jsonl")):
        groups: set = set()
        for line in path.read_text().splitlines():
            row = json.loads(line)
            step = row["step"]
            prompt = len(row["prompt_token_ids"])
            if shared_prefix and (step, row["sibling_group"]) in groups:
                prompt = 0
            groups.add((step, row["sibling_group"]))
            out[step] = out.get(step, 0) + prompt + len(row["response_token_ids"])
    return out


def version_check(run: Path) -> tuple[int, int]:
    """(samples, samples whose adapter_version is not their step) over the run's round rows."""
    total = bad = 0
    for path in sorted(run.glob("round_*/*.jsonl")):
        for line in path.read_text().splitlines():
            row = json.loads(line)
            total += 1
            bad += int(row["adapter_version"] != row["step"])
    return total, bad


def ddp_check(config: str, overrides: list[str], steps: int, work: Path) -> dict:
    """Adapter movement of the learner with N workers vs 1 worker (and the 1-worker noise floor)."""
    import ray
    from safetensors.torch import load

    from bench.synthetic import grouped_batch, relative_gap
    from learner.job import LearnerJob
    from config import load_config
    from config.runtime_env import apply_defaults

    cfg = load_config(config, overrides)
    workers = cfg.learner.workers
    mb = cfg.learner.micro_batch_size
    n = cfg.trainer.prompts_per_step * cfg.trainer.group_size
    arms = {"n_workers": (workers, mb), "one_worker": (1, mb), "noise_floor": (1, max(1, mb // 2))}
    apply_defaults()
    ray.init(address=cfg.trainer.ray_address, include_dashboard=False, log_to_driver=False,
             **({} if cfg.trainer.ray_address else {"num_cpus": cfg.trainer.ray_num_cpus}))
    out: dict = {"workers": workers, "steps": steps}
    try:
        finals, init = {}, None
        for name, (w, m) in arms.items():
            arm_cfg = cfg.model_copy(deep=True)
            arm_cfg.learner.workers, arm_cfg.learner.micro_batch_size = w, m
            job = LearnerJob(arm_cfg, work / name)
            try:
                info = job.start()
                init = init or load(info.init_payload.safetensors)
                for k in range(steps):
                    batch = grouped_batch(n, cfg.trainer.group_size, 64, (4, cfg.rollout.max_tokens), 1000, 1000 + k,
                                          rollout_logprob=-7.0)
                    result = job.step(batch)
                finals[name] = load(result.adapter.safetensors)
            finally:
                job.stop()
    finally:
        ray.shutdown()

    one = finals["one_worker"]
    moved = {k: one[k].float() - init[k].float() for k in one}  # the 1-worker adapter's movement
    out["floor"] = relative_gap(finals["noise_floor"], one, moved)
    out["diff"] = relative_gap(finals["n_workers"], one, moved)
    out["bound"] = max(1e-4, 2 * out["floor"])
    out["ok"] = out["diff"] <= out["bound"]
    return out


def ddp_line(ddp: dict) -> str:
    return (f"- learner, {ddp['workers']} workers vs 1 worker, same global batches, {ddp['steps']} steps: "
            f"||delta_N - delta_1|| / ||delta_1|| = {ddp['diff']:.3e}; noise floor (1 worker, half micro-batch) "
            f"{ddp['floor']:.3e}; bound {ddp['bound']:.3e} ({'OK' if ddp['ok'] else 'FAIL'})")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="configs/multi-gpu.yaml")
    ap.add_argument("--set", dest="overrides", action="append", default=[])
    ap.add_argument("--run-name", default=f"bench-multi-{int(time.time())}")
    ap.add_argument("--out", default="bench/results/multi-gpu.md")
    ap.add_argument("--skip-first", type=int, default=1, help="Warm-up steps left out of the medians.")
    ap.add_argument("--no-ddp-check", action="store_true", help="Skip the N-vs-1 learner worker check.")
    ap.add_argument("--ddp-steps", type=int, default=2, help="Learner steps of each arm of the DDP check.")
    ap.add_argument("--peak-tflops", type=float, default=989.0,
                    help="Per-GPU peak for MFU (H100/H200 SXM dense bf16, datasheet; 788 measured on a lent H200).")
    ap.add_argument("--title", default="Multi-GPU run", help="Heading of the written table.")
    ap.add_argument("--check-only", action="store_true",
                    help="Only the N-vs-1 learner worker check (no training run): for a run measured before.")
    args = ap.parse_args()
    if args.check_only:
        import tempfile

        ddp = ddp_check(args.config, args.overrides, args.ddp_steps, Path(tempfile.mkdtemp(prefix="cp-ddp-check-")))
        lines = [f"# {args.title} ({time.strftime('%Y-%m-%d')})", "", "Command:", "", "```",
                 shlex.join(["python", "bench/multi_gpu.py", *sys.argv[1:]]), "```", "", ddp_line(ddp)]
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text("\n".join(lines) + "\n")
        print("\n".join(lines))
        return int(not ddp["ok"])

    cmd = [sys.executable, "-m", "services.cli", "train", "--config", args.config, "--run-name", args.run_name,
           "--set", "trainer.runs_dir=runs", *sum((["--set", o] for o in args.overrides), [])]
    peaks: dict[int, float] = {}
    held: dict[tuple[int, str], float] = {}
    stop = threading.Event()
    for target, arg in ((gpu_memory_sampler, peaks), (gpu_process_sampler, held)):
        threading.Thread(target=target, args=(stop, arg), daemon=True).start()
    t0 = time.time()
    rc = subprocess.run(cmd, cwd=REPO).returncode
    wall = time.time() - t0
    stop.set()
    run = REPO / "runs" / args.run_name
    timing = [json.loads(x) for x in (run / "timing.jsonl").read_text().splitlines()] if (run / "timing.jsonl").exists() else []
    metrics = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()] if (run / "metrics.jsonl").exists() else []
    cfg = json.loads((run / "run.json").read_text())["config"] if (run / "run.json").exists() else {}
    kept = timing[args.skip_first:] or timing
    med = lambda xs: statistics.median(xs) if xs else float("nan")  # noqa: E731
    replicas = cfg.get("rollout", {}).get("replicas", 1)
    gen_tokens = med([m.get("generated_tokens", 0) / max(1e-9, t["phases_s"].get("gen", 0))
                      for m, t in zip(metrics[args.skip_first:], kept)])
    lcfg = cfg.get("learner", {})
    learner_gpus = lcfg.get("workers", 1) if lcfg.get("use_gpu") else 0
    learner_tokens = med([m.get("total_tokens", 0) / max(1e-9, t["phases_s"].get("update_actor", 0))
                          for m, t in zip(metrics[args.skip_first:], kept)])
    learner_line = f"learner tokens/s (prompt + response tokens of the batch over update_actor): {learner_tokens:.0f}"
    if learner_gpus and timing:
        weights = matmul_weights(cfg["model"])
        computed = computed_tokens(run, lcfg.get("share_prompt_prefix", True))
        mfu = med([4 * weights * computed.get(t["step"], 0)
                   / (max(1e-9, t["phases_s"].get("update_actor", 0)) * learner_gpus * args.peak_tflops * 1e12)
                   for t in kept])
        learner_line += (f"; per learner GPU: {learner_tokens / learner_gpus:.0f}; MFU {100 * mfu:.2f}% "
                         f"(4 x {weights / 1e6:.1f}M linear weights x tokens computed, "
                         f"{args.peak_tflops:g} TFLOP/s per GPU, {learner_gpus} GPUs, {cfg['model'].get('dtype')})")
    lines = [
        f"# {args.title} ({time.strftime('%Y-%m-%d')})", "",
        "Command:", "", "```", shlex.join(["python", "bench/multi_gpu.py", *sys.argv[1:]]), "```", "",
        f"exit code {rc}; wall {wall:.0f} s; {len(timing)} steps trained; medians over steps {args.skip_first + 1}..",
        f"rollout replicas {replicas} (GPUs each {cfg.get('rollout', {}).get('num_gpus')}), learner workers "
        f"{lcfg.get('workers')} (GPU {lcfg.get('use_gpu')}, {lcfg.get('gpus_per_worker', 1.0)} each; "
        f"strategy {lcfg.get('strategy', 'ddp')}), rollout engine {cfg.get('rollout', {}).get('engine')}", "",
        "| phase | median s |", "|---|---|",
        *[f"| {p} | {med([t['phases_s'].get(p, 0.0) for t in kept]):.3f} |" for p in PHASES],
        f"| **total (s/step)** | {med([t['total_s'] for t in kept]):.3f} |", "",
        f"generation tokens/s (all replicas): {gen_tokens:.1f}; per replica/GPU: {gen_tokens / replicas:.1f}",
        learner_line,
        f"ppl_ratio (median): {med([m.get('ppl_ratio', float('nan')) for m in metrics[args.skip_first:]]):.5f}", "",
        "| GPU | peak memory used (MiB) |", "|---|---|",
        *([f"| {i} | {peaks[i]:.0f} |" for i in sorted(peaks)] or ["| (no GPU) | - |"]),
    ]
    if held:
        lines += ["", "| GPU | process (nvidia-smi compute apps) | peak MiB |", "|---|---|---|",
                  *[f"| {i} | {name} | {mib:.0f} |" for (i, name), mib in sorted(held.items())]]
    lines += ["", "| step | " + " | ".join(PHASES) + " | total |", "|---" * (len(PHASES) + 2) + "|",
              *[f"| {t['step']} | " + " | ".join(f"{t['phases_s'].get(p, 0.0):.2f}" for p in PHASES)
                + f" | {t['total_s']:.2f} |" for t in timing]]
    samples, stale = version_check(run)
    ppl = [m.get("ppl_ratio", float("nan")) for m in metrics]
    checks = {
        "adapter versions": samples > 0 and stale == 0,
        "ppl_ratio within 1 +- 0.05": bool(ppl) and all(abs(p - 1.0) <= 0.05 for p in ppl),
    }
    lines += ["", "Checks:", "",
              f"- adapter version of the step: {samples - stale} of {samples} samples were generated with their "
              f"step's adapter version ({'OK' if checks['adapter versions'] else 'FAIL'})",
              f"- ppl_ratio per step: {', '.join(f'{p:.4f}' for p in ppl)} "
              f"({'OK' if checks['ppl_ratio within 1 +- 0.05'] else 'FAIL'})"]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    if not args.no_ddp_check and lcfg.get("workers", 1) > 1:
        import tempfile

        # Written first without it: a check cut short still leaves the run's figures.
        Path(args.out).write_text("\n".join([*lines, "- learner N vs 1 worker: (check running)"]) + "\n")

        ddp = ddp_check(args.config, args.overrides, args.ddp_steps, Path(tempfile.mkdtemp(prefix="cp-ddp-check-")))
        checks["ddp"] = ddp["ok"]
        lines.append(ddp_line(ddp))
    Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return rc or int(not all(checks.values()))


if __name__ == "__main__":
    raise SystemExit(main())
