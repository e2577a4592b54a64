"""The hf engine's fast path (rollout/engines/hf_fast.py) on CPU: the same step function the
CUDA graphs capture, run eagerly on the tiny model of configs/smoke.yaml. Its figures on the GPU
are in bench/results/gpu-engine.md (bench/gpu_engine.py)."""

from __future__ import annotations

import pytest
import torch

from config.learner import LoraConfig
from config.rollout import ModelConfig, RolloutConfig
from model.adapter_dir import AdapterError
from rollout.engines.base import AdapterVersionError
from rollout.engines.hf_fast import (
    HFFastEngine,
    batch_bucket,
    cache_len,
    filter_logits,
    split_rows,
    stop_string_cut,
)
from rollout.engines.lora_weights import load_safetensors_bytes, parse_adapter
from model.adapter import AdapterPayload
from rollout.types import Prompt, SamplingParams

MODEL = ModelConfig(name_or_path="tiny-random", dtype="float32")  # configs/smoke.yaml's model
PROMPTS = [
    Prompt(messages=({"role": "user", "content": "Harmonise this bass line."},)),
    Prompt(messages=({"role": "user", "content": "Write four bars in C major, please, with a cadence."},),
           assistant_prefix="[["),
]


def params(**kw) -> SamplingParams:
    return SamplingParams(**{**dict(n=3, temperature=1.0, top_p=1.0, top_k=-1, max_tokens=12, seed=5), **kw})


# --------------------------------------------------------------------------- pure helpers


def test_batch_bucket_is_the_smallest_that_fits():
    assert [batch_bucket(n, [8, 1, 4, 2]) for n in (1, 2, 3, 5, 8)] == [1, 2, 4, 8, 8]
    with pytest.raises(ValueError, match="exceed the largest batch bucket 8"):
        batch_bucket(9, [1, 8])


def test_split_rows_cuts_at_the_largest_bucket():
    assert split_rows(5, [1, 2]) == [(0, 2), (2, 4), (4, 5)]
    assert split_rows(64, [8, 64]) == [(0, 64)]


def test_cache_len_rounds_up_and_caps_at_max_model_len():
    assert cache_len(200, 384, 4096) == 768
    assert cache_len(200, 56, 4096) == 256
    assert cache_len(900, 100, 1000) == 1000  # capped: the request fits max_model_len exactly


def test_filter_logits_matches_transformers_warpers():
    from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    torch.manual_seed(0)
    logits = torch.randn(4, 50) * 3
    for t, k, p in [(0.7, 0, 1.0), (1.0, 5, 1.0), (1.3, 0, 0.8), (0.9, 10, 0.5)]:
        ref = TemperatureLogitsWarper(t)(None, logits.clone())
        if k:
            ref = TopKLogitsWarper(k)(None, ref)
        if p < 1:
            ref = TopPLogitsWarper(p)(None, ref)
        ours = filter_logits(logits, torch.tensor(t), k, torch.tensor(p) if p < 1 else None)
        assert torch.equal(torch.isinf(ours), torch.isinf(ref)), (t, k, p)
        assert torch.allclose(ours[~torch.isinf(ours)], ref[~torch.isinf(ref)])


def test_safetensors_bytes_load_equals_safetensors():
    from safetensors.torch import load, save

    tensors = {"a": torch.randn(3, 5), "b": torch.randn(7).to(torch.bfloat16), "c": torch.randn(2, 2),
               "d": torch.randn(1).to(torch.float16)}
    blob = save(tensors)
    ours, ref = load_safetensors_bytes(blob), load(blob)
    assert set(ours) == set(ref)
    for k in ref:
        assert ours[k].dtype == ref[k].dtype and torch.equal(ours[k], ref[k]), k


def test_stop_string_cut_keeps_the_completing_token():
    from transformers import AutoTokenizer

    from model.base import resolve_model

    tok = AutoTokenizer.from_pretrained(str(resolve_model(MODEL)))
    ids = tok("one two END three", add_special_tokens=False)["input_ids"]
    cut = stop_string_cut(tok, ids, ["END"])
    assert "END" in tok.decode(ids[:cut]) and "END" not in tok.decode(ids[: cut - 1])
    assert stop_string_cut(tok, ids, ["nowhere"]) is None


# --------------------------------------------------------------------------- adapters


@pytest.fixture(scope="module")
def peft_and_payload():
    from learner.lora import adapter_payload, attach_lora, load_base_model

    peft = attach_lora(load_base_model(MODEL), LoraConfig(r=8, alpha=16), seed=3)
    with torch.no_grad():  # B = 0 at init would make every adapter the base model
        for name, p in peft.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    return peft.eval(), adapter_payload(peft, 1)


def with_version(payload: AdapterPayload, version: int) -> AdapterPayload:
    return AdapterPayload(version=version, safetensors=payload.safetensors, config=payload.config)


def engine(mode: str = "merged") -> HFFastEngine:
    from model.base import resolve_model

    return HFFastEngine(resolve_model(MODEL), MODEL, RolloutConfig(max_model_len=1024, hf_lora=mode), device="cpu")


