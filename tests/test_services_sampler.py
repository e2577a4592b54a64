"""The seeded prompt sampler: determinism, resume continuity, limits, epoch coverage."""

from __future__ import annotations

from collections import Counter

import pytest

from config import TrainerConfig
from services.sampler import PromptSampler, SamplerError, sampler_from_config

POOL = [f"case-{i:02d}" for i in range(10)]


def make(**kw) -> PromptSampler:
    args = dict(pool=POOL, prompts_per_step=4, seed=7, prompt_order="shuffle_each_epoch")
    args.update(kw)
    return PromptSampler(**args)


def test_same_seed_same_batches_and_other_seed_differs() -> None:
    a, b = make(), make()
    steps = range(1, 30)
    assert [a.batch_for_step(s) for s in steps] == [b.batch_for_step(s) for s in steps]
    c = make(seed=8)
    assert [a.batch_for_step(s) for s in steps] != [c.batch_for_step(s) for s in steps]


def test_resume_from_fresh_object_continues_exactly() -> None:
    first_run = make()
    expected = [first_run.batch_for_step(s) for s in range(1, 41)]
    # A resumed process knows only its next step number; it never saw steps 1..16.
    resumed = make()
    assert [resumed.batch_for_step(s) for s in range(17, 41)] == expected[16:]
    # Asking out of order gives the same answers too.
    shuffled = make()
    picked = [shuffled.batch_for_step(s) for s in (40, 3, 22)]
    assert picked == [expected[39], expected[2], expected[21]]


@pytest.mark.parametrize("order", ["shuffle_each_epoch", "fixed"])
@pytest.mark.parametrize("pool_size,per_step", [(10, 4), (10, 3), (7, 7), (9, 2), (5, 4)])
def test_each_case_once_per_epoch_and_batches_distinct(order, pool_size, per_step) -> None:
    pool = POOL[:pool_size]
    sampler = PromptSampler(pool=pool, prompts_per_step=per_step, seed=3, prompt_order=order)
    epochs = 6
    steps = epochs * pool_size // per_step + 2
    stream = [c for s in range(1, steps + 1) for c in sampler.batch_for_step(s)]
    for e in range(epochs):
        assert Counter(stream[e * pool_size : (e + 1) * pool_size]) == Counter(pool)
    for s in range(1, steps + 1):
        batch = sampler.batch_for_step(s)
        assert len(batch) == per_step
        assert len(set(batch)) == per_step, (s, batch)


def test_fixed_order_is_pool_order() -> None:
    sampler = make(prompt_order="fixed")
    assert sampler.batch_for_step(1) == POOL[:4]
    assert sampler.batch_for_step(2) == POOL[4:8]
    assert sampler.batch_for_step(3) == POOL[8:] + POOL[:2]


def test_shuffle_differs_between_epochs() -> None:
    sampler = make(prompts_per_step=5)
    epoch0 = sampler.batch_for_step(1) + sampler.batch_for_step(2)
    epoch1 = sampler.batch_for_step(3) + sampler.batch_for_step(4)
    assert sorted(epoch0) == sorted(epoch1) == POOL
    assert epoch0 != epoch1
    assert epoch0 != POOL


def test_pool_smaller_than_batch_still_serves_every_slot() -> None:
    sampler = make(pool=POOL[:3], prompts_per_step=5)
    batch = sampler.batch_for_step(1)
    assert len(batch) == 5 and set(batch) == set(POOL[:3])


def test_limit_uses_first_cases_of_pool() -> None:
    sampler = make(limit=4, prompt_order="fixed")
    assert sampler.cases == tuple(POOL[:4])
    assert {c for s in range(1, 20) for c in sampler.batch_for_step(s)} == set(POOL[:4])


def test_limit_above_pool_names_both_numbers() -> None:
    with pytest.raises(SamplerError) as info:
        make(limit=25)
    assert "25" in str(info.value) and "10" in str(info.value)


@pytest.mark.parametrize("bad", [dict(pool=[]), dict(pool=["a", "a"]), dict(prompts_per_step=0)])
def test_bad_input_is_an_error(bad) -> None:
    with pytest.raises(SamplerError):
        make(**bad)


def test_steps_are_one_based() -> None:
    with pytest.raises(SamplerError, match="1-based"):
        make().batch_for_step(0)


def test_position_and_plan() -> None:
    sampler = make(steps=10)
    assert sampler.position(1) == {"epoch": 0, "index": 0}
    assert sampler.position(3) == {"epoch": 0, "index": 8}
    assert sampler.position(4) == {"epoch": 1, "index": 2}
    plan = sampler.plan()
    assert plan["pool_size"] == 10 and plan["cases_used"] == 10 and plan["steps"] == 10
    assert plan["epochs"] == 4.0
    assert plan["times_each_prompt_seen"] == {"min": 4, "max": 4}
    assert "~4.00 times" in plan["note"]
    uneven = make(steps=3).plan()
    assert uneven["times_each_prompt_seen"] == {"min": 1, "max": 2}


def test_from_config() -> None:
    trainer = TrainerConfig(steps=5, prompts_per_step=2, limit=6, prompt_order="fixed")
    sampler = sampler_from_config(POOL, trainer, seed=1)
    assert sampler.batch_for_step(4) == [POOL[0], POOL[1]]
    assert sampler.plan()["limit"] == 6
    with pytest.raises(SamplerError, match="11"):
        sampler_from_config(POOL, TrainerConfig(limit=11), seed=1)
