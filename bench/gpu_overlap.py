"""Does the update hide under generation on one GPU, and under which sharing? A torch-only probe
for issue 34: minutes on the H200, no vLLM, no checkpoint, no Ray.

Two loads over Qwen3-4B's linear layers (36 layers of q, k, v, o, gate, up and down; bf16,
random weights):
- decode, the replica's part: every layer's GEMMs at ROWS rows (the decode batch: 8 at 1x8, 32
  at 4x8), one step captured as a CUDA graph, replayed STEPS times (384: one generation call);
- update, the learner's part: every layer's forward GEMMs and their input-gradient GEMMs at
  ROWS x 584 tokens (the 4x8 step's rows of ~200 prompt and 384 response tokens), REPS passes.
Attention, norms, LoRA's small GEMMs and the LM head are left out of both: the probe asks how
the two processes' big kernels share the GPU, not what a step costs.

Variants, each a fresh set of processes released at once:
  alone          each load by itself: the baseline, measured in the same run
  timeslice      two processes, no MPS: the GPU switches between their contexts
  mps            two MPS clients, both normal, every SM (gpu_sharing.mode=mps)
  mps_capN       the update at N% of the SMs (gpu_sharing.learner_sm_percent=N), any N in 1-99:
                 mps_cap50, mps_cap30, ...
  mps_low        the update a below-normal client (gpu_sharing.learner_priority=below_normal)
  mps_low_capN   both
  ..._rM         the decode too capped, at M% (gpu_sharing.rollout_sm_percent=M): mps_cap30_r70
  streams        one process: the decode on a high-priority stream, the update on a low one
                 (what MPS priorities would give at best: one context, no time-slicing at all)
A row: each load's seconds (from its release to its last kernel), the pair's wall, and
`hidden` = (decode alone + update alone - wall) / update alone: the share of the update's time
that disappeared under the decode (1 all of it, 0 back to back, below 0 worse than back to
back). The MPS daemon is the run's own (services/mps.py), under a temporary pipe directory,
quit at the end; it is never the GPU's compute mode that changes.

    python3 bench/gpu_overlap.py --rows 8,32 --out $OUT/overlap.json
    python3 bench/gpu_overlap.py --device cpu --tiny --variants alone,timeslice   # the plumbing, anywhere
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

if sys.path and Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
    sys.path[0] = str(Path(__file__).resolve().parents[1])

TOKENS_PER_ROW = 584  # bench/gpu_vs_trl.py's rows: ~200 prompt and 384 response tokens
VARIANTS = ("alone", "timeslice", "mps", "mps_cap50", "mps_low", "mps_low_cap50", "streams")  # the default set


def mps_settings(variant: str) -> dict | None:
    """A variant's MPS settings as config/gpu_sharing.py names them: the update's SM percent and
    priority, the decode's SM percent; None for a variant that is not an MPS one or a cap outside
    1-99 (100 is no cap: plain `mps`)."""
    m = re.fullmatch(r"mps(_low)?(?:_cap(\d+))?(?:_r(\d+))?", variant)
    if m is None:
        return None
    caps = [int(c) for c in m.group(2, 3) if c is not None]
    if not all(0 < c < 100 for c in caps):
        return None
    return {"learner_sm_percent": int(m.group(2) or 100),
            "learner_priority": "below_normal" if m.group(1) else "normal",
            "rollout_sm_percent": int(m.group(3) or 100)}


def known(variant: str) -> bool:
    return variant in ("alone", "timeslice", "streams") or mps_settings(variant) is not None


@dataclass(frozen=True)
class Shape:
    hidden: int
    q: int
    kv: int
    intermediate: int
    layers: int

    def linears(self) -> list[tuple[int, int]]:
        """(in, out) of one layer's linear layers: q, k, v, o, gate, up, down."""
        h = self.hidden
        return [(h, self.q), (h, self.kv), (h, self.kv), (self.q, h), (h, self.intermediate),
                (h, self.intermediate), (self.intermediate, h)]


QWEN3_4B = Shape(hidden=2560, q=4096, kv=1024, intermediate=9728, layers=36)
TINY = Shape(hidden=64, q=64, kv=32, intermediate=128, layers=2)


def hidden_share(decode_alone: float, update_alone: float, wall: float) -> float:
    """The share of the update's own time that ran under the decode: 1 when the pair took as long
    as the decode alone, 0 when it took the two back to back."""
    return (decode_alone + update_alone - wall) / update_alone


# ------------------------------------------------------------------ the loads (one process)


