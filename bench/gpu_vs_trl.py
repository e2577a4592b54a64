"""counterpoint's whole GRPO step against TRL's GRPOTrainer on one GPU (issue 15, "Benchmark").

Same random-init Qwen3 shapes (0.6B and 4B: Qwen3Config with the real vocabulary of 151,936 and
the carried tokenizer, bf16), same settings: LoRA r=32 alpha 64 on all linear layers, G=8,
1x8 and 4x8 completions a step, 384 new tokens (TRL: min_new_tokens; counterpoint: a random
model stops only by sampling a stop token, ~2 in 151,936 a token; the exact tokens are
recorded), ~200-token prompts, temperature 1, loss dapo, beta 0, lr 1e-5.

    # on the device (carry .whl and .devcache), one call: both sides, every shape, spread over
    # the visible GPUs (one process per side and GPU, pinned by CUDA_VISIBLE_DEVICES), then the
    # report (gpu-vs-trl.json / .md) written into $OUT:
    python3 bench/gpu_vs_trl.py all --out-dir $OUT --budget-s 570
    # or the parts alone, and the report here from the files that came back:
    python3 bench/gpu_vs_trl.py trl --out $OUT/trl.json
    python3 bench/gpu_vs_trl.py counterpoint --out $OUT/counterpoint.json
    python bench/gpu_vs_trl.py report --trl trl.json --counterpoint counterpoint.json --command '...'

``all`` places the (side, shape) jobs on the GPUs longest first (the estimates are the
2026-11-30 figures), so one call holds everything when the GPUs and the call's time allow: on
one H200 the whole set needs ~20 min of GPU time, on two ~10 min each (a device call
may last 10 min: the 2026-11-30 results took three calls). TRL takes no step that would end
past ``--budget-s`` (its row keeps the steps it timed and says so); a process still running at
the budget is killed (its file keeps the shapes it finished); the report is written either way.

Carried (.whl/ is git-ignored; 4.5 MB): ``.whl/gpubench/`` = pydantic 2.14.4, pydantic_core
2.50.5, annotated_types 0.8.0, typing_inspection 0.4.5, typing_extensions 4.16.0 (the schema) and
trl 1.16.0, datasets 5.2.0, dill 0.4.1, multiprocess 0.70.19 (py312) for TRL, fetched with the
device README's `pip download --no-deps --only-binary=:all: --python-version 3.12 ...`; Ray is
not needed. ``.devcache/tokenizer`` as bench/multi_gpu_device.py makes it. On the device:
``python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/gpubench/*.whl`` and
``PYTHONPATH=/tmp/site:$PWD``. bench/results/gpu-vs-trl.md says which call measured which row.

- ``trl``: TRL 1.16's GRPOTrainer with its default generation (transformers ``generate``) and
  its other defaults (gradient checkpointing on, bf16); a callback times each optimizer step
  (one generation batch per step), wrappers time generation and generate+score inside it.
- ``counterpoint``: the driver's own step loop (services.orchestrator.run_steps: gen, score,
  adv, the learner's old_log_prob / ref / update_actor, update_weights) over the real parts in
  ONE process: the rollout engine ``make_engine`` picks for ``rollout.engine=hf`` on CUDA, the
  ``PolicyLearner`` the Ray Train worker runs, a trivial scoring task. What it leaves out is
  Ray: the batch and the adapter do not cross the object store, and the replica is not behind
  a Serve handle (both measured in bench/results/multi-gpu.md). Checkpoints are not saved.
- fp8 rollouts (rollout.quantization=fp8: vLLM's online fp8 of the bf16 weights; README "FP8
  rollouts"): ``train ... --set rollout.quantization=fp8`` (configs/gpu-bench.yaml's vllm_lora=auto
  then merges the adapter into the fp8 layers, re-quantized through vLLM's layerwise reload at every
  merge: fp8 GEMMs and no LoRA kernels; the 14B/32B shapes' dummy weights need the shared bf16
  base, which fp8 refuses), or ``counterpoint --engine vllm --quantization fp8``. Add
  ``--set rollout.vllm_lora=unmerged`` for vLLM's LoRA kernels over the fp8 base instead. Each train row
  keeps ppl_ratio, rollout_k3_kl and tis_clip_frac per step and run.json's rollout_quantization.
  TRL has no such switch: TRL 1.16's GRPOConfig passes nothing to vLLM's quantization (its colocate
  ``LLM(...)`` sets quantization only to "bitsandbytes" for a bnb 4-bit model), and its colocate
  weight sync calls ``model.load_weights`` per parameter, which vLLM 0.26 does not re-quantize into
  an online-fp8 layer (rollout/engines/vllm_merge.py's docstring). ``trl --vllm --quantization fp8``
  patches both (``trl_fp8_colocate``: fp8 for its LLM, its sync through vLLM's ``reload_weights``),
  for the fair fp8 ratio the issue asks for.
- ``report``: bench/results/gpu-vs-trl.json (the schema below) and gpu-vs-trl.md.

Per shape: 1 warm-up step (it holds any compile of the engine) + N timed steps, medians; a
shape that does not fit in the call's deadline keeps its row with null figures, and says why.
``mfu`` counts the same useful work for both systems, 8 x params x (prompt + completion tokens)
of every sequence (2 N for sampling, 6 N for the update: learner/microbatch.py's convention),
over the step time and the device's dense bf16 peak (config learner.peak_flops).

The results' schema: {"shapes": [{"model", "prompts", "group_size", "tokens", "trl_s_per_step",
"counterpoint_s_per_step", "phases_s": {...}, "peak_gib", "mfu"}], "command", "versions"}.
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import json
import math
import os
import random
import re
import statistics
import sys
import time
import traceback
from pathlib import Path
from types import SimpleNamespace
from typing import Any

if sys.path and Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
    sys.path[0] = str(Path(__file__).resolve().parents[1])

ROOT = Path(__file__).resolve().parents[1]
VOCAB = 151_936  # Qwen3's; the carried 49k tokenizer decodes the ids it lacks as nothing
SHAPES: dict[str, dict[str, Any]] = {
    "qwen3-0.6b": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, tie_word_embeddings=True),
    "qwen3-4b": dict(hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, tie_word_embeddings=True),
    # Qwen3-14B's and Qwen3-32B's shapes (their config.json). Their bf16 checkpoints (29.5 and 65.5 GB)
    # would not fit the lent H200's 64 GiB disk beside the rest, and need not exist: the replica
    # draws random weights (model.load_format=dummy) and the learner maps them (CONFIG_ONLY).
    "qwen3-14b": dict(hidden_size=5120, intermediate_size=17408, num_hidden_layers=40, num_attention_heads=40,
                      num_key_value_heads=8, head_dim=128, tie_word_embeddings=False),
    "qwen3-32b": dict(hidden_size=5120, intermediate_size=25600, num_hidden_layers=64, num_attention_heads=64,
                      num_key_value_heads=8, head_dim=128, tie_word_embeddings=False),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, tie_word_embeddings=True),  # CPU dry runs
}
# Shapes built as config.json + tokenizer only: `counterpoint train` runs them with the replica's
# random weights lent to the learner (CONFIG_ONLY_SETS); TRL, which loads a checkpoint, cannot.
CONFIG_ONLY = ("qwen3-14b", "qwen3-32b")
CONFIG_ONLY_SETS = ("model.load_format=dummy", "share_base_weights=true", "rollout.vllm_lora=unmerged")
# vLLM's share of the card where the weights alone exceed configs/gpu-bench.yaml's 0.35 (49 GiB):
# 32B's 61 GiB of bf16 weights and ~20 GiB of KV cache; the learner maps the weights and takes the rest.
SHAPE_SETS = {"qwen3-32b": ("rollout.gpu_memory_utilization=0.62",)}
# (model, prompts per step), most wanted first: a deadline drops the last ones.
RUNS = [("qwen3-4b", 1), ("qwen3-0.6b", 1), ("qwen3-4b", 4), ("qwen3-0.6b", 4)]
GROUP_SIZE = 8
NEW_TOKENS = 384
PROMPT_TOKENS = 200
LORA_R, LORA_ALPHA = 32, 64
LR = 1e-5
SHAPE_KEYS = ("model", "prompts", "group_size", "tokens", "trl_s_per_step", "trl_vllm_s_per_step",
              "counterpoint_s_per_step", "counterpoint_train_s_per_step", "counterpoint_train_variant",
              "counterpoint_train_modes", "phases_s", "peak_gib", "mfu",
              # fp8 rollouts sample from another policy than the bf16 learner's: kept beside the
              # headline, each side at the same fp8 setting, never in it
              "trl_vllm_fp8_s_per_step", "counterpoint_train_fp8_s_per_step", "counterpoint_train_fp8_variant")
PHASES = ("gen", "score", "adv", "old_log_prob", "ref", "update_actor", "update_weights")
SHOWN_PHASES = ("gen", "score", "update_actor", "update_weights")  # the report's columns: the rest are ~0 here


# ---------------------------------------------------------------- shared inputs
def build_model(shape: str, tokenizer_dir: Path, out: Path, device: str, weights: bool | None = None) -> Path:
    """A random-init Qwen3 of ``shape`` in bf16 with the carried tokenizer, saved once to ``out``;
    without its weights (config and tokenizer only) for CONFIG_ONLY shapes unless ``weights``."""
    import torch
    from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

    from model.base import _align_generation_config

    if (out / "config.json").is_file():
        return out
    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    config = Qwen3Config(vocab_size=VOCAB, max_position_embeddings=40960, rope_theta=1_000_000.0, rms_norm_eps=1e-6,
                         bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                         dtype="bfloat16", **SHAPES[shape])
    if (shape in CONFIG_ONLY) if weights is None else not weights:  # the config, generation config, tokenizer
        from transformers import GenerationConfig

        tmp = out.with_name(out.name + ".tmp")
        # what a checkpoint's config names (save_pretrained of a model writes it): without it vLLM 0.26
        # built a pooling model, with no output head (bench/vllm_params_probe.py, 2026-12-03)
        config.architectures = ["Qwen3ForCausalLM"]
        config.save_pretrained(tmp)
        holder = type("Holder", (), {"generation_config": GenerationConfig.from_model_config(config)})()
        _align_generation_config(holder, tok)
        holder.generation_config.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        tmp.rename(out)
        return out
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            model = Qwen3ForCausalLM(config)
    finally:
        torch.set_default_dtype(default)
    _align_generation_config(model, tok)
    tmp = out.with_name(out.name + ".tmp")
    model.save_pretrained(tmp, safe_serialization=True)
    tok.save_pretrained(tmp)
    tmp.rename(out)
    del model
    return out


def prompt_texts(tokenizer_dir: Path, n: int, tokens: int = PROMPT_TOKENS, seed: int = 0) -> list[str]:
    """``n`` distinct user messages whose chat-templated prompt is ~``tokens`` tokens."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    words = ("voice", "chord", "tonic", "bass", "soprano", "cadence", "motion", "parallel", "fifth", "octave",
             "measure", "degree", "leading", "tone", "resolve", "minor", "major", "interval", "contrary", "step")
    overhead = len(tok.apply_chat_template([{"role": "user", "content": "x"}], add_generation_prompt=True,
                                           tokenize=True, return_dict=False)) - 1
    rng = random.Random(seed)
    out = []
    for i in range(n):
        text = f"Task {i}:"
        while len(tok(text)["input_ids"]) < tokens - overhead:
            text += " " + rng.choice(words)
        out.append(text)
    return out


