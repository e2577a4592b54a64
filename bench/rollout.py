"""Rollout bench: generation throughput of the vLLM and transformers engines, and the seconds
it takes to make a new LoRA adapter live on every Serve replica.

    flock /tmp/cp-heavy.lock .venv/bin/python bench/rollout.py                # 8 x 8 x 128
    .venv/bin/python bench/rollout.py --prompts 2 --samples 2 --max-tokens 16 --model tiny-random

Prints one table; --json-out writes the rows too. Throughput counts generated tokens (a
completion that stops early counts what it produced) over the wall time of one warm generate
call (after a small warm-up call).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path

# This file is named like the `rollout` package; run as a script, its own folder would come
# first on sys.path and shadow the package. Put the repo root there instead.
if sys.path and Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
    sys.path[0] = str(Path(__file__).resolve().parents[1])

PROMPT = (
    "Write a four-voice (SATB) realization of the progression I - IV - V - I in C major as a "
    "JSON array of chords, each chord a list of four MIDI note numbers from bass to soprano."
)


def _prompts(n: int):
    from rollout.types import Prompt

    return [
        Prompt(messages=({"role": "user", "content": f"{PROMPT} (variant {i})"},), assistant_prefix="[")
        for i in range(n)
    ]


def bench_engine(kind: str, model_cfg, rollout_cfg, args) -> dict:
    from rollout.engines import make_engine
    from rollout.types import SamplingParams

    t0 = time.perf_counter()
    engine = make_engine(model_cfg, rollout_cfg, kind=kind, seed=args.seed)
    start_s = time.perf_counter() - t0
    warm = SamplingParams.from_rollout(rollout_cfg, max_tokens=8, seed=args.seed)
    engine.generate(_prompts(1), warm, 0)  # warm-up
    params = SamplingParams.from_rollout(rollout_cfg, n=args.samples, temperature=1.0,
                                           max_tokens=args.max_tokens, seed=args.seed)
    t0 = time.perf_counter()
    samples = engine.generate(_prompts(args.prompts), params, 0)
    seconds = time.perf_counter() - t0
    tokens = sum(len(s.token_ids) for s in samples)
    del engine
    gc.collect()
    return {
        "what": f"{kind} generate {args.prompts}x{args.samples}x{args.max_tokens}",
        "start_s": round(start_s, 2), "seconds": round(seconds, 2), "tokens": tokens,
        "tokens_per_s": round(tokens / seconds, 1),
    }


def bench_sync(model_cfg, rollout_cfg, args) -> list[dict]:
    import ray

    from bench.synthetic import make_lora_payload
    from rollout.deployment import deploy_rollout, stop_rollout
    from model.base import resolve_model
    from rollout.types import SamplingParams

    model_dir = resolve_model(model_cfg)
    payloads = [
        make_lora_payload(model_dir, version=v, r=args.lora_rank, alpha=2.0 * args.lora_rank, b_std=0.01, seed=v)
        for v in range(1, args.syncs + 1)
    ]
    size_mb = len(payloads[0].safetensors) / 2**20
    ray.init(num_cpus=2, include_dashboard=False)
    rows = []
    try:
        t0 = time.perf_counter()
        client = deploy_rollout(model_cfg, rollout_cfg, seed=args.seed)
        start_s = time.perf_counter() - t0
        publish_s, sync_s, total_s = [], [], []
        for payload in payloads:
            t0 = time.perf_counter()
            client.publish(payload)
            t1 = time.perf_counter()
            sync_s.append(client.sync(payload.version))
            total_s.append(time.perf_counter() - t0)
            publish_s.append(t1 - t0)
        rows.append({
            "what": f"adapter live on {rollout_cfg.replicas} replicas (r={args.lora_rank}, {size_mb:.1f} MB), "
                    f"median of {args.syncs}",
            "start_s": round(start_s, 2),
            "seconds": round(statistics.median(total_s), 3),
            "publish_s": round(statistics.median(publish_s), 3),
            "wait_all_s": round(statistics.median(sync_s), 3),
            "max_s": round(max(total_s), 3),
        })
        params = SamplingParams.from_rollout(rollout_cfg, n=args.samples, temperature=1.0,
                                           max_tokens=args.max_tokens, seed=args.seed)
        warm = SamplingParams.from_rollout(rollout_cfg, max_tokens=8)
        client.generate(_prompts(rollout_cfg.replicas), warm, payloads[-1].version)
        t0 = time.perf_counter()
        samples = client.generate(_prompts(args.prompts), params, payloads[-1].version)
        seconds = time.perf_counter() - t0
        tokens = sum(len(s.token_ids) for s in samples)
        rows.append({
            "what": f"serve x{rollout_cfg.replicas} generate {args.prompts}x{args.samples}x{args.max_tokens} (LoRA)",
            "seconds": round(seconds, 2), "tokens": tokens, "tokens_per_s": round(tokens / seconds, 1),
        })
        stop_rollout()
    finally:
        from ray import serve

        serve.shutdown()
        ray.shutdown()
    return rows


def main() -> None:
    from config.runtime_env import apply_defaults

    apply_defaults()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="Model name or path (default: the config default).")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--engines", default="vllm,hf", help="Comma-separated engines to time.")
    parser.add_argument("--replicas", type=int, default=2, help="Serve replicas (0 = skip the sync bench).")
    parser.add_argument("--syncs", type=int, default=5, help="Adapter versions to publish and time.")
    parser.add_argument("--lora-rank", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json-out", type=Path, default=None)
    args = parser.parse_args()

    from config.rollout import ModelConfig, RolloutConfig

    model_cfg = ModelConfig(**({"name_or_path": args.model} if args.model else {}), dtype=args.dtype)
    rollout_cfg = RolloutConfig(
        max_model_len=1024, max_lora_rank=max(8, args.lora_rank), replicas=max(1, args.replicas), num_cpus=1.0
    )
    rows = [bench_engine(kind, model_cfg, rollout_cfg, args) for kind in args.engines.split(",") if kind]
    if args.replicas > 0:
        rows += bench_sync(model_cfg, rollout_cfg, args)

    from rich.console import Console
    from rich.table import Table

    columns = ["what", "start_s", "seconds", "tokens", "tokens_per_s", "publish_s", "wait_all_s", "max_s"]
    table = Table(title=f"rollout bench: {model_cfg.name_or_path} ({model_cfg.dtype})")
    for c in columns:
        table.add_column(c, justify="left" if c == "what" else "right")
    for row in rows:
        table.add_row(*(str(row.get(c, "")) for c in columns))
    Console(width=200).print(table)
    if args.json_out:
        args.json_out.parent.mkdir(parents=True, exist_ok=True)
        args.json_out.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
