"""Group-relative advantage estimators: rewards of G completions per prompt -> one scalar each.

Problem: GRPO has no value network; a completion is judged against its siblings (same prompt).
The estimators differ in how the baseline and the scale are taken:

- ``grpo``      A_i = (r_i - mean_g) / (std_g + eps)      (DeepSeekMath; TRL default)
- ``dr_grpo``   A_i =  r_i - mean_g                        (Dr. GRPO: no std, no length bias)
- ``rank``      A_i = (rank_i - mean rank_g) / (n_g - 1)   in [-0.5, 0.5]; ties share the average
                rank, so the estimator only sees the order of rewards, never their scale.
- ``rloo``      A_i =  r_i - mean_{j != i} r_j = n_g / (n_g - 1) * (r_i - mean_g)

``std`` is the unbiased sample std (torch.std, as TRL). ``scale_rewards`` applies to ``grpo``
only: ``group`` divides by the group's std, ``batch`` by the std over the whole batch (TRL's
"batch" mode), ``none`` not at all (then grpo == dr_grpo). Dr. GRPO, rank and RLOO are never
scaled.

``*_valid_only`` variants: members whose completion failed (unparseable, crashed verifier...)
are not competitors. The group statistics are taken over the VALID members only, and the failed
members get the configured fixed advantage ``invalid_advantage`` (e.g. -1: "failing is worse
than any valid answer") instead of a value that depends on how many siblings also failed.
A group with fewer than two valid members gives its valid member(s) advantage 0.

Groups are given by integer ids (any values, members need not be contiguous, sizes may differ);
``group_ids_for(n, group_size)`` builds the usual contiguous layout. Everything here is
vectorised; tests/test_learner_math.py checks it against a per-group Python loop.

The estimator names, and the defaults of ``scale_rewards`` and ``invalid_advantage``, are the
learner section's (config/learner.py); the table below is built from those names.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import get_args

import torch

from config.learner import AdvantageEstimator, LearnerConfig, ScaleRewards

_LEARNER = LearnerConfig()  # the schema's defaults: declared there, read here

EPS = 1e-4  # TRL's epsilon in (r - mean) / (std + eps)


def group_ids_for(num_samples: int, group_size: int) -> torch.Tensor:
    """Contiguous groups [0]*G + [1]*G + ...: LongTensor [num_samples]."""
    if group_size < 1 or num_samples % group_size:
        raise ValueError(
            f"num_samples={num_samples} is not a multiple of group_size={group_size}"
        )
    return torch.arange(num_samples) // group_size


def _dense(group_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Map arbitrary group ids [N] to 0..K-1; returns (index [N], K)."""
    _, index = torch.unique(group_ids, return_inverse=True)
    return index, int(index.max().item()) + 1 if index.numel() else 0