def versions() -> dict[str, str]:
    out = {"python": sys.version.split()[0]}
    for name in ("torch", "transformers", "peft", "trl", "accelerate", "datasets", "ray"):
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            pass
    try:
        import torch

        if torch.cuda.is_available():
            out["device"] = torch.cuda.get_device_name(0)
    except ImportError:
        pass
    return out


def step_model_flops(params: int, sequences: int, prompt_tokens: float, completion_tokens: float) -> float:
    """The useful work of one GRPO step: sample every sequence (2 N per token) and train on it
    (6 N per token), learner/microbatch.py's convention; the same for both systems."""
    from learner.microbatch import model_flops

    tokens = sequences * (prompt_tokens + completion_tokens)
    return model_flops(params, train_tokens=tokens, forward_tokens=tokens)


def peak_flops() -> float:
    from config.learner import LearnerConfig

    return LearnerConfig().peak_flops  # the schema's one default (H100/H200 dense bf16)


def median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


# ---------------------------------------------------------------- counterpoint
def bench_config(model_dir: Path | str, prompts: int, steps: int, runs_dir: Path | str, gpu: bool = True,
                 max_tokens: int = NEW_TOKENS, engine: str = "hf", quantization: str | None = None,
                 mode: str = "sync", vllm_multiprocessing: bool | None = None, vllm_lora: str = "auto"):
    """The run config of one shape, validated by the schema (also what a `counterpoint train`
    of this shape would take: configs/gpu-bench-4b.yaml). ``quantization``: rollout.quantization
    (fp8 needs engine="vllm"; the schema refuses it otherwise). ``mode``: trainer.mode;
    ``vllm_multiprocessing``: rollout.vllm_multiprocessing (False: vLLM's engine core in this
    process, so that its kernels and the learner's share one CUDA context); ``vllm_lora``:
    rollout.vllm_lora (merged over fp8: the merge re-quantized, rollout/engines/vllm_merge.py)."""
    from config import RunConfig

    return RunConfig.model_validate({
        "seed": 0,
        "model": {"name_or_path": str(model_dir), "dtype": "bfloat16"},
        "rollout": {"engine": engine, "num_gpus": 0.5 if gpu else 0.0, "max_tokens": max_tokens,
                    "max_lora_rank": LORA_R, "temperature": 1.0, "max_model_len": 2048,
                    "gpu_memory_utilization": 0.35, "max_num_seqs": 64, "quantization": quantization,
                    "vllm_multiprocessing": vllm_multiprocessing, "vllm_lora": vllm_lora},
        "learner": {"use_gpu": gpu, "gpus_per_worker": 0.5, "lora": {"r": LORA_R, "alpha": LORA_ALPHA},
                    "lr": LR, "beta": 0.0, "loss_type": "dapo", "micro_batch_tokens": 8192},
        "trainer": {"steps": steps, "prompts_per_step": prompts, "group_size": GROUP_SIZE, "save_every": 0,
                    "runs_dir": str(runs_dir), "mode": mode},
    })


class _Sampler:
    """Prompts of a step: case ids (step-1)*P .. step*P-1 of the pool, round robin."""

    def __init__(self, pool: int, per_step: int):
        self.pool, self.per_step = pool, per_step

    def batch_for_step(self, step: int) -> list[str]:
        return [f"p{((step - 1) * self.per_step + i) % self.pool}" for i in range(self.per_step)]

    def position(self, step: int) -> dict[str, int]:
        return {"step": step}


class _TrivialGrader:
    """A trivial verifier: reward = share of vowels among the completion's letters (in [0, 1],
    different across a group, so advantages are not all 0)."""

    def score_batch(self, items):
        out = []
        for _, text in items:
            letters = [c for c in text.lower() if c.isalpha()]
            reward = sum(c in "aeiou" for c in letters) / len(letters) if letters else 0.0
            out.append(SimpleNamespace(reward=reward, format_ok=True))
        return out


def run_counterpoint_shape(engine, policy, texts: list[str], prompts: int, steps: int, runs_dir: Path,
                           version: int, model_dir: Path, gpu: bool, prof_dir: Path, mode: str = "sync",
                           streams: bool = False) -> tuple[dict[str, Any], int]:
    """1 warm-up + ``steps`` steps of the driver's loop on one shape; returns figures and the
    adapter version live at the end. ``streams``: generation on a high-priority CUDA stream and
    the update on a normal one, in this one process (with mode one_step_off they run at once)."""
    import torch

    from services.inprocess import InProcessLearner, InProcessRollout
    from services.orchestrator import RunParts, run_steps

    cfg = bench_config(model_dir, prompts, steps + 1, runs_dir, gpu=gpu, max_tokens=engine_max_tokens(engine),
                       engine=engine.kind, mode=mode)
    gen_priority, update_priority = (-1, 0) if streams else (None, None)  # -1: above the default's 0
    records: list[Any] = []
    cases = {f"p{i}": SimpleNamespace(messages=({"role": "user", "content": t},), prefixes=())
             for i, t in enumerate(texts)}
    parts = RunParts(cfg=cfg, cases=cases, sampler=_Sampler(len(texts), prompts), grader=_TrivialGrader(),
                     rollout=InProcessRollout(engine, stream_priority=gen_priority),
                     learner=InProcessLearner(policy, run_dir=None, stream_priority=update_priority),
                     record=records.append, version=version)
    if gpu:
        torch.cuda.reset_peak_memory_stats()
    run_steps(parts, 1)
    timed = records[1:]
    engine_stats = engine.stats() if hasattr(engine, "stats") else {}
    profile = profile_step(parts, steps + 2, gpu, prof_dir / f"profile-{model_dir.name}-{prompts}x{GROUP_SIZE}.txt")
    seqs = prompts * GROUP_SIZE
    gen_tokens = [sum(len(s.token_ids) for s in r.rollouts.samples) for r in records]
    prompt_len = statistics.mean(len(s.prompt_token_ids) for s in records[-1].rollouts.samples)
    s_step = median([r.total_s for r in timed])
    flops = step_model_flops(policy.num_params, seqs, prompt_len, statistics.mean(gen_tokens) / seqs)
    return {
        "warmup_s": records[0].total_s,
        "steps_s": [r.total_s for r in timed],
        "s_per_step": s_step,
        "phases_s": {p: median([r.phases_s.get(p, 0.0) for r in timed]) for p in PHASES},
        "generate_s": median([r.extra["generate_s"] for r in timed]),
        "adapter_staleness": [r.extra["adapter_staleness"] for r in records],
        "gen_tokens": gen_tokens,
        "prompt_tokens": prompt_len,
        "learner_mfu": median([r.learner_metrics["learner_mfu"] for r in timed]),
        "learner_tokens_per_s": median([r.learner_metrics["learner_tokens_per_s"] for r in timed]),
        "ppl_ratio": [r.learner_metrics["ppl_ratio"] for r in records],
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if gpu else None,
        "mfu": flops / s_step / peak_flops() if s_step else None,
        "completion_tokens_per_s": statistics.mean(gen_tokens[1:]) / s_step if s_step else None,
        "params": policy.num_params,
        "engine_stats": engine_stats,
        "profile": profile,
    }, parts.version


