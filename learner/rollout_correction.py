"""Rollout correction: does the sampling engine describe the trainer's distribution? (ppl_ratio,
rollout_kl, rollout_k3_kl), and the sum-then-finalize reduction of per-token metrics.

For sequence i with response mask m, rollout log-probs r (the engine that sampled) and trainer
log-probs o (recomputed before the update), DESIGN.md fixes:

    d_i            = mean_t(r) - mean_t(o)
    ppl_ratio      = mean_i exp(d_i)          training ppl / rollout ppl (verl's definition)
    rollout_kl     = token-mean(r - o)
    rollout_k3_kl  = token-mean(exp(o - r) - (o - r) - 1)

1.0 / 0 / 0 mean both sides describe the same distribution; a drift is a bug (different dtype,
temperature, template) or a stale adapter. This module is the one implementation: the learner
calls it on tensors every step, ``parity_stats`` on plain lists (the `rollout logprobs` CLI, tests).

Metrics cross workers as SUMS so that an all-reduce(sum) then ``finalize`` gives the value of
the whole step batch whatever the sharding: keys ``<name>/tok_sum`` are divided by ``tokens``,
``<name>/seq_sum`` by ``sequences``; other keys are counts and pass through.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass

import torch


def rollout_mismatch_sum_tensors(
    rollout_logprobs: torch.Tensor, trainer_logprobs: torch.Tensor, mask: torch.Tensor
) -> dict[str, torch.Tensor]:
    """The sums of ``rollout_mismatch_sums`` as 0-d tensors on the inputs' device, so a learner
    adds them over micro-batches without a host sync per micro-batch (``as_floats`` once)."""
    dtype = torch.promote_types(rollout_logprobs.dtype, torch.float32)  # float64 lists stay float64
    r, o, m = (t.to(dtype) for t in (rollout_logprobs, trainer_logprobs, mask))
    n_tok = m.sum(-1)  # [B]
    has = n_tok > 0
    d = ((r - o) * m).sum(-1) / n_tok.clamp(min=1)
    delta = (o - r) * m
    k3 = (torch.exp(o - r) - (o - r) - 1) * m
    return {
        "ppl_ratio/seq_sum": (torch.exp(d) * has).sum(),
        "rollout_kl/tok_sum": ((r - o) * m).sum(),
        "rollout_k3_kl/tok_sum": k3.sum(),
        "rollout_abs_diff/tok_sum": delta.abs().sum(),
        "tokens": m.sum(),
        "sequences": has.sum().to(dtype),
    }


def rollout_mismatch_sums(
    rollout_logprobs: torch.Tensor, trainer_logprobs: torch.Tensor, mask: torch.Tensor
) -> dict[str, float]:
    """Sums over a micro-batch: r, o, mask are [B, T]. Sequences with no response token are
    skipped (they have no mean)."""
    return as_floats(rollout_mismatch_sum_tensors(rollout_logprobs, trainer_logprobs, mask))


def as_floats(sums: dict) -> dict[str, float]:
    """A sum-dict of 0-d tensors (and floats) as floats, with ONE device-to-host transfer for
    the tensors: each ``float(t)`` of a CUDA tensor is a host sync of its own."""
    keys = [k for k, v in sums.items() if isinstance(v, torch.Tensor)]
    out = {k: float(v) for k, v in sums.items() if not isinstance(v, torch.Tensor)}
    if keys:
        values = torch.stack([sums[k].detach().to(torch.float64).reshape(()) for k in keys]).tolist()
        out.update(zip(keys, values))
    return out


def finalize(sums: dict[str, float]) -> dict[str, float]:
    """Turn reduced sums into means (see the module docstring)."""
    out: dict[str, float] = {}
    tokens = max(sums.get("tokens", 0.0), 1.0)
    sequences = max(sums.get("sequences", 0.0), 1.0)
    for key, value in sums.items():
        if key.endswith("/tok_sum"):
            out[key[: -len("/tok_sum")]] = value / tokens
        elif key.endswith("/seq_sum"):
            out[key[: -len("/seq_sum")]] = value / sequences
        else:
            out[key] = value
    return out


def rollout_mismatch(
    rollout_logprobs: torch.Tensor, trainer_logprobs: torch.Tensor, mask: torch.Tensor
) -> dict[str, float]:
    """ppl_ratio, rollout_kl, rollout_k3_kl (and rollout_abs_diff) of one batch [B, T]."""
    return finalize(rollout_mismatch_sums(rollout_logprobs, trainer_logprobs, mask))


def merge_sums(*parts: dict) -> dict:
    """Add sum-dicts key by key (micro-batches of one worker); floats or 0-d tensors."""
    out: dict = {}
    for part in parts:
        for key, value in part.items():
            out[key] = out.get(key, 0.0) + value
    return out


@dataclass(frozen=True)
class ParityStats:
    ppl_ratio: float
    rollout_kl: float
    rollout_k3_kl: float
    max_abs_diff: float
    sequences: int
    tokens: int

    def as_dict(self) -> dict:
        return asdict(self)


def _padded(rows: Sequence[Sequence[float]], width: int) -> torch.Tensor:
    out = torch.zeros((len(rows), width), dtype=torch.float64)
    for i, row in enumerate(rows):
        out[i, : len(row)] = torch.tensor(list(row), dtype=torch.float64)
    return out


def parity_stats(rollout: Sequence[Sequence[float]], trainer: Sequence[Sequence[float]]) -> ParityStats:
    """The same statistics on plain per-sequence lists (rollout engine vs trainer recompute).
    Sequences with no tokens are skipped; lengths must match pairwise."""
    if len(rollout) != len(trainer):
        raise ValueError(f"{len(rollout)} rollout sequences vs {len(trainer)} trainer sequences")
    for i, (r, o) in enumerate(zip(rollout, trainer)):
        if len(r) != len(o):
            raise ValueError(f"sequence {i}: {len(r)} rollout log-probs vs {len(o)} trainer log-probs")
    width = max((len(r) for r in rollout), default=0)
    if width == 0:
        raise ValueError("no response tokens to compare")
    mask = _padded([[1.0] * len(r) for r in rollout], width)
    r, o = _padded(rollout, width), _padded(trainer, width)
    stats = rollout_mismatch(r, o, mask)
    return ParityStats(
        ppl_ratio=stats["ppl_ratio"], rollout_kl=stats["rollout_kl"], rollout_k3_kl=stats["rollout_k3_kl"],
        max_abs_diff=float(((o - r).abs() * mask).max()), sequences=int(stats["sequences"]), tokens=int(stats["tokens"]),
    )


def ppl_ratio(rollout: Sequence[Sequence[float]], trainer: Sequence[Sequence[float]]) -> float:
    return parity_stats(rollout, trainer).ppl_ratio
