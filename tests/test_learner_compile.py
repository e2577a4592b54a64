"""learner.compile_layers against the eager learner, on CPU with inductor's C++ backend: the loss
and the LoRA gradients to float32 rounding over peft's LoRA layers and the fused ones; a whole
PolicyLearner update (fused, gradient checkpointing, the reference pass) with the layers really
compiled (no graph break) to rounding; the config's refusals."""

from __future__ import annotations

import copy

import pytest
import torch
import torch._dynamo
from peft import LoraConfig, get_peft_model
from torch._dynamo.utils import counters

from config import RunConfig
from learner.compiled_layers import compile_choice, compile_layers, decoder_layers
from tests.test_fused_lora import learner_steps, relative
from tests.test_learner_gpu_opts import gradients, two_groups
from tests.test_shared_prefix import tiny_llama


@pytest.fixture(scope="module")
def dynamo_on():
    """torch.compile enabled and its caches empty, whatever this worker process ran before: a vLLM
    CPU engine created in the same process turns dynamo off process-wide
    (rollout/engines/vllm_engine.py), and a graph compiled by an earlier test would be reused
    without counting as a graph here. Module-wide: the tests below share the graphs they compile
    (the same tiny model, LoRA on every linear layer), the slow part on a CPU."""
    with torch._dynamo.config.patch(disable=False):
        torch._dynamo.reset()
        counters.clear()
        yield
        torch._dynamo.reset()


def test_decoder_layers_are_the_models_repeated_blocks():
    model = tiny_llama()
    layers = decoder_layers(model)
    assert [type(m).__name__ for m in layers] == ["LlamaDecoderLayer"] * 2
    assert layers == list(model.model.layers)
    assert decoder_layers(torch.nn.Linear(2, 2)) == []  # no _no_split_modules: nothing to compile


def test_compiled_layers_give_the_eager_loss_and_gradients(dynamo_on):
    """One update_actor pass (no optimizer step) through peft's LoRA layers (the learner's default
    targets, every linear layer): the loss and every
    LoRA gradient to float32 rounding. Inductor fuses the norms', the MLP's and the LoRA term's
    element-wise chains and so reorders their sums; a missing or wrong term would be O(1)."""
    batch = two_groups(torch.Generator().manual_seed(7))
    eager = get_peft_model(tiny_llama(), LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    with torch.no_grad():  # B drawn (peft starts it at zero), so every LoRA gradient is non-zero
        for name, p in eager.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.05)
    compiled = copy.deepcopy(eager)
    assert compile_layers(compiled.get_base_model()) == 2
    _, loss_eager, grads_eager = gradients(eager, batch, "dapo", size=4, share_prefix=False)
    _, loss, grads = gradients(compiled, batch, "dapo", size=4, share_prefix=False)
    assert loss == pytest.approx(loss_eager, rel=1e-6)
    for name, want in grads_eager.items():
        assert want.abs().max() > 0, name
        assert relative(grads[name], want) < 1e-5, name
    assert counters["stats"]["unique_graphs"] >= 1 and not counters["graph_break"], dict(counters["graph_break"])