def profile_step(parts, step: int, gpu: bool, out: Path) -> dict[str, Any]:
    """One more step of the loop under torch.profiler: its phases and the top device-time ops
    (the table is written to ``out``; a captured decode graph shows as its replays)."""
    import dataclasses

    import torch
    from torch.profiler import ProfilerActivity, profile

    from services.orchestrator import run_steps

    records: list[Any] = []
    cfg = parts.cfg.model_copy(update={"trainer": parts.cfg.trainer.model_copy(update={"steps": step})})
    p2 = dataclasses.replace(parts, cfg=cfg, record=records.append)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if gpu else [])
    with profile(activities=acts) as prof:
        run_steps(p2, step)
    parts.version = p2.version
    avgs = prof.key_averages()
    try:
        table = avgs.table(sort_by="self_device_time_total" if gpu else "self_cpu_time_total", row_limit=25)
    except (KeyError, AttributeError, ValueError):
        table = avgs.table(sort_by="self_cuda_time_total" if gpu else "self_cpu_time_total", row_limit=25)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(table)
    attr = "self_device_time_total" if gpu else "self_cpu_time_total"
    total = sum(getattr(e, attr, 0.0) for e in avgs) or 1.0
    top = sorted(avgs, key=lambda e: getattr(e, attr, 0.0), reverse=True)[:12]
    return {"phases_s": records[0].phases_s, "total_s": records[0].total_s, "table": str(out),
            "top_ops": [{"name": e.key[:80], "self_ms": getattr(e, attr, 0.0) / 1e3,
                         "share": getattr(e, attr, 0.0) / total, "calls": e.count} for e in top]}


def engine_max_tokens(engine) -> int:
    return engine.rollout_cfg.max_tokens


def counterpoint(args) -> dict[str, Any]:
    import torch

    from learner.policy import PolicyLearner
    from rollout.engines import make_engine
    from model.adapter import adapter_version

    gpu = torch.cuda.is_available() and not args.cpu
    device = "cuda" if gpu else "cpu"
    texts = prompt_texts(args.tokenizer, 64)
    result: dict[str, Any] = {"system": "counterpoint", "versions": versions(), "shapes": []}
    by_model: dict[str, list[int]] = {}
    for model, prompts in runs_of(args):
        by_model.setdefault(model, []).append(prompts)
    for model, prompt_counts in by_model.items():
        t0 = time.perf_counter()
        model_dir = build_model(model, args.tokenizer, args.models / model, device)
        cfg = bench_config(model_dir, prompt_counts[0], args.steps + 1, args.runs, gpu=gpu, max_tokens=args.new_tokens,
                           engine=args.engine, quantization=args.quantization, mode=args.mode,
                           # the engine core in this process: its kernels and the update's in one context
                           vllm_multiprocessing=False if args.streams else None, vllm_lora=args.vllm_lora)
        engine = make_engine(cfg.model, cfg.rollout, kind=args.engine, seed=cfg.seed)
        policy = PolicyLearner.for_run(cfg, device=device)
        engine.load_adapter(policy.payload(adapter_version(0)))
        version = adapter_version(0)
        load_s = time.perf_counter() - t0
        print(f"[counterpoint] {model}: built and loaded in {load_s:.1f} s (engine {type(engine).__name__})", flush=True)
        for prompts in prompt_counts:
            row = {"model": model, "prompts": prompts, "group_size": GROUP_SIZE, "engine": type(engine).__name__,
                   "load_s": load_s, "mode": args.mode, "streams": args.streams, "quantization": args.quantization,
                   "vllm_lora": getattr(getattr(engine, "settings", None), "lora", None)}  # as resolved
            if time.monotonic() > args.deadline:
                row["skipped"] = "the call's deadline came first"
            else:
                try:
                    figures, version = run_counterpoint_shape(engine, policy, texts, prompts, args.steps, args.runs,
                                                              version, model_dir, gpu, args.out.parent,
                                                              mode=args.mode, streams=args.streams)
                    row.update(figures)
                except Exception as err:  # noqa: BLE001 - record the failure, go on with the next shape
                    row["error"] = f"{type(err).__name__}: {err}"
                    traceback.print_exc()
            print(f"[counterpoint] {json.dumps(row)}", flush=True)
            result["shapes"].append(row)
            save(result, args.out)
        del engine, policy
        if gpu:
            torch.cuda.empty_cache()
    return result


# ---------------------------------------------------------------- TRL
PHASE_LOG_ENV = "CP_PHASE_LOG"  # bench/memory.py names a file here to learn which phase a run is in


class PhaseMarks:
    """Which phase TRL's run is in, for bench/memory.py: each change appends "<unix time>
    <phase>" to the file named by CP_PHASE_LOG (nothing without it). Phases nest (sync inside
    generate inside score); leaving one returns to the one around it."""

    def __init__(self, path: str | None):
        self.path, self.stack = path, []

    def _write(self, phase: str) -> None:
        if self.path:
            with open(self.path, "a") as fh:
                fh.write(f"{time.time():.3f} {phase}\n")

    def enter(self, phase: str) -> None:
        """``phase`` from now on, whatever ran before."""
        self.stack = [phase]
        self._write(phase)

    def wrap(self, phase: str, fn):
        """``fn`` with ``phase`` marked while it runs."""
        def wrapper(*a, **k):
            self.stack.append(phase)
            self._write(phase)
            try:
                return fn(*a, **k)
            finally:
                self.stack.pop()
                self._write(self.stack[-1] if self.stack else "update")
        return wrapper


def trl_fp8_colocate() -> None:
    """TRL 1.16's colocated vLLM with vLLM's online fp8 (``trl --vllm --quantization fp8``): the
    same fp8 rollout as counterpoint's rollout.quantization=fp8, so that the two compare fairly.
    TRL has no such switch, so two of its pieces are patched (trl/generation/vllm_generation.py):
    - the ``LLM(...)`` it builds gets ``quantization="fp8"`` (it passes only "bitsandbytes", for
      a bnb 4-bit model);
    - its colocate weight sync, which calls ``model.load_weights`` once per parameter (bf16 into
      an fp8, transposed parameter: a shape error, or a cast with no new scale), goes through
      vLLM's ``reload_weights`` instead: the same parameters from the same iterator, each layer
      rebuilt and re-quantized as at start-up once all its shards are in (vLLM's layerwise reload,
      as counterpoint's merge over fp8: rollout/engines/vllm_merge.py). Sleep mode's wake-up
      before it is kept as TRL has it."""
    import trl.generation.vllm_generation as vg

    real_llm, real_sync = vg.LLM, vg.VLLMGeneration.sync_weights

    def fp8_llm(*a, **k):
        if k.get("quantization") not in (None, "fp8"):
            raise ValueError(f"TRL asked vLLM for quantization={k['quantization']!r}; this bench adds fp8 only "
                             "to a bf16 model")
        return real_llm(*a, **{**k, "quantization": "fp8"})

    def fp8_sync(self):
        if self.mode != "colocate":
            return real_sync(self)
        if self.enable_sleep_mode:
            vg.empty_cache()
            self.llm.wake_up(tags=["weights"])
            self._llm_weights_sleeping = False
        runner = self.llm.llm_engine.model_executor.driver_worker.model_runner
        runner.reload_weights(weights_iterator=self._iter_named_params(), is_checkpoint_format=True)
        self.llm.reset_prefix_cache()

    vg.LLM, vg.VLLMGeneration.sync_weights = fp8_llm, fp8_sync


