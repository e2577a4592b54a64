"""The clipped GRPO policy loss, fed typed inputs (prime-rl style) and aggregated by name.

Per response token (A = the sequence's advantage, ratio = exp(logp - old_logp)):

    pg    = max(-A * ratio, -A * clip(ratio, 1 - epsilon_low, 1 + epsilon_high))
    pg   *= w,  w = min(exp(old_logp - rollout_logp), tis_cap), detached      (truncated IS)
    loss  = pg + beta * KL(logp, ref_logp) - entropy_coef * entropy           (if switched on)

Truncated importance sampling (Yao et al., "Your efficient RL framework secretly brings you
off-policy RL"; verl rollout_corr_helper): the rollout engine samples from pi_rollout, which
is never exactly the trainer's pi_old (kernels, dtype, a stale adapter). w re-weights each
token toward pi_old; capping it bounds the variance; detaching it keeps it a weight, not a
gradient path. The entropy bonus only applies while the step's mean entropy is below
``entropy_floor`` (a floor against collapse, not a push toward noise); the decision is taken
once per step from the whole batch (``entropy_bonus_active``) so every worker agrees.

Aggregation over tokens (``loss_type``, as TRL documents them), written so that summing the
micro-batch losses of a worker and averaging over ``dp_size`` workers (DDP's gradient mean)
gives exactly the loss of the whole step batch:

- ``grpo``     mean over sequences of (token mean within the sequence)
- ``bnpo``     token sum / response tokens of this worker's shard ("local batch"; the one mode
               whose value depends on how the batch is sharded, by definition)
- ``dr_grpo``  token sum / (sequences in the global batch * max_completion_length)
- ``dapo``     token sum / response tokens of the GLOBAL batch (passed in: 1 worker and 2 workers
               take the same update)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from learner.kl import kl_estimate


@dataclass
class LossInputs:
    """One micro-batch of B sequences over T positions (response positions have mask 1)."""

    logprobs: torch.Tensor  # [B, T] current policy, carries the gradient
    old_logprobs: torch.Tensor  # [B, T] policy before this step's update, no grad
    advantages: torch.Tensor  # [B]
    mask: torch.Tensor  # [B, T] float, 1 = response token
    rollout_logprobs: torch.Tensor | None = None  # [B, T] sampling engine's (for TIS)
    ref_logprobs: torch.Tensor | None = None  # [B, T] adapter disabled; needed iff beta > 0
    entropy: torch.Tensor | None = None  # [B, T]; carries the gradient iff the bonus is on


@dataclass(frozen=True)
class LossNorm:
    """Denominators of the aggregation. Parallelism enters as numbers (verl style)."""

    loss_type: str
    global_tokens: float  # response tokens of the whole step batch, all workers (dapo)
    global_sequences: int  # sequences of the whole step batch (grpo, dr_grpo)
    local_tokens: float  # response tokens of this worker's shard (bnpo)
    max_completion_length: int  # dr_grpo's constant
    dp_size: int = 1  # DDP averages gradients over workers; the loss multiplies it back


@dataclass(frozen=True)
class ObjectiveParams:
    """The objective's knobs, always cut from a LearnerConfig (``from_config``): the schema is
    the only place their defaults and meanings live."""

    epsilon_low: float
    epsilon_high: float
    beta: float
    kl_estimator: str
    entropy_coef: float
    tis_cap: float | None

    @classmethod
    def from_config(cls, cfg) -> "ObjectiveParams":
        """From a config.learner.LearnerConfig."""
        return cls(
            epsilon_low=cfg.epsilon_low,
            epsilon_high=cfg.epsilon_high,
            beta=cfg.beta,
            kl_estimator=cfg.kl_estimator,
            entropy_coef=cfg.entropy_coef,
            tis_cap=cfg.tis_cap,
        )


@dataclass
class LossOutputs:
    loss: torch.Tensor  # scalar: this micro-batch's share of the step loss (call backward on it)
    sum_tensors: dict[str, torch.Tensor]  # detached 0-d token sums, on the loss's device

    @property
    def sums(self) -> dict[str, float]:
        """The token sums as floats (one host transfer); reduce with rollout_correction.finalize."""
        from learner.rollout_correction import as_floats

        return as_floats(self.sum_tensors)


def _agg_grpo(x: torch.Tensor, m: torch.Tensor, n: LossNorm) -> torch.Tensor:
    per_seq = (x * m).sum(-1) / m.sum(-1).clamp(min=1.0)
    return per_seq.sum() / n.global_sequences * n.dp_size


def _agg_bnpo(x: torch.Tensor, m: torch.Tensor, n: LossNorm) -> torch.Tensor:
    return (x * m).sum() / max(n.local_tokens, 1.0)


def _agg_dr_grpo(x: torch.Tensor, m: torch.Tensor, n: LossNorm) -> torch.Tensor:
    return (x * m).sum() / (n.global_sequences * n.max_completion_length) * n.dp_size


def _agg_dapo(x: torch.Tensor, m: torch.Tensor, n: LossNorm) -> torch.Tensor:
    return (x * m).sum() / max(n.global_tokens, 1.0) * n.dp_size


LOSS_AGGREGATORS: dict[str, Callable[[torch.Tensor, torch.Tensor, LossNorm], torch.Tensor]] = {
    "grpo": _agg_grpo,
    "bnpo": _agg_bnpo,
    "dr_grpo": _agg_dr_grpo,
    "dapo": _agg_dapo,
}


def aggregate(per_token: torch.Tensor, mask: torch.Tensor, norm: LossNorm) -> torch.Tensor:
    """[B, T] per-token values -> scalar share of the step loss, by ``norm.loss_type``."""
    if norm.loss_type not in LOSS_AGGREGATORS:
        raise ValueError(f"unknown loss_type {norm.loss_type!r}; one of {sorted(LOSS_AGGREGATORS)}")
    return LOSS_AGGREGATORS[norm.loss_type](per_token, mask, norm)


def entropy_bonus_active(mean_entropy: float, entropy_coef: float, entropy_floor: float | None) -> bool:
    """The bonus is on when it has a coefficient and the step's entropy is under the floor."""
    if entropy_coef <= 0:
        return False
    return entropy_floor is None or mean_entropy < entropy_floor