def test_policy_update_with_compiled_layers(tmp_path, dynamo_on):
    """The PolicyLearner with learner.compile_layers=true, which runs its passes once at start-up
    to compile (the gradients dropped, the RNG restored: the same numbers after it), with gradient
    checkpointing (the layer recomputed in the backward) and the reference pass (beta > 0:
    adapters disabled): its metrics to float32 rounding; its adapters after two AdamW steps within
    1e-3 of their movement, since AdamW's first steps (update ~ lr g / |g|) scale a rounding
    difference up where a gradient element is near zero (the gradients themselves agree to 1e-5,
    above)."""
    tiny_llama(tmp_path)
    extra = {"gradient_checkpointing": True, "beta": 0.05}
    eager, eager_steps = learner_steps(tmp_path, compile_layers=False, **extra)
    compiled, compiled_steps = learner_steps(tmp_path, compile_layers=True, **extra)
    assert eager.stats()["compiled_layers"] == 0 and compiled.stats()["compiled_layers"] == 2
    assert compiled.stats()["compile_s"] > 0 and eager.stats()["compile_s"] == 0  # compiled at start-up
    assert compiled.stats()["fused_lora"] is None
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert all(getattr(layer, "_compiled_call_impl", None) is not None
               for layer in decoder_layers(compiled.peft_model.get_base_model()))
    init = eager_steps[0][1]
    for (m_eager, a_eager), (m_comp, a_comp) in zip(eager_steps[1:], compiled_steps[1:]):
        for key in ("loss", "grad_norm", "ppl_ratio", "kl"):
            assert m_comp[key] == pytest.approx(m_eager[key], rel=1e-5, abs=1e-7), key
        for name, want in a_eager.items():
            if (want - init[name]).abs().max() > 0:  # step 1 moves B alone (B starts at zero)
                assert relative(a_comp[name] - init[name], want - init[name]) < 1e-3, name
    final = eager_steps[-1][1]
    assert all((final[name] - init[name]).abs().max() > 0 for name in init)  # by step 2 every A and B moved


def test_compile_layers_is_refused_where_it_was_not_built():
    assert RunConfig().learner.compile_layers == "auto"
    for bad, match in (({"strategy": "fsdp2"}, "compile_layers=true with learner.strategy=fsdp2"),
                       ({"strategy": "deepspeed", "use_gpu": True}, "compile_layers=true with learner.strategy=deepspeed"),
                       ({"cuda_graphs": True}, "compile_layers=true with learner.cuda_graphs=true"),
                       ({"share_prompt_prefix": True}, "compile_layers=true with learner.share_prompt_prefix=true"),
                       ({"fused_lora": True}, "compile_layers=true with learner.fused_lora=true")):
        with pytest.raises(ValueError, match=match):
            RunConfig.model_validate({"learner": {"compile_layers": True, **bad}})
        RunConfig.model_validate({"learner": {"compile_layers": "auto", **bad}})
    assert RunConfig.model_json_schema()["$defs"]["LearnerConfig"]["properties"]["compile_layers"].get("description")


@pytest.mark.parametrize("learner, on_cuda, world_size, mapped_base, want", [
    ({}, True, 1, False, True),  # one CUDA worker, ddp: measured to pay
    ({}, False, 1, False, False),  # CPU workers: the default run unchanged
    ({}, True, 2, False, False),  # several ranks: not measured
    ({}, True, 1, True, False),  # a base mapped from the replica: its correction runs in hooks
    ({"strategy": "fsdp2"}, True, 1, False, False),
    ({"strategy": "deepspeed", "use_gpu": True}, True, 1, False, False),
    ({"cuda_graphs": True}, True, 1, False, False),
    ({"pack_sequences": True}, True, 1, False, False),
    ({"share_prompt_prefix": True}, True, 1, False, False),
    ({"share_prompt_prefix": False}, True, 1, False, True),
    ({"compile_layers": True}, False, 2, True, True),  # asked for: compiled wherever the config allows it
    ({"compile_layers": False}, True, 1, False, False),
])
def test_compile_choice(learner, on_cuda, world_size, mapped_base, want):
    cfg = RunConfig.model_validate({"learner": learner}).learner
    assert compile_choice(cfg, on_cuda=on_cuda, world_size=world_size, mapped_base=mapped_base) is want


def test_no_layer_is_compiled_where_torch_compile_is_disabled(caplog):
    model = tiny_llama()
    with torch._dynamo.config.patch(disable=True), caplog.at_level("WARNING"):
        assert compile_layers(model) == 0
    assert all(getattr(layer, "_compiled_call_impl", None) is None for layer in decoder_layers(model))
    assert "torch.compile is disabled in this process" in caplog.text
