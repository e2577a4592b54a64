"""Per-token KL estimators of KL(policy || reference) from sampled-token log-probs.

Tokens are sampled from the policy, so with d = ref_logp - logp (per token):
- ``k1``          -d                    unbiased, high variance, can be negative
- ``k2``          d^2 / 2               biased, low variance
- ``k3``          exp(d) - d - 1        unbiased, always >= 0 (Schulman's k3; TRL's GRPO KL)
- ``low_var_kl``  k3 with d clamped to [-20, 20] and the result to [-10, 10] (verl's, keeps
                  a single runaway token from dominating the loss)
Reference: http://joschu.net/blog/kl-approx.html; verl core_algos.kl_penalty.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

KLEstimator = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def kl_k1(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    return logp - ref_logp


def kl_k2(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    return 0.5 * (logp - ref_logp) ** 2


def kl_k3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    d = ref_logp - logp
    return torch.exp(d) - d - 1


def kl_low_var(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    d = torch.clamp(ref_logp - logp, min=-20, max=20)
    return torch.clamp(torch.exp(d) - d - 1, min=-10, max=10)


KL_ESTIMATORS: dict[str, KLEstimator] = {
    "k1": kl_k1,
    "k2": kl_k2,
    "k3": kl_k3,
    "low_var_kl": kl_low_var,
}


def kl_estimate(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token KL [B, T] (same shape as the inputs)."""
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"unknown kl estimator {estimator!r}; one of {sorted(KL_ESTIMATORS)}")
    return KL_ESTIMATORS[estimator](logp, ref_logp)
