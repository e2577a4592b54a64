"""A step whose gradients are not finite is refused before the optimizer moves anything.

What it guards (issue 34, an H100 under MPS): the learner's forward gave nan from the first step,
AdamW turned the adapter into nans, the replica kept generating from it, a grader scored the
degenerate text, and the run exited 0 with ppl_ratio "nan" in its step lines. Here the nan comes
the way a broken replica sends it (non-finite rollout log-probs, which the TIS weight multiplies
into the loss); the learner's own forward going nan reaches the same norm."""

from __future__ import annotations

import math

import pytest
import torch

from config import RunConfig
from learner.lora import adapter_state_dict
from learner.passes import NonFiniteGradients, refuse_nonfinite
from learner.policy import PolicyLearner
from learner.types import TrainBatch

pytestmark = pytest.mark.slow


def cfg() -> RunConfig:
    return RunConfig.model_validate({
        "seed": 5, "model": {"name_or_path": "tiny-random"},
        "learner": {"lr": 1e-3, "micro_batch_size": 2, "loss_type": "dapo"},
        "rollout": {"max_tokens": 4}, "trainer": {"steps": 4},
    })


def batch(k: int, nan_at: int | None = None) -> TrainBatch:
    g = torch.Generator().manual_seed(k)
    prompts = [torch.randint(1, 400, (3 + i % 2,), generator=g).tolist() for i in range(4)]
    responses = [torch.randint(1, 400, (2 + i % 3,), generator=g).tolist() for i in range(4)]
    rollout = [[-10.8] * len(r) for r in responses]
    if nan_at is not None:
        rollout[nan_at][1] = math.nan
    return TrainBatch(prompts, responses, rollout, advantages=[1.0, -1.0, 0.5, -0.5])


def test_a_nan_step_is_refused_and_leaves_no_trace():
    refused, fresh = PolicyLearner.for_run(cfg()), PolicyLearner.for_run(cfg())
    init = {k: v.clone() for k, v in adapter_state_dict(refused.peft_model).items()}
    with pytest.raises(NonFiniteGradients, match=r"gradient norm is nan: .* the optimizer step was not taken"):
        refused.step(batch(0, nan_at=2))
    # Nothing moved: the weights, the optimizer's state, the schedule, the step count, the grads.
    after = adapter_state_dict(refused.peft_model)
    assert all(torch.equal(after[k], init[k]) for k in init)
    assert not refused.optimizer.state and refused.step_count == 0
    assert refused.optimizer.param_groups[0]["lr"] == fresh.optimizer.param_groups[0]["lr"]
    assert all(p.grad is None for p in refused.peft_model.parameters() if p.requires_grad)

    # So the next good step is exactly the one a learner that never saw the bad batch takes.
    got, want = refused.step(batch(1))[0], fresh.step(batch(1))[0]
    assert math.isfinite(got["grad_norm"]) and got["grad_norm"] == want["grad_norm"] and got["loss"] == want["loss"]
    a, b = adapter_state_dict(refused.peft_model), adapter_state_dict(fresh.peft_model)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert any(not torch.equal(a[k], init[k]) for k in a)  # it did train


@pytest.mark.parametrize("norm", [math.nan, math.inf, -math.inf])
def test_refuse_nonfinite_drops_the_gradients(norm):
    w = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.AdamW([w], lr=0.1)
    w.grad = torch.full((3,), norm)
    with pytest.raises(NonFiniteGradients, match=f"gradient norm is {norm}"):
        refuse_nonfinite(norm, opt)
    assert w.grad is None and not opt.state
    with pytest.raises(NonFiniteGradients, match="its optimizer step was taken"):
        refuse_nonfinite(norm, opt, stepped=True)
    assert refuse_nonfinite(2.5, opt) == 2.5  # a finite norm passes through
    # where it was seen is said only to a worker under MPS
    with pytest.raises(NonFiniteGradients, match="checkpoint.$"):
        refuse_nonfinite(norm, opt, under_mps=False)
    with pytest.raises(NonFiniteGradients, match="runs under CUDA MPS, where a capped share.s GEMMs .*try another gpu_sharing.learner_sm_percent or gpu_sharing.mode=timeslice"):
        refuse_nonfinite(norm, opt, under_mps=True)
