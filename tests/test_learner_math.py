"""The learner's pure math against numbers computed by hand (and loops vs vectorised code)."""

from __future__ import annotations

import dataclasses

import math
import random
import zlib

import pytest
import torch

from learner.advantages import (
    ADVANTAGE_ESTIMATORS,
    EPS,
    compute_advantages,
    frac_reward_zero_std,
    group_ids_for,
)
from learner.checkpoint import lr_decision
from learner.kl import kl_estimate
from learner.losses import (
    LossInputs,
    LossNorm,
    ObjectiveParams,
    aggregate,
    entropy_bonus_active,
    policy_loss,
)
from learner.optim import lr_factor, rebase_lr
from learner.rollout_correction import finalize, merge_sums, rollout_mismatch, rollout_mismatch_sums

REWARDS = torch.tensor([1.0, 0, 0, 0, 1, 1, 0, 0])
GROUPS = group_ids_for(8, 4)


def close(actual, expected, tol=1e-5):
    assert torch.allclose(torch.as_tensor(actual, dtype=torch.float32),
                          torch.tensor(expected, dtype=torch.float32), atol=tol), (actual, expected)


# ---------------------------------------------------------------- advantages, by hand
# group 1 = [1,0,0,0]: mean 0.25, unbiased std sqrt((0.75^2 + 3 * 0.25^2) / 3) = 0.5
# group 2 = [1,1,0,0]: mean 0.5,  unbiased std sqrt(4 * 0.25 / 3) = sqrt(1/3)


def test_grpo_group_scaled():
    s2 = math.sqrt(1 / 3)
    expected = [0.75 / (0.5 + EPS)] + [-0.25 / (0.5 + EPS)] * 3 + [0.5 / (s2 + EPS)] * 2 + [-0.5 / (s2 + EPS)] * 2
    close(compute_advantages(REWARDS, GROUPS, "grpo", "group"), expected)


def test_grpo_batch_scaled():
    # all 8 rewards: mean 3/8; sum of squares 3 * 0.625^2 + 5 * 0.375^2 = 1.875; var 1.875 / 7
    std = math.sqrt(1.875 / 7)
    centered = [0.75, -0.25, -0.25, -0.25, 0.5, 0.5, -0.5, -0.5]
    close(compute_advantages(REWARDS, GROUPS, "grpo", "batch"), [c / (std + EPS) for c in centered])


def test_grpo_unscaled_and_dr_grpo_are_mean_only():
    centered = [0.75, -0.25, -0.25, -0.25, 0.5, 0.5, -0.5, -0.5]
    close(compute_advantages(REWARDS, GROUPS, "grpo", "none"), centered)
    # Dr. GRPO never divides by a std, whatever scale_rewards says
    close(compute_advantages(REWARDS, GROUPS, "dr_grpo", "group"), centered)


def test_rloo_leave_one_out_baseline():
    # 1 - mean(0,0,0) = 1; 0 - mean(1,0,0) = -1/3; 1 - mean(1,0,0) = 2/3; 0 - mean(1,1,0) = -2/3
    close(compute_advantages(REWARDS, GROUPS, "rloo"), [1, -1 / 3, -1 / 3, -1 / 3, 2 / 3, 2 / 3, -2 / 3, -2 / 3])


def test_rank_uses_average_ranks_for_ties():
    # [1,0,0,0]: ranks 3, 1, 1, 1 (ties share (0+1+2)/3); centred on 1.5, / (G-1) = 3
    # [1,1,0,0]: ranks 2.5, 2.5, 0.5, 0.5; centred on 1.5 -> +-1, / 3
    close(compute_advantages(REWARDS, GROUPS, "rank"), [0.5, -1 / 6, -1 / 6, -1 / 6, 1 / 3, 1 / 3, -1 / 3, -1 / 3])
    # distinct rewards 3, 1, 2 -> ranks 2, 0, 1 -> centred 1, -1, 0 -> / 2
    close(compute_advantages(torch.tensor([3.0, 1, 2]), torch.zeros(3, dtype=torch.long), "rank"), [0.5, -0.5, 0.0])
    # the scale of rewards does not matter, only their order
    close(compute_advantages(torch.tensor([300.0, 1, 2]), torch.zeros(3, dtype=torch.long), "rank"), [0.5, -0.5, 0.0])


