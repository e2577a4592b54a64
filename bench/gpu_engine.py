"""The hf engine on one GPU: plain `generate`, transformers' static cache + compile, its
continuous-batching `generate_batch`, and counterpoint's fast path (rollout/engines/hf_fast.py:
static cache + a decode step captured as a CUDA graph), with the LoRA merged and unmerged; the
adapter load (update_weights) time; the capture (compile) time per bucket; and ppl_ratio of the
engine's samples against the learner's own recompute (learner.passes.response_logprobs on a
peft model loaded by learner.lora.attach_lora), bf16 on both sides.

Random-init Qwen3 shapes (0.6B, 4B) built from a Qwen3Config on the device, the Qwen3
tokenizer from .devcache/tokenizer (git-ignored; carry it). No Ray. Run on the GPU host:

    PYTHONPATH=/tmp/site:. python3 bench/gpu_engine.py --out $OUT

Writes <out>/gpu-engine.jsonl (one line per measurement, as it goes) and <out>/gpu-engine.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SHAPES = {  # Qwen3-0.6B and Qwen3-4B architectures (vocab 151936, tied head)
    "0.6b": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16),
    "4b": dict(hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32),
}
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def build_model(shape: str):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(vocab_size=151936, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                      rope_theta=1_000_000.0, rms_norm_eps=1e-6, tie_word_embeddings=True, **SHAPES[shape])
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):
        model = Qwen3ForCausalLM(cfg)
    torch.set_default_dtype(torch.float32)
    return model.eval().requires_grad_(False)


def lora_payload(model, r: int, version: int, b_std: float, seed: int):
    """A peft-format r/all-linear adapter payload with random A and B (B != 0, so it matters)."""
    from safetensors.torch import save

    from model.adapter import AdapterPayload

    g = torch.Generator().manual_seed(seed)
    state = {}
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear) and name.split(".")[-1] in TARGETS:
            pre = f"base_model.model.{name}"
            state[f"{pre}.lora_A.weight"] = torch.randn(r, mod.in_features, generator=g) / mod.in_features**0.5
            state[f"{pre}.lora_B.weight"] = torch.randn(mod.out_features, r, generator=g) * b_std
    cfg = {"peft_type": "LORA", "r": r, "lora_alpha": 2 * r, "target_modules": sorted(TARGETS), "bias": "none",
           "lora_dropout": 0.0, "task_type": "CAUSAL_LM", "use_rslora": False, "use_dora": False}
    return AdapterPayload(version=version, safetensors=save(state), config=cfg)


def payload_maker(model, r: int, b_std: float):
    """version -> payload, each built once (building a 4B adapter takes a second or two)."""
    made: dict = {}

    def payload(version: int):
        if version not in made:
            made[version] = lora_payload(model, r, version, b_std, seed=version)
        return made[version]

    return payload


def make_prompts(tokenizer, n: int, tokens: int):
    from rollout.types import Prompt

    words = [f"bar{i} chord {i % 7} voice" for i in range(tokens)]
    out = []
    for p in range(n):
        text = " ".join(words[p : p + tokens // 4])
        ids = tokenizer(text, add_special_tokens=False)["input_ids"][: tokens - 12]
        out.append(Prompt(messages=({"role": "user", "content": tokenizer.decode(ids)},)))
    return out


class Recorder:
    def __init__(self, out: Path):
        self.rows, self.path = [], out / "gpu-engine.jsonl"
        self.path.write_text("")

    def add(self, **row):
        row = {k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()}
        self.rows.append(row)
        with self.path.open("a") as f:
            f.write(json.dumps(row) + "\n")
        print(json.dumps(row), flush=True)


def timed(fn):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0, out


def bench_ours(rec, model, tok, stop, shape, batches, new_tokens, prompt_tokens, mode, decode, payload, samples_for):
    from rollout.engines.hf_fast import HFFastEngine
    from rollout.types import SamplingParams

    cfg = SimpleNamespace(max_model_len=4096, hf_batch_buckets=[1, 2, 4, 8, 16, 32, 64, 128], hf_decode=decode,
                          hf_lora=mode)
    eng = HFFastEngine.from_model(model, tok, stop, cfg)
    loads = []
    for i in range(3):
        p = payload(version=i + 1)
        loads.append(timed(lambda: eng.load_adapter(p))[0])
    rec.add(shape=shape, what="update_weights", lora=mode, s_median=statistics.median(loads), s_all=loads,
            payload_mb=len(p.safetensors) / 2**20)
    version = eng.loaded_version()
    for batch in batches:
        prompts = make_prompts(tok, batch // 8, prompt_tokens)
        params = SamplingParams(n=8, temperature=1.0, top_p=1.0, top_k=-1, max_tokens=new_tokens, seed=1)
        for v in ([version, 0] if batch == batches[0] else [version]):
            before = dict(eng.stats()["capture_s"])
            first, _ = timed(lambda: eng.generate(prompts, params, v))
            capture = {k: x for k, x in eng.stats()["capture_s"].items() if k not in before}
            times, steps = [], []
            for _ in range(2):
                s0, d0 = eng.decoder.stats["decode_steps"], eng.decoder.stats["decode_s"]
                wall, samples = timed(lambda: eng.generate(prompts, params, v))
                times.append(wall)
                steps.append((eng.decoder.stats["decode_s"] - d0) / max(1, eng.decoder.stats["decode_steps"] - s0))
            ntok = sum(len(s.token_ids) for s in samples)
            rec.add(shape=shape, what="ours", decode=decode, lora=mode if v else "base", batch=batch,
                    gen_s=statistics.median(times), ms_per_step=1000 * statistics.median(steps),
                    tokens=ntok, tokens_per_s=ntok / statistics.median(times), first_call_s=first,
                    capture_s=capture)
            if v and samples_for is not None and batch == batches[-1]:
                samples_for[mode] = samples
    eng.adapter.detach()
    return eng


def parity(rec, model, tok, shape, payload, samples_by_mode):
    """ppl_ratio of the engine's samples vs the learner's recompute (peft, bf16 base)."""
    from learner.lora import attach_lora
    from learner.passes import response_logprobs
    from learner.rollout_correction import parity_stats
    from model.adapter_dir import write_payload

    d = write_payload(payload(version=3), tempfile.mkdtemp(prefix="cp-bench-adapter-"))
    peft = attach_lora(model, None, seed=0, init_adapter=d).eval()
    for mode, samples in samples_by_mode.items():
        prompts, resps = [s.prompt_token_ids for s in samples], [s.token_ids for s in samples]
        trainer = response_logprobs(peft, prompts, resps, pad_id=0, temperature=1.0)
        st = parity_stats([s.logprobs for s in samples], trainer)
        with peft.disable_adapter():  # the control: the same samples against the BASE model
            base = response_logprobs(peft, prompts, resps, pad_id=0, temperature=1.0)
        ctl = parity_stats([s.logprobs for s in samples], base)
        rec.add(shape=shape, what="ppl_ratio", lora=mode, ppl_ratio=st.ppl_ratio, rollout_kl=st.rollout_kl,
                max_abs_diff=st.max_abs_diff, tokens=st.tokens, control_vs_base_ppl_ratio=ctl.ppl_ratio)
    peft.unload()


def bench_plain(rec, model, tok, shape, batch, prompt_tokens, tokens):
    from transformers import GenerationConfig

    ids = torch.randint(1000, 100000, (batch, prompt_tokens), device="cuda")
    cfg = GenerationConfig(do_sample=True, max_new_tokens=tokens, min_new_tokens=tokens, pad_token_id=0)
    model.generate(ids, generation_config=cfg)
    wall, _ = timed(lambda: model.generate(ids, generation_config=cfg))
    rec.add(shape=shape, what="plain_generate", batch=batch, tokens=tokens, ms_per_step=1000 * wall / tokens)


def bench_static(rec, model, tok, shape, batch, prompt_tokens, tokens):
    from transformers import CompileConfig, GenerationConfig

    ids = torch.randint(1000, 100000, (batch, prompt_tokens), device="cuda")
    cfg = GenerationConfig(do_sample=True, max_new_tokens=tokens, min_new_tokens=tokens, pad_token_id=0,
                           cache_implementation="static",
                           compile_config=CompileConfig(fullgraph=True, dynamic=False, mode="reduce-overhead"))
    first, _ = timed(lambda: model.generate(ids, generation_config=cfg))
    wall, _ = timed(lambda: model.generate(ids, generation_config=cfg))
    rec.add(shape=shape, what="static_compile_generate", batch=batch, tokens=tokens, ms_per_step=1000 * wall / tokens,
            first_call_s=first)


def bench_batch(rec, model, tok, shape, batch, prompt_tokens, tokens):
    from transformers import GenerationConfig

    inputs = [torch.randint(1000, 100000, (prompt_tokens,)).tolist() for _ in range(batch)]
    cfg = GenerationConfig(do_sample=True, max_new_tokens=tokens, min_new_tokens=tokens, pad_token_id=0,
                           eos_token_id=151935)
    first, _ = timed(lambda: model.generate_batch(inputs, generation_config=cfg))
    wall, out = timed(lambda: model.generate_batch(inputs, generation_config=cfg))
    ntok = sum(len(o.generated_tokens) for o in out.values())
    rec.add(shape=shape, what="generate_batch", batch=batch, tokens=tokens, gen_s=wall, ms_per_step=1000 * wall / tokens,
            generated=ntok, first_call_s=first)


def attempt(rec, shape, what, fn):
    try:
        fn()
    except Exception as e:  # one method failing must not cost the others' figures
        traceback.print_exc()
        rec.add(shape=shape, what=what, error=f"{type(e).__name__}: {str(e)[:300]}")


def table(rows) -> str:
    lines = ["| shape | method | lora | batch | ms/step | gen s | tokens/s | capture/compile s |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r.get("what") in ("ours", "plain_generate", "static_compile_generate", "generate_batch"):
            method = f"ours ({r['decode']})" if r["what"] == "ours" else r["what"]
            cap = r.get("capture_s") or r.get("first_call_s")
            lines.append(f"| {r['shape']} | {method} | {r.get('lora', 'base')} | {r.get('batch')} | "
                         f"{r.get('ms_per_step', ''):.2f} | {r.get('gen_s', '')} | {r.get('tokens_per_s', '')} | {cap} |")
    lines += ["", "| shape | lora | update_weights s (median of 3) | payload MiB |", "|---|---|---|---|"]
    lines += [f"| {r['shape']} | {r['lora']} | {r['s_median']} | {r['payload_mb']:.1f} |" for r in rows
              if r.get("what") == "update_weights"]
    lines += ["", "| shape | lora | ppl_ratio | rollout_kl | max abs diff | tokens | control: vs base model |",
              "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['shape']} | {r['lora']} | {r['ppl_ratio']:.5f} | {r['rollout_kl']:.2e} | {r['max_abs_diff']:.3f} | "
              f"{r['tokens']} | {r['control_vs_base_ppl_ratio']:.3f} |" for r in rows if r.get("what") == "ppl_ratio"]
    lines += ["", "Errors: " + ("; ".join(f"{r['shape']} {r['what']}: {r['error']}" for r in rows if "error" in r) or "none")]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--shapes", default="0.6b,4b")
    ap.add_argument("--batches", default="8,32")
    ap.add_argument("--prompt-tokens", type=int, default=200)
    ap.add_argument("--new-tokens", type=int, default=384)
    ap.add_argument("--plain-tokens", type=int, default=32, help="plain generate is slow: time fewer steps")
    ap.add_argument("--decode", default="graph", help="rollout.hf_decode of the fast path's main rows")
    ap.add_argument("--modes", default="merged,unmerged", help="rollout.hf_lora values to measure")
    ap.add_argument("--lora-r", type=int, default=32)
    ap.add_argument("--b-std", type=float, default=0.01, help="std of the random LoRA B entries")
    ap.add_argument("--extra", default="static:0.6b,batch:0.6b,inductor:0.6b",
                    help="the slow comparisons, as method:shape (compiles of a minute or more each)")
    ap.add_argument("--tokenizer", default=".devcache/tokenizer")
    args = ap.parse_args()
    from transformers import AutoTokenizer

    from model.base import StopTokens

    args.out.mkdir(parents=True, exist_ok=True)
    rec = Recorder(args.out)
    tok = AutoTokenizer.from_pretrained(str(Path(args.tokenizer).resolve()))
    eot = tok.convert_tokens_to_ids("<|im_end|>")
    stop = StopTokens(ids=(eot,), end_of_turn_ids=(eot,), generation_eos_ids=(eot,), mismatch=False)
    batches = [int(b) for b in args.batches.split(",")]
    extra = {tuple(x.split(":")) for x in args.extra.split(",") if x}
    rec.add(what="env", torch=torch.__version__, transformers=__import__("transformers").__version__,
            device=torch.cuda.get_device_name(), command=" ".join(sys.argv))
    shapes = args.shapes.split(",")
    for shape in shapes:  # the engine's figures first; the slow comparisons after (a timeout keeps these)
        model = build_model(shape)
        torch.cuda.reset_peak_memory_stats()

        payload = payload_maker(model, args.lora_r, args.b_std)
        samples: dict = {}
        for mode in args.modes.split(","):
            attempt(rec, shape, f"ours-{mode}", lambda: bench_ours(
                rec, model, tok, stop, shape, batches, args.new_tokens, args.prompt_tokens, mode, args.decode, payload,
                samples))
        rec.add(shape=shape, what="peak_memory", gib=torch.cuda.max_memory_allocated() / 2**30)
        attempt(rec, shape, "parity", lambda: parity(rec, model, tok, shape, payload, samples))
        if args.plain_tokens:
            attempt(rec, shape, "plain", lambda: bench_plain(rec, model, tok, shape, batches[0], args.prompt_tokens, args.plain_tokens))
        model = None
        torch.cuda.empty_cache()
    for shape in shapes:
        if not any((m, shape) in extra for m in ("static", "batch", "inductor")):
            continue
        model = build_model(shape)
        payload = payload_maker(model, args.lora_r, args.b_std)
        if ("batch", shape) in extra:
            attempt(rec, shape, "batch", lambda: bench_batch(rec, model, tok, shape, batches[0], args.prompt_tokens,
                                                            args.new_tokens))
        if ("inductor", shape) in extra:
            attempt(rec, shape, "ours-inductor", lambda: bench_ours(
                rec, model, tok, stop, shape, batches[:1], args.new_tokens, args.prompt_tokens, "merged", "inductor",
                payload, None))
        if ("static", shape) in extra:
            attempt(rec, shape, "static", lambda: bench_static(rec, model, tok, shape, batches[0], args.prompt_tokens,
                                                              args.new_tokens))
        model = None
        torch.cuda.empty_cache()
    md = args.out / "gpu-engine.md"
    md.write_text(f"Command: `{' '.join(sys.argv)}`\n\n{table(rec.rows)}\n")
    print(md.read_text())


if __name__ == "__main__":
    main()
