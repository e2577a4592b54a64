"""Where the rollout engine's generation time goes on a GPU (issue 21): counterpoint's vLLM engine
against plain ``LLM.generate`` calls on the same engine, one sampling option changed at a time.

The Ray runs spend most of a 4B step in generation (1.49 s for 8 x 384 tokens, ~3.9 ms a decode
step, against ~1.9 ms for one read of the 8 GB of weights). This splits that figure:

- ``ours``: ``VllmEngine.generate`` as the driver calls it (per-request seeds, the sampled
  token's processed log-prob, our stop set, the samples built from vLLM's outputs);
- ``raw``: the same requests straight to ``engine.llm.generate`` (what our wrapping costs);
- ``raw_unseeded``: without per-request seeds (vLLM samples seeded rows one kernel each);
- ``raw_flat``: the log-prob as flat lists (``flat_logprobs=True``, what ``ours`` asks for) instead
  of a dict and a Logprob object per token: the knob alone, against ``raw``;
- ``raw_nologprobs``: without the log-prob;
- ``raw_bare``: neither;
- ``raw_1tok``: max_tokens=1, the prefill and the fixed cost of a call; a decode step is
  (raw - raw_1tok) / (tokens - 1).

``--adapter``: before timing, the engine loads three random r=32 adapters on every linear layer
(bench/synthetic.py ``config_lora_payload``, made from config.json), each load timed
(``adapter_load_s``; the engine's own read/merge split in ``engine_stats``), and ``ours``
generates with the last. That row is the one to compare across LoRA modes: with merged LoRA the
``raw*`` rows run on the merged weights too, with unmerged LoRA on the base without LoRA kernels.
With ``--set rollout.quantization=fp8`` (auto: merged) the loads are merges re-quantized through
vLLM's reload (rollout/engines/vllm_merge.py), against ``--set rollout.vllm_lora=unmerged`` over
fp8 and the bf16 merged default.

    python3 bench/vllm_decode.py --model /tmp/gpu-vs-trl/models/qwen3-4b --tokenizer /tmp/cp-tok/tokenizer \
        --prompts 1,4 --reps 3 --out $OUT/decode-4b.json [--set rollout.vllm_multiprocessing=false] [--adapter]

The engine takes bench/gpu_vs_trl.py's ``bench_config``: configs/gpu-bench.yaml's rollout
settings (0.5 GPU, gpu_memory_utilization 0.35, max_num_seqs 64, merged LoRA and CUDA graphs by
the CUDA defaults) except max_model_len 2048 for 1024; ``--set`` changes any of them. Prints a
table; the JSON keeps every timing.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

if sys.path and Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from bench.gpu_vs_trl import GROUP_SIZE, NEW_TOKENS, bench_config, prompt_texts, save  # noqa: E402

WEIGHT_READ_TB_S = 4.3  # the H200's HBM3e, as issue 21 counts the floor


def variants(engine, prompt_ids: list[list[int]], stop_ids: tuple[int, ...], seed: int) -> dict:
    """name -> a call that generates the shape's batch one way."""
    from vllm import SamplingParams as VllmSamplingParams
    from vllm.inputs import TokensPrompt

    def raw(seeded: bool = True, logprobs: bool = True, max_tokens: int = NEW_TOKENS, flat: bool = False):
        params = [VllmSamplingParams(n=GROUP_SIZE, temperature=1.0, max_tokens=max_tokens,
                                     seed=seed + i * GROUP_SIZE if seeded else None,
                                     logprobs=0 if logprobs else None, flat_logprobs=flat,
                                     stop_token_ids=list(stop_ids),
                                     ignore_eos=True, detokenize=False)
                  for i in range(len(prompt_ids))]
        return lambda: engine.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompt_ids], params,
                                           use_tqdm=False)

    return {"raw": raw(), "raw_flat": raw(flat=True), "raw_unseeded": raw(seeded=False),
            "raw_nologprobs": raw(logprobs=False),
            "raw_bare": raw(seeded=False, logprobs=False), "raw_1tok": raw(max_tokens=1)}


def tokens_of(out) -> int:
    """Completion tokens of one call's result (samples or vLLM outputs)."""
    if out and hasattr(out[0], "token_ids") and not hasattr(out[0], "outputs"):
        return max(len(s.token_ids) for s in out)
    return max(len(c.token_ids) for o in out for c in o.outputs)


