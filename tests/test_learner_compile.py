"""learner.compile_layers against the eager learner, on CPU with inductor's C++ backend, in a
fresh process: the loss and the LoRA gradients to float32 rounding; a whole PolicyLearner update
(compiled at start-up, gradient checkpointing, the reference pass) with the layers really
compiled (graphs, no graph break) to rounding; the same over 2 real gloo ranks under
strategy=ddp and strategy=fsdp2 (tests/fsdp_ranks.py ``compiled``); where it compiles; the
config's refusals."""

from __future__ import annotations

import copy
import multiprocessing

import pytest
import torch
import torch._dynamo
from peft import LoraConfig, get_peft_model
from torch._dynamo.utils import counters

from config import RunConfig
from learner.compiled_layers import compile_decision, compile_layers, decoder_layers
from tests.test_fused_lora import learner_steps, relative
from tests.test_learner_gpu_opts import gradients, two_groups
from tests.test_learner_fsdp import rel, run_ranks
from tests.test_shared_prefix import tiny_llama


def compile_checks(model_dir: str) -> dict:
    """Both comparisons below, in a process of their own (``in_fresh_process``): the learner
    compiles in a fresh worker process, and a pytest worker's earlier tests leave global state
    behind (a vLLM CPU engine turns dynamo off process-wide, rollout/engines/vllm_engine.py;
    graphs compiled earlier would be reused uncounted). Returns plain numbers."""
    torch._dynamo.config.disable = False  # TORCH_COMPILE_DISABLE may come with the environment
    counters.clear()
    out: dict = {}
    # one update_actor pass (no optimizer step) through peft's layers, LoRA on every linear layer
    batch = two_groups(torch.Generator().manual_seed(7))
    eager = get_peft_model(tiny_llama(), LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    with torch.no_grad():  # B drawn (peft starts it at zero), so every LoRA gradient is non-zero
        for name, p in eager.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.05)
    compiled = copy.deepcopy(eager)
    out["layers"] = compile_layers(compiled.get_base_model())
    _, out["loss_eager"], grads_eager = gradients(eager, batch, "dapo", size=4, share_prefix=False)
    _, out["loss"], grads = gradients(compiled, batch, "dapo", size=4, share_prefix=False)
    out["grad_rel"] = {n: relative(grads[n], g) for n, g in grads_eager.items()}
    out["grad_zero"] = [n for n, g in grads_eager.items() if not g.abs().max() > 0]
    out["graphs"] = counters["stats"]["unique_graphs"]
    # the PolicyLearner, compiled at start-up, with gradient checkpointing, the reference pass and
    # packed rows (each micro-batch one unpadded row: other shapes and a block-diagonal mask)
    extra = {"gradient_checkpointing": True, "beta": 0.05, "pack_sequences": True}
    eager_p, eager_steps = learner_steps(model_dir, compile_layers=False, **extra)
    comp_p, comp_steps = learner_steps(model_dir, compile_layers=True, **extra)
    out["stats"] = {k: (eager_p.stats()[k], comp_p.stats()[k]) for k in ("compiled_layers", "compile_s", "fused_lora")}
    out["packed"] = (eager_p.pack, comp_p.pack)
    out["compiled_calls"] = [getattr(layer, "_compiled_call_impl", None) is not None
                             for layer in decoder_layers(comp_p.peft_model.get_base_model())]
    init = eager_steps[0][1]
    out["metrics"] = [{k: (me[k], mc[k]) for k in ("loss", "grad_norm", "ppl_ratio", "kl")}
                      for (me, _), (mc, _) in zip(eager_steps[1:], comp_steps[1:])]
    out["adapter_rel"] = [{n: relative(ac[n] - init[n], ae[n] - init[n]) for n in ae if (ae[n] - init[n]).abs().max() > 0}
                          for (_, ae), (_, ac) in zip(eager_steps[1:], comp_steps[1:])]
    out["unmoved"] = [n for n in init if not (eager_steps[-1][1][n] - init[n]).abs().max() > 0]
    out["graph_breaks"] = dict(counters["graph_break"])
    return out


@pytest.fixture(scope="module")
def checked(tmp_path_factory) -> dict:
    model_dir = tmp_path_factory.mktemp("tiny-llama")
    tiny_llama(model_dir)
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        return pool.apply(compile_checks, (str(model_dir),))


