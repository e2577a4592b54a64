"""The adapter's way from the learner to a merged vLLM replica's worker, host side, on this box:
the bytes route it took before issue 21's second GPU session against the array route it takes now.

    python3 bench/adapter_transport.py [--mib 126] [--repeats 3]

Both routes carry a random adapter of the 4B r=32 shape's size (126 MiB in bf16, 504 tensors)
through the same five hops, each timed on its own (best of ``--repeats``):
- ``export``: the learner's tensors to a payload (``bytes``: cast per tensor, one flat copy to
  the host, joined into a bytes object; ``array``: learner/lora.py ``safetensors_blob``);
- ``put``: ray.put of the payload (the learner's rank 0);
- ``get``: ray.get of it (the replica);
- ``shm write``: the replica writes it to /dev/shm for the engine's worker process
  (rollout/engines/vllm_merge.py ``write_shm``);
- ``shm read``: the worker reads it (``bytes``: read_bytes; ``array``: ``read_shm``, a mapping,
  touched once so that the pages are counted).
On a GPU host the tensors start on the device and the first hop ends in page-locked memory;
here they start on the CPU, so the table shows what the copies alone cost. The GPU figures are
bench/results/gpu-2026-12-01-6aa10bd/notes.md's.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

if sys.path and Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
    sys.path[0] = str(Path(__file__).resolve().parents[1])


def adapter_state(mib: float, tensors: int = 504):
    """Random float32 LoRA-shaped tensors whose bf16 size is ``mib`` MiB."""
    import torch

    per = int(mib * 2**20 / 2 / tensors)
    g = torch.Generator().manual_seed(0)
    return {f"base_model.model.layers.{i // 2}.lora_{'AB'[i % 2]}.weight": torch.randn(per, generator=g)
            for i in range(tensors)}


def bytes_export(state):
    """The route before: a cast per tensor, one flat copy, the bytes joined."""
    import torch

    from learner.lora import safetensors_bytes
    from model.adapter import AdapterPayload

    cast = {k: v.to(torch.bfloat16) for k, v in state.items()}
    return AdapterPayload(version=2, safetensors=safetensors_bytes(cast, {"format": "pt"}), config={})


def array_export(state):
    import torch

    from learner.lora import safetensors_blob
    from model.adapter import AdapterPayload

    blob, checksum = safetensors_blob(state, {"format": "pt"}, dtype=torch.bfloat16)
    return AdapterPayload(version=2, safetensors=blob, config={}, checksum=checksum)


def best(fn, repeats: int):
    out, times = None, []
    for _ in range(repeats):
        t = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t)
    return out, min(times)


def route(name: str, export, state, repeats: int) -> dict[str, float]:
    import ray

    from rollout.engines.vllm_merge import read_shm, write_shm

    payload, t_export = best(lambda: export(state), repeats)
    ref, t_put = best(lambda: ray.put(payload), repeats)
    got, t_get = best(lambda: ray.get(ref), repeats)
    path, t_write = best(lambda: write_shm(got), 1)
    try:
        if name == "bytes":
            _, t_read = best(lambda: Path(path).read_bytes(), repeats)
        else:
            def mapped():
                mm = read_shm(path)
                view = memoryview(mm)
                total = sum(view[i] for i in range(0, len(view), 4096))  # touch every page once
                view.release()
                mm.close()
                return total
            _, t_read = best(mapped, repeats)
    finally:
        os.unlink(path)
    assert got.data()[:8] == payload.data()[:8]
    return {"export": t_export, "put": t_put, "get": t_get, "shm write": t_write, "shm read": t_read}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=float, default=126.0, help="the adapter's size in bf16")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    import ray

    ray.init(num_cpus=1, include_dashboard=False, logging_level="ERROR", object_store_memory=2 * 2**30)
    try:
        state = adapter_state(args.mib)
        rows = {"bytes": route("bytes", bytes_export, state, args.repeats),
                "array": route("array", array_export, state, args.repeats)}
    finally:
        ray.shutdown()
    hops = list(rows["bytes"])
    print(f"adapter of {args.mib:.0f} MiB (bf16), 504 tensors; best of {args.repeats}, ms")
    print(f"{'route':<8}" + "".join(f"{h:>11}" for h in hops) + f"{'total':>11}")
    for name, row in rows.items():
        print(f"{name:<8}" + "".join(f"{row[h] * 1e3:>11.1f}" for h in hops) + f"{sum(row.values()) * 1e3:>11.1f}")
    ratio = sum(rows["array"].values()) / sum(rows["bytes"].values())
    print(f"array / bytes: {ratio:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
