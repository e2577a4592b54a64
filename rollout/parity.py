"""Do the rollout engine and the learner describe the same distribution?

For each sequence i with rollout log-probs r_i (from the engine that sampled, after
temperature) and trainer log-probs o_i (teacher-forced recompute, same temperature):

    d_i           = mean_t(r_i) - mean_t(o_i)
    ppl_ratio     = mean_i exp(d_i)                      (training ppl / rollout ppl; verl)
    rollout_kl    = token-mean(r - o)                    (k1 estimate of KL(rollout || trainer))
    rollout_k3_kl = token-mean(exp(o - r) - (o - r) - 1) (k3, non-negative per token)

1.0 / 0 / 0 means both sides agree; a drift is a bug (different dtype, temperature, template)
or a stale adapter. Token means pool all tokens of all sequences. Sequences with no tokens are
skipped. Pure Python on lists: used by the CLI, tests and anyone holding plain rows.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass


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


def parity_stats(
    rollout: Sequence[Sequence[float]], trainer: Sequence[Sequence[float]]
) -> ParityStats:
    if len(rollout) != len(trainer):
        raise ValueError(f"{len(rollout)} rollout sequences vs {len(trainer)} trainer sequences")
    ratios: list[float] = []
    k1 = k3 = max_abs = 0.0
    tokens = 0
    for i, (r, o) in enumerate(zip(rollout, trainer)):
        if len(r) != len(o):
            raise ValueError(f"sequence {i}: {len(r)} rollout log-probs vs {len(o)} trainer log-probs")
        if not r:
            continue
        ratios.append(math.exp(sum(r) / len(r) - sum(o) / len(o)))
        for rt, ot in zip(r, o):
            delta = ot - rt
            k1 += rt - ot
            k3 += math.exp(delta) - delta - 1.0
            max_abs = max(max_abs, abs(delta))
        tokens += len(r)
    if not tokens:
        raise ValueError("no response tokens to compare")
    return ParityStats(
        ppl_ratio=sum(ratios) / len(ratios),
        rollout_kl=k1 / tokens,
        rollout_k3_kl=k3 / tokens,
        max_abs_diff=max_abs,
        sequences=len(ratios),
        tokens=tokens,
    )


def ppl_ratio(rollout: Sequence[Sequence[float]], trainer: Sequence[Sequence[float]]) -> float:
    return parity_stats(rollout, trainer).ppl_ratio