def test_decoder_layers_are_the_models_repeated_blocks():
    model = tiny_llama()
    layers = decoder_layers(model)
    assert [type(m).__name__ for m in layers] == ["LlamaDecoderLayer"] * 2
    assert layers == list(model.model.layers)
    assert decoder_layers(torch.nn.Linear(2, 2)) == []  # no _no_split_modules: nothing to compile
    # through peft's wrapper (which declares none itself), as learner/fsdp.py shards them
    wrapped = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"]))
    assert decoder_layers(wrapped) == layers


def test_compiled_layers_give_the_eager_loss_and_gradients(checked):
    """One update_actor pass (no optimizer step) through peft's LoRA layers (the learner's default
    targets, every linear layer): the loss and every LoRA gradient to float32 rounding. Inductor
    fuses the norms', the MLP's and the LoRA term's element-wise chains and so reorders their
    sums; a missing or wrong term would be O(1). The layers really compiled: graphs, no break.
    The loss gets the gradients' bound: it is a sum over tokens of terms of both signs (advantages
    of both signs) that cancel to ~0.015, so rounding in the terms is large against it (1.3e-6 of
    it on an AVX-512 FP16 Xeon, where inductor's vector code sums in another order)."""
    assert checked["layers"] == 2 and checked["graphs"] >= 1 and not checked["graph_breaks"], checked["graph_breaks"]
    assert checked["loss"] == pytest.approx(checked["loss_eager"], rel=1e-5)
    assert not checked["grad_zero"] and len(checked["grad_rel"]) == 2 * 7 * 2  # A and B of 7 linears, 2 layers
    assert max(checked["grad_rel"].values()) < 1e-5, checked["grad_rel"]


def test_policy_update_with_compiled_layers(checked):
    """The PolicyLearner with learner.compile_layers=true, which runs its passes once at start-up
    to compile (the gradients dropped, the RNG restored: the same numbers after it), with gradient
    checkpointing (the layer recomputed in the backward), the reference pass (beta > 0:
    adapters disabled) and packed rows (learner.pack_sequences): its metrics to float32 rounding;
    its adapters after two AdamW steps within 1e-3 of their movement, since AdamW's first steps
    (update ~ lr g / |g|) scale a rounding difference up where a gradient element is near zero
    (the gradients themselves agree to 1e-5, above)."""
    stats = checked["stats"]
    assert stats["compiled_layers"] == (0, 2) and stats["fused_lora"] == (None, None)
    assert stats["compile_s"][0] == 0 and stats["compile_s"][1] > 0  # compiled at start-up
    assert checked["compiled_calls"] == [True, True]
    assert checked["packed"] == (True, True)
    for step in checked["metrics"]:
        for key, (eager, compiled) in step.items():
            assert compiled == pytest.approx(eager, rel=1e-5, abs=1e-7), key
    assert checked["adapter_rel"][-1] and max(max(step.values()) for step in checked["adapter_rel"]) < 1e-3
    assert not checked["unmoved"]  # by step 2 every A and B moved