def _loads(load: str, shape: Shape, rows: int, device: str):
    """Callables that enqueue the decode (one generation call) and one update pass."""
    import torch

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    g = torch.Generator(device=device).manual_seed(0)
    weights = [torch.randn(i, o, device=device, dtype=dtype, generator=g) * i ** -0.5
               for _ in range(shape.layers) for i, o in shape.linears()]
    sizes = {n for w in weights for n in w.shape}

    def buffers(m: int) -> dict[int, "torch.Tensor"]:
        return {n: torch.randn(m, n, device=device, dtype=dtype, generator=g) for n in sizes}

    out = {}
    if load in ("decode", "both"):
        x, y = buffers(rows), buffers(rows)

        def step():
            for w in weights:
                torch.mm(x[w.shape[0]], w, out=y[w.shape[1]])

        out["decode_step"] = step
    if load in ("update", "both"):
        t = rows * TOKENS_PER_ROW
        act, fwd, grad, dx = buffers(t), buffers(t), buffers(t), buffers(t)

        def update_pass():
            for w in weights:  # forward
                torch.mm(act[w.shape[0]], w, out=fwd[w.shape[1]])
            for w in reversed(weights):  # the input gradients
                torch.mm(grad[w.shape[1]], w.t(), out=dx[w.shape[0]])

        out["update_pass"] = update_pass
    return out


def worker(load: str, shape: Shape, rows: int, steps: int, reps: int, device: str) -> dict:
    """Build, warm, say ready, wait for the release on stdin, run, report seconds (wall-clock
    epoch times, so that the parent can line two processes up)."""
    import torch

    cuda = device == "cuda"
    if not cuda:
        torch.set_num_threads(1)  # the plumbing run: two workers on a small host
    loads = _loads(load, shape, rows, device)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    decode = loads.get("decode_step")
    if decode is not None and cuda:  # one step as a CUDA graph: no host work between kernels
        decode()
        sync()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            loads["decode_step"]()
        decode = graph.replay
    for fn in (decode, loads.get("update_pass")):
        if fn is not None:
            fn()
    sync()
    print("ready", flush=True)
    sys.stdin.readline()
    if load == "both":  # one context, two streams: the decode's kernels go first where both wait
        hi, lo = torch.cuda.Stream(priority=-1), torch.cuda.Stream(priority=0)
        start = torch.cuda.Event(enable_timing=True)
        ends = {k: torch.cuda.Event(enable_timing=True) for k in ("decode", "update")}
        t0 = time.time()
        start.record()
        hi.wait_event(start)
        lo.wait_event(start)
        with torch.cuda.stream(hi):
            for _ in range(steps):
                decode()
            ends["decode"].record()
        with torch.cuda.stream(lo):
            for _ in range(reps):
                loads["update_pass"]()
            ends["update"].record()
        sync()
        times = {k: start.elapsed_time(e) / 1e3 for k, e in ends.items()}
        return {"start": t0, "end": t0 + max(times.values()), **times}
    t0 = time.time()
    if load == "decode":
        for _ in range(steps):
            decode()
    else:
        for _ in range(reps):
            loads["update_pass"]()
    sync()
    t1 = time.time()
    return {"start": t0, "end": t1, load: t1 - t0}


# ------------------------------------------------------------------ the orchestration


def _worker_cmd(load: str, rows: int, args) -> list[str]:
    return [sys.executable, str(Path(__file__).resolve()), "worker", load, "--rows", str(rows),
            "--steps", str(args.steps), "--reps", str(args.reps), "--device", args.device,
            *(["--tiny"] if args.tiny else [])]


def run_together(cmds: list[tuple[list[str], dict[str, str]]], timeout: float) -> list[dict]:
    """Start every command, release them together once each says ready, and return what each
    reported. A worker that fails fails the bench with its output's tail."""
    procs = [subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env={**os.environ, **env}) for cmd, env in cmds]
    try:
        for p in procs:
            line = p.stdout.readline().strip()
            if line != "ready":
                p.kill()
                raise RuntimeError(f"a worker did not come up ({line!r}): {p.stderr.read()[-2000:]}")
        for p in procs:
            p.stdin.write("go\n")
            p.stdin.flush()
        results = []
        for p in procs:
            out, err = p.communicate(timeout=timeout)
            if p.returncode != 0:
                raise RuntimeError(f"a worker failed (exit {p.returncode}): {err[-2000:]}")
            results.append(json.loads(out.strip().splitlines()[-1]))
        return results
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def measure(args, rows: int, variant: str, mps_env) -> dict:
    """One variant at ``rows`` rows: each load's seconds and the pair's wall."""
    decode, update = _worker_cmd("decode", rows, args), _worker_cmd("update", rows, args)
    if variant == "alone":
        (d,), (u,) = run_together([(decode, {})], args.timeout), run_together([(update, {})], args.timeout)
        return {"decode": d["decode"], "update": u["update"], "wall": None}
    if variant == "streams":
        (both,) = run_together([(_worker_cmd("both", rows, args), {})], args.timeout)
        return {"decode": both["decode"], "update": both["update"], "wall": max(both["decode"], both["update"])}
    if variant == "timeslice":
        envs = ({}, {})
    else:
        mps = mps_settings(variant)
        envs = (mps_env("rollout", mps["rollout_sm_percent"], "normal"),
                mps_env("learner", mps["learner_sm_percent"], mps["learner_priority"]))
    d, u = run_together([(decode, envs[0]), (update, envs[1])], args.timeout)
    return {"decode": d["decode"], "update": u["update"], "wall": max(d["end"], u["end"]) - min(d["start"], u["start"])}


