"""ppl_ratio / rollout_kl / rollout_k3_kl as DESIGN.md defines them (pure functions)."""

from __future__ import annotations

import math

import pytest

from learner.rollout_correction import parity_stats, ppl_ratio


def test_identical_logprobs_agree_exactly():
    lp = [[-1.0, -2.0, -0.5], [-3.0]]
    stats = parity_stats(lp, lp)
    assert stats.ppl_ratio == 1.0
    assert stats.rollout_kl == 0.0
    assert stats.rollout_k3_kl == 0.0
    assert stats.tokens == 4 and stats.sequences == 2


def test_hand_computed_values():
    r = [[-1.0, -1.0], [-2.0]]
    o = [[-1.5, -0.5], [-1.0]]
    # d_0 = -1 - (-1) = 0; d_1 = -2 - (-1) = -1
    assert ppl_ratio(r, o) == pytest.approx((1.0 + math.exp(-1.0)) / 2)
    stats = parity_stats(r, o)
    assert stats.rollout_kl == pytest.approx((0.5 - 0.5 - 1.0) / 3)
    deltas = [-0.5, 0.5, 1.0]  # o - r per token
    assert stats.rollout_k3_kl == pytest.approx(sum(math.exp(d) - d - 1 for d in deltas) / 3)
    assert stats.max_abs_diff == pytest.approx(1.0)


def test_rollout_more_confident_than_trainer_gives_ratio_above_one():
    assert ppl_ratio([[-0.1, -0.1]], [[-0.3, -0.3]]) > 1.0


def test_empty_sequences_are_skipped_but_all_empty_is_an_error():
    assert parity_stats([[], [-1.0]], [[], [-1.0]]).sequences == 1
    with pytest.raises(ValueError, match="no response tokens"):
        parity_stats([[]], [[]])


def test_length_mismatch_names_the_sequence():
    with pytest.raises(ValueError, match="sequence 1"):
        parity_stats([[-1.0], [-1.0, -2.0]], [[-1.0], [-1.0]])
    with pytest.raises(ValueError, match="2 rollout sequences vs 1"):
        parity_stats([[-1.0], [-1.0]], [[-1.0]])