def test_valid_only_statistics_skip_failed_members():
    rewards = torch.tensor([1.0, 0.5, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0])
    valid = torch.tensor([True, True, True, False, True, False, False, False])
    # group 1 valid = [1, .5, 0]: mean .5, unbiased std sqrt((.25 + 0 + .25) / 2) = .5
    # group 2 has one valid member: no competitor, advantage 0; failed members get -1
    close(
        compute_advantages(rewards, GROUPS, "grpo_valid_only", "group", valid, invalid_advantage=-1.0),
        [0.5 / (0.5 + EPS), 0.0, -0.5 / (0.5 + EPS), -1.0, 0.0, -1.0, -1.0, -1.0],
    )
    close(
        compute_advantages(rewards, GROUPS, "dr_grpo_valid_only", "group", valid, invalid_advantage=-0.5),
        [0.5, 0.0, -0.5, -0.5, 0.0, -0.5, -0.5, -0.5],
    )
    # rloo over [1, .5, 0]: 1 - .25, .5 - .5, 0 - .75
    close(compute_advantages(rewards, GROUPS, "rloo_valid_only", "none", valid), [0.75, 0, -0.75, -1, 0, -1, -1, -1])
    close(compute_advantages(rewards, GROUPS, "rank_valid_only", "none", valid), [0.5, 0, -0.5, -1, 0, -1, -1, -1])
    # without _valid_only the mask is ignored: plain group statistics over all four
    close(compute_advantages(rewards, GROUPS, "dr_grpo", "none", valid), [0.625, 0.125, -0.375, -0.375, 0.75, -0.25, -0.25, -0.25])


def test_frac_reward_zero_std():
    rewards = torch.tensor([1.0, 1, 1, 0, 1, 0, 0, 0, 0])
    assert frac_reward_zero_std(rewards, group_ids_for(9, 3)) == pytest.approx(2 / 3)
    assert frac_reward_zero_std(REWARDS, GROUPS) == 0.0


def test_bad_advantage_inputs_are_named():
    with pytest.raises(ValueError, match="group_size"):
        group_ids_for(7, 4)
    with pytest.raises(ValueError, match="unknown advantage estimator 'ppo'"):
        compute_advantages(REWARDS, GROUPS, "ppo")
    with pytest.raises(ValueError, match="NaN"):
        compute_advantages(torch.tensor([1.0, float("nan")]), torch.tensor([0, 0]), "grpo")
    with pytest.raises(ValueError, match="differ in shape"):
        compute_advantages(REWARDS, GROUPS[:4], "grpo")


def test_every_name_the_config_accepts_is_implemented_and_nothing_else():
    """config/learner.py declares the estimator, loss and KL names; the registries implement
    exactly those (a name added to one side only fails here, not in a run)."""
    from typing import get_args

    from config.learner import AdvantageEstimator, KLEstimator, LossType
    from learner.kl import KL_ESTIMATORS
    from learner.losses import LOSS_AGGREGATORS

    assert list(ADVANTAGE_ESTIMATORS) == list(get_args(AdvantageEstimator))
    assert {name: valid_only for name, (_, valid_only) in ADVANTAGE_ESTIMATORS.items()} == {
        n: n.endswith("_valid_only") for n in get_args(AdvantageEstimator)}
    assert set(LOSS_AGGREGATORS) == set(get_args(LossType))
    assert set(KL_ESTIMATORS) == set(get_args(KLEstimator))


# ---------------------------------------------------------------- advantages, loop vs vectorised


def _std(xs):
    if len(xs) < 2:
        return 0.0
    m = sum(xs) / len(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1))