def add_step_ms(rows: list[dict]) -> list[dict]:
    """Each row's time per decode step: its call less the same shape's 1-token call (the prefill
    and the fixed cost of a call), over the tokens after the first. Shapes without a 1-token
    row get none."""
    one = {r["prompts"]: r["s"] for r in rows if r["variant"] == "raw_1tok"}
    for r in rows:
        if r["variant"] != "raw_1tok" and r["prompts"] in one:
            r["ms_per_step"] = 1e3 * (r["s"] - one[r["prompts"]]) / max(r["tokens"] - 1, 1)
    return rows


def load_adapters(engine, model_dir: Path, cfg, result: dict, versions: int = 3) -> int:
    """Load ``versions`` random adapters of the run's LoRA shape into ``engine``, timing each
    (the first also reads W0 where LoRA is merged); the last version's number."""
    from bench.synthetic import config_lora_payload

    loads = []
    for version in range(1, versions + 1):
        payload = config_lora_payload(model_dir, version, r=cfg.learner.lora.r, alpha=cfg.learner.lora.alpha,
                                      seed=version)
        t = time.perf_counter()
        engine.load_adapter(payload)
        loads.append(time.perf_counter() - t)
    stats = engine.stats()
    result["adapter_load_s"] = loads
    result["engine_stats"] = {k: v for k, v in stats.items() if k.startswith(("adapter_", "merged_"))}
    print(f"adapter loads {', '.join(f'{s:.3f}' for s in loads)} s; {result['engine_stats']}", flush=True)
    return versions


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--tokenizer", type=Path, required=True)
    ap.add_argument("--prompts", default="1,4", help="prompts per call, comma-separated (x8 completions each)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--set", dest="sets", action="append", default=[], help="rollout.key=value")
    ap.add_argument("--adapter", action="store_true",
                    help="load three random adapters first (timed) and generate `ours` with the last")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)

    import torch

    from config.run import config_with_overrides
    from rollout.engines import make_engine
    from rollout.types import Prompt, SamplingParams

    base = bench_config(args.model, 1, 1, "/tmp/cp-decode-runs", gpu=torch.cuda.is_available(), engine="vllm")
    cfg = config_with_overrides(base.model_dump(), args.sets, source="bench/vllm_decode.py --set")
    t0 = time.perf_counter()
    engine = make_engine(cfg.model, cfg.rollout, kind="vllm", seed=cfg.seed)
    start_s = time.perf_counter() - t0
    weights_gb = sum(p.stat().st_size for p in args.model.glob("*.safetensors")) / 1e9
    floor_ms = weights_gb / WEIGHT_READ_TB_S  # GB / (TB/s) = ms
    texts = prompt_texts(args.tokenizer, 64)
    result = {"model": str(args.model), "settings": engine.stats()["settings"], "start_s": start_s,
              "sets": args.sets, "weights_gb": weights_gb, "floor_ms_per_step": floor_ms, "rows": []}
    print(f"engine {result['settings']} started in {start_s:.1f} s; weights {weights_gb:.2f} GB, "
          f"one read {floor_ms:.2f} ms", flush=True)
    version = load_adapters(engine, args.model, cfg, result) if args.adapter else 0
    for n_prompts in (int(x) for x in args.prompts.split(",")):
        prompts = [Prompt(messages=({"role": "user", "content": t},)) for t in texts[:n_prompts]]
        params = SamplingParams.from_rollout(cfg.rollout, n=GROUP_SIZE, max_tokens=NEW_TOKENS, seed=12345)
        prompt_ids, stop_ids = engine.prepare(prompts, params, version)
        calls = {"ours": lambda: engine.generate(prompts, params, version),
                 **variants(engine, prompt_ids, stop_ids, 12345)}
        for name, call in calls.items():
            call()  # warm: the first call of a batch size may still compile or allocate
            times, toks = [], 0
            for _ in range(args.reps):
                t = time.perf_counter()
                out = call()
                times.append(time.perf_counter() - t)
                toks = tokens_of(out)
            result["rows"].append({"prompts": n_prompts, "sequences": n_prompts * GROUP_SIZE, "variant": name,
                                   "s": statistics.median(times), "times_s": times, "tokens": toks})
        add_step_ms(result["rows"])
        save(result, args.out)
    print(f"{'shape':<7} {'variant':<15} {'s':>7} {'ms/step':>8} {'x floor':>8}")
    for r in result["rows"]:
        ms = r.get("ms_per_step")
        print(f"{r['prompts']}x{GROUP_SIZE:<5} {r['variant']:<15} {r['s']:7.3f} "
              f"{'' if ms is None else f'{ms:8.2f}'} {'' if ms is None else f'{ms / floor_ms:8.2f}'}")
    return 0



if __name__ == "__main__":
    raise SystemExit(main())