def test_compile_layers_is_refused_where_it_was_not_built():
    assert RunConfig().learner.compile_layers == "auto"
    for bad, match in (({"strategy": "deepspeed", "use_gpu": True}, "compile_layers=true with learner.strategy=deepspeed"),
                       ({"strategy": "fsdp2", "use_gpu": True, "fsdp_cpu_offload": True},
                        "compile_layers=true with learner.fsdp_cpu_offload=true"),
                       ({"cuda_graphs": True}, "compile_layers=true with learner.cuda_graphs=true"),
                       ({"share_prompt_prefix": True}, "compile_layers=true with learner.share_prompt_prefix=true"),
                       ({"fused_lora": True}, "compile_layers=true with learner.fused_lora=true")):
        with pytest.raises(ValueError, match=match):
            RunConfig.model_validate({"learner": {"compile_layers": True, **bad}})
        RunConfig.model_validate({"learner": {"compile_layers": "auto", **bad}})
    assert RunConfig.model_json_schema()["$defs"]["LearnerConfig"]["properties"]["compile_layers"].get("description")
    RunConfig.model_validate({"learner": {"compile_layers": True, "strategy": "fsdp2"}})  # tested below


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> dict:
    """One GRPO step (the reference pass, two update epochs, rank 1 running a padding
    micro-batch) over 2 gloo ranks: eager DDP, and the layers compiled under DDP and under fsdp2
    (which swaps each layer's class for its sharded subclass, and gathers its weights in hooks
    around the compiled forward). Eager DDP over 2 ranks is the 1-rank step and fsdp2's, bit for
    bit (tests/test_learner_ddp_uneven.py, tests/test_learner_fsdp.py)."""
    root = tmp_path_factory.mktemp("compiled_ranks")
    return {name: run_ranks(strategy, 2, root / name, mode=("compiled", on), timeout=400)
            for name, strategy, on in (("eager", "ddp", "off"), ("ddp", "ddp", "on"), ("fsdp2", "fsdp2", "on"))}


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_compiled_layers_over_two_ranks_take_the_eager_step(ranks, strategy):
    """The same step to float32 rounding, as on one process above: metrics to 1e-5, every LoRA
    gradient (all-reduced, or reduce-scattered and gathered) to 1e-5 by norm, the adapter's move
    in the AdamW step to 1e-3. Every layer compiled, into graphs without a break."""
    got, want = ranks[strategy], ranks["eager"]
    assert want["stats"]["compiled_layers"] == 0 and got["stats"]["compiled_layers"] == 2
    assert got["stats"]["compile_s"] > 0 and got["graphs"] >= 1 and not got["graph_breaks"], got["graph_breaks"]
    for key in ("loss", "grad_norm", "kl", "entropy", "ppl_ratio", "pg_loss"):
        assert got["metrics"][key] == pytest.approx(want["metrics"][key], rel=1e-5, abs=1e-7), key
    assert want["metrics"]["kl"] > 0  # the reference pass ran on an adapter that moved
    assert set(got["grads"]) == set(want["grads"]) and len(want["grads"]) == 7 * 2 * 2  # A, B of 7 linears, 2 layers
    assert all(g.abs().max() > 0 for name, g in want["grads"].items() if "lora_B" in name)
    assert rel(got["grads"], want["grads"]) < 1e-5
    moved = {n: want["step1"][n] - want["init"][n] for n in want["init"]}
    assert rel({n: got["step1"][n] - got["init"][n] for n in moved}, moved) < 1e-3
    assert rel(got["init"], want["init"]) == 0  # the same initial adapter: the compile's warm-up changed nothing


@pytest.mark.parametrize("learner, on_cuda, world_size, mapped_base, want, why", [
    ({}, True, 1, False, True, "one CUDA worker under ddp"),  # measured to pay
    ({}, False, 1, False, False, "on the CPU"),  # CPU workers: the default run unchanged
    ({}, True, 2, False, False, "2 learner workers"),  # several ranks: not measured
    ({}, True, 1, True, False, "mapped from the replica"),  # its correction runs in hooks
    ({"strategy": "fsdp2"}, True, 1, False, False, "strategy=fsdp2"),
    ({"strategy": "deepspeed", "use_gpu": True}, True, 1, False, False, "strategy=deepspeed"),
    ({"cuda_graphs": True}, True, 1, False, False, "cuda_graphs=true"),
    ({"pack_sequences": True}, True, 1, False, False, "pack_sequences=true"),
    ({"share_prompt_prefix": True}, True, 1, False, False, "share_prompt_prefix=true"),
    ({"share_prompt_prefix": False}, True, 1, False, True, "one CUDA worker under ddp"),
    ({"compile_layers": True}, False, 2, True, True, "compile_layers=true"),  # asked for: wherever the config allows
    ({"compile_layers": False}, True, 1, False, False, "compile_layers=false"),
])
def test_compile_decision(learner, on_cuda, world_size, mapped_base, want, why):
    cfg = RunConfig.model_validate({"learner": learner}).learner
    compiled, reason = compile_decision(cfg, on_cuda=on_cuda, world_size=world_size, mapped_base=mapped_base)
    assert compiled is want and why in reason, reason
    if "auto" in reason:  # auto names itself and, where it leaves the layers eager, says so
        assert reason.startswith("learner.compile_layers=auto") and ("eager" in reason) is (not want)


def test_no_layer_is_compiled_where_torch_compile_is_disabled(caplog):
    model = tiny_llama()
    with torch._dynamo.config.patch(disable=True), caplog.at_level("WARNING"):
        assert compile_layers(model) == 0
    assert all(getattr(layer, "_compiled_call_impl", None) is None for layer in decoder_layers(model))
    assert "torch.compile is disabled in this process" in caplog.text


