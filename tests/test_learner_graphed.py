"""learner/graphed.py and the update's lean path, on CPU: micro-batches padded to graph buckets
without an attention mask score the same tokens the same way; a captured update (here a CPU
stand-in that aliases its outputs and gradients the way torch.cuda.make_graphed_callables does)
gives the eager update, over several micro-batches, only because the gradients are kept
allocated; a capture that fails falls back to eager and says so; the metric sums cross to the
host once."""

from __future__ import annotations

import json
import struct

import pytest
import torch

from config import RunConfig
from config.learner import LearnerConfig
from learner.graphed import GraphedScorer, ScoredTokens
from learner.lora import adapter_payload, adapter_state_dict, disable_lora_input_casts
from learner.losses import LossNorm, ObjectiveParams
from learner.passes import ddp_grad_sync, forward_logprobs, make_micro_batches, update_actor
from learner.policy import PolicyLearner
from learner.rollout_correction import as_floats, rollout_mismatch_sum_tensors, rollout_mismatch_sums
from learner.shared_prefix import SharedPrefixLM
from tests.test_learner_gpu_opts import two_groups
from tests.test_shared_prefix import lora, tiny_llama


def aliasing_capture(module: torch.nn.Module, sample: torch.Tensor):
    """A CPU stand-in for torch.cuda.make_graphed_callables with its memory semantics: the
    input is copied into a static tensor, the outputs are views of static buffers and the
    parameters' gradients come back as views of static gradient buffers, all overwritten by
    the next call. (No graph: the point is what autograd does with such buffers.)"""
    params = tuple(p for p in module.parameters() if p.requires_grad)
    static_in = sample.clone()
    grad_bufs = tuple(torch.zeros_like(p) for p in params)
    out_bufs: list[torch.Tensor] = []

    class Graphed(torch.autograd.Function):
        @staticmethod
        def forward(ctx, inp, *ps):
            static_in.copy_(inp)
            with torch.enable_grad():
                outs = module(static_in)
            ctx.outs = outs
            if not out_bufs:
                out_bufs.extend(torch.empty_like(o) for o in outs)
            for buf, o in zip(out_bufs, outs):
                buf.copy_(o.detach())
            return tuple(buf.detach() for buf in out_bufs)

        @staticmethod
        def backward(ctx, *grads):
            pairs = [(o, g) for o, g in zip(ctx.outs, grads) if o.requires_grad and g is not None]
            got = torch.autograd.grad([o for o, _ in pairs], params, [g for _, g in pairs], allow_unused=True)
            for buf, g in zip(grad_bufs, got):
                buf.copy_(g if g is not None else torch.zeros_like(buf))
            return (None, *(b.detach() for b in grad_bufs))

    return lambda inp: Graphed.apply(inp, *params)


def learner_cfg(model_dir, **learner) -> RunConfig:
    return RunConfig.model_validate({
        "seed": 0, "model": {"name_or_path": str(model_dir)},
        "learner": {"lr": 1e-2, "micro_batch_size": 4, "lora": {"r": 4, "alpha": 8}, **learner},
        "rollout": {"temperature": 0.7}, "trainer": {"steps": 2},
    })


def step_of(model_dir, capture=None, steps: int = 1, **learner):
    if capture is not None:
        learner.setdefault("cuda_graphs", True)  # off by default (measured); on where a capture is given
    policy = PolicyLearner.for_run(learner_cfg(model_dir, **learner), graph_capture=capture)
    batch = two_groups(torch.Generator().manual_seed(3))
    for _ in range(steps):
        metrics, _ = policy.step(batch)
    return policy, metrics, adapter_state_dict(policy.peft_model)