def trl(args) -> dict[str, Any]:
    if args.quantization and not args.vllm:
        raise SystemExit(f"trl --quantization {args.quantization} needs --vllm: TRL's own generate samples in bf16")
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    gpu = torch.cuda.is_available() and not args.cpu
    device = "cuda" if gpu else "cpu"
    texts = prompt_texts(args.tokenizer, 64)
    result: dict[str, Any] = {"system": "trl-vllm" if args.vllm else "trl", "versions": versions(), "shapes": []}
    if args.vllm:
        # TRL's colocated vLLM joins a torch.distributed group of one (../shared/MEASURED.md).
        from graders.ports import free_port

        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=os.environ.get("MASTER_PORT") or str(free_port()))
        result["versions"]["vllm"] = md.version("vllm")
        if args.quantization:
            trl_fp8_colocate()
            result["rollout_quantization"] = args.quantization

    class StepTimer(TrainerCallback):
        """Times each optimizer step; stops training once the next step would end past the
        call's hard stop (after the warm-up and at least one timed step)."""

        def __init__(self):
            self.t0, self.steps, self.stopped_early = 0.0, [], False

        def on_step_begin(self, *a, **k):
            if gpu:
                torch.cuda.synchronize()
            marks.enter("update")
            self.t0 = time.perf_counter()

        def on_step_end(self, args_, state, control, **k):
            if gpu:
                torch.cuda.synchronize()
            self.steps.append(time.perf_counter() - self.t0)
            if len(self.steps) >= 2 and time.monotonic() + self.steps[-1] > args.stop:
                control.should_training_stop = self.stopped_early = True

    def timed(fn, sink: list[float]):
        def wrapper(*a, **k):
            t = time.perf_counter()
            out = fn(*a, **k)
            if gpu:
                torch.cuda.synchronize()
            sink.append(time.perf_counter() - t)
            return out
        return wrapper

    def reward(completions, **_):
        out = []
        for c in completions:
            text = c if isinstance(c, str) else c[-1]["content"]
            letters = [ch for ch in text.lower() if ch.isalpha()]
            out.append(sum(ch in "aeiou" for ch in letters) / len(letters) if letters else 0.0)
        return out

    marks = PhaseMarks(os.environ.get(PHASE_LOG_ENV))
    for model, prompts in runs_of(args):
        row: dict[str, Any] = {"model": model, "prompts": prompts, "group_size": GROUP_SIZE}
        if time.monotonic() > args.deadline:
            row["skipped"] = "the call's deadline came first"
            result["shapes"].append(row)
            save(result, args.out)
            continue
        marks.enter("start")
        try:
            # TRL loads a checkpoint: a CONFIG_ONLY shape is written with its weights, apart
            model_dir = build_model(model, args.tokenizer,
                                    args.models / (f"{model}-weights" if model in CONFIG_ONLY else model), device,
                                    weights=True)
            steps = args.steps if prompts == 1 else args.trl_steps_4x8
            tok = AutoTokenizer.from_pretrained(str(model_dir))
            lm = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.bfloat16).to(device)
            data = Dataset.from_list([{"prompt": [{"role": "user", "content": t}]} for t in texts])
            # One optimizer step per step of G x prompts completions: the whole batch at once, or
            # (--accumulate) one group per micro-step, generated together (steps_per_generation
            # follows gradient_accumulation_steps).
            per_device, accum = (GROUP_SIZE, prompts) if args.accumulate else (prompts * GROUP_SIZE, 1)
            extra: dict[str, Any] = {}
            if args.checkpointing is not None:
                extra["gradient_checkpointing"] = args.checkpointing
            if args.vllm:
                extra.update(use_vllm=True, vllm_mode="colocate", vllm_gpu_memory_utilization=args.vllm_gpu_util,
                             vllm_max_model_length=2048, generation_kwargs={"min_tokens": args.new_tokens})
                if args.vllm_sleep:
                    extra["vllm_enable_sleep_mode"] = True
            else:
                extra["generation_kwargs"] = {"min_new_tokens": args.new_tokens}
            conf = GRPOConfig(
                output_dir=str(args.runs / f"trl-{model}-{prompts}"), per_device_train_batch_size=per_device,
                gradient_accumulation_steps=accum, num_generations=GROUP_SIZE, max_completion_length=args.new_tokens,
                temperature=1.0, learning_rate=LR, beta=0.0, loss_type="dapo", max_steps=1 + steps, logging_steps=1,
                save_strategy="no", report_to="none", bf16=gpu, use_cpu=not gpu, seed=0, disable_tqdm=True,
                dataloader_num_workers=0, **extra,
            )
            peft_cfg = LoraConfig(r=LORA_R, lora_alpha=LORA_ALPHA, target_modules="all-linear", task_type="CAUSAL_LM")
            trainer = GRPOTrainer(model=lm, reward_funcs=reward, args=conf, train_dataset=data,
                                  processing_class=tok, peft_config=peft_cfg)
            timer, gen_s, gen_score_s = StepTimer(), [], []
            trainer.add_callback(timer)
            trainer._generate_single_turn = timed(trainer._generate_single_turn, gen_s)
            trainer._generate_and_score_completions = timed(trainer._generate_and_score_completions, gen_score_s)
            if marks.path:  # bench/memory.py: generation, its weight sync, and scoring with the old log-probs
                trainer._generate_single_turn = marks.wrap("generate", trainer._generate_single_turn)
                trainer._generate_and_score_completions = marks.wrap("score", trainer._generate_and_score_completions)
                sync_owner = getattr(trainer, "vllm_generation", None)
                if sync_owner is not None and hasattr(sync_owner, "sync_weights"):
                    sync_owner.sync_weights = marks.wrap("sync", sync_owner.sync_weights)
                elif hasattr(trainer, "_move_model_to_vllm"):
                    trainer._move_model_to_vllm = marks.wrap("sync", trainer._move_model_to_vllm)
            if gpu:
                torch.cuda.reset_peak_memory_stats()
            trainer.train()
            marks.enter("end")
            params = sum(p.numel() for p in trainer.model.parameters())
            prompt_len = statistics.mean(
                len(tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True,
                                            tokenize=True, return_dict=False)) for t in texts)
            s_step = median(timer.steps[1:])
            seqs = prompts * GROUP_SIZE
            row.update(
                warmup_s=timer.steps[0] if timer.steps else None, steps_s=timer.steps[1:], s_per_step=s_step,
                phases_s={"gen": median(gen_s[1:]),
                          "score_and_logprobs": median([a - b for a, b in zip(gen_score_s[1:], gen_s[1:])]),
                          "update": median([s - g for s, g in zip(timer.steps[1:], gen_score_s[1:])])},
                prompt_tokens=prompt_len, params=params,
                peak_gib=torch.cuda.max_memory_allocated() / 2**30 if gpu else None,
                mfu=step_model_flops(params, seqs, prompt_len, args.new_tokens) / s_step / peak_flops() if s_step else None,
                completion_tokens_per_s=seqs * args.new_tokens / s_step if s_step else None,
                gradient_checkpointing=conf.gradient_checkpointing, generation="vllm-colocate" if args.vllm else "generate",
                rollout_quantization=args.quantization,
                per_device_train_batch_size=per_device, gradient_accumulation_steps=accum,
            )
            if timer.stopped_early:
                row["stopped_early"] = f"{len(timer.steps) - 1} of {steps} timed steps: the call's hard stop came first"
            del trainer, lm
            if gpu:
                torch.cuda.empty_cache()
        except Exception as err:  # noqa: BLE001 - record it, go on with the next shape
            row["error"] = f"{type(err).__name__}: {err}"
            traceback.print_exc()
        print(f"[trl] {json.dumps(row)}", flush=True)
        result["shapes"].append(row)
        save(result, args.out)
    return result


# ---------------------------------------------------------------- counterpoint train (Ray)
TRAIN_CONFIG = ROOT / "configs" / "gpu-bench.yaml"


def train_overrides(model_dir: Path, prompts: int, mode: str, steps: int, runs_dir: Path) -> list[str]:
    """`--set`s that turn configs/gpu-bench.yaml into one (shape, mode) of the bench."""
    return [f"model.name_or_path={model_dir}", f"trainer.prompts_per_step={prompts}", f"trainer.mode={mode}",
            f"trainer.steps={steps}", f"trainer.runs_dir={runs_dir}"]


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.is_file() else []


def train_figures(run: Path, skip: int, mode: str) -> dict[str, Any]:
    """What a finished `counterpoint train` run directory says about its speed and its samples:
    s/step and phases (medians of timing.jsonl after ``skip`` warm-up steps), ppl_ratio and
    staleness per step, and every sample's adapter version against its step's (round rows)."""
    timing, metrics = read_jsonl(run / "timing.jsonl"), read_jsonl(run / "metrics.jsonl")
    # The last step is left out too: in one_step_off it has no next generation to overlap with,
    # so it is shorter than the steady state (and in sync mode it is like the others).
    kept = timing[skip:-1] or timing
    samples, off, worst = 0, 0, 0
    for path in sorted(run.glob("round_*/*.jsonl")):
        for row in read_jsonl(path):
            behind = row["step"] - row["adapter_version"]  # version v samples step v when on-policy
            samples += 1
            worst = max(worst, behind)
            off += int(behind != 0)
    receipt = json.loads((run / "run.json").read_text()) if (run / "run.json").is_file() else {}
    bound = 0 if mode == "sync" else 1
    return {
        "steps_trained": len(timing),
        "steps_s": [t["total_s"] for t in timing],
        "s_per_step": median([t["total_s"] for t in kept]),
        "phases_s": {p: median([t["phases_s"].get(p, 0.0) for t in kept]) for p in PHASES},
        "ppl_ratio": [m.get("ppl_ratio") for m in metrics],
        # the rollout/learner mismatch per step: what an fp8 rollout (--set rollout.quantization=fp8) moves
        "rollout_k3_kl": [m.get("rollout_k3_kl") for m in metrics],
        "tis_clip_frac": [m.get("tis_clip_frac") for m in metrics],
        "adapter_staleness": [m.get("adapter_staleness") for m in metrics],
        "generate_s": median([m.get("generate_s", 0.0) for m in metrics[skip:-1] or metrics]),
        # one_step_off: the part of update_weights the next generation still ran beside (a merging
        # replica waits for it); 0 in sync mode, None in runs from before it was recorded
        "update_weights_beside_gen_s": median([m["update_weights_beside_gen_s"] for m in metrics[skip:-1] or metrics
                                               if m.get("update_weights_beside_gen_s") is not None]),
        "learner_cuda_graphs": [m.get("learner_cuda_graphs") for m in metrics],
        # the memory plan's choice per step (None in runs from before it was recorded)
        "learner_gradient_checkpointing": [m.get("learner_gradient_checkpointing") for m in metrics],
        "learner_micro_batches": [m.get("learner_micro_batches") for m in metrics],
        "gen_tokens": [int(m.get("generated_tokens", 0)) for m in metrics],
        "samples": samples, "samples_behind": off, "max_behind": worst,
        "versions_ok": samples > 0 and worst <= bound and (mode != "sync" or off == 0),
        "status": receipt.get("status"),
        "rollout_engine": receipt.get("rollout_engine"),
        "rollout_quantization": receipt.get("rollout_quantization"),
        "gpu_sharing": receipt.get("gpu_sharing"),
    }


