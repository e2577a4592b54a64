"""Checkpoint resume: the step continues, training continues exactly, the LR is the configured one."""

from __future__ import annotations

import json

import pytest
import torch

from learner import checkpoint
from learner.checkpoint import checkpoint_dir, read_state
from learner.job import LearnerJob
from learner.lora import adapter_state_dict
from learner.types import TrainBatch
from learner.policy import PolicyLearner
from config import RunConfig

pytestmark = pytest.mark.slow


def cfg(**learner):
    base = {"lr": 1e-3, "lr_schedule": "linear", "warmup_steps": 1, "micro_batch_size": 4}
    base.update(learner)
    return RunConfig.model_validate({
        "seed": 3, "model": {"name_or_path": "tiny-random"}, "learner": base,
        "rollout": {"max_tokens": 4}, "trainer": {"steps": 10},
    })


def batch(k: int) -> TrainBatch:
    g = torch.Generator().manual_seed(k)
    prompts = [torch.randint(1, 400, (3 + i % 2,), generator=g).tolist() for i in range(6)]
    responses = [torch.randint(1, 400, (2 + i % 3,), generator=g).tolist() for i in range(6)]
    return TrainBatch(prompts, responses, [[-10.8] * len(r) for r in responses],
                      advantages=[1.0, -1.0, 0.5, -0.5, 2.0, -2.0])


def test_resume_continues_the_run_exactly(tmp_path):
    straight = PolicyLearner.for_run(cfg())
    for k in range(4):
        straight.step(batch(k))

    first = PolicyLearner.for_run(cfg())
    for k in range(2):
        first.step(batch(k))
    ckpt = checkpoint_dir(tmp_path, 2)
    sha = first.save_checkpoint(ckpt, data_position={"epoch": 0, "cursor": 8})
    state = read_state(ckpt)
    assert state["step"] == 2 and state["adapter_sha256"] == sha and state["lr"] == 1e-3
    # peft's target_modules set is written sorted, so identical checkpoints are identical bytes
    # (tests/test_learner_lora.py compares two processes with different hash seeds).
    targets = json.loads((ckpt / "adapter" / "adapter_config.json").read_text())["target_modules"]
    assert len(targets) > 2 and targets == sorted(targets)

    resumed = PolicyLearner.for_run(cfg(), resume_from=ckpt)
    assert resumed.step_count == 2
    assert resumed.data_position == {"epoch": 0, "cursor": 8}
    assert resumed.lr_rebase_note is None
    lrs = []
    for k in range(2, 4):
        lrs.append(resumed.step(batch(k))[0]["learning_rate"])
    assert resumed.step_count == 4
    # linear schedule, 1 warmup step, 10 total: steps 2 and 3 (0-based) run at 1 - (k-1)/9
    assert lrs == pytest.approx([1e-3 * (1 - 1 / 9), 1e-3 * (1 - 2 / 9)])
    want, got = adapter_state_dict(straight.peft_model), adapter_state_dict(resumed.peft_model)
    assert all(torch.allclose(got[k], want[k], atol=1e-7) for k in want)
    assert any(want[k].abs().sum() > 0 for k in want if "lora_B" in k)  # it did train


def test_lr_mismatch_rebases_on_config_or_refuses(tmp_path):
    first = PolicyLearner.for_run(cfg(lr=1e-3))
    first.step(batch(0))
    ckpt = checkpoint_dir(tmp_path, 1)
    first.save_checkpoint(ckpt, None)

    rebased = PolicyLearner.for_run(cfg(lr=2e-4), resume_from=ckpt)
    assert rebased.lr_rebase_note == "checkpoint lr 0.001, config lr 0.0002: re-based on config"
    # step index 1 of a linear schedule after 1 warmup step: factor 1 - 0/9 = 1 -> config lr
    assert rebased.step(batch(1))[0]["learning_rate"] == pytest.approx(2e-4)

    with pytest.raises(ValueError, match=r"checkpoint lr 0\.001 differs from config lr 0\.0002"):
        PolicyLearner.for_run(cfg(lr=2e-4, on_lr_mismatch="refuse"), resume_from=ckpt)
    # the driver refuses before starting any worker
    job = LearnerJob(cfg(lr=2e-4, on_lr_mismatch="refuse"), tmp_path, resume_from=ckpt)
    with pytest.raises(ValueError, match=r"checkpoint lr 0\.001 differs from config lr 0\.0002"):
        job.start()



def test_resuming_with_the_other_learner_is_refused_by_name(tmp_path):
    """A plain checkpoint has optimizer.pt, a DeepSpeed one deepspeed/zero/: resuming one with
    the other learner would silently restart Adam, so restore names what is missing instead."""
    learner = PolicyLearner.for_run(cfg())
    learner.step(batch(0))
    plain = checkpoint_dir(tmp_path, 1)
    learner.save_checkpoint(plain, None)
    never_called = object()  # the check comes before any engine call
    with pytest.raises(FileNotFoundError, match=r"holds no deepspeed/zero/ optimizer partitions .*set learner.strategy=ddp\)"):
        checkpoint.restore(plain, rank=0, optimizer=None, scheduler=learner.scheduler, deepspeed_engine=never_called)

    (plain / "optimizer.pt").unlink()  # what a DeepSpeed checkpoint lacks
    with pytest.raises(FileNotFoundError, match=r"holds no optimizer.pt \(a DeepSpeed checkpoint\? set learner.strategy=deepspeed\)"):
        PolicyLearner.for_run(cfg(), resume_from=plain)