def reference_advantages(rewards, groups, estimator, scale, valid, invalid_adv):
    """A per-group Python loop written straight from the definitions."""
    valid_only = estimator.endswith("_valid_only")
    base = estimator.removesuffix("_valid_only")
    members_all = [i for i in range(len(rewards)) if (valid[i] or not valid_only)]
    batch_std = _std([rewards[i] for i in members_all])
    out = [0.0] * len(rewards)
    for g in sorted(set(groups)):
        idx = [i for i in range(len(rewards)) if groups[i] == g]
        mem = [i for i in idx if valid[i] or not valid_only]
        rs = [rewards[i] for i in mem]
        n = len(rs)
        mean = sum(rs) / n if n else 0.0
        for i in idx:
            if valid_only and not valid[i]:
                out[i] = invalid_adv
                continue
            r = rewards[i]
            if base == "grpo":
                denom = {"group": _std(rs) + EPS, "batch": batch_std + EPS, "none": 1.0}[scale]
                out[i] = (r - mean) / denom
            elif base == "dr_grpo":
                out[i] = r - mean
            elif base == "rloo":
                out[i] = 0.0 if n < 2 else r - (sum(rs) - r) / (n - 1)
            elif base == "rank":
                below = sum(1 for x in rs if x < r)
                ties = sum(1 for x in rs if x == r)
                out[i] = 0.0 if n < 2 else (below + (ties - 1) / 2 - (n - 1) / 2) / (n - 1)
    return out


@pytest.mark.parametrize("estimator", sorted(ADVANTAGE_ESTIMATORS))
@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_vectorised_matches_reference_loop(estimator, scale):
    # crc32, not hash(): str hashes change with PYTHONHASHSEED, so the inputs would too.
    rng = random.Random(zlib.crc32(f"{estimator}/{scale}".encode()))
    for _ in range(20):
        sizes = [rng.randint(1, 6) for _ in range(rng.randint(1, 5))]
        groups = [g * 7 + 3 for g, s in enumerate(sizes) for _ in range(s)]  # non-contiguous ids
        rng.shuffle(groups)
        rewards = [rng.choice([0.0, 0.5, 1.0, rng.random()]) for _ in groups]
        valid = [rng.random() > 0.3 for _ in groups]
        got = compute_advantages(torch.tensor(rewards), torch.tensor(groups), estimator, scale,
                                 torch.tensor(valid), invalid_advantage=-0.7)
        want = reference_advantages(rewards, groups, estimator, scale, valid, -0.7)
        close(got, want, tol=1e-4)


# ---------------------------------------------------------------- KL estimators


def test_kl_estimators_by_hand():
    logp, ref = torch.tensor([math.log(0.5)]), torch.tensor([math.log(0.25)])
    # d = ref - logp = log 0.5
    close(kl_estimate(logp, ref, "k1"), [math.log(2)])
    close(kl_estimate(logp, ref, "k2"), [0.5 * math.log(2) ** 2])
    close(kl_estimate(logp, ref, "k3"), [0.5 - math.log(0.5) - 1])
    close(kl_estimate(logp, ref, "low_var_kl"), [0.5 - math.log(0.5) - 1])
    # low_var_kl clamps a runaway token at 10; k3 does not
    assert kl_estimate(torch.tensor([0.0]), torch.tensor([30.0]), "low_var_kl").item() == 10.0
    assert kl_estimate(torch.tensor([0.0]), torch.tensor([30.0]), "k3").item() > 1e12
    with pytest.raises(ValueError, match="unknown kl estimator 'k9'"):
        kl_estimate(logp, ref, "k9")


# ---------------------------------------------------------------- policy loss
# seq 0: A = +1, mask [1,1,0], ratios [1.5, 0.5, -]
#   t0: max(-1.5, -1.28) = -1.28 (clipped high); t1: max(-0.5, -0.8) = -0.5 (A > 0: not clipped)
# seq 1: A = -2, mask [1,1,1], ratios [0.5, 1, 2]
#   t0: max(1.0, 1.6) = 1.6 (clipped low); t1: 2; t2: max(4, 2.56) = 4
# token sum -1.78 + 7.6 = 5.82 over 5 tokens; per-sequence means -0.89 and 7.6 / 3