def run(args) -> dict:
    from services.mps import GpuSharing, MpsPlan, find_control_binary

    wanted = [v for v in args.variants.split(",") if v]
    unknown = [v for v in wanted if not known(v)]
    if unknown:
        raise SystemExit(f"--variants: unknown {unknown}; choose from {', '.join(VARIANTS)}, or mps_capN / "
                         f"mps_low_capN / mps_capN_rM for other caps in 1-99")
    wanted = ["alone", *(v for v in wanted if v != "alone")]  # first: every other row is read against it
    cuda_only = [v for v in wanted if v.startswith("mps") or v == "streams"]
    if args.device != "cuda" and cuda_only:
        raise SystemExit(f"--variants {','.join(cuda_only)} need --device cuda")
    sharing = None
    if any(v.startswith("mps") for v in wanted):
        binary = find_control_binary()
        if binary is None:
            raise SystemExit("the MPS variants need nvidia-cuda-mps-control (it ships with the NVIDIA driver)")
        root = tempfile.mkdtemp(prefix="cp-overlap-mps-")
        sharing = GpuSharing(MpsPlan("start", "bench/gpu_overlap.py", f"{root}/pipe", f"{root}/log"), binary)

    def mps_env(role: str, sm: int, priority: str) -> dict[str, str]:
        return replace(sharing.plan, sm_percent={role: sm}, priority={role: priority}).env(role)

    rows: list[dict] = []
    try:
        for n in [int(r) for r in args.rows.split(",")]:
            base = None
            for variant in sorted(wanted, key=lambda v: v.startswith("mps")):  # the daemon comes up once, last
                if variant.startswith("mps") and sharing is not None and not sharing.started:
                    sharing.start()
                got = measure(args, n, variant, mps_env)
                if variant == "alone":
                    base = got
                row = {"rows": n, "tokens": n * TOKENS_PER_ROW, "variant": variant, **got}
                if got["wall"] is not None:
                    row["back_to_back"] = base["decode"] + base["update"]
                    row["hidden"] = hidden_share(base["decode"], base["update"], got["wall"])
                rows.append(row)
                print(table_row(row), flush=True)
    finally:
        if sharing is not None:
            sharing.stop()
    return {"shape": "tiny" if args.tiny else "qwen3-4b", "steps": args.steps, "reps": args.reps,
            "device": args.device, "rows": rows, "mps": sharing.record() if sharing else None}


HEADER = "| rows | variant | decode s | update s | wall s | back to back s | hidden |\n|---|---|---|---|---|---|---|"


def table_row(row: dict) -> str:
    def f(key: str, fmt: str = "{:.3f}") -> str:
        return "–" if row.get(key) is None else fmt.format(row[key])

    return (f"| {row['rows']} | {row['variant']} | {f('decode')} | {f('update')} | {f('wall')} | "
            f"{f('back_to_back')} | {f('hidden', '{:.0%}')} |")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("mode", nargs="?", default="bench", choices=("bench", "worker"))
    ap.add_argument("load", nargs="?", choices=("decode", "update", "both"))
    ap.add_argument("--rows", default="32", help="decode batch sizes, comma-separated (8: 1x8, 32: 4x8)")
    ap.add_argument("--steps", type=int, default=384, help="decode steps (one generation call)")
    ap.add_argument("--reps", type=int, default=2, help="update passes")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--tiny", action="store_true", help="tiny layers instead of Qwen3-4B's (the plumbing)")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds a worker may take")
    ap.add_argument("--out", type=Path, default=None, help="write the rows as JSON here")
    args = ap.parse_args(argv)
    shape = TINY if args.tiny else QWEN3_4B
    if args.mode == "worker":
        print(json.dumps(worker(args.load, shape, int(args.rows), args.steps, args.reps, args.device)), flush=True)
        return 0
    print(HEADER, flush=True)
    result = run(args)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