def _group_stats(
    rewards: torch.Tensor, index: torch.Tensor, k: int, members: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-member (count, mean, unbiased std) of its group, over ``members`` only. Each [N].

    std is 0 where a group has fewer than two members (instead of torch's NaN)."""
    w = members.to(rewards.dtype)
    count = torch.zeros(k, dtype=rewards.dtype).index_add_(0, index, w)
    total = torch.zeros(k, dtype=rewards.dtype).index_add_(0, index, rewards * w)
    mean = total / count.clamp(min=1)
    dev2 = (rewards - mean[index]) ** 2 * w
    ss = torch.zeros(k, dtype=rewards.dtype).index_add_(0, index, dev2)
    std = torch.where(count > 1, (ss / (count - 1).clamp(min=1)).sqrt(), torch.zeros_like(ss))
    return count[index], mean[index], std[index]


def _batch_std(rewards: torch.Tensor, members: torch.Tensor) -> torch.Tensor:
    picked = rewards[members]
    return picked.std() if picked.numel() > 1 else torch.zeros((), dtype=rewards.dtype)


def _grpo(rewards, index, k, members, scale_rewards):
    count, mean, std = _group_stats(rewards, index, k, members)
    centered = rewards - mean
    if scale_rewards == "group":
        return centered / (std + EPS)
    if scale_rewards == "batch":
        return centered / (_batch_std(rewards, members) + EPS)
    return centered


def _dr_grpo(rewards, index, k, members, scale_rewards):
    _, mean, _ = _group_stats(rewards, index, k, members)
    return rewards - mean


def _rloo(rewards, index, k, members, scale_rewards):
    count, mean, _ = _group_stats(rewards, index, k, members)
    factor = torch.where(count > 1, count / (count - 1).clamp(min=1), torch.zeros_like(count))
    return factor * (rewards - mean)


def _rank(rewards, index, k, members, scale_rewards):
    # Pairwise [N, N] comparison restricted to same-group members; N is a step's batch (small).
    same = (index[:, None] == index[None, :]) & members[None, :]
    below = ((rewards[None, :] < rewards[:, None]) & same).sum(1).to(rewards.dtype)
    ties = ((rewards[None, :] == rewards[:, None]) & same).sum(1).to(rewards.dtype)
    count = same.sum(1).to(rewards.dtype)
    rank = below + (ties - 1) / 2  # average rank, 0-based, among the group's members
    centered = rank - (count - 1) / 2
    return torch.where(count > 1, centered / (count - 1).clamp(min=1), torch.zeros_like(rank))


Estimator = Callable[[torch.Tensor, torch.Tensor, int, torch.Tensor, str], torch.Tensor]

_BASE_ESTIMATORS: dict[str, Estimator] = {"grpo": _grpo, "dr_grpo": _dr_grpo, "rank": _rank, "rloo": _rloo}
VALID_ONLY = "_valid_only"
# name -> (estimator, valid_only), for every name the config accepts
ADVANTAGE_ESTIMATORS: dict[str, tuple[Estimator, bool]] = {
    name: (_BASE_ESTIMATORS[name.removesuffix(VALID_ONLY)], name.endswith(VALID_ONLY))
    for name in get_args(AdvantageEstimator)
}


def compute_advantages(
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    estimator: str,
    scale_rewards: str = _LEARNER.scale_rewards,
    valid: torch.Tensor | None = None,
    invalid_advantage: float = _LEARNER.invalid_advantage,
) -> torch.Tensor:
    """Advantages [N] float32.

    rewards: [N] float; group_ids: [N] int (same id = same prompt); valid: [N] bool (None = all
    valid; only the *_valid_only estimators read it); scale_rewards: group | batch | none.
    """
    if estimator not in ADVANTAGE_ESTIMATORS:
        raise ValueError(f"unknown advantage estimator {estimator!r}; one of {sorted(ADVANTAGE_ESTIMATORS)}")
    if scale_rewards not in get_args(ScaleRewards):
        raise ValueError(f"scale_rewards must be {' | '.join(get_args(ScaleRewards))}, got {scale_rewards!r}")
    rewards = torch.as_tensor(rewards, dtype=torch.float32).flatten()
    group_ids = torch.as_tensor(group_ids).flatten()
    if group_ids.shape != rewards.shape:
        raise ValueError(f"group_ids {tuple(group_ids.shape)} and rewards {tuple(rewards.shape)} differ in shape")
    if not torch.isfinite(rewards).all():
        raise ValueError("rewards contain NaN or inf")
    fn, valid_only = ADVANTAGE_ESTIMATORS[estimator]
    if valid is None:
        valid = torch.ones_like(rewards, dtype=torch.bool)
    valid = torch.as_tensor(valid, dtype=torch.bool).flatten()
    if valid.shape != rewards.shape:
        raise ValueError(f"valid {tuple(valid.shape)} and rewards {tuple(rewards.shape)} differ in shape")
    if rewards.numel() == 0:
        return rewards
    index, k = _dense(group_ids)
    members = valid if valid_only else torch.ones_like(valid)
    adv = fn(rewards, index, k, members, scale_rewards)
    if valid_only:
        adv = torch.where(valid, adv, torch.full_like(adv, invalid_advantage))
    return adv


def frac_reward_zero_std(rewards: torch.Tensor, group_ids: torch.Tensor) -> float:
    """Share of groups whose rewards are all equal (nothing to learn from them)."""
    rewards = torch.as_tensor(rewards, dtype=torch.float32).flatten()
    index, k = _dense(torch.as_tensor(group_ids).flatten())
    if k == 0:
        return 0.0
    lo = torch.full((k,), float("inf")).scatter_reduce(0, index, rewards, "amin")
    hi = torch.full((k,), float("-inf")).scatter_reduce(0, index, rewards, "amax")
    return float((lo == hi).float().mean().item())