def policy_loss(
    inp: LossInputs, norm: LossNorm, params: ObjectiveParams, entropy_bonus: bool = False
) -> LossOutputs:
    """The GRPO objective of one micro-batch (see the module docstring)."""
    mask = inp.mask.float()
    adv = inp.advantages.float().unsqueeze(-1)  # [B, 1]
    ratio = torch.exp(inp.logprobs - inp.old_logprobs)
    clipped_ratio = torch.clamp(ratio, 1 - params.epsilon_low, 1 + params.epsilon_high)
    pg = torch.maximum(-adv * ratio, -adv * clipped_ratio)
    if params.tis_cap is not None and inp.rollout_logprobs is not None:
        tis_raw = torch.exp(inp.old_logprobs - inp.rollout_logprobs).detach()
        tis_w = torch.clamp(tis_raw, max=params.tis_cap)
        tis_capped = tis_raw > params.tis_cap
    else:
        tis_w = torch.ones_like(pg)
        tis_capped = torch.zeros_like(mask, dtype=torch.bool)
    per_token = pg * tis_w
    kl = None
    if params.beta > 0:
        if inp.ref_logprobs is None:
            raise ValueError("beta > 0 needs ref_logprobs (the adapter-disabled log-probs)")
        kl = kl_estimate(inp.logprobs, inp.ref_logprobs, params.kl_estimator)
        per_token = per_token + params.beta * kl
    if entropy_bonus:
        if inp.entropy is None:
            raise ValueError("the entropy bonus is on but LossInputs.entropy is None")
        per_token = per_token - params.entropy_coef * inp.entropy
    loss = aggregate(per_token, mask, norm)

    with torch.no_grad():  # 0-d tensors: no host sync per micro-batch (learner/passes.py)
        low = (ratio < 1 - params.epsilon_low) & (adv < 0)
        high = (ratio > 1 + params.epsilon_high) & (adv > 0)
        sums = {
            "tokens": mask.sum(),
            "sequences": mask.new_full((), float(mask.shape[0])),  # a fill, not a host-to-device copy
            "pg_loss/tok_sum": (pg * tis_w * mask).sum(),
            "clip_frac/tok_sum": ((low | high).float() * mask).sum(),
            "clip_frac_low/tok_sum": (low.float() * mask).sum(),
            "clip_frac_high/tok_sum": (high.float() * mask).sum(),
            "ratio/tok_sum": (ratio * mask).sum(),
            "tis_weight/tok_sum": (tis_w * mask).sum(),
            "tis_clip_frac/tok_sum": (tis_capped.float() * mask).sum(),  # tokens whose weight hit tis_cap
            "kl/tok_sum": (kl * mask).sum() if kl is not None else mask.new_zeros(()),
        }
        if inp.entropy is not None:
            sums["entropy/tok_sum"] = (inp.entropy * mask).sum()
    return LossOutputs(loss=loss, sum_tensors=sums)
