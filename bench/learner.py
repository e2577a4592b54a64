"""Learner bench: tokens/s of a full GRPO update through Ray Train (LearnerJob), 1 and 2 workers.

    flock /tmp/cp-heavy.lock .venv/bin/python bench/learner.py               # smollm2-135m, 8 x (64 + 128)
    .venv/bin/python bench/learner.py --model tiny-random --sequences 8 --steps 2
    # the default run's shape: 2 groups of 8 x (456 prompt + 35 completion), with and without
    # computing each group's prompt once (learner.share_prompt_prefix)
    .venv/bin/python bench/learner.py --workers 1 --setups folded --sequences 16 --group-size 8 \
        --prompt-len 456 --response-len 35 --micro-batch-size 8 --share on off

Two objective set-ups per worker count:
- ``full``: old_log_prob pass + ref pass (beta > 0) + update, every phase run separately;
- ``folded``: the default objective (beta 0, epochs_per_step 1): old log-probs come from the
  update's own forward, no ref pass.
The batch is random token ids (speed does not depend on their meaning); each run of
``--group-size`` rows shares one prompt, as a GRPO group does. The first step of each job is a
warm-up and is not counted; tokens/s = (prompt + response tokens of every row, i.e. the tokens
the update is about, whether or not a shared prompt is computed once) / (old + ref + update).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

# This file is named like the `learner` package; run as a script its own folder would come
# first on sys.path and shadow the package. Put the repo root there instead.
if sys.path and Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
    sys.path[0] = str(Path(__file__).resolve().parents[1])


def bench_one(args, workers: int, setup: str, share: bool, run_dir: Path) -> dict:
    from bench.synthetic import grouped_batch
    from learner.job import LearnerJob
    from config import RunConfig

    learner = {
        "workers": workers,
        "num_cpus_per_worker": args.cpus / workers,
        "micro_batch_size": args.micro_batch_size,
        "share_prompt_prefix": share,
    }
    if setup == "full":
        learner.update(beta=0.04, fold_old_logprobs=False)
    cfg = RunConfig.model_validate({
        "model": {"name_or_path": args.model},
        "learner": learner,
        "rollout": {"max_tokens": args.response_len},
        "trainer": {"steps": args.steps},
    })
    job = LearnerJob(cfg, run_dir / f"{setup}_w{workers}_share{int(share)}")
    try:
        job.start()
        rows, walls = [], []
        for k in range(args.steps):
            b = grouped_batch(args.sequences, args.group_size, args.prompt_len, (args.response_len, args.response_len),
                              args.vocab, k, rollout_logprob=-10.0)
            t = time.perf_counter()
            rows.append(job.step(b))
            walls.append(time.perf_counter() - t)
    finally:
        job.stop()
    counted = rows[1:] or rows
    phases = {p: statistics.median(r.phases_s[p] for r in counted) for p in ("old_log_prob", "ref", "update_actor")}
    seconds = sum(phases.values())
    tokens = counted[0].metrics["total_tokens"]
    return {
        "setup": setup, "shared_prefix": "on" if share else "off", "workers": workers, "threads_per_worker": max(1, int(args.cpus / workers)),
        "tokens": int(tokens), **{f"{p}_s": round(v, 2) for p, v in phases.items()},
        "step_s": round(seconds, 2), "tokens_per_s": round(tokens / seconds, 1),
        # driver-side wall time of job.step: phases + Ray round trips + adapter export/transfer
        "wall_s": round(statistics.median(walls[1:] or walls), 2),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--setups", nargs="+", default=["full", "folded"], choices=["full", "folded"])
    ap.add_argument("--sequences", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--response-len", type=int, default=128)
    ap.add_argument("--micro-batch-size", type=int, default=4)
    ap.add_argument("--group-size", type=int, default=1, help="consecutive rows sharing one prompt")
    ap.add_argument("--share", nargs="+", default=["on"], choices=["on", "off"],
                    help="learner.share_prompt_prefix settings to time")
    ap.add_argument("--steps", type=int, default=2, help="steps per job; the first is a warm-up")
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--cpus", type=int, default=2, help="Ray CPUs shared by the workers")
    ap.add_argument("--run-dir", default="/tmp/counterpoint-bench-learner")
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args()

    import ray

    from config.runtime_env import apply_defaults

    apply_defaults()
    ray.init(num_cpus=args.cpus, include_dashboard=False, log_to_driver=False)
    results = []
    try:
        for setup in args.setups:
            for share in args.share:
                for w in args.workers:
                    results.append(bench_one(args, w, setup, share == "on", Path(args.run_dir)))
                print(json.dumps(results[-1]), flush=True)
    finally:
        ray.shutdown()

    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"learner update, {args.model}, {args.sequences} x ({args.prompt_len} + {args.response_len}) "
                  f"tokens, groups of {args.group_size}")
    cols = ["setup", "shared_prefix", "workers", "threads_per_worker", "tokens", "old_log_prob_s", "ref_s", "update_actor_s", "step_s", "tokens_per_s", "wall_s"]
    for c in cols:
        table.add_column(c)
    for r in results:
        table.add_row(*(str(r[c]) for c in cols))
    Console(width=160).print(table)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
