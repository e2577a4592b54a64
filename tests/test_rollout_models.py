"""Model resolution (embedded GGUF default, tiny random model) and the stop-token set."""

from __future__ import annotations

import json
import logging
import shutil
import threading
from pathlib import Path

import pytest

from config.rollout import ModelConfig, RolloutConfig
from model.base import gguf_path, resolve_model, stop_token_ids

IM_END = 2  # SmolLM2's <|im_end|>
ENDOFTEXT = 0  # SmolLM2's <|endoftext|>


@pytest.fixture(scope="module")
def tiny_dir() -> Path:
    return resolve_model(ModelConfig(name_or_path="tiny-random"))


@pytest.mark.slow
def test_tiny_random_is_built_once_atomically_and_loads(tmp_path):
    cfg = ModelConfig(name_or_path="tiny-random", cache_dir=str(tmp_path), tiny_seed=3)
    results: list[Path] = []
    threads = [threading.Thread(target=lambda: results.append(resolve_model(cfg))) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results[0] == results[1] == tmp_path / "models" / "tiny-random-seed3"
    built = results[0]
    # No half-built temp dirs left beside it.
    assert sorted(p.name for p in (tmp_path / "models").iterdir() if p.is_dir()) == ["tiny-random-seed3"]
    for name in ("config.json", "model.safetensors", "generation_config.json", "tokenizer.json"):
        assert (built / name).is_file(), name
    config = json.loads((built / "config.json").read_text())
    assert config["head_dim"] == 64 and config["hidden_size"] == 256
    assert config["num_hidden_layers"] == 2 and config["vocab_size"] == 49152
    stamp = (built / "model.safetensors").stat().st_mtime_ns
    assert resolve_model(cfg) == built
    assert (built / "model.safetensors").stat().st_mtime_ns == stamp  # cached, not rebuilt

    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(built)
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    assert text.endswith("<|im_start|>assistant\n")
    model = AutoModelForCausalLM.from_pretrained(built)
    assert sum(p.numel() for p in model.parameters()) < 20_000_000


@pytest.mark.slow
def test_seed_changes_tiny_weights(tmp_path, tiny_dir):
    from safetensors.torch import load_file

    other = resolve_model(ModelConfig(name_or_path="tiny-random", cache_dir=str(tmp_path), tiny_seed=1))
    a = load_file(tiny_dir / "model.safetensors")
    b = load_file(other / "model.safetensors")
    key = next(k for k in a if "q_proj" in k)
    assert not (a[key] == b[key]).all()


@pytest.mark.slow
def test_embedded_default_resolves_with_template_and_stop_token():
    assert gguf_path().is_file()
    model_dir = resolve_model(ModelConfig())
    config = json.loads((model_dir / "config.json").read_text())
    assert config["model_type"] == "llama" and config["vocab_size"] == 49152
    assert "quantization_config" not in config
    stop = stop_token_ids(model_dir)
    assert IM_END in stop.ids and stop.end_of_turn_ids == (IM_END,)
    assert not stop.mismatch and stop.warning is None


def test_local_path_and_unknown_names(tmp_path):
    (tmp_path / "m").mkdir()
    with pytest.raises(FileNotFoundError, match="no config.json"):
        resolve_model(ModelConfig(name_or_path=str(tmp_path / "m")))
    with pytest.raises(FileNotFoundError, match="neither"):
        resolve_model(ModelConfig(name_or_path="no-such-org/no-such-model-xyz"))


def _mismatched_copy(src: Path, dst: Path, with_weights: bool = False) -> Path:
    """The Qwen3-Base trap: generation_config and tokenizer say <|endoftext|>, the template
    closes turns with <|im_end|>."""
    dst.mkdir()
    for f in src.iterdir():
        if f.is_file() and (with_weights or f.suffix != ".safetensors"):
            shutil.copy(f, dst / f.name)
    gen = json.loads((dst / "generation_config.json").read_text())
    gen["eos_token_id"] = ENDOFTEXT
    (dst / "generation_config.json").write_text(json.dumps(gen))
    tok_cfg = json.loads((dst / "tokenizer_config.json").read_text())
    tok_cfg["eos_token"] = "<|endoftext|>"
    (dst / "tokenizer_config.json").write_text(json.dumps(tok_cfg))
    return dst


def test_stop_tokens_match_for_the_tiny_model(tiny_dir):
    stop = stop_token_ids(tiny_dir)
    assert stop.end_of_turn_ids == (IM_END,)
    assert stop.ids == (IM_END,) and not stop.mismatch and not stop.overridden


def test_eos_mismatch_is_detected_and_end_of_turn_still_stops(tiny_dir, tmp_path):
    model_dir = _mismatched_copy(tiny_dir, tmp_path / "trap")
    stop = stop_token_ids(model_dir)
    assert stop.mismatch
    assert stop.generation_eos_ids == (ENDOFTEXT,)
    assert stop.end_of_turn_ids == (IM_END,)
    assert set(stop.ids) == {IM_END, ENDOFTEXT}
    assert "<|im_end|>" in stop.warning and "[0]" in stop.warning
    assert stop.as_dict()["mismatch"] is True


def test_override_replaces_eos_but_keeps_end_of_turn(tiny_dir, tmp_path):
    model_dir = _mismatched_copy(tiny_dir, tmp_path / "trap")
    stop = stop_token_ids(model_dir, override=[7, 9])
    assert stop.ids == (IM_END, 7, 9) and stop.overridden
    assert stop.mismatch  # the override does not hide what generation_config says


@pytest.mark.slow
def test_engine_start_warns_about_the_mismatch(tiny_dir, tmp_path, caplog):
    from rollout.engines.hf import HFEngine

    model_dir = _mismatched_copy(tiny_dir, tmp_path / "trap", with_weights=True)
    with caplog.at_level(logging.WARNING, logger="rollout.engines.base"):
        engine = HFEngine(model_dir, ModelConfig(name_or_path=str(model_dir)), RolloutConfig())
    assert engine.stop.mismatch
    assert any("does not contain the chat template's end-of-turn" in r.getMessage() for r in caplog.records)
