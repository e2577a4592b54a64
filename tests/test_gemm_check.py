"""model/gemm_check.py: the GEMM check a capped MPS client runs before a run's GPU processes
(services/mps.py). On this CPU box it runs in fp32 and must pass; its verdict on wrong and
non-finite results is checked on tensors directly."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from model.gemm_check import FALLBACK_WIDTHS, TOLERANCE, Gemm, check, learner_gemms, relative_error

QWEN3_4B = {"hidden_size": 2560, "num_attention_heads": 32, "head_dim": 128, "num_key_value_heads": 8,
            "intermediate_size": 9728, "num_hidden_layers": 36, "vocab_size": 151936}


def test_widths_of_a_layer_from_its_config(tmp_path):
    """services/mps.py reads the run's model's config.json (services/memory_budget.py) into the
    check's widths: Qwen3-4B's are the fallback's, a multimodal wrapper's text_config counts."""
    from config import RunConfig
    from services.mps import numerics_specs

    (tmp_path / "config.json").write_text(json.dumps(QWEN3_4B))
    run = {"model": {"name_or_path": str(tmp_path)}, "rollout": {"num_gpus": 0.4},
           "learner": {"use_gpu": True, "gpus_per_worker": 0.6}}
    assert numerics_specs(RunConfig.model_validate(run))["learner"]["widths"] == [list(w) for w in FALLBACK_WIDTHS]
    (tmp_path / "config.json").write_text(json.dumps({"text_config": QWEN3_4B}))
    assert numerics_specs(RunConfig.model_validate(run))["learner"]["widths"] == [list(w) for w in FALLBACK_WIDTHS]


def test_every_product_of_a_layer_per_token_count():
    gemms = learner_gemms(((8, 16), (16, 8)), 4, (10, 7))
    assert len(gemms) == 2 * 2 * (2 + 3 + 4)
    assert Gemm("lora_A 8->4", "wgrad", 7, 8, 4) in gemms and Gemm("lora_B 4->16", "addmm", 10, 4, 16) in gemms
    assert not any(g.linear.startswith("base") and g.op == "wgrad" for g in gemms)  # the base is frozen
    assert gemms[0].name == "base 8->16 forward at 10 tokens"


def test_the_verdict_on_wrong_and_non_finite_results():
    ref = torch.tensor([[1.0, -2.0], [0.5, 4.0]])
    assert relative_error(ref.clone(), ref) == 0.0
    assert relative_error(ref + 0.004 * 4, ref) == pytest.approx(0.004, rel=1e-4)  # bf16's rounding: within
    assert relative_error(ref * 1.5, ref) > TOLERANCE  # the 75% share: finite and wrong
    for bad in (float("nan"), float("inf")):
        got = ref.clone()
        got[1, 0] = bad
        assert relative_error(got, ref) == float("inf")


def test_fp32_on_the_cpu_passes_every_product():
    result = check(learner_gemms(((48, 80), (80, 48)), 8, (37, 64)), "cpu", "float32")
    assert result["ok"] and result["off"] == [] and result["checked"] == 36 and result["sm_count"] is None
    assert result["worst"]["error"] < 1e-5


@pytest.mark.subprocess
def test_the_module_is_the_client_the_run_starts():
    spec = {"widths": [[48, 80]], "rank": 8, "tokens": [37], "device": "cpu", "dtype": "float32"}
    done = subprocess.run([sys.executable, "-m", "model.gemm_check", json.dumps(spec)], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["ok"] and result["checked"] == 9