def train_side(args) -> dict[str, Any]:
    """`counterpoint train` (Ray Serve vLLM replica + Ray Train learner + the gRPC grader, one GPU
    shared by fractions) per (shape, mode), each a subprocess as a user runs it."""
    import subprocess
    import threading

    from bench.multi_gpu import gpu_memory_sampler

    result: dict[str, Any] = {"system": "counterpoint-train", "versions": versions(), "shapes": []}
    for model, prompts in runs_of(args):
        model_dir = build_model(model, args.tokenizer, args.models / model, "cuda" if not args.cpu else "cpu")
        for mode in args.modes:
            row: dict[str, Any] = {"model": model, "prompts": prompts, "group_size": GROUP_SIZE, "mode": mode}
            left = args.deadline - time.monotonic()
            if left < 60:
                row["skipped"] = "the call's deadline came first"
                result["shapes"].append(row)
                save(result, args.out)
                continue
            name = f"gpu-bench-{model}-{prompts}x{GROUP_SIZE}-{mode}-{int(time.time())}"
            sets = (train_overrides(model_dir, prompts, mode, args.steps + args.skip + 1, args.runs)
                    + (list(CONFIG_ONLY_SETS) if model in CONFIG_ONLY else []) + list(SHAPE_SETS.get(model, ()))
                    + list(args.set))
            cmd = [sys.executable, "-m", "services.cli", "train", "--config", str(args.config), "--run-name", name,
                   *sum((["--set", x] for x in sets), [])]
            row["command"] = "counterpoint " + " ".join(cmd[3:])
            peaks: dict[int, float] = {}
            stop = threading.Event()
            threading.Thread(target=gpu_memory_sampler, args=(stop, peaks), daemon=True).start()
            t0 = time.monotonic()
            log_path = (args.out.parent if args.out else Path(".")) / f"{name}.log"
            with open(log_path, "w") as log_file:
                try:
                    rc = subprocess.run(cmd, cwd=ROOT, stdout=log_file, stderr=subprocess.STDOUT,
                                        timeout=max(left - 20, 30)).returncode
                except subprocess.TimeoutExpired:
                    rc = "timeout"
            stop.set()
            row.update(exit_code=rc, wall_s=time.monotonic() - t0, log=str(log_path),
                       peak_gpu_mib=max(peaks.values()) if peaks else None)
            run = args.runs / name
            if (run / "timing.jsonl").is_file():
                row.update(train_figures(run, args.skip, mode))
                timing = read_jsonl(run / "timing.jsonl")
                row["startup_s"] = row["wall_s"] - sum(t["total_s"] for t in timing)
            print(f"[train] {json.dumps(row)}", flush=True)
            result["shapes"].append(row)
            save(result, args.out)
    return result


# ---------------------------------------------------------------- results
def runs_of(args) -> list[tuple[str, int]]:
    wanted = [tuple(s.split(":")) for s in args.shapes.split(",")] if args.shapes else RUNS
    return [(m, int(p)) for m, p in wanted]


def save(result: dict[str, Any], path: Path | None) -> None:
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=1))


def train_variant(row: dict[str, Any]) -> str:
    """A `counterpoint train` row's label: its mode, then what it runs differently from the
    time-sliced bf16 rollout (MPS, fp8 rollouts, and over fp8 the LoRA merged: its --set)."""
    sharing = (row.get("gpu_sharing") or {}).get("mode")
    if sharing is None:  # rows from before run.json's gpu_sharing was kept: the command's --set says
        found = re.search(r"gpu_sharing\.mode=(\w+)", row.get("command") or "")
        sharing = found.group(1) if found else "timeslice"
    record = row.get("rollout_quantization") or {}
    quant = record.get("mode")
    merged = quant not in (None, "none") and ("LoRA merged" in record.get("rollout_weights", "")
                                              or "rollout.vllm_lora=merged" in (row.get("command") or ""))
    # the learner's own --sets (compiled layers, the fused LoRA off, ...), the adapter's transport and
    # MPS's shares and priority, as written: two runs that differ only there must not share a label,
    # or one would hide the other in the report
    sets = re.findall(r"--set ((?:learner\.|adapter_transport=|gpu_sharing\.learner_)\S+)", row.get("command") or "")
    return ", ".join([row["mode"]] + (["MPS"] if sharing == "mps" else [])
                     + ([f"{quant} rollouts"] if quant not in (None, "none") else [])
                     + (["LoRA merged"] if merged else []) + sets)


def _quantized(row: dict[str, Any]) -> bool:
    """A result row (either side) whose rollouts came from an fp8 engine."""
    q = row.get("rollout_quantization")
    return (q.get("mode") if isinstance(q, dict) else q) not in (None, "none")


def trained_finite(row: dict[str, Any]) -> bool:
    """A train row whose learner stayed finite: no step's ppl_ratio is nan or inf (None: not
    recorded). A run whose policy went nan still has a step time, and a fast one: on an H100
    under MPS with the learner at 75% of the SMs (2026-12-05, before the learner refused non-finite
    gradients) such a run would have been the report's headline."""
    return all(v is None or math.isfinite(v) for v in row.get("ppl_ratio") or [])


def best_train_row(rows: list[dict[str, Any]], fp8: bool = False) -> dict[str, Any]:
    """The fastest row of one shape among those with TRL's semantics (bf16 rollouts: an fp8 row
    samples from another policy, so it is reported beside, never as the headline); with fp8,
    the fastest fp8 row instead. A row whose policy went nan is never either."""
    timed = [r for r in rows if r.get("s_per_step") and _quantized(r) == fp8 and trained_finite(r)]
    return min(timed, key=lambda r: r["s_per_step"]) if timed else {}


def one_device(*results: dict[str, Any] | None) -> str | None:
    """The GPU every result file was measured on. A ratio across machines would compare two
    experiments, so files from two devices are refused, naming both."""
    devices = {res["versions"]["device"] for res in results if res and (res.get("versions") or {}).get("device")}
    if len(devices) > 1:
        raise ValueError(f"the result files come from different GPUs ({', '.join(sorted(devices))}): "
                         "a ratio must be measured on one machine, back to back")
    return next(iter(devices), None)


def merge(trl_res: dict[str, Any] | None, cp_res: dict[str, Any] | None, command: str,
          trl_vllm_res: dict[str, Any] | None = None, train_res: dict[str, Any] | None = None) -> dict[str, Any]:
    """The committed JSON: one row per (model, prompts), null where a side was not measured.
    ``phases_s``, ``peak_gib`` and ``mfu`` are `counterpoint train`'s (its faster mode) where it
    ran, else the one-process loop's."""
    def index(res, keep=lambda r: True):
        return {(r["model"], r["prompts"]): r for r in (res or {}).get("shapes", []) if keep(r)}

    one_device(trl_res, cp_res, trl_vllm_res, train_res)
    trl_rows, cp_rows = index(trl_res), index(cp_res)
    # TRL + vLLM at bf16 (the headline's peer) and with its vLLM in fp8 (the fp8 rows' peer)
    tv_rows = index(trl_vllm_res, lambda r: not _quantized(r))
    tv_fp8 = index(trl_vllm_res, _quantized)
    train_rows: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for r in (train_res or {}).get("shapes", []):
        train_rows.setdefault((r["model"], r["prompts"]), []).append(r)
    keys = set(trl_rows) | set(cp_rows) | set(tv_rows) | set(tv_fp8) | set(train_rows)
    shapes = []
    for key in [k for k in RUNS if k in keys] + sorted(keys - set(RUNS)):
        t, c, tv = trl_rows.get(key, {}), cp_rows.get(key, {}), tv_rows.get(key, {})
        modes = {train_variant(r) + ("" if trained_finite(r) else " (went nan: not a result)"): r.get("s_per_step")
                 for r in train_rows.get(key, [])}
        best = best_train_row(train_rows.get(key, []))
        best_fp8 = best_train_row(train_rows.get(key, []), fp8=True)
        gen = best.get("gen_tokens") or c.get("gen_tokens")
        peak = best.get("peak_gpu_mib") / 1024 if best.get("peak_gpu_mib") else c.get("peak_gib")
        mfu = None
        if best.get("s_per_step") and c.get("params") and c.get("prompt_tokens") and gen:
            mfu = step_model_flops(c["params"], key[1] * GROUP_SIZE, c["prompt_tokens"],
                                   statistics.median(gen) / (key[1] * GROUP_SIZE)) / best["s_per_step"] / peak_flops()
        shapes.append({
            "model": key[0], "prompts": key[1], "group_size": GROUP_SIZE,
            "tokens": round(statistics.median(gen[1:])) if gen and len(gen) > 1 else key[1] * GROUP_SIZE * NEW_TOKENS,
            "trl_s_per_step": t.get("s_per_step"),
            "trl_vllm_s_per_step": tv.get("s_per_step"),
            "counterpoint_s_per_step": c.get("s_per_step"),
            "counterpoint_train_s_per_step": best.get("s_per_step"),
            "counterpoint_train_variant": train_variant(best) if best else None,
            "counterpoint_train_modes": {m: v for m, v in modes.items() if v is not None},
            "phases_s": best.get("phases_s") or c.get("phases_s") or {},
            "peak_gib": peak,
            "mfu": mfu if best else c.get("mfu"),
            "trl_vllm_fp8_s_per_step": tv_fp8.get(key, {}).get("s_per_step"),
            "counterpoint_train_fp8_s_per_step": best_fp8.get("s_per_step"),
            "counterpoint_train_fp8_variant": train_variant(best_fp8) if best_fp8 else None,
        })
    vers = {"counterpoint": (cp_res or {}).get("versions", {}), "trl": (trl_res or {}).get("versions", {}),
            "trl_vllm": (trl_vllm_res or {}).get("versions", {}), "counterpoint_train": (train_res or {}).get("versions", {})}
    return {"shapes": shapes, "command": command, "versions": vers}