def _inputs(**extra) -> LossInputs:
    old = torch.tensor([[-1.0, -2.0, -3.0], [-1.0, -1.5, -2.0]])
    ratio = torch.tensor([[1.5, 0.5, 1.0], [0.5, 1.0, 2.0]])
    logp = (old + ratio.log()).requires_grad_(True)
    return LossInputs(
        logprobs=logp, old_logprobs=old, advantages=torch.tensor([1.0, -2.0]),
        mask=torch.tensor([[1.0, 1, 0], [1, 1, 1]]), **extra,
    )


def _norm(loss_type, **kw):
    base = dict(global_tokens=5, global_sequences=2, local_tokens=5, max_completion_length=4, dp_size=1)
    base.update(kw)
    return LossNorm(loss_type=loss_type, **base)


# No TIS, no KL leash, no entropy bonus: the bare clipped objective.
PARAMS = ObjectiveParams(epsilon_low=0.2, epsilon_high=0.28, beta=0.0, kl_estimator="k3", entropy_coef=0.0,
                         tis_cap=None)


@pytest.mark.parametrize(
    "loss_type, norm_kw, expected",
    [
        ("grpo", {}, (-0.89 + 7.6 / 3) / 2),
        ("bnpo", {}, 5.82 / 5),
        ("dr_grpo", {}, 5.82 / (2 * 4)),
        ("dapo", {}, 5.82 / 5),
        # dapo: the global batch had 10 tokens on 2 workers -> this worker's share x dp_size
        ("dapo", {"global_tokens": 10, "dp_size": 2}, 5.82 / 10 * 2),
    ],
)
def test_policy_loss_aggregations_by_hand(loss_type, norm_kw, expected):
    out = policy_loss(_inputs(), _norm(loss_type, **norm_kw), PARAMS)
    assert out.loss.item() == pytest.approx(expected, abs=1e-5)
    m = finalize(out.sums)
    assert m["clip_frac"] == pytest.approx(2 / 5)
    assert m["clip_frac_low"] == pytest.approx(1 / 5)
    assert m["clip_frac_high"] == pytest.approx(1 / 5)
    assert m["pg_loss"] == pytest.approx(5.82 / 5, abs=1e-5)
    assert m["tokens"] == 5


def test_policy_loss_gradient_is_zero_where_clipped():
    inp = _inputs()
    policy_loss(inp, _norm("dapo"), PARAMS).loss.backward()
    # d/dlogp of -A * ratio / 5 = -A * ratio / 5 where not clipped; 0 where clipped or masked
    expected = torch.tensor([[0.0, -1 * 0.5 / 5, 0.0], [0.0, 2 * 1.0 / 5, 2 * 2.0 / 5]])
    close(inp.logprobs.grad, expected.tolist())


def test_truncated_importance_weights():
    # exp(old - rollout) = [[3, 0.5, x], [1, 1, 1]] -> capped at 2 -> [[2, .5], [1, 1, 1]]
    old = torch.tensor([[-1.0, -2.0, -3.0], [-1.0, -1.5, -2.0]])
    rollout = old - torch.tensor([[math.log(3), math.log(0.5), 0.0], [0.0, 0.0, 0.0]])
    out = policy_loss(_inputs(rollout_logprobs=rollout), _norm("dapo"),
                      dataclasses.replace(PARAMS, tis_cap=2.0))
    # token terms: -1.28 * 2, -0.5 * 0.5, 1.6, 2, 4 -> sum -2.56 - 0.25 + 7.6 = 4.79
    assert out.loss.item() == pytest.approx(4.79 / 5, abs=1e-5)
    assert finalize(out.sums)["tis_weight"] == pytest.approx((2 + 0.5 + 3) / 5)
    # tis_cap=None switches it off
    off = policy_loss(_inputs(rollout_logprobs=rollout), _norm("dapo"), PARAMS)
    assert off.loss.item() == pytest.approx(5.82 / 5, abs=1e-5)


