"""The learner's memory (issue 31, item 2), checked on CPU.

1. Log-probs and entropies over slices of the logits (learner/passes.py ``token_logprobs`` with
   ``chunk_tokens`` > 0, learner.logprob_chunk_tokens) equal the plain path's BIT FOR BIT on CPU:
   values and gradients w.r.t. the logits, float32 and bfloat16 logits, every entropy mode, T = 1
   and T != 1. Each slice runs the plain path's own ops, and every op works on one position's
   row, so nothing but the number of rows changes. (On an H200, bf16 logits [8, 585, 151936]:
   log-probs and gradients bit-equal too; entropies within 1.9e-6 absolute for slices under 1024
   tokens, where CUDA's row-sum kernel splits its work by the number of rows, bit-equal above.)
   No float32 tensor of the whole [B, W, V] is made, forward or backward. The same losses and
   LoRA gradients come out of old_log_prob, ref and update_actor, and the same adapter out of a
   PolicyLearner step.
2. The memory plan (learner/memory_plan.py) by table, and its wiring: CPU workers run exactly as
   configured ('auto' = no checkpointing, micro_batch_size rows); on CUDA the plan turns
   checkpointing on for a step only when a longest row would not fit without it (simulated here
   by giving a CPU learner a plan).
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from config import RunConfig
from config.learner import LearnerConfig
from learner.lora import adapter_state_dict
from learner.losses import LossNorm, ObjectiveParams
from learner.memory_plan import (
    COMPILED_LAYER_SHARE, LORA_BYTES_PER_PARAM, ModelShape, Sharding, fixed_bytes, layer_activation_bytes, layer_params, lora_params,
    memory_plan, per_token_bytes, weight_bytes,
)
from learner.microbatch import capped_count_bounds, count_bounds, largest_micro_batch, token_budget_bounds
from learner.passes import (
    GradSync, forward_logprobs, make_micro_batches, old_log_prob, ref_log_prob, token_logprobs, update_actor,
)
from learner.policy import PolicyLearner
from learner.shared_prefix import SharedPrefixLM
from tests.test_shared_prefix import VOCAB, lora, tiny_llama

GIB = 2**30
MIB = 2**20
MODES = ("none", "detached", "grad")


def plain_token_logprobs(logits, targets, temperature, entropy="none"):
    """learner/passes.py token_logprobs as it was before chunking (the reference, verbatim)."""
    logits = logits[:, :-1, :].float()
    if temperature != 1.0:
        logits = logits / temperature
    logp_all = torch.log_softmax(logits, dim=-1)
    logp = logp_all.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    if entropy == "none":
        return logp, None
    if entropy == "grad":
        return logp, -(logp_all.exp() * logp_all).sum(-1)
    with torch.no_grad():
        detached = logp_all.detach()
        return logp, -(detached.exp() * detached).sum(-1)


def scored(fn, base: torch.Tensor, targets: torch.Tensor, mode: str):
    """(log-probs, entropies, d loss / d logits) of a loss that weighs both by fixed random weights."""
    g = torch.Generator().manual_seed(5)
    w_logp = torch.randn(targets.shape, generator=g)
    w_ent = torch.randn(targets.shape, generator=g)
    x = base.clone().requires_grad_(True)
    logp, ent = fn(x)
    loss = (logp * w_logp).sum() + ((ent * w_ent).sum() if mode == "grad" else 0.0)
    loss.backward()
    return logp.detach(), None if ent is None else ent.detach(), x.grad


def random_logits(b: int, w: int, v: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(b, w + 1, v, generator=g) * 4).to(dtype)
    return logits, torch.randint(0, v, (b, w), generator=g)


# ------------------------------------------------------------------ 1. chunked log-probs
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("mode", MODES)
def test_chunked_logprobs_entropies_and_gradients_are_the_plain_ones_bit_for_bit(dtype, temperature, mode):
    b, w, v = 3, 13, 1031  # a vocabulary past the vector width, odd sizes everywhere
    base, targets = random_logits(b, w, v, dtype)
    want = scored(lambda x: plain_token_logprobs(x, targets, temperature, mode), base, targets, mode)
    plain_now = scored(lambda x: token_logprobs(x, targets, temperature, mode), base, targets, mode)
    # chunk_tokens < B (one position per slice), not dividing W, exactly W positions, beyond B x W
    for chunk in (1, 7, 3 * 4, 3 * 13, 1000):
        got = scored(lambda x: token_logprobs(x, targets, temperature, mode, chunk), base, targets, mode)
        for name, a, e in zip(("logp", "entropy", "grad"), got, want):
            if e is None:
                assert a is None, (name, chunk)
                continue
            assert a.dtype == e.dtype and a.shape == e.shape, (name, chunk)
            assert torch.equal(a, e), (name, chunk, (a.float() - e.float()).abs().max())
    for a, e in zip(plain_now, want):  # chunk 0 is the plain path, unchanged
        assert (a is None and e is None) or torch.equal(a, e)
    assert want[2].abs().max() > 0 and torch.equal(want[2][:, -1], torch.zeros_like(want[2][:, -1]))


def test_chunked_logprobs_at_a_real_vocabulary_size_are_bit_equal():
    """SmolLM2's 49,152-token vocabulary, the default run's, under the two threads a worker uses."""
    base, targets = random_logits(2, 9, 49152, torch.float32, seed=3)
    for mode in ("detached", "grad"):
        want = scored(lambda x: plain_token_logprobs(x, targets, 0.7, mode), base, targets, mode)
        got = scored(lambda x: token_logprobs(x, targets, 0.7, mode, 5), base, targets, mode)
        assert all(torch.equal(a, e) for a, e in zip(got, want)), mode


def test_chunked_logprobs_without_grad_and_with_nothing_to_score():
    base, targets = random_logits(2, 6, 50, torch.float32)
    with torch.no_grad():
        logp, ent = token_logprobs(base, targets, 1.0, "detached", 4)
    want_logp, want_ent = plain_token_logprobs(base, targets, 1.0, "detached")
    assert torch.equal(logp, want_logp) and torch.equal(ent, want_ent) and not logp.requires_grad
    logp, ent = token_logprobs(base[:, :1].requires_grad_(), targets[:, :0], 1.0, "grad", 4)
    assert logp.shape == (2, 0) and ent.shape == (2, 0)


class Float32Sizes(TorchDispatchMode):
    """The largest float32 tensor any op makes (forward and backward), and the ops seen."""

    def __init__(self):
        super().__init__()
        self.largest, self.ops = 0, set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.ops.add(str(func))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.dtype == torch.float32:
                self.largest = max(self.largest, t.numel())
        return out


@pytest.mark.parametrize("mode", ["detached", "grad"])
def test_the_chunked_path_never_makes_a_float32_copy_of_the_logits(mode):
    """bf16 logits, as on the GPU: the plain path makes float32 [B, W, V] tensors (the upcast, the
    log-softmax, exp x logp, their gradients); slices of 8 tokens make nothing above [B, 8 // B, V]."""
    b, w, v = 4, 24, 512
    base, targets = random_logits(b, w, v, torch.bfloat16)
    sizes = {}
    for chunk in (0, 8):
        with Float32Sizes() as seen:
            scored(lambda x: token_logprobs(x, targets, 0.7, mode, chunk), base, targets, mode)
        sizes[chunk] = seen.largest
        assert "aten._log_softmax_backward_data.default" in seen.ops  # the backward ran under the mode
    assert sizes[0] >= b * w * v
    assert sizes[8] == b * (8 // b) * v


# ------------------------------------------------------------------ ... through the passes
def two_groups(seed: int):
    from tests.test_learner_gpu_opts import two_groups as batch_of

    return batch_of(torch.Generator().manual_seed(seed))


def passes(peft_model, batch, chunk: int, entropy_bonus: bool):
    """old_log_prob, ref and update_actor on the batch's micro-batches: their outputs, the loss and
    the LoRA gradients (no optimizer step)."""
    lm = SharedPrefixLM(peft_model)
    mbs = make_micro_batches(batch, 4, logprob_chunk=chunk)
    assert all(mb.logprob_chunk == chunk for mb in mbs)
    trainable = {n: p for n, p in peft_model.named_parameters() if p.requires_grad}
    grads: dict[str, torch.Tensor] = {}

    def step() -> float:
        grads.update({n: p.grad.detach().clone() for n, p in trainable.items()})
        for p in trainable.values():
            p.grad = None
        return 0.0

    with torch.no_grad():
        olds, rollout, ent_sum = old_log_prob(lm, mbs, 0.7, True)
        refs = ref_log_prob(lm, peft_model, mbs, 0.7)
        fwd = forward_logprobs(lm, mbs[0], 0.7, "detached")
    norm = LossNorm(loss_type="dapo", global_tokens=float(batch.num_response_tokens()), global_sequences=len(batch),
                    local_tokens=float(batch.num_response_tokens()), max_completion_length=8, dp_size=1)
    params = ObjectiveParams.from_config(LearnerConfig(beta=0.05, entropy_coef=0.01))
    res = update_actor(lm, mbs, GradSync(backward=lambda loss, last: loss.backward(), step=step), norm, params,
                       temperature=0.7, epochs=1, old=olds, ref=refs, entropy_bonus=entropy_bonus)
    return {"olds": olds, "refs": refs, "fwd": list(fwd), "rollout": rollout, "ent_sum": ent_sum,
            "loss": res.loss, "sums": res.sums, "grads": grads}


@pytest.mark.parametrize("entropy_bonus", [False, True])
def test_the_passes_give_the_same_losses_and_gradients_chunked_or_not(entropy_bonus):
    peft_model = lora(tiny_llama())
    batch = two_groups(7)
    want = passes(peft_model, batch, 0, entropy_bonus)
    for chunk in (1, 5, 64):
        got = passes(peft_model, batch, chunk, entropy_bonus)
        for key in ("olds", "refs", "fwd"):
            assert all(torch.equal(a, e) for a, e in zip(got[key], want[key])), (key, chunk)
        assert got["rollout"] == want["rollout"] and got["ent_sum"] == want["ent_sum"], chunk
        assert got["loss"] == want["loss"] and got["sums"] == want["sums"], chunk
        assert any(g.abs().max() > 0 for g in want["grads"].values())
        for name, g in want["grads"].items():
            assert torch.equal(got["grads"][name], g), (name, chunk)


# ------------------------------------------------------------------ ... through the policy
def policy(model_dir, steps: int = 2, **learner):
    cfg = RunConfig.model_validate({
        "seed": 0, "model": {"name_or_path": str(model_dir)},
        "learner": {"lr": 1e-2, "micro_batch_size": 4, "lora": {"r": 4, "alpha": 8}, "entropy_coef": 0.01, **learner},
        "rollout": {"temperature": 0.7}, "trainer": {"steps": steps},
    })
    return PolicyLearner.for_run(cfg)


def run_steps(learner, steps: int = 2):
    metrics = [learner.step(two_groups(3 + k))[0] for k in range(steps)]
    return metrics, adapter_state_dict(learner.peft_model)


def test_cpu_defaults_are_todays_path(tmp_path):
    tiny_llama(tmp_path)
    learner = policy(tmp_path)
    assert learner.cfg.gradient_checkpointing == "auto" and learner.cfg.micro_batch_tokens == "auto"
    assert learner.logprob_chunk == 0 and learner.memory_shape is None
    assert learner.plan(two_groups(3), 8) == (False, None, None)  # no checkpointing, micro_batch_size rows
    run_steps(learner, 1)
    assert not learner.peft_model.is_gradient_checkpointing and learner.stats()["memory_plan"] is None
    explicit = policy(tmp_path, gradient_checkpointing=False, micro_batch_tokens=None, logprob_chunk_tokens=0)
    assert explicit.plan(two_groups(3), 8) == (False, None, None) and explicit.logprob_chunk == 0


def test_a_chunked_policy_step_is_the_plain_one_bit_for_bit(tmp_path):
    tiny_llama(tmp_path)
    plain_m, plain_a = run_steps(policy(tmp_path))
    chunked = policy(tmp_path, logprob_chunk_tokens=6)
    assert chunked.logprob_chunk == 6
    chunked_m, chunked_a = run_steps(chunked)
    for got, want in zip(chunked_m, plain_m):
        for key in ("loss", "grad_norm", "ppl_ratio", "entropy", "kl", "clip_frac"):
            if key in want:
                assert got[key] == want[key], key
    assert any(v.abs().max() > 0 for k, v in plain_a.items() if "lora_B" in k)
    for name, want in plain_a.items():
        assert torch.equal(chunked_a[name], want), name


def simulated_cuda_plan(learner, budget: int) -> None:
    """What PolicyLearner.__init__ sets on a CUDA worker with an 'auto' value, on a CPU learner."""
    trainable = sum(p.numel() for p in learner.peft_model.parameters() if p.requires_grad)
    learner.lora_trainable = trainable
    learner.memory_shape = ModelShape.from_hf_config(learner.peft_model.config, learner.num_params - trainable, 4)
    learner.memory_budget = budget


def test_the_plan_turns_checkpointing_on_only_for_steps_that_need_it(tmp_path):
    tiny_llama(tmp_path)
    batch = two_groups(3)
    longest = max(len(p) + len(r) for p, r in zip(batch.prompt_ids, batch.response_ids))
    learner = policy(tmp_path, steps=3)
    base_m, base_a = run_steps(policy(tmp_path, steps=3), 1)
    shape_trainable = sum(p.numel() for p in learner.peft_model.parameters() if p.requires_grad)

    def plan_at(budget):
        simulated_cuda_plan(learner, budget)
        return memory_plan(learner.memory_shape, 4, shape_trainable, budget, longest, 0)

    # the smallest budget (in 1 KiB steps) where a longest row fits only with checkpointing
    budget = 1024
    while not plan_at(budget).fits:
        budget += 1024
    tight = plan_at(budget)
    assert tight.gradient_checkpointing and tight.micro_batch_tokens >= longest
    checkpointed, tokens, rows = learner.plan(batch, len(batch))
    assert (checkpointed, tokens, rows) == (True, tight.micro_batch_tokens, 4)
    metrics, _ = run_steps(learner, 1)
    assert learner.peft_model.is_gradient_checkpointing and learner.stats()["memory_plan"]["gradient_checkpointing"]
    for key in ("loss", "grad_norm", "ppl_ratio"):  # checkpointing and the cut change only rounding
        assert metrics[0][key] == pytest.approx(base_m[0][key], rel=1e-4, abs=1e-6), key
    # plenty of memory: checkpointing off again, micro_batch_size rows as on CPU
    simulated_cuda_plan(learner, 64 * GIB)
    checkpointed, tokens, rows = learner.plan(batch, len(batch))
    assert not checkpointed and tokens > 4 * longest and rows == 4
    run_steps(learner, 1)
    assert not learner.peft_model.is_gradient_checkpointing
    # in between: one row fits without checkpointing, but the step's 6 rows take more micro-batches
    # that way than checkpointed (micro_batch_size 4 bounds both): the plan checkpoints, where the
    # old rule (one row fits: no checkpointing) would not
    def rows_at(b, ckpt):
        return memory_plan(learner.memory_shape, 4, shape_trainable, b, longest, 0,
                           checkpointing=ckpt).micro_batch_tokens // longest

    middle = budget
    while not 1 <= rows_at(middle, False) < min(4, rows_at(middle, True)) or -(-6 // rows_at(middle, False)) <= \
            -(-6 // min(4, rows_at(middle, True))):
        middle += 1024
        assert rows_at(middle, False) < 4, "no budget where checkpointing saves a micro-batch"
    assert not plan_at(middle).gradient_checkpointing  # rows=1: the old rule
    simulated_cuda_plan(learner, middle)
    assert learner.plan(batch, len(batch)) == (
        True, memory_plan(learner.memory_shape, 4, shape_trainable, middle, longest, 0, True).micro_batch_tokens, 4)
    # a configured value is kept: the plan then only sizes what is 'auto'
    forced = policy(tmp_path, gradient_checkpointing=False, micro_batch_tokens=50)
    simulated_cuda_plan(forced, budget)
    assert forced.plan(batch, len(batch)) == (False, 50, None)


# ------------------------------------------------------------------ 2. the plan, by table
QWEN3_4B = ModelShape(params=4_022_468_096, hidden=2560, intermediate=9728, layers=36, vocab=151_936,
                      q_dim=4096, kv_dim=1024, dtype_bytes=2)  # params: peft's count of the random-init model
QWEN3_4B_LORA32 = 66_060_288  # peft's trainable count at r=32 on all linear layers (same H200 run)


def test_shapes_and_lora_counts_match_the_models():
    assert lora_params(QWEN3_4B, 32) == QWEN3_4B_LORA32
    model = tiny_llama()
    peft_model = lora(model)  # r=4 on q_proj, v_proj, down_proj
    shape = ModelShape.from_hf_config(model.config, params=1, dtype_bytes=4)
    assert (shape.hidden, shape.intermediate, shape.layers, shape.vocab, shape.q_dim, shape.kv_dim) == (64, 96, 2, VOCAB, 64, 32)
    trainable = sum(p.numel() for p in peft_model.parameters() if p.requires_grad)
    assert lora_params(shape, 4, ["q_proj", "v_proj", "down_proj"]) == trainable


@pytest.mark.parametrize("budget_gib, chunk, checkpointing, tokens, fits", [
    (139.0, 256, False, 18694, True),  # a whole H200: no checkpointing, ~32 rows of 584 per micro-batch
    (24.0, 256, False, 1979, True),  # the 24 GB card: 3 rows of 584 per micro-batch, no checkpointing
    # (on an H200 with learner.memory_budget_gib=24, a PolicyLearner step peaked at 19.0 GiB this way)
    (24.0, 0, False, 1454, True),  # ... with the plain log-prob path: 2 rows
    (16.0, 256, False, 816, True),  # one row still fits without checkpointing
    (12.0, 256, True, 1395, True),  # it no longer does: checkpointing, 2 rows
    (10.0, 256, True, 1, False),  # the weights, LoRA state, slices and reserve alone exceed it
])
def test_memory_plan_table_qwen3_4b_r32_rows_of_584(budget_gib, chunk, checkpointing, tokens, fits):
    plan = memory_plan(QWEN3_4B, 32, QWEN3_4B_LORA32, int(budget_gib * GIB), 584, chunk)
    assert (plan.gradient_checkpointing, plan.micro_batch_tokens, plan.fits) == (checkpointing, tokens, fits)
    assert plan.per_token_bytes == per_token_bytes(QWEN3_4B, 32, checkpointing, chunk)
    assert plan.fixed_bytes == fixed_bytes(QWEN3_4B, QWEN3_4B_LORA32, int(budget_gib * GIB), chunk)


def test_memory_plan_given_checkpointing_and_larger_micro_batches():
    budget = int(69.5 * GIB)  # configs/gpu-bench.yaml: half an H200, micro_batch_tokens 8192
    assert not memory_plan(QWEN3_4B, 32, QWEN3_4B_LORA32, budget, 8192, 256).gradient_checkpointing
    assert memory_plan(QWEN3_4B, 32, QWEN3_4B_LORA32, budget, 8192, 0).gradient_checkpointing  # plain path: not
    forced = memory_plan(QWEN3_4B, 32, QWEN3_4B_LORA32, 16 * GIB, 584, 256, checkpointing=True)
    assert forced.gradient_checkpointing and forced.micro_batch_tokens > 816 * 5
    refused = memory_plan(QWEN3_4B, 32, QWEN3_4B_LORA32, 12 * GIB, 584, 256, checkpointing=False)
    assert not refused.gradient_checkpointing and not refused.fits
    for ckpt in (False, True):  # more memory, never fewer tokens
        tokens = [memory_plan(QWEN3_4B, 32, QWEN3_4B_LORA32, gib * GIB, 584, 256, ckpt).micro_batch_tokens
                  for gib in range(8, 141, 4)]
        assert tokens == sorted(tokens) and tokens[-1] > tokens[0], ckpt
    with pytest.raises(ValueError, match="positive"):
        memory_plan(QWEN3_4B, 32, QWEN3_4B_LORA32, 0, 584, 256)


@pytest.mark.parametrize("budget_gib, rows, max_rows, checkpointing, micro_batches", [
    # the 24 GB recipe's learner on an H200 (gradient_checkpointing=auto, 1x8 rows of 584 tokens):
    # without checkpointing 3 rows a micro-batch (3 micro-batches), with it all 8 in one
    (24.0, 8, None, True, 1),
    (139.0, 8, None, False, 1),  # a whole H200: all 8 fit without it, nothing to gain
    (24.0, 3, None, False, 1),  # 3 rows fit one plain micro-batch as well as one checkpointed
    (24.0, 8, 2, False, 4),  # micro_batch_size 2 bounds both modes to 4 micro-batches: no checkpointing
    (24.0, 1, None, False, 1),  # rows=1: the old rule (one row fits without it)
])
def test_auto_checkpointing_takes_the_mode_with_fewer_micro_batches(budget_gib, rows, max_rows, checkpointing,
                                                                      micro_batches):
    plan = memory_plan(QWEN3_4B, 32, QWEN3_4B_LORA32, int(budget_gib * GIB), 584, 256, rows=rows, max_rows=max_rows)
    assert plan.gradient_checkpointing is checkpointing
    per_batch = min(max_rows or rows, plan.micro_batch_tokens // 584)
    assert -(-rows // per_batch) == micro_batches
    # the same budget given a mode plans that mode's tokens
    given = memory_plan(QWEN3_4B, 32, QWEN3_4B_LORA32, int(budget_gib * GIB), 584, 256, checkpointing=checkpointing)
    assert given.micro_batch_tokens == plan.micro_batch_tokens


def test_the_estimate_is_above_what_an_h200_measured():
    """Peak memory per token of one forward + backward (bf16 random-init Qwen3-4B, LoRA r=32,
    autocast, rows of 200 prompt + 384 response tokens; slope over 1, 4 and 8 rows, H200,
    torch 2.11): the plan's per-token bytes must not be below it."""
    measured_mib = {(False, 512): 5.64, (False, 0): 6.87, (True, 512): 0.675, (True, 0): 1.90}
    for (ckpt, chunk), mib in measured_mib.items():
        est = per_token_bytes(QWEN3_4B, 32, ckpt, chunk) / MIB
        assert mib <= est <= 2.1 * mib, (ckpt, chunk, est)
    # one decoder layer per token: ~153 KB measured (no checkpointing, chunked: 5.64 MiB less logits)
    assert 153_000 <= layer_activation_bytes(QWEN3_4B, 32) <= 1.1 * 153_000
    assert QWEN3_4B_LORA32 * LORA_BYTES_PER_PARAM < 1.1e9


def test_compiled_layers_estimate_is_above_what_an_h200_measured_and_unchecks_the_h100_half():
    """Compiled layers (learner.compile_layers) keep less for the backward. Measured on an H200
    (2026-12-06, bench/results/gpu-2026-12-06-h200, the same batches, chunk 256): one micro-batch
    of 8 x 584 = 4,672 tokens peaked at 28.43 GiB compiled and 34.75 GiB eager; with eager's
    measured 5.64 MiB a token (above), the compiled learner keeps 6.32 GiB / 4,672 less."""
    eager_mib = 5.64
    compiled_mib = eager_mib - (34.75 - 28.43) * 1024 / 4672
    est = per_token_bytes(QWEN3_4B, 32, False, 256, compiled=True) / MIB
    assert compiled_mib <= est <= 1.25 * compiled_mib, (compiled_mib, est)
    assert est < per_token_bytes(QWEN3_4B, 32, False, 256) / MIB  # below eager's estimate
    # only the plain mode: checkpointing keeps the layers' inputs, which compiling does not shrink
    assert per_token_bytes(QWEN3_4B, 32, True, 256, compiled=True) == per_token_bytes(QWEN3_4B, 32, True, 256)
    # the layers' part scaled, the logits' not
    eager_layers = 37 * layer_activation_bytes(QWEN3_4B, 32)
    assert (per_token_bytes(QWEN3_4B, 32, False, 256) - per_token_bytes(QWEN3_4B, 32, False, 256, compiled=True)
            == eager_layers - int(eager_layers * COMPILED_LAYER_SHARE))
    # The H100 bench (bench/results/gpu-2026-12-06-h100-fp8): half an 80 GB H100 (42.5 GB), one
    # group of 4,672 tokens per micro-batch. The eager estimate checkpoints it; compiled layers
    # (measured peak 28.4 GiB, under the half's 39.6 GiB) run it plain.
    half_h100 = 42_500_000_000
    assert memory_plan(QWEN3_4B, 32, QWEN3_4B_LORA32, half_h100, 4672, 256).gradient_checkpointing
    plan = memory_plan(QWEN3_4B, 32, QWEN3_4B_LORA32, half_h100, 4672, 256, compiled=True)
    assert not plan.gradient_checkpointing and plan.fits
    assert plan.fixed_bytes + 4672 * plan.per_token_bytes <= half_h100
    # ... but not a micro-batch of the configured cap (8192 tokens): the plan must see the real one
    assert memory_plan(QWEN3_4B, 32, QWEN3_4B_LORA32, half_h100, 8192, 256, compiled=True).gradient_checkpointing


@pytest.mark.parametrize("lengths, budget, groups, packed, largest", [
    ([584] * 16, 8192, [0] * 8 + [1] * 8, False, 4672),  # 8 x 584 fits, 16 x 584 does not: one group each
    ([584] * 16, 9343, [0] * 8 + [1] * 8, False, 4672),  # one token short of both
    ([584] * 16, 9344, [0] * 8 + [1] * 8, False, 9344),  # both groups fit one micro-batch
    ([584] * 16, 4000, [0] * 8 + [1] * 8, False, 3504),  # a group cut by rows: 6 x 584
    ([500, 600, 700], 1000, [], False, 700),  # a row longer than the budget goes alone
    ([500, 600, 100, 700], 2000, [0, 0, 1, 1], False, 1400),  # padded: 2 x 700
    ([500, 600, 100, 700], 2000, [0, 0, 1, 1], True, 1900),  # packed: the sum, one micro-batch
    ([], 100, [], False, 0),
])
def test_largest_micro_batch_is_the_largest_cut(lengths, budget, groups, packed, largest):
    assert largest_micro_batch(lengths, budget, groups, packed) == largest
    bounds = token_budget_bounds(lengths, budget, groups, packed) if lengths else []
    assert largest == max((len(lengths[lo:hi]) * max(lengths[lo:hi]) if not packed else sum(lengths[lo:hi])
                           for lo, hi in bounds), default=0)


def test_the_policy_plans_for_the_micro_batches_it_builds_and_its_compiled_layers(tmp_path):
    """With a configured token cap the plan sizes memory for the largest micro-batch the cut
    really builds (groups kept whole: it can be well under the cap), and with compiled layers by
    their smaller per-token estimate: each alone can spare a step its checkpointing."""
    tiny_llama(tmp_path)
    batch = two_groups(3)
    lengths = [len(p) + len(r) for p, r in zip(batch.prompt_ids, batch.response_ids)]
    group = 4 * max(lengths[:4])  # padded cost of the first group (4 rows)
    cap = 4 * max(lengths) + group  # above one group, below both
    real = largest_micro_batch(lengths, cap, batch.group_ids)
    assert real < cap and len(token_budget_bounds(lengths, cap, batch.group_ids)) == 2
    learner = policy(tmp_path, micro_batch_tokens=cap)
    trainable = sum(p.numel() for p in learner.peft_model.parameters() if p.requires_grad)

    def fits_plain(budget, tokens, compiled=False):
        simulated_cuda_plan(learner, budget)
        return not memory_plan(learner.memory_shape, 4, trainable, budget, tokens, 0, compiled=compiled
                               ).gradient_checkpointing

    budget = 1024
    while not fits_plain(budget, real):
        budget += 1024
    assert not fits_plain(budget, cap)  # sized on the cap, the step would checkpoint
    assert learner.plan(batch, len(batch)) == (False, cap, None)
    metrics, _ = run_steps(learner, 1)
    assert not learner.peft_model.is_gradient_checkpointing and learner.stats()["memory_plan"]["fits"]
    assert (metrics[0]["learner_gradient_checkpointing"], metrics[0]["learner_micro_batches"]) == (0.0, 2.0)
    # one worker of two: the larger of the two shards' micro-batches, the same on both
    learner.world_size = 2
    assert learner._largest_micro_batch(batch, cap) == max(largest_micro_batch(lengths[:4], cap, batch.group_ids[:4]),
                                                           largest_micro_batch(lengths[4:], cap, batch.group_ids[4:]))
    learner.world_size = 1
    # compiled layers: a budget where eager's estimate checkpoints the real micro-batch and theirs does not
    tight = 1024
    while not fits_plain(tight, real, compiled=True):
        tight += 1024
    assert not fits_plain(tight, real)
    simulated_cuda_plan(learner, tight)
    assert learner.plan(batch, len(batch))[0] is True
    assert run_steps(learner, 1)[0][0]["learner_gradient_checkpointing"] == 1.0
    learner.compiled_layers = 2  # what compile_layers returns for the tiny model's two layers
    assert learner.plan(batch, len(batch)) == (False, cap, None)


# ------------------------------------------------------------------ micro-batches capped by count
def test_capped_count_bounds_are_count_bounds_where_they_fit():
    lengths = [10, 12, 11, 9, 20, 21, 22, 20, 5]
    groups = [0, 0, 0, 0, 1, 1, 1, 1, 2]
    assert capped_count_bounds(lengths, 4, 4 * 22, groups) == count_bounds(9, 4)
    # the second micro-batch (4 x 22 = 88) exceeds 60: cut by the budget, two rows each
    assert capped_count_bounds(lengths, 4, 60, groups) == [(0, 4), (4, 6), (6, 8), (8, 9)]
    # never more than `size` rows, whatever the budget
    assert capped_count_bounds(lengths, 3, 10_000) == count_bounds(9, 3)
    with pytest.raises(ValueError, match="group ids"):
        capped_count_bounds(lengths, 4, 60, [0])


def test_auto_micro_batches_on_cuda_are_count_micro_batches_when_memory_allows():
    batch = two_groups(2)
    lengths = [len(p) + len(r) for p, r in zip(batch.prompt_ids, batch.response_ids)]
    by_count = make_micro_batches(batch, 4)
    capped = make_micro_batches(batch, 4, token_budget=10_000, max_rows=4)
    assert [mb.input_ids.shape for mb in capped] == [mb.input_ids.shape for mb in by_count]
    tight = make_micro_batches(batch, 4, token_budget=2 * max(lengths), max_rows=4)
    assert len(tight) > len(by_count) and all(mb.input_ids.numel() <= 2 * max(lengths) for mb in tight)


def test_the_new_learner_values_parse_and_old_ones_keep_their_meaning():
    for value, want in ((True, True), (False, False), ("auto", "auto"), ("true", True)):
        assert RunConfig.model_validate({"learner": {"gradient_checkpointing": value}}).learner.gradient_checkpointing == want
    for value in (None, "auto", 4096):
        assert RunConfig.model_validate({"learner": {"micro_batch_tokens": value}}).learner.micro_batch_tokens == value
    for value in (0, 256, "auto"):
        assert RunConfig.model_validate({"learner": {"logprob_chunk_tokens": value}}).learner.logprob_chunk_tokens == value
    for bad in ({"micro_batch_tokens": 0}, {"logprob_chunk_tokens": -1}, {"gradient_checkpointing": "sometimes"},
                {"memory_budget_gib": 0}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            RunConfig.model_validate({"learner": bad})


# ------------------------------------------------------------------ the plan under fsdp2
# Qwen3-32B's config.json: hidden 5120, 64 layers, 64 heads x 128, 8 KV heads, MLP 25600, vocab 151936, untied
QWEN3_32B = ModelShape(params=32_762_106_880, hidden=5120, intermediate=25600, layers=64, vocab=151_936,
                       q_dim=8192, kv_dim=1024, dtype_bytes=2)
QWEN3_32B_LORA32 = 268_435_456  # 64 layers x 32 x (13312 + 6144 + 6144 + 13312 + 30720 + 30720 + 30720)


def test_fsdp2_plan_counts_one_ranks_shard_qwen3_32b_over_8():
    # one layer: 2 x 5120 x 8192 + 2 x 5120 x 1024 + 3 x 5120 x 25600 + 2 x 5120; the root: 2 x 151936 x 5120 + 5120
    assert layer_params(QWEN3_32B) == 487_598_080
    assert QWEN3_32B.params == 64 * 487_598_080 + 1_555_829_760 and lora_params(QWEN3_32B, 32) == QWEN3_32B_LORA32
    ddp = 32_762_106_880 * 2 + 268_435_456 * 16  # all weights in bf16, LoRA weight, gradient, two moments
    assert weight_bytes(QWEN3_32B, QWEN3_32B_LORA32) == ddp == 69_819_181_056
    fsdp = (32_762_106_880 // 8 * 2  # the rank's shard of the weights
            + 1_555_829_760 * 2  # the root (embeddings, head, final norm) gathered for the pass
            + 2 * 487_598_080 * 2  # two decoder layers gathered (running, prefetched)
            + 268_435_456 * 4  # LoRA gradients whole between micro-batches
            + 268_435_456 * 16 // 8)  # LoRA weight, sharded gradient, AdamW moments: the rank's shard
    assert weight_bytes(QWEN3_32B, QWEN3_32B_LORA32, Sharding(8)) == fsdp == 14_863_191_296
    offload = 1_555_829_760 * 2 + 2 * 487_598_080 * 2 + 268_435_456 * 4  # the shards in host memory
    assert weight_bytes(QWEN3_32B, QWEN3_32B_LORA32, Sharding(8, cpu_offload=True)) == offload
    slices, reserve = 6 * 256 * 151_936 * 4, int(0.1 * 80 * GIB)
    assert fixed_bytes(QWEN3_32B, QWEN3_32B_LORA32, 80 * GIB, 256, Sharding(8)) == fsdp + slices + reserve
    # an 80 GiB card, rows of 4096 tokens, 8 rows a rank: per token 1,997,184 bytes checkpointed
    # (64 x 2 x 5120 layer inputs + 2 x 367,040 for two layers + 2 x 2 x 151936 logits)
    assert per_token_bytes(QWEN3_32B, 32, True, 256) == 64 * 2 * 5120 + 2 * 367_040 + 4 * 151_936 == 1_997_184
    whole = memory_plan(QWEN3_32B, 32, QWEN3_32B_LORA32, 80 * GIB, 4096, 256, rows=8)
    sharded = memory_plan(QWEN3_32B, 32, QWEN3_32B_LORA32, 80 * GIB, 4096, 256, rows=8, sharding=Sharding(8))
    assert whole.fixed_bytes == ddp + slices + reserve and not whole.fits  # DDP: one 4096-token row does not fit
    assert whole.micro_batch_tokens == (80 * GIB - ddp - slices - reserve) // 1_997_184 == 3282
    assert sharded.gradient_checkpointing and sharded.fits
    assert sharded.micro_batch_tokens == (80 * GIB - fsdp - slices - reserve) // 1_997_184 == 30_799  # 7 rows of 4096
    # without checkpointing 24,465,344 bytes a token (65 layers x 367,040 + logits): 2514 tokens, not one row
    assert memory_plan(QWEN3_32B, 32, QWEN3_32B_LORA32, 80 * GIB, 4096, 256, False,
                       sharding=Sharding(8)).micro_batch_tokens == (80 * GIB - fsdp - slices - reserve) // 24_465_344


def test_the_policy_plans_with_its_sharding(tmp_path):
    tiny_llama(tmp_path)
    learner = policy(tmp_path)
    assert learner.memory_sharding is None  # ddp
    batch = two_groups(3)
    longest = max(len(p) + len(r) for p, r in zip(batch.prompt_ids, batch.response_ids))
    simulated_cuda_plan(learner, 40 * MIB)
    learner.memory_sharding = Sharding(4)  # what an fsdp2 learner over 4 ranks sets
    trainable = learner.lora_trainable
    want = memory_plan(learner.memory_shape, 4, trainable, 40 * MIB, longest, 0, rows=len(batch), max_rows=4,
                       sharding=Sharding(4))
    assert want != memory_plan(learner.memory_shape, 4, trainable, 40 * MIB, longest, 0, rows=len(batch), max_rows=4)
    assert learner.plan(batch, len(batch)) == (want.gradient_checkpointing, want.micro_batch_tokens, 4)
