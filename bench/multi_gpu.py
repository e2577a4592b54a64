"""Measure a distributed run: s/step with its phase breakdown, update_weights seconds, tokens/s
per GPU (or per rollout replica on CPU), peak memory per GPU; write them with the exact command.

    python bench/multi_gpu.py --config configs/multi-gpu.yaml [--set k=v ...] \
        [--out bench/results/multi-gpu.md]

On a multi-GPU host this runs `configs/multi-gpu.yaml` unchanged (rollout replicas and learner
workers on distinct GPUs through Ray resources); on CPU hosts run the stand-in
`configs/multi-gpu-cpu.yaml` (2 learner workers over gloo, 2 rollout replicas).
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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="configs/multi-gpu.yaml")
    ap.add_argument("--set", dest="overrides", action="append", default=[])
    ap.add_argument("--run-name", default=f"bench-multi-{int(time.time())}")
    ap.add_argument("--out", default="bench/results/multi-gpu.md")
    ap.add_argument("--skip-first", type=int, default=1, help="Warm-up steps left out of the medians.")
    args = ap.parse_args()

    cmd = [sys.executable, "-m", "services.cli", "train", "--config", args.config, "--run-name", args.run_name,
           "--set", "trainer.runs_dir=runs", *sum((["--set", o] for o in args.overrides), [])]
    peaks: dict[int, float] = {}
    stop = threading.Event()
    sampler = threading.Thread(target=gpu_memory_sampler, args=(stop, peaks), daemon=True)
    sampler.start()
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
    lines = [
        f"# Multi-GPU run ({time.strftime('%Y-%m-%d')})", "",
        "Command:", "", "```", shlex.join(["python", "bench/multi_gpu.py", "--config", args.config,
                                           *sum((["--set", o] for o in args.overrides), [])]), "```", "",
        f"exit code {rc}; wall {wall:.0f} s; {len(timing)} steps trained; medians over steps {args.skip_first + 1}..",
        f"rollout replicas {replicas} (GPUs each {cfg.get('rollout', {}).get('num_gpus')}), learner workers "
        f"{cfg.get('learner', {}).get('workers')} (GPU {cfg.get('learner', {}).get('use_gpu')})", "",
        "| phase | median s |", "|---|---|",
        *[f"| {p} | {med([t['phases_s'].get(p, 0.0) for t in kept]):.3f} |" for p in PHASES],
        f"| **total (s/step)** | {med([t['total_s'] for t in kept]):.3f} |", "",
        f"generation tokens/s (all replicas): {gen_tokens:.1f}; per replica/GPU: {gen_tokens / replicas:.1f}",
        f"ppl_ratio (median): {med([m.get('ppl_ratio', float('nan')) for m in metrics[args.skip_first:]]):.5f}", "",
        "| GPU | peak memory used (MiB) |", "|---|---|",
        *([f"| {i} | {peaks[i]:.0f} |" for i in sorted(peaks)] or ["| (no GPU) | - |"]),
    ]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