def test_tis_clip_fraction_counts_the_capped_tokens():
    # exp(old - rollout) = [[3, 0.5, (masked) 4], [1, 2.5, 1]]: 3 and 2.5 exceed the cap of 2 -> 2 of 5 tokens
    old = torch.tensor([[-1.0, -2.0, -3.0], [-1.0, -1.5, -2.0]])
    rollout = old - torch.tensor([[math.log(3), math.log(0.5), math.log(4)], [0.0, math.log(2.5), 0.0]])
    capped = policy_loss(_inputs(rollout_logprobs=rollout), _norm("dapo"), dataclasses.replace(PARAMS, tis_cap=2.0))
    assert finalize(capped.sums)["tis_clip_frac"] == pytest.approx(2 / 5)
    assert finalize(capped.sums)["tis_weight"] == pytest.approx((2 + 0.5 + 1 + 2 + 1) / 5)
    # weights under the cap clip nothing; nor does TIS off (tis_cap=None)
    at_cap = policy_loss(_inputs(rollout_logprobs=old - math.log(2.0)), _norm("dapo"), dataclasses.replace(PARAMS, tis_cap=2.5))
    assert finalize(at_cap.sums)["tis_clip_frac"] == 0.0
    off = policy_loss(_inputs(rollout_logprobs=rollout), _norm("dapo"), PARAMS)
    assert PARAMS.tis_cap is None and finalize(off.sums)["tis_clip_frac"] == 0.0


def test_kl_leash_and_entropy_bonus():
    inp = _inputs(
        ref_logprobs=torch.tensor([[-1.0, -2.0, -3.0], [-1.0, -1.5, -2.0]]),  # = old
        entropy=torch.full((2, 3), 2.0),
    )
    params = dataclasses.replace(PARAMS, beta=0.1, kl_estimator="k1", entropy_coef=0.01)
    out = policy_loss(inp, _norm("dapo"), params, entropy_bonus=True)
    # k1 = logp - ref = log ratio: log 1.5 + log 0.5 + log 0.5 + 0 + log 2 = log 0.375
    kl_sum = math.log(1.5) + math.log(0.5) + math.log(0.5) + math.log(2.0)
    expected = (5.82 + 0.1 * kl_sum - 0.01 * 2.0 * 5) / 5
    assert out.loss.item() == pytest.approx(expected, abs=1e-5)
    assert finalize(out.sums)["kl"] == pytest.approx(kl_sum / 5, abs=1e-6)
    assert finalize(out.sums)["entropy"] == pytest.approx(2.0)
    # bonus off: the entropy is reported but not in the loss
    off = policy_loss(inp, _norm("dapo"), params, entropy_bonus=False)
    assert off.loss.item() == pytest.approx((5.82 + 0.1 * kl_sum) / 5, abs=1e-5)
    with pytest.raises(ValueError, match="ref_logprobs"):
        policy_loss(_inputs(), _norm("dapo"), params)


def test_entropy_floor_gate():
    assert entropy_bonus_active(1.0, 0.01, 2.0) is True
    assert entropy_bonus_active(3.0, 0.01, 2.0) is False
    assert entropy_bonus_active(3.0, 0.01, None) is True
    assert entropy_bonus_active(1.0, 0.0, 2.0) is False


@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "dapo"])
def test_sharded_loss_equals_global_loss(loss_type):
    """2 workers x 2 sequences (DDP averages) == 1 worker x 4 sequences: value and gradient."""
    torch.manual_seed(0)
    old = torch.randn(4, 5)
    logp = (old + 0.3 * torch.randn(4, 5)).requires_grad_(True)
    mask = torch.tensor([[1.0, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0], [1, 1, 0, 0, 0]])
    adv = torch.tensor([1.0, -0.5, 2.0, -1.0])
    tokens = float(mask.sum())

    def loss_of(rows, dp):
        local = float(mask[rows].sum())
        norm = LossNorm(loss_type, tokens, 4, local, 5, dp)
        return policy_loss(LossInputs(logp[rows], old[rows], adv[rows], mask[rows]), norm, PARAMS).loss

    whole = loss_of(slice(0, 4), 1)
    (g_whole,) = torch.autograd.grad(whole, logp)
    halves = [loss_of(slice(0, 2), 2), loss_of(slice(2, 4), 2)]
    averaged = (halves[0] + halves[1]) / 2  # what DDP's gradient mean computes
    (g_halves,) = torch.autograd.grad(averaged, logp)
    assert averaged.item() == pytest.approx(whole.item(), abs=1e-6)
    assert torch.allclose(g_halves, g_whole, atol=1e-7)