def ray_overhead(loop_res: dict[str, Any] | None, train_res: dict[str, Any] | None) -> list[dict[str, Any]]:
    """What Ray's path adds, per shape measured both ways: the one-process loop with the vLLM
    engine (``counterpoint --engine vllm``) against `counterpoint train` in sync mode (the same
    phases in the same order; one_step_off overlaps them, so it is not comparable phase by
    phase). Rows of other engines are left out: their generation differs for other reasons."""
    loops = {(r["model"], r["prompts"]): r for r in (loop_res or {}).get("shapes", [])
             if r.get("engine") == "VllmEngine" and r.get("s_per_step")}
    rows = []
    for r in (train_res or {}).get("shapes", []):
        key, loop = (r["model"], r["prompts"]), loops.get((r["model"], r["prompts"]))
        if r.get("mode") != "sync" or not r.get("s_per_step") or loop is None:
            continue
        lp, tp = loop.get("phases_s", {}), r.get("phases_s", {})
        rows.append({"model": key[0], "prompts": key[1], "loop_s": loop["s_per_step"], "train_s": r["s_per_step"],
                     "added_s": r["s_per_step"] - loop["s_per_step"],
                     "added_share": r["s_per_step"] / loop["s_per_step"] - 1,
                     "phases_added_s": {ph: tp.get(ph, 0.0) - lp.get(ph, 0.0) for ph in PHASES
                                        if ph in lp or ph in tp}})
    return rows


def validate_results(doc: dict[str, Any]) -> None:
    """The committed JSON has exactly the issue's schema; raises ValueError naming what is off."""
    if set(doc) != {"shapes", "command", "versions"}:
        raise ValueError(f"top-level keys {sorted(doc)}, want command, shapes, versions")
    if not isinstance(doc["command"], str) or not isinstance(doc["versions"], dict):
        raise ValueError("command must be a string and versions an object")
    for i, row in enumerate(doc["shapes"]):
        if set(row) != set(SHAPE_KEYS):
            raise ValueError(f"shapes[{i}] keys {sorted(row)}, want {sorted(SHAPE_KEYS)}")
        for k in ("phases_s", "counterpoint_train_modes"):
            if not isinstance(row[k], dict):
                raise ValueError(f"shapes[{i}].{k} must be an object")
        for k in ("trl_s_per_step", "trl_vllm_s_per_step", "counterpoint_s_per_step", "counterpoint_train_s_per_step",
                  "peak_gib", "mfu", "trl_vllm_fp8_s_per_step", "counterpoint_train_fp8_s_per_step"):
            if row[k] is not None and not isinstance(row[k], (int, float)):
                raise ValueError(f"shapes[{i}].{k} must be a number or null, got {row[k]!r}")
        for k in ("prompts", "group_size", "tokens"):
            if not isinstance(row[k], int):
                raise ValueError(f"shapes[{i}].{k} must be an integer, got {row[k]!r}")


def fmt(x, spec=".2f") -> str:
    return "–" if x is None else format(x, spec)


def _ratio(a, b):
    return a / b if a and b else None


def _steps(row: dict[str, Any], spec: str) -> str:
    """A side's timed steps, or why it has none; a TRL run cut short says so."""
    steps = ", ".join(fmt(x, spec) for x in row.get("steps_s", []))
    if steps and row.get("stopped_early"):
        steps += f" ({row['stopped_early']})"
    return steps or row.get("skipped") or row.get("error") or ""


def _section(title: str, headers: list[str], rows: list[list[Any]]) -> list[str]:
    """A markdown section: its heading and one table."""
    return ["", f"## {title}", "", "| " + " | ".join(headers) + " |", "|" + "---|" * len(headers),
            *("| " + " | ".join(str(c) for c in row) + " |" for row in rows)]


def _plan_steps(r: dict[str, Any]) -> str:
    """The learner's memory plan over a run's steps: how many checkpointed, and the micro-batch
    counts ('–' for runs from before it was recorded)."""
    ckpt = [x for x in r.get("learner_gradient_checkpointing") or [] if x is not None]
    mbs = sorted({int(x) for x in r.get("learner_micro_batches") or [] if x is not None})
    if not ckpt:
        return "–"
    return f"{int(sum(ckpt))}/{len(ckpt)} steps ({', '.join(map(str, mbs))})"


def _range(xs) -> str:
    xs = [x for x in xs or [] if x is not None]
    return f"{min(xs):.4f}–{max(xs):.4f}" if xs else "–"


