"""The seeded prompt sampler: which pool cases a step trains on.

The data order is a pure function of (pool, limit, prompts_per_step, seed, prompt_order, step):
no state is carried between steps, so a resumed run that knows its next step number continues
the data order exactly, and two fresh samplers agree on every batch.

Definition. The cases in use are the first ``limit`` of the pool (pool order). They are laid
end to end as an endless *stream* of epochs; epoch e (0-based) is one permutation of the cases:
pool order for ``prompt_order="fixed"``, a reshuffle seeded by (seed, e) for
``"shuffle_each_epoch"``. Step s (1-based) takes stream positions
[(s-1)*P, s*P) with P = prompts_per_step, so a batch may straddle an epoch boundary.

Straddling batches. When the batch holding the end of epoch e-1 also holds the start of epoch
e, the raw permutation of epoch e could repeat a case already in that batch. When the pool holds
at least P cases we avoid this: the head of epoch e (the part inside the straddling batch) is the
first cases of its raw permutation that are NOT in the batch's tail part, and the rest of the
epoch follows in raw order. Every epoch therefore remains a permutation (each case seen exactly
once per epoch) and every batch holds distinct cases. With fewer cases than P a batch necessarily
repeats cases; the stream is then used as is.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from config.run import TrainerConfig

_TRAINER = TrainerConfig()  # the schema's defaults: declared there, read here

PromptOrder = Literal["shuffle_each_epoch", "fixed"]


class SamplerError(ValueError):
    """A sampler asked for something the pool cannot give; the message names the numbers."""


def _epoch_rng(seed: int, epoch: int) -> random.Random:
    # A digest, not hash(): stable across processes and Python versions.
    digest = hashlib.sha256(f"counterpoint.sampler:{seed}:{epoch}".encode()).digest()
    return random.Random(int.from_bytes(digest[:8], "big"))


@dataclass
class PromptSampler:
    """Seeded batches of case ids. ``steps`` only feeds :meth:`plan` (the receipt)."""

    pool: Sequence[str]
    prompts_per_step: int
    seed: int
    prompt_order: PromptOrder = _TRAINER.prompt_order
    limit: int | None = None
    steps: int | None = None
    _epochs: list[list[str]] = field(default_factory=list, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.prompts_per_step < 1:
            raise SamplerError(f"prompts_per_step must be >= 1, got {self.prompts_per_step}")
        if self.prompt_order not in ("shuffle_each_epoch", "fixed"):
            raise SamplerError(
                f"prompt_order must be 'shuffle_each_epoch' or 'fixed', got {self.prompt_order!r}"
            )
        if not self.pool:
            raise SamplerError("the prompt pool is empty")
        if len(set(self.pool)) != len(self.pool):
            raise SamplerError("pool case ids must be unique")
        if self.limit is not None:
            if self.limit < 1:
                raise SamplerError(f"limit must be >= 1, got {self.limit}")
            if self.limit > len(self.pool):
                raise SamplerError(
                    f"limit {self.limit} asks for more cases than the pool holds "
                    f"({len(self.pool)}); lower trainer.limit or use a larger pool"
                )
        self.pool = tuple(self.pool)

    @property
    def cases(self) -> tuple[str, ...]:
        """The cases in use: the first ``limit`` of the pool."""
        return tuple(self.pool[: self.limit]) if self.limit is not None else tuple(self.pool)

    def _raw_order(self, epoch: int) -> list[str]:
        order = list(self.cases)
        if self.prompt_order == "shuffle_each_epoch":
            _epoch_rng(self.seed, epoch).shuffle(order)
        return order

    def _epoch_order(self, epoch: int) -> list[str]:
        # Built in sequence: epoch e's head depends on the tail of epoch e-1 (module docstring).
        n, per_step = len(self.cases), self.prompts_per_step
        while len(self._epochs) <= epoch:
            e = len(self._epochs)
            raw = self._raw_order(e)
            tail_len = (e * n) % per_step  # cases of epoch e-1 inside the straddling batch
            if e == 0 or tail_len == 0 or n < per_step:
                self._epochs.append(raw)
                continue
            tail = set(self._epochs[e - 1][n - tail_len :])
            head = [case for case in raw if case not in tail][: per_step - tail_len]
            head_set = set(head)
            self._epochs.append(head + [case for case in raw if case not in head_set])
        return self._epochs[epoch]

    def batch_for_step(self, step: int) -> list[str]:
        """The case ids step ``step`` (1-based) trains on, in order."""
        if step < 1:
            raise SamplerError(f"steps are 1-based, got step {step}")
        n = len(self.cases)
        start = (step - 1) * self.prompts_per_step
        return [
            self._epoch_order(pos // n)[pos % n]
            for pos in range(start, start + self.prompts_per_step)
        ]

    def position(self, step: int) -> dict[str, int]:
        """Where step ``step`` starts in the data order: 0-based epoch and index within it."""
        if step < 1:
            raise SamplerError(f"steps are 1-based, got step {step}")
        start = (step - 1) * self.prompts_per_step
        return {"epoch": start // len(self.cases), "index": start % len(self.cases)}

    def plan(self) -> dict[str, object]:
        """The sampling plan the receipt records."""
        n = len(self.cases)
        plan: dict[str, object] = {
            "pool_size": len(self.pool),
            "limit": self.limit,
            "cases_used": n,
            "prompts_per_step": self.prompts_per_step,
            "prompt_order": self.prompt_order,
            "seed": self.seed,
            "steps": self.steps,
        }
        if self.steps is not None:
            total = self.steps * self.prompts_per_step
            epochs = total / n
            full, rest = divmod(total, n)
            plan.update(
                prompts_total=total,
                epochs=round(epochs, 4),
                times_each_prompt_seen={"min": full, "max": full + (1 if rest else 0)},
                note=f"each prompt seen ~{epochs:.2f} times ({epochs:.2f} epochs over {n} cases)",
            )
        return plan


def sampler_from_config(pool: Sequence[str], trainer: TrainerConfig, seed: int) -> PromptSampler:
    """A sampler for the run's trainer section and top-level seed."""
    return PromptSampler(
        pool=pool,
        prompts_per_step=trainer.prompts_per_step,
        seed=seed,
        prompt_order=trainer.prompt_order,
        limit=trainer.limit,
        steps=trainer.steps,
    )