def served_correction_checks() -> dict:
    """A 4-layer Llama under LoRA whose base layers carry model/shared_base.py's ServedCorrection
    for an owner that merges (a real Fence and ServedAdapter in shared memory), eager and with its
    layers compiled: a pass before the owner announces an adapter, then passes after it announced
    one and switched it on; and the same model compiled without the correction. In a process of
    its own (``compile_checks``'s reasons). Plain numbers."""
    from types import SimpleNamespace

    from transformers import LlamaConfig, LlamaForCausalLM

    from model.shared_base import Fence, ServedAdapter, ServedCorrection, _checkpoint_name
    from tests.test_shared_prefix import VOCAB

    torch._dynamo.config.disable = False
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    plain = get_peft_model(LlamaForCausalLM(config), LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    with torch.no_grad():
        for name, p in plain.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.05)
    eager, compiled = copy.deepcopy(plain), copy.deepcopy(plain)
    fence = Fence.create()
    corrections = [ServedCorrection(m, fence, torch.device("cpu"), merges=True) for m in (eager, compiled)]
    batch = two_groups(torch.Generator().manual_seed(7))
    out: dict = {"zero_terms": len({id(t) for layer in corrections[1].layers.values()
                                    for t in layer.base_layer.served_term[:2]})}
    _, out["loss_off"], _ = gradients(plain, batch, "dapo", size=4, share_prefix=False)
    torch._dynamo.reset()  # each model's graphs counted from none: the models share code objects
    counters.clear()
    out["layers"] = compile_layers(compiled.get_base_model())
    _, out["loss_before"], _ = gradients(compiled, batch, "dapo", size=4, share_prefix=False)
    out["graphs_before"] = counters["stats"]["unique_graphs"]
    # the owner merges an adapter (another one, drawn) and announces it; the learner maps it
    served = {_checkpoint_name(name): SimpleNamespace(a=torch.randn(4, m.in_features) * 0.05,
                                                      b=torch.randn(m.out_features, 4) * 0.05, scale=2.0)
              for name, m in plain.named_modules() if hasattr(m, "lora_A") and hasattr(m, "base_layer")}
    out["served_layers"] = len(served)
    owner = ServedAdapter(fence, torch.device("cpu"))
    owner.store(served, lambda a, b, scale: None)
    owner.switch(True)
    out["refreshed"] = [c.refresh() for c in corrections]
    _, out["loss_eager"], grads_eager = gradients(eager, batch, "dapo", size=4, share_prefix=False)
    _, out["loss"], grads = gradients(compiled, batch, "dapo", size=4, share_prefix=False)
    out["graphs"] = counters["stats"]["unique_graphs"]
    out["graph_breaks"] = dict(counters["graph_break"])
    out["grad_rel"] = max(relative(grads[n], g) for n, g in grads_eager.items())
    torch._dynamo.reset()
    counters.clear()
    compile_layers(plain.get_base_model())
    gradients(plain, batch, "dapo", size=4, share_prefix=False)
    out["graphs_plain"] = counters["stats"]["unique_graphs"]
    return out


@pytest.mark.subprocess
def test_the_served_correction_adds_no_graph_to_the_compiled_layers():
    """A learner that maps a replica's merged weights subtracts the replica's adapter in a forward
    hook on each base layer (model/shared_base.py ServedCorrection). Compiled, those hooks give
    the eager loss and gradients to float32 rounding, before the replica announces an adapter
    (nothing subtracted: the plain model's loss) and after; the layers share as many graphs as
    they do without the hooks, and the announcement compiles none. Seen failing both ways: a hook
    per layer that closed over the layer's name made dynamo compile a graph per decoder layer (4
    here; at 36, its recompile limit of 8 left 28 layers eager), and a term that first appeared
    with the announcement recompiled the layers mid-run."""
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        got = pool.apply(served_correction_checks)
    assert got["layers"] == 4 and got["served_layers"] == 4 * 7 and got["refreshed"] == [True, True]
    assert got["zero_terms"] == 2 * 7  # before the announcement: an A and a B per kind of linear, not per layer
    assert got["graphs_before"] == got["graphs"] == got["graphs_plain"] < 4 and not got["graph_breaks"], got
    assert got["loss_before"] == pytest.approx(got["loss_off"], rel=1e-5)
    assert got["loss"] == pytest.approx(got["loss_eager"], rel=1e-5)
    assert got["loss_eager"] != pytest.approx(got["loss_off"], rel=1e-3)  # the correction is on
    assert got["grad_rel"] < 1e-5, got