def markdown(doc: dict[str, Any], trl_res: dict[str, Any] | None, cp_res: dict[str, Any] | None,
             notes: str = "", trl_vllm_res: dict[str, Any] | None = None,
             train_res: dict[str, Any] | None = None, loop_res: dict[str, Any] | None = None) -> str:
    """bench/results/gpu-vs-trl.md: the command, the headline (counterpoint train against TRL +
    vLLM), then each side's details; TRL's default generation and the one-process loop as
    secondary rows."""
    def rows_of(res):
        return {(r["model"], r["prompts"]): r for r in (res or {}).get("shapes", [])}

    t_rows, c_rows = rows_of(trl_res), rows_of(cp_res)
    device = one_device(trl_res, cp_res, trl_vllm_res, train_res) or "one GPU"
    lines = [f"# counterpoint vs TRL on one {device.removeprefix('NVIDIA ')}: the whole GRPO step", "",
             "Random-init Qwen3 shapes (vocab 151,936, bf16), LoRA r=32 alpha 64 on all linear layers, G=8, "
             "384 new tokens, ~200-token prompts, temperature 1, dapo, beta 0. bench/gpu_vs_trl.py says how.", "",
             "## Command", "", "```", doc["command"], "```", "",
             "## Per step: `counterpoint train` (Ray) against TRL + vLLM colocate (medians over the timed steps)", "",
             "| model | completions | TRL + vLLM s/step | counterpoint train s/step | ratio | its variant | "
             "every variant s/step (ratio) | gen | score | update_actor | update_weights | TRL `generate` s/step | "
             "one-process loop s/step | peak GiB | MFU (step) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in doc["shapes"]:
        ph, modes, trl_s = row["phases_s"], row["counterpoint_train_modes"], row["trl_vllm_s_per_step"]
        every = "; ".join(f"{m} {fmt(v)}" + (f" ({fmt(_ratio(v, trl_s), '.3f')})" if trl_s else "")
                          for m, v in sorted(modes.items(), key=lambda mv: mv[1]))
        lines.append(
            f"| {row['model']} | {row['prompts']}x{row['group_size']} | {fmt(trl_s)} | "
            f"{fmt(row['counterpoint_train_s_per_step'])} | "
            f"{fmt(_ratio(row['counterpoint_train_s_per_step'], trl_s), '.3f')} | "
            f"{row.get('counterpoint_train_variant') or '–'} | {every or '–'} | "
            + " | ".join(fmt(ph.get(p)) for p in SHOWN_PHASES)
            + f" | {fmt(row['trl_s_per_step'])} | {fmt(row['counterpoint_s_per_step'])} | "
              f"{fmt(row['peak_gib'], '.1f')} | {fmt(row['mfu'], '.4f')} |")
    fp8_rows = [r for r in doc["shapes"] if r["trl_vllm_fp8_s_per_step"] or r["counterpoint_train_fp8_s_per_step"]]
    lines += _section(
        "fp8 rollouts, beside the headline (the fp8 engine samples from another policy than the bf16 learner's; "
        "TIS corrects for it)",
        ["model", "completions", "TRL + vLLM, its vLLM in fp8, s/step", "counterpoint train, fp8 rollouts, s/step",
         "its variant", "ratio at the same fp8 setting", "ratio to TRL + vLLM's faster setting (bf16 or fp8)"],
        [[r["model"], f"{r['prompts']}x{r['group_size']}", fmt(r["trl_vllm_fp8_s_per_step"]),
          fmt(r["counterpoint_train_fp8_s_per_step"]), r["counterpoint_train_fp8_variant"] or "–",
          fmt(_ratio(r["counterpoint_train_fp8_s_per_step"], r["trl_vllm_fp8_s_per_step"]), ".3f"),
          fmt(_ratio(r["counterpoint_train_fp8_s_per_step"],
                     min((x for x in (r["trl_vllm_s_per_step"], r["trl_vllm_fp8_s_per_step"]) if x), default=None)),
              ".3f")] for r in fp8_rows] or [["–"] * 7])
    lines += ["", "## counterpoint train (Ray Serve vLLM replica + Ray Train learner + gRPC grader, one GPU)", "",
              "| model | completions | variant | exit | timed steps s | gen (wait) | generate call | score | update_actor | "
              "update_weights | of it beside gen | ppl_ratio range | rollout k3 KL | TIS clipped | staleness | samples on their step's "
              "version (sync) / at most one behind | learner graphs | learner checkpointed (micro-batches) | start-up s |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in (train_res or {}).get("shapes", []):
        ph = r.get("phases_s", {})
        why = r.get("skipped") or ""
        stale = sorted({int(x) for x in r.get("adapter_staleness", []) if x is not None})
        lines.append(
            f"| {r['model']} | {r['prompts']}x{GROUP_SIZE} | {train_variant(r)} | {r.get('exit_code', '–')} | "
            f"{', '.join(fmt(x) for x in r.get('steps_s', [])) or why} | {fmt(ph.get('gen'))} | "
            f"{fmt(r.get('generate_s'))} | "
            + " | ".join(fmt(ph.get(p)) for p in ("score", "update_actor", "update_weights"))
            + f" | {fmt(r.get('update_weights_beside_gen_s'))} | {_range(r.get('ppl_ratio'))} | {_range(r.get('rollout_k3_kl'))} | {_range(r.get('tis_clip_frac'))}"
              f" | {stale or '–'} | "
              f"{r.get('samples', 0) - r.get('samples_behind', 0)}/{r.get('samples', 0)} on, max behind "
              f"{r.get('max_behind', '–')} ({'OK' if r.get('versions_ok') else 'FAIL'}) | "
              f"{_range(r.get('learner_cuda_graphs'))} | {_plan_steps(r)} | {fmt(r.get('startup_s'), '.0f')} |")
    overhead = ray_overhead(loop_res, train_res)
    lines += _section("Ray against the one-process loop (vLLM engine both, sync mode, same session)",
                      ["model", "completions", "loop s/step", "train s/step", "Ray adds", "share",
                       *(f"{p} added" for p in SHOWN_PHASES)],
                      [[o["model"], f"{o['prompts']}x{GROUP_SIZE}", fmt(o["loop_s"]), fmt(o["train_s"]),
                        fmt(o["added_s"]), f"{o['added_share']:+.1%}",
                        *(fmt(o["phases_added_s"].get(p), "+.3f") for p in SHOWN_PHASES)]
                       for o in overhead] or [["–"] * (6 + len(SHOWN_PHASES))])
    tv_cells = []
    for t in (trl_vllm_res or {}).get("shapes", []):
        ph = t.get("phases_s", {})
        tv_cells.append([t["model"], f"{t['prompts']}x{GROUP_SIZE}", t.get("rollout_quantization") or "bf16",
                         f"{t.get('per_device_train_batch_size', '–')} x {t.get('gradient_accumulation_steps', '–')}",
                         t.get("gradient_checkpointing", "–"), fmt(t.get("warmup_s"), ".1f"), _steps(t, ".2f"),
                         fmt(ph.get("gen")), fmt(ph.get("score_and_logprobs")), fmt(ph.get("update")),
                         fmt(t.get("peak_gib"), ".1f")])
    lines += _section("TRL + vLLM colocate (GRPOTrainer, use_vllm=True, vllm_mode='colocate')",
                      ["model", "completions", "its vLLM", "batch", "checkpointing", "warm-up s", "timed steps s",
                       "gen (incl. weight sync)", "score + logprobs", "update", "peak GiB"], tv_cells)
    t_cells = []
    for key, t in t_rows.items():
        ph = t.get("phases_s", {})
        t_cells.append([key[0], f"{key[1]}x{GROUP_SIZE}", fmt(t.get("warmup_s"), ".1f"), _steps(t, ".1f"),
                        fmt(ph.get("gen")), fmt(ph.get("score_and_logprobs")), fmt(ph.get("update")),
                        fmt(t.get("peak_gib"), ".1f"), fmt(t.get("mfu"), ".4f")])
    lines += _section("TRL with its default generation (transformers `generate`), secondary",
                      ["model", "completions", "warm-up s", "timed steps s", "gen", "score + logprobs", "update",
                       "peak GiB", "MFU"], t_cells)
    c_cells = [[key[0], f"{key[1]}x{GROUP_SIZE}", c.get("engine", ""), fmt(c.get("load_s"), ".1f"),
                fmt(c.get("warmup_s"), ".1f"), _steps(c, ".2f"), ", ".join(str(n) for n in c.get("gen_tokens", [])),
                fmt(c.get("learner_tokens_per_s"), ".0f"), _range(c.get("ppl_ratio"))] for key, c in c_rows.items()]
    lines += _section("counterpoint's step loop in one process (no Ray), secondary",
                      ["model", "completions", "engine", "load s", "warm-up s (compile)", "timed steps s",
                       "tokens per step", "learner tok/s", "ppl_ratio range"], c_cells)
    lines += ["", "## Versions", "", "```", json.dumps(doc["versions"], indent=1), "```"]
    if notes:
        lines += ["", notes.strip()]
    return "\n".join(lines) + "\n"


def combine(results: list[dict[str, Any]]) -> dict[str, Any] | None:
    """One side's result from the files of its processes (one per GPU): their shapes in the
    order of RUNS; the versions of the first (all processes run the same image)."""
    if not results:
        return None
    rows = [r for res in results for r in res.get("shapes", [])]
    order = {k: i for i, k in enumerate(RUNS)}
    rows.sort(key=lambda r: order.get((r["model"], r["prompts"]), len(order)))
    return {**results[0], "shapes": rows}


def write_report(trl_res, cp_res, command: str, json_out: Path, md_out: Path, notes: str = "",
                 trl_vllm_res=None, train_res=None, loop_res=None) -> None:
    doc = merge(trl_res, cp_res, command, trl_vllm_res, train_res)
    validate_results(doc)
    json_out.write_text(json.dumps(doc, indent=1) + "\n")
    md_out.write_text(markdown(doc, trl_res, cp_res, notes, trl_vllm_res, train_res, loop_res))
    print(f"wrote {json_out} and {md_out}", flush=True)


def report(args) -> None:
    def load(paths):
        return combine([json.loads(p.read_text()) for p in paths])

    write_report(load(args.trl), load(args.counterpoint), args.command, args.json_out, args.md_out,
                 "\n\n".join(p.read_text().strip() for p in args.notes), load(args.trl_vllm), load(args.train),
                 load(args.loop))


# ---------------------------------------------------------------- one call, every GPU
# Seconds per (side, model, prompts): model build/load + warm-up + 5 timed steps (+ the profiled
# step for counterpoint), as measured on the H200 on 2026-11-30 (bench/results/gpu-vs-trl.md).
ESTIMATE_S = {
    ("trl", "qwen3-4b", 1): 230, ("trl", "qwen3-0.6b", 1): 175,
    ("trl", "qwen3-4b", 4): 250, ("trl", "qwen3-0.6b", 4): 185,
    ("counterpoint", "qwen3-4b", 1): 85, ("counterpoint", "qwen3-0.6b", 1): 60,
    ("counterpoint", "qwen3-4b", 4): 95, ("counterpoint", "qwen3-0.6b", 4): 65,
}


def plan_jobs(parts: list[str], runs: list[tuple[str, int]], gpus: int) -> list[list[tuple[str, list[tuple[str, int]]]]]:
    """Each GPU's processes, in order: ``[(side, [(model, prompts), ...]), ...]`` per GPU.

    Longest job first onto the least loaded GPU (LPT); on a GPU, TRL's process runs before
    counterpoint's and a side's shapes of one model are adjacent (counterpoint loads a model once)."""
    jobs = sorted(((p, m, n) for p in parts for m, n in runs), key=lambda j: -ESTIMATE_S.get(j, 100))
    load, placed = [0.0] * gpus, [[] for _ in range(gpus)]
    for job in jobs:
        g = min(range(gpus), key=lambda i: load[i])
        load[g] += ESTIMATE_S.get(job, 100)
        placed[g].append(job)
    plan = []
    for mine in placed:
        procs = []
        for side in [p for p in ("trl", "counterpoint") if p in parts]:
            shapes = sorted(((m, n) for p, m, n in mine if p == side), key=lambda r: (r[0], r[1]))
            if shapes:
                procs.append((side, shapes))
        plan.append(procs)
    return plan


def run_all(args) -> int:
    """Both sides on every visible GPU in parallel, then the report into ``--out-dir``."""
    import shlex
    import subprocess
    import threading

    out: Path = args.out_dir.resolve()
    out.mkdir(parents=True, exist_ok=True)
    gpus = args.gpus or _visible_gpus()
    plan = plan_jobs(args.parts, runs_of(args), max(gpus, 1))
    end = time.monotonic() + args.budget_s
    print(f"[all] {max(gpus, 1)} slot(s), plan: {json.dumps(plan)}", flush=True)
    files: dict[str, list[Path]] = {"trl": [], "counterpoint": []}

    def lane(g: int, procs) -> None:
        for side, shapes in procs:
            left = end - time.monotonic()
            shard = out / f"{side}-gpu{g}.json"
            shard.unlink(missing_ok=True)  # a file left by an earlier run in this dir is not this run's
            files[side].append(shard)
            cmd = [sys.executable, str(Path(__file__).resolve()), side, "--out", str(shard),
                   "--shapes", ",".join(f"{m}:{n}" for m, n in shapes), "--steps", str(args.steps),
                   "--trl-steps-4x8", str(args.trl_steps_4x8), "--new-tokens", str(args.new_tokens),
                   "--tokenizer", str(args.tokenizer), "--models", str(args.models / f"gpu{g}"),
                   "--runs", str(args.runs / f"gpu{g}"),
                   "--deadline-s", str(max(left - args.reserve_s, 0)), "--stop-s", str(max(left - 15, 0))]
            if args.cpu:
                cmd.append("--cpu")
            env = dict(os.environ)
            if gpus:
                env["CUDA_VISIBLE_DEVICES"] = str(g)
            if len(plan) > 1:
                # Each process's torch would start one CPU thread per core: two counterpoint
                # processes on one 32-core host ran update_actor 3-4x slower than one alone
                # (4B 1x8: 4.64 vs 1.15 s, 2026-11-30). Share the cores out instead (not yet
                # re-measured on a GPU host); Ray does the same for its workers.
                env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // len(plan))))
            print(f"[all] gpu{g}: {shlex.join(cmd[1:])}", flush=True)
            with open(out / f"{side}-gpu{g}.log", "w") as log:
                proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                # past the budget the process is killed: its file keeps the shapes it finished
                watchdog = threading.Timer(max(end - time.monotonic(), 0), proc.kill)
                watchdog.start()
                for line in proc.stdout:
                    log.write(line)
                    log.flush()
                    if line.startswith(("[trl]", "[counterpoint]", "Traceback")):
                        print(f"[gpu{g}] {_summary(line)}", flush=True)
                print(f"[all] gpu{g}: {side} exited {proc.wait()}", flush=True)
                watchdog.cancel()

    threads = [threading.Thread(target=lane, args=(g, procs)) for g, procs in enumerate(plan)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    loaded = {side: [json.loads(p.read_text()) for p in paths if p.is_file()] for side, paths in files.items()}
    trl_res, cp_res = combine(loaded["trl"]), combine(loaded["counterpoint"])
    for side, res in (("trl", trl_res), ("counterpoint", cp_res)):
        if res is not None:
            save(res, out / f"{side}.json")
    write_report(trl_res, cp_res, args.command or shlex.join(["python3", "bench/gpu_vs_trl.py", *sys.argv[1:]]),
                 out / "gpu-vs-trl.json", out / "gpu-vs-trl.md")
    rows = (trl_res or {}).get("shapes", []) + (cp_res or {}).get("shapes", [])
    return 0 if rows and all("error" not in r for r in rows) else 1


def _summary(line: str) -> str:
    """A result row's line shortened to what a console needs (the whole row is in the log)."""
    tag, _, rest = line.rstrip("\n").partition(" ")
    try:
        row = json.loads(rest)
    except ValueError:
        return line.rstrip("\n")
    keep = ("model", "prompts", "warmup_s", "steps_s", "s_per_step", "phases_s", "peak_gib", "skipped", "error",
            "stopped_early")
    short = {k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items() if k in keep}
    if "steps_s" in short:
        short["steps_s"] = [round(x, 2) for x in short["steps_s"]]
    if "phases_s" in short:
        short["phases_s"] = {k: round(v, 3) for k, v in short["phases_s"].items() if v is not None}
    return f"{tag} {json.dumps(short)}"


def _parts(text: str) -> list[str]:
    """--parts: a comma list of the sides, refused at parse time when it names anything else."""
    parts = [p.strip() for p in text.split(",") if p.strip()]
    unknown = sorted(set(parts) - {"trl", "counterpoint"})
    if unknown or not parts:
        raise argparse.ArgumentTypeError(f"unknown side(s) {unknown or text!r}: use trl, counterpoint or both")
    return parts


def _visible_gpus() -> int:
    try:
        import torch

        return torch.cuda.device_count()
    except ImportError:
        return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="part", required=True)
    for name in ("trl", "counterpoint", "train", "all"):
        p = sub.add_parser(name)
        p.add_argument("--tokenizer", type=Path, default=ROOT / ".devcache" / "tokenizer")
        p.add_argument("--models", type=Path, default=Path("/tmp/gpu-vs-trl/models"))
        p.add_argument("--runs", type=Path, default=Path("/tmp/gpu-vs-trl/runs"))
        p.add_argument("--shapes", default="", help="model:prompts,... (default: all four, most wanted first)")
        p.add_argument("--steps", type=int, default=5, help="timed steps after the warm-up")
        p.add_argument("--trl-steps-4x8", type=int, default=5, help="TRL's timed steps on the 4x8 shapes")
        p.add_argument("--new-tokens", type=int, default=NEW_TOKENS)
        p.add_argument("--cpu", action="store_true", help="dry run on CPU (use --shapes tiny:1)")
        if name == "trl":
            p.add_argument("--vllm", action="store_true", help="generation by vLLM colocated in the trainer's process")
            p.add_argument("--vllm-gpu-util", type=float, default=0.3, help="TRL's vllm_gpu_memory_utilization")
            p.add_argument("--vllm-sleep", action="store_true",
                           help="TRL's vllm_enable_sleep_mode: vLLM's weights and KV cache leave the GPU while it trains")
            p.add_argument("--accumulate", action="store_true",
                           help="one group per micro-step, gradient accumulation over the step's groups")
            p.add_argument("--quantization", choices=("fp8",), default=None,
                           help="with --vllm: vLLM's online fp8 for TRL's colocated engine, its weight sync through "
                                "vLLM's reload_weights (trl_fp8_colocate)")
            ckpt = p.add_mutually_exclusive_group()
            ckpt.add_argument("--checkpointing", dest="checkpointing", action="store_true", default=None,
                              help="gradient checkpointing on (TRL's default)")
            ckpt.add_argument("--no-checkpointing", dest="checkpointing", action="store_false")
        if name == "counterpoint":
            p.add_argument("--engine", choices=("hf", "vllm"), default="hf", help="the rollout engine in the loop")
            p.add_argument("--quantization", choices=("fp8",), default=None,
                           help="rollout.quantization of the engine (fp8: with --engine vllm)")
            p.add_argument("--vllm-lora", choices=("auto", "merged", "unmerged"), default="auto",
                           help="rollout.vllm_lora (auto: merged on one CUDA GPU, bf16 or fp8)")
            p.add_argument("--mode", choices=("sync", "one_step_off"), default="sync", help="trainer.mode of the loop")
            p.add_argument("--streams", action="store_true",
                           help="one CUDA context: vLLM's engine core in this process, generation on a high-priority "
                                "stream, the update on a normal one (with --mode one_step_off they run side by side)")
        if name == "train":
            p.add_argument("--config", type=Path, default=TRAIN_CONFIG)
            p.add_argument("--modes", type=lambda x: x.split(","), default=["sync", "one_step_off"])
            p.add_argument("--skip", type=int, default=2, help="warm-up steps left out of the medians")
            p.add_argument("--set", action="append", default=[], help="more overrides for every run")
        if name == "all":
            p.add_argument("--out-dir", type=Path, required=True, help="shards, logs and the report go here")
            p.add_argument("--parts", default="trl,counterpoint", type=_parts, help="trl, counterpoint or both")
            p.add_argument("--gpus", type=int, default=0, help="slots to spread over (default: the visible GPUs)")
            p.add_argument("--budget-s", type=float, default=570.0, help="the call's time: every side stops by then")
            p.add_argument("--reserve-s", type=float, default=60.0, help="start no shape this close to the budget")
            p.add_argument("--command", default="", help="recorded as the report's command (default: this one)")
        else:
            p.add_argument("--out", type=Path, required=True)
            p.add_argument("--deadline-s", type=float, default=540.0, help="start no shape after this many seconds")
            p.add_argument("--stop-s", type=float, default=None,
                           help="TRL takes no step that would end after this many seconds (default: deadline + 60)")
    p = sub.add_parser("report")
    p.add_argument("--trl", type=Path, nargs="*", default=[], help="TRL result file(s), one per process")
    p.add_argument("--counterpoint", type=Path, nargs="*", default=[], help="counterpoint result file(s)")
    p.add_argument("--trl-vllm", type=Path, nargs="*", default=[], help="TRL + vLLM result file(s)")
    p.add_argument("--train", type=Path, nargs="*", default=[], help="`counterpoint train` result file(s)")
    p.add_argument("--command", required=True, help="the device command(s) that produced the inputs")
    p.add_argument("--loop", type=Path, nargs="*", default=[],
                   help="the one-process loop with the vLLM engine, measured beside the --train runs")
    p.add_argument("--notes", type=Path, nargs="*", default=[], help="markdown appended to the report, in order")
    p.add_argument("--json-out", type=Path, default=ROOT / "bench" / "results" / "gpu-vs-trl.json")
    p.add_argument("--md-out", type=Path, default=ROOT / "bench" / "results" / "gpu-vs-trl.md")
    args = ap.parse_args(argv)
    if args.part == "report":
        report(args)
        return 0
    args.tokenizer, args.models, args.runs = args.tokenizer.resolve(), args.models.resolve(), args.runs.resolve()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if args.part == "all":
        return run_all(args)
    args.deadline = time.monotonic() + args.deadline_s
    args.stop = time.monotonic() + (args.stop_s if args.stop_s is not None else args.deadline_s + 60)
    result = {"trl": trl, "counterpoint": counterpoint, "train": train_side}[args.part](args)
    save(result, args.out)
    return 0 if all("error" not in r for r in result["shapes"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