@pytest.mark.parametrize("mode", ["merged", "unmerged"])
def test_in_memory_adapter_gives_the_peft_paths_logits(peft_and_payload, mode):
    from rollout.engines.hf import HFEngine
    from model.base import resolve_model

    _, payload = peft_and_payload
    ids = torch.tensor([[1, 5, 9, 33, 2, 7, 100]])
    reference = HFEngine(resolve_model(MODEL), MODEL, RolloutConfig(max_model_len=1024))
    reference.load_adapter(payload)  # the peft path: payload -> temp dir -> PeftModel
    fast = engine(mode)
    with torch.no_grad():
        base = fast.model(ids).logits
        fast.load_adapter(payload)
        ours, ref = fast.model(ids).logits, reference.model(input_ids=ids).logits
    assert (ref - base).abs().max() > 1e-2  # the adapter changes the logits: the test can fail
    assert torch.allclose(ours, ref, atol=1e-5), (ours - ref).abs().max()


def test_parse_adapter_refuses_what_it_cannot_merge(peft_and_payload):
    _, payload = peft_and_payload
    for key, value, message in [("use_dora", True, "use_dora"), ("bias", "all", "bias"),
                                ("modules_to_save", ["lm_head"], "modules_to_save")]:
        bad = AdapterPayload(version=2, safetensors=payload.safetensors, config={**payload.config, key: value})
        with pytest.raises(AdapterError, match=message):
            parse_adapter(bad)
    from safetensors.torch import save

    odd = AdapterPayload(version=2, safetensors=save({"base_model.model.x.weight": torch.zeros(2)}),
                         config=payload.config)
    with pytest.raises(AdapterError, match="not a LoRA A/B weight"):
        parse_adapter(odd)


def test_adapter_for_a_layer_the_model_lacks_is_refused(peft_and_payload):
    from safetensors.torch import save

    _, payload = peft_and_payload
    bad = AdapterPayload(version=2, config=payload.config, safetensors=save({
        "base_model.model.model.layers.9.mlp.up_proj.lora_A.weight": torch.zeros(8, 256),
        "base_model.model.model.layers.9.mlp.up_proj.lora_B.weight": torch.zeros(512, 8)}))
    with pytest.raises(AdapterError, match="not a linear layer"):
        engine().load_adapter(bad)


# --------------------------------------------------------------------------- generate


@pytest.mark.parametrize("mode", ["merged", "unmerged"])
def test_versions_are_answered_exactly_and_logprobs_match_the_learner(peft_and_payload, mode):
    from learner.passes import response_logprobs
    from learner.rollout_correction import parity_stats

    peft, payload = peft_and_payload
    eng = engine(mode)
    with pytest.raises(AdapterVersionError, match="holds adapter v0; request needs v1"):
        eng.generate(PROMPTS, params(), 1)
    eng.load_adapter(payload)
    for version in (1, 0, 1):  # the base model and back: weights/hooks switch both ways
        samples = eng.generate(PROMPTS, params(temperature=0.7), version)
        assert [(s.prompt_index, s.sample_index) for s in samples] == [(i, j) for i in range(2) for j in range(3)]
        assert {s.adapter_version for s in samples} == {version}
        rows = ([s.prompt_token_ids for s in samples], [s.token_ids for s in samples])
        if version:
            trainer = response_logprobs(peft, *rows, pad_id=eng.pad_id, temperature=0.7)
        else:
            with peft.disable_adapter():
                trainer = response_logprobs(peft, *rows, pad_id=eng.pad_id, temperature=0.7)
        stats = parity_stats([s.logprobs for s in samples], trainer)
        assert abs(stats.ppl_ratio - 1) < 1e-5 and stats.max_abs_diff < 1e-4, (version, stats)
    eng.load_adapter(with_version(payload, 2))
    assert eng.loaded_version() == 2
    with pytest.raises(AdapterVersionError, match="holds adapter v2; request needs v1"):
        eng.generate(PROMPTS, params(), 1)


def test_seeded_calls_repeat_and_rows_beyond_a_bucket_are_split():
    eng = engine()
    eng.decoder.buckets = [1, 2]  # 2 prompts x n=3 = 6 rows: three chunks of 2
    a, b = eng.generate(PROMPTS, params(), 0), eng.generate(PROMPTS, params(), 0)
    assert [s.token_ids for s in a] == [s.token_ids for s in b]
    assert len(a) == 6 and all(len(s.token_ids) == 12 for s in a)
    assert eng.generate(PROMPTS, params(seed=6), 0)[0].token_ids != a[0].token_ids


def test_a_stop_token_ends_the_row_and_says_stop():
    eng = engine()
    first = eng.generate(PROMPTS[:1], params(n=1), 0)[0]
    stop = first.token_ids[3]
    again = eng.generate(PROMPTS[:1], params(n=1, stop_token_ids=(stop,)), 0)[0]
    cut = first.token_ids.index(stop) + 1
    assert again.token_ids == first.token_ids[:cut] and again.finish_reason == "stop"
    assert again.logprobs == pytest.approx(first.logprobs[:cut], abs=1e-6)
    assert first.finish_reason == "length" or first.token_ids[-1] in eng.stop.ids


def test_bad_requests_are_refused_before_sampling():
    eng = engine()
    with pytest.raises(ValueError, match="temperature must be > 0"):
        eng.generate(PROMPTS, params(temperature=0.0), 0)
    with pytest.raises(ValueError, match="exceeds rollout.max_model_len 1024"):
        eng.generate(PROMPTS, params(max_tokens=1020), 0)


def test_rollout_and_learner_share_one_gpu_by_fractions():
    from config.run import load_config
    from services.launch import required_resources

    cfg = load_config("configs/smoke.yaml", ["rollout.engine=hf", "rollout.num_gpus=0.4", "learner.use_gpu=true",
                                             "learner.gpus_per_worker=0.6"])
    assert cfg.rollout.num_gpus == 0.4
    assert required_resources(cfg)["GPU"] == pytest.approx(1.0)