def test_unknown_loss_type():
    with pytest.raises(ValueError, match="unknown loss_type 'ppo'"):
        aggregate(torch.zeros(1, 1), torch.ones(1, 1), _norm("ppo"))


# ---------------------------------------------------------------- rollout agreement


def test_ppl_ratio_and_rollout_kl_by_hand():
    r = torch.tensor([[-1.0, -2.0, 0.0], [-1.0, -1.0, -1.0]])
    o = torch.tensor([[-2.0, -2.0, 9.0], [-1.0, -1.0, -1.0]])
    m = torch.tensor([[1.0, 1, 0], [1, 1, 1]])
    got = rollout_mismatch(r, o, m)
    # seq 0: mean r = -1.5, mean o = -2 -> d = .5; seq 1: d = 0
    assert got["ppl_ratio"] == pytest.approx((math.exp(0.5) + 1) / 2)
    assert got["rollout_kl"] == pytest.approx(1 / 5)  # only token (0,0) differs, by 1
    assert got["rollout_k3_kl"] == pytest.approx((math.exp(-1) + 1 - 1) / 5)
    # sums survive sharding: two halves merged == the whole
    halves = merge_sums(rollout_mismatch_sums(r[:1], o[:1], m[:1]), rollout_mismatch_sums(r[1:], o[1:], m[1:]))
    assert finalize(halves) == pytest.approx(got)
    # identical log-probs: exactly 1 / 0 / 0
    same = rollout_mismatch(r, r, m)
    assert (same["ppl_ratio"], same["rollout_kl"], same["rollout_k3_kl"]) == (1.0, 0.0, 0.0)


# ---------------------------------------------------------------- LR schedule


def test_lr_schedule_by_hand():
    assert [lr_factor(k, "constant", 2, 10) for k in range(4)] == [0.5, 1.0, 1.0, 1.0]
    # linear after 2 warmup steps over 8 remaining: p = (k - 2) / 8
    assert lr_factor(2, "linear", 2, 10) == 1.0
    assert lr_factor(6, "linear", 2, 10) == pytest.approx(0.5)
    assert lr_factor(10, "linear", 2, 10) == 0.0
    assert lr_factor(6, "cosine", 2, 10) == pytest.approx(0.5)
    assert lr_factor(4, "cosine", 2, 10) == pytest.approx((1 + math.cos(math.pi / 4)) / 2)
    assert lr_factor(0, "cosine", 0, 10) == 1.0


def test_rebase_keeps_the_step_and_takes_the_config_lr():
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.AdamW([p], lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: lr_factor(k, "linear", 0, 10))
    for _ in range(5):
        opt.step()
        sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(1e-3 * 0.5)
    rebase_lr(opt, sched, 2e-4)
    assert opt.param_groups[0]["lr"] == pytest.approx(2e-4 * 0.5)
    opt.step()
    sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(2e-4 * 0.4)


def test_lr_decision_names_both_values():
    assert lr_decision(1e-4, 1e-4, "refuse") is None
    assert lr_decision(1e-4, 3e-4, "rebase") == "checkpoint lr 0.0001, config lr 0.0003: re-based on config"
    with pytest.raises(ValueError, match="checkpoint lr 0.0001 differs from config lr 0.0003"):
        lr_decision(1e-4, 3e-4, "refuse")


def test_objective_params_come_from_the_schema_only():
    """ObjectiveParams has no defaults of its own: every knob is the LearnerConfig's."""
    from config.learner import LearnerConfig

    cfg = LearnerConfig()
    params = ObjectiveParams.from_config(cfg)
    for name in ("epsilon_low", "epsilon_high", "beta", "kl_estimator", "entropy_coef", "tis_cap"):
        assert getattr(params, name) == getattr(cfg, name), name
    assert params.tis_cap == 2.0
