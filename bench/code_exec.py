"""Code-exec sandbox throughput and overhead (issue 13).

  trivial     `print(1)` run N times: per-execution wall time under `namespaces` and `none`
              (bare subprocess: prlimit + fresh interpreter, no namespaces) -> sandbox overhead;
              then N more with every slot busy (max_concurrent = cores) -> executions/s/core
  ladder      each reference rung of each bundled task once under `namespaces`: exec seconds
  2x limit    2 * max_concurrent scripts of `--hold` seconds submitted at once, with a queue wait
              shorter than one script (-> RESOURCE_EXHAUSTED for the surplus) and longer (-> all
              queue and finish; the queued ones' latency)
  service     the same scripts through the gRPC service (plain grpcio server on 127.0.0.1,
              the registered `code-exec` task, max_concurrent = cores): executions/s for one
              ScoreBatch of N, and for the batch sent as chunks of max_concurrent at once
              (graders/spread.py); trivial = `print(1)` (no submission:
              invalid_submission), constant = the ladder's constant rung (reads the data,
              writes and grades a submission)

    python bench/code_exec.py [--n 20] [--hold 1.5] [--only service]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from graders.code_exec import sandbox as sb  # noqa: E402
from config.code_exec import CodeExecConfig  # noqa: E402


def _times(box, script: str, n: int) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        res, _, _ = box.run(script, None, collect=None)
        assert res.outcome == "ok", res.tail
        out.append(time.perf_counter() - t0)
    return out


def trivial(n: int) -> list[str]:
    cores = os.cpu_count() or 1
    rows = ["| isolation | median s/exec | p90 s/exec | exec/s/core (1 slot) | exec/s/core (all cores busy) |",
            "|---|---|---|---|---|"]
    med = {}
    for level in ("none", "namespaces"):
        box = sb.Sandbox(CodeExecConfig(isolation=level, min_isolation="none", max_concurrent=cores))
        _times(box, "print(1)", 2)  # warm page cache
        ts = sorted(_times(box, "print(1)", n))
        med[level] = statistics.median(ts)
        t0 = time.perf_counter()
        with ThreadPoolExecutor(cores) as pool:
            list(pool.map(lambda _: box.run("print(1)", None, collect=None), range(n)))
        busy = n / (time.perf_counter() - t0) / cores
        rows.append(f"| {level} | {med[level]:.3f} | {ts[int(0.9 * (len(ts) - 1))]:.3f} | "
                    f"{1 / med[level]:.1f} | {busy:.1f} |")
    rows.append(f"\nSandbox overhead (namespaces - none), median per execution: "
                f"**{(med['namespaces'] - med['none']) * 1000:.0f} ms**")
    return rows


def ladder() -> list[str]:
    from graders.code_exec.ladder import RUNGS, as_completion, ladder_script
    from graders.code_exec.verifier import CodeExecTask

    v = CodeExecTask(CodeExecConfig(max_concurrent=1))
    rows = ["| task | rung | status | test metric | val metric | reward | exec s | exec/s/core |",
            "|---|---|---|---|---|---|---|---|"]
    for tid in sorted(v.tasks):
        for rung in RUNGS:
            r = v.score(tid, as_completion(ladder_script(rung, v.tasks[tid].metric)))
            rows.append(f"| {tid} | {rung} | {r.status} | {r.test_metric:.4f} | "
                        f"{r.val_metric:.4f} | {r.reward:.4f} | {r.exec_time:.2f} | "
                        f"{1 / r.exec_time:.2f} |")
    rows.append(f"\nTasks: `{v.tasks_dir}` (seed {v.cfg.seed}); isolation {v.isolation}; "
                f"reward on the val split, test reported.")
    return rows


def overload(hold: float) -> list[str]:
    cores = os.cpu_count() or 1
    rows = ["| max_concurrent | submitted | queue_wait_s | finished ok | RESOURCE_EXHAUSTED | "
            "latency of each (s) |", "|---|---|---|---|---|---|"]
    for wait in (hold / 3, hold * 3):
        box = sb.Sandbox(CodeExecConfig(max_concurrent=cores, queue_wait_s=wait))
        barrier = threading.Barrier(2 * cores)

        def one(_):
            barrier.wait()
            t0 = time.perf_counter()
            try:
                res, _, _ = box.run(f"import time; time.sleep({hold})", None, collect=None)
                return res.outcome, time.perf_counter() - t0
            except sb.ResourceExhausted:
                return "exhausted", time.perf_counter() - t0

        with ThreadPoolExecutor(2 * cores) as pool:
            got = list(pool.map(one, range(2 * cores)))
        ok = sum(o == "ok" for o, _ in got)
        ex = sum(o == "exhausted" for o, _ in got)
        lat = ", ".join(f"{t:.2f}{'x' if o == 'exhausted' else ''}" for o, t in sorted(got, key=lambda g: g[1]))
        rows.append(f"| {cores} | {2 * cores} | {wait:.2f} | {ok} | {ex} | {lat} |")
    rows.append(f"\nEach script sleeps {hold} s; `x` marks a request refused after its queue wait.")
    return rows


def service(n: int) -> list[str]:
    from config.grader import GraderConfig
    from graders.client import GraderClient
    from graders.code_exec.ladder import as_completion, ladder_script
    from graders.spread import score_spread
    from graders.service import GraderCore, start_server
    from graders.tasks import make_task

    cores = os.cpu_count() or 1
    task = make_task(GraderConfig(task="code-exec", code_exec={"max_concurrent": cores}))
    server = start_server(GraderCore(task), "127.0.0.1", 0)
    rows = ["| script | executions | how sent | status | wall s | exec/s | exec/s/core |",
            "|---|---|---|---|---|---|---|"]
    scripts = {"trivial": "```python\nprint(1)\n```",
               "constant": as_completion(ladder_script("constant", "roc_auc"))}
    try:
        with GraderClient(server.address, max_retries=0, timeout_s=600) as client:
            client.score_batch([("tabular-binary", scripts["trivial"])] * cores)  # warm
            for name, completion in scripts.items():
                pairs = [("tabular-binary", completion)] * n
                for how, send in (("one ScoreBatch", client.score_batch),
                                  (f"chunks of {cores}", lambda p: score_spread(client, p, cores))):
                    t0 = time.perf_counter()
                    got = send(pairs)
                    wall = time.perf_counter() - t0
                    statuses = ",".join(sorted({s.status for s in got}))
                    rows.append(f"| {name} | {n} | {how} | {statuses} | {wall:.2f} | {n / wall:.2f} | "
                                f"{n / wall / cores:.2f} |")
    finally:
        server.stop(None)
    rows.append(f"\nOne grpcio server process, isolation {task.verifier.isolation}, "
                f"max_concurrent = {cores} = cores; wall time is the client's, gRPC included.")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=20, help="trivial executions per measurement")
    ap.add_argument("--hold", type=float, default=1.5, help="seconds each 2x-limit script sleeps")
    ap.add_argument("--only", choices=("trivial", "ladder", "overload", "service"), help="one section")
    args = ap.parse_args()
    level, why = sb.detect_isolation()
    print(f"host: {os.cpu_count()} cores, uid {os.geteuid()}, best isolation {level} ({why}), "
          f"interpreter baseline {sb.baseline_bytes() / 2**20:.0f} MiB VmPeak\n")
    sections = {"trivial": ("Trivial script", lambda: trivial(args.n)),
                "ladder": ("Reference ladder", ladder),
                "overload": ("2x the concurrency limit", lambda: overload(args.hold)),
                "service": ("Through the gRPC service", lambda: service(args.n))}
    for key, (title, run) in sections.items():
        if args.only in (None, key):
            print(f"## {title}\n")
            print("\n".join(run()) + "\n")


if __name__ == "__main__":
    main()