# ------------------------------------------------------------------ padded, maskless micro-batches
def test_padded_causal_micro_batches_score_the_same_tokens_the_same_way():
    lm = SharedPrefixLM(lora(tiny_llama()))
    batch = two_groups(torch.Generator().manual_seed(5))
    plain = make_micro_batches(batch, 4, share_prefix=False)
    padded = make_micro_batches(batch, 4, share_prefix=False, pad_multiple=16, causal_only=True)
    for p, q in zip(plain, padded):
        assert q.input_ids.shape[1] % 16 == 0 and q.start % 16 == 0
        assert q.input_ids.shape[1] > p.input_ids.shape[1] and q.start < p.start  # really padded
        assert q.mask.sum() == p.mask.sum()
        with torch.no_grad():
            lp, _ = forward_logprobs(lm, p, 0.7)
            lq, _ = forward_logprobs(lm, q, 0.7)
        torch.testing.assert_close(lq[q.mask > 0], lp[p.mask > 0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(q.rollout_logprobs[q.mask > 0], p.rollout_logprobs[p.mask > 0])
    with pytest.raises(ValueError, match="pad_multiple"):
        make_micro_batches(batch, 4, pad_multiple=0)


# ------------------------------------------------------------------ the graphed update
def test_graphed_update_equals_the_eager_one_over_several_micro_batches(tmp_path):
    tiny_llama(tmp_path)
    _, eager_m, eager_a = step_of(tmp_path, steps=2, share_prompt_prefix=False)
    graphed, graphed_m, graphed_a = step_of(tmp_path, capture=aliasing_capture, steps=2, graph_pad_tokens=32,
                                            share_prompt_prefix=False)  # the one thing a graph cannot hold
    stats = graphed.scorer.stats()
    # both groups' micro-batches (prompts of 15 and 18 tokens) pad to one shape: one capture,
    # replayed for 2 micro-batches x 2 steps; nothing ran eagerly
    assert stats["captures"] == 1 and stats["replays"] == 4 and stats["eager"] == 0 and stats["disabled"] is None
    assert graphed_m["learner_cuda_graphs"] == 1.0 and eager_m["learner_cuda_graphs"] == 0.0
    for key in ("loss", "grad_norm", "ppl_ratio", "entropy", "clip_frac"):
        assert graphed_m[key] == pytest.approx(eager_m[key], rel=1e-4, abs=1e-6), key
    moved = 0
    for name, want in eager_a.items():  # two Adam steps of lr 1e-2 over float32 noise: 1e-5
        torch.testing.assert_close(graphed_a[name], want, atol=1e-5, rtol=1e-4, msg=name)
        moved += int("lora_B" in name and want.abs().max() > 0)
    assert moved > 0


def _grads(peft_model, scorer, keep_grads: bool) -> dict[str, torch.Tensor]:
    lm = SharedPrefixLM(peft_model)
    batch = two_groups(torch.Generator().manual_seed(7))
    mbs = make_micro_batches(batch, 4, share_prefix=False, pad_multiple=32, causal_only=True)
    assert len(mbs) == 2
    trainable = {n: p for n, p in peft_model.named_parameters() if p.requires_grad}
    for p in trainable.values():
        p.grad = None
    opt = torch.optim.SGD(trainable.values(), lr=0.0)  # step() only clips and zeroes: grads read before
    sync = ddp_grad_sync(lm, opt, max_grad_norm=1e9, keep_grads=keep_grads)
    taken: dict[str, torch.Tensor] = {}
    real_step = sync.step

    def step() -> float:
        taken.update({n: p.grad.detach().clone() for n, p in trainable.items()})
        return real_step()

    sync.step = step
    norm = LossNorm(loss_type="dapo", global_tokens=float(batch.num_response_tokens()), global_sequences=len(batch),
                    local_tokens=float(batch.num_response_tokens()), max_completion_length=8)
    update_actor(lm, mbs, sync, norm, ObjectiveParams.from_config(LearnerConfig()), temperature=0.7, epochs=1,
                 old=None, ref=None, entropy_bonus=False, scorer=scorer)
    return taken


def test_graphed_gradients_accumulate_only_into_kept_grads():
    peft_model = lora(tiny_llama())
    eager = _grads(peft_model, None, keep_grads=False)
    kept = _grads(peft_model, GraphedScorer(peft_model, 2, aliasing_capture), keep_grads=True)
    for name, want in eager.items():
        torch.testing.assert_close(kept[name], want, atol=1e-6, rtol=1e-4, msg=name)
    # without kept grads autograd installs the first micro-batch's gradient buffer as .grad,
    # the second replay overwrites it and then adds to it: the first micro-batch is lost
    lost = _grads(peft_model, GraphedScorer(peft_model, 2, aliasing_capture), keep_grads=False)
    assert max(float((lost[n] - eager[n]).abs().max()) for n in eager) > 1e-3


def test_a_failed_capture_falls_back_to_the_eager_update_and_says_so(tmp_path, caplog):
    tiny_llama(tmp_path)

    def broken(module, sample):
        raise RuntimeError("operation not permitted when stream is capturing\nmore detail")

    _, eager_m, eager_a = step_of(tmp_path, share_prompt_prefix=False)
    policy, m, a = step_of(tmp_path, capture=broken, share_prompt_prefix=False)
    assert policy.scorer.stats()["disabled"] == "RuntimeError: operation not permitted when stream is capturing"
    assert policy.scorer.stats()["eager"] == 2 and policy.scorer.stats()["captures"] == 0
    assert m["learner_cuda_graphs"] == 0.0
    assert "capturing the update as a CUDA graph failed" in caplog.text
    assert m["loss"] == pytest.approx(eager_m["loss"], rel=1e-4, abs=1e-6)
    for name, want in eager_a.items():
        torch.testing.assert_close(a[name], want, atol=1e-5, rtol=1e-4, msg=name)


def test_graphs_are_kept_per_shape_least_recently_used_first_out():
    peft_model = lora(tiny_llama())
    scorer = GraphedScorer(peft_model, 1, aliasing_capture)
    batch = two_groups(torch.Generator().manual_seed(7))
    a, b = make_micro_batches(batch, 4, share_prefix=False, pad_multiple=1, causal_only=True)
    assert a.input_ids.shape != b.input_ids.shape
    for mb in (a, b, a):
        logp, _ = scorer(None, mb, 1.0, "none", None)
        assert logp.shape == mb.mask.shape
    assert scorer.stats()["captures"] == 3 and scorer.stats()["graphs_held"] == 1
    # a micro-batch with a shared prefix or a mask is not what a graph holds: eager
    shared = make_micro_batches(batch, 4)[0]
    assert shared.shared_prefix > 0
    logp, _ = scorer(SharedPrefixLM(peft_model), shared, 1.0, "none", None)
    assert scorer.stats()["eager"] == 1 and logp.shape == shared.mask.shape
    with pytest.raises(ValueError, match="max_graphs"):
        GraphedScorer(peft_model, 0)


def test_scored_tokens_is_the_eager_forward_without_a_mask():
    peft_model = lora(tiny_llama())
    batch = two_groups(torch.Generator().manual_seed(9))
    (mb,) = make_micro_batches(batch, 8, share_prefix=False, causal_only=True)
    with torch.no_grad():
        logp, ent = ScoredTokens(peft_model, mb.start, 0.7, "detached")(mb.input_ids)
        want_lp, want_ent = forward_logprobs(SharedPrefixLM(peft_model), mb, 0.7, "detached")
    torch.testing.assert_close(logp, want_lp)
    torch.testing.assert_close(ent, want_ent)


# ------------------------------------------------------------------ syncs, casts, payload dtype
def test_metric_sums_cross_to_the_host_once_and_equal_the_float_version():
    g = torch.Generator().manual_seed(0)
    r, o = torch.rand(3, 5, generator=g) * -3, torch.rand(3, 5, generator=g) * -3
    m = (torch.rand(3, 5, generator=g) > 0.3).float()
    m[2] = 0  # a row with no response token is skipped
    tensors = rollout_mismatch_sum_tensors(r, o, m)
    assert all(isinstance(v, torch.Tensor) and v.ndim == 0 for v in tensors.values())
    assert as_floats(tensors) == pytest.approx(rollout_mismatch_sums(r, o, m))
    assert as_floats(tensors)["sequences"] == 2.0
    assert as_floats({"a": 1.5, "b": torch.tensor(2.0)}) == {"a": 1.5, "b": 2.0}


def test_lora_input_casts_are_switched_off_without_changing_the_output():
    from peft.tuners.lora import LoraLayer

    peft_model = lora(tiny_llama())
    ids = torch.randint(1, 32, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        before = peft_model(input_ids=ids).logits
    disable_lora_input_casts(peft_model)
    layers = [m for m in peft_model.modules() if isinstance(m, LoraLayer)]
    assert layers and not any(m.cast_input_dtype_enabled for m in layers)
    with torch.no_grad():
        torch.testing.assert_close(peft_model(input_ids=ids).logits, before)


def test_the_payload_can_travel_in_the_autocast_dtype():
    peft_model = lora(tiny_llama())

    def dtypes(payload) -> set[str]:
        data = payload.data()
        (n,) = struct.unpack("<Q", data[:8])
        header = json.loads(data[8 : 8 + n])
        return {v["dtype"] for k, v in header.items() if k != "__metadata__"}

    assert dtypes(adapter_payload(peft_model, 1)) == {"F32"}
    half = adapter_payload(peft_model, 1, dtype=torch.bfloat16)
    assert dtypes(half) == {"BF16"}
    assert len(half.safetensors) < 0.6 * len(adapter_payload(peft_model, 1).safetensors)
