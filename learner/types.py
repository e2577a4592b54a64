"""Typed boundary of the learner: what the orchestrator sends each step and gets back.

Plain dataclasses of lists (no torch): they cross the Ray object store to every worker.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from model.adapter import AdapterPayload, AdapterRef


@dataclass
class TrainBatch:
    """The GLOBAL batch of one step (every completion of every group); workers shard it by rank.

    ``rollout_logprobs[i][t]`` is the sampling engine's log-prob of ``response_ids[i][t]`` (after
    temperature). ``response_mask`` (optional, same shape as response_ids) drops tokens from the
    loss, e.g. forced tokens that were not sampled; None = every response token counts.
    """

    prompt_ids: list[list[int]]
    response_ids: list[list[int]]
    rollout_logprobs: list[list[float]]
    advantages: list[float]
    rewards: list[float] = field(default_factory=list)
    group_ids: list[int] = field(default_factory=list)
    response_mask: list[list[int]] | None = None

    def __post_init__(self) -> None:
        n = len(self.prompt_ids)
        if n == 0:
            raise ValueError("TrainBatch is empty")
        for name in ("response_ids", "rollout_logprobs", "advantages"):
            if len(getattr(self, name)) != n:
                raise ValueError(f"TrainBatch.{name} has {len(getattr(self, name))} rows, prompt_ids has {n}")
        for name in ("rewards", "group_ids"):
            if getattr(self, name) and len(getattr(self, name)) != n:
                raise ValueError(f"TrainBatch.{name} has {len(getattr(self, name))} rows, prompt_ids has {n}")
        for i, (p, r, lp) in enumerate(zip(self.prompt_ids, self.response_ids, self.rollout_logprobs)):
            if not p:
                raise ValueError(f"TrainBatch row {i}: empty prompt (nothing to condition the first token on)")
            if len(lp) != len(r):
                raise ValueError(f"TrainBatch row {i}: {len(r)} response tokens but {len(lp)} rollout log-probs")
        if self.response_mask is not None:
            if len(self.response_mask) != n or any(
                len(m) != len(r) for m, r in zip(self.response_mask, self.response_ids)
            ):
                raise ValueError("TrainBatch.response_mask must have the shape of response_ids")

    def __len__(self) -> int:
        return len(self.prompt_ids)

    def rows(self, start: int, stop: int) -> "TrainBatch":
        """Rows [start, stop) as a new batch (a worker's shard)."""
        sl = slice(start, stop)
        return TrainBatch(
            prompt_ids=self.prompt_ids[sl],
            response_ids=self.response_ids[sl],
            rollout_logprobs=self.rollout_logprobs[sl],
            advantages=self.advantages[sl],
            rewards=self.rewards[sl] if self.rewards else [],
            group_ids=self.group_ids[sl] if self.group_ids else [],
            response_mask=self.response_mask[sl] if self.response_mask is not None else None,
        )

    def num_response_tokens(self) -> int:
        if self.response_mask is not None:
            return sum(sum(1 for x in m if x) for m in self.response_mask)
        return sum(len(r) for r in self.response_ids)

    def num_total_tokens(self) -> int:
        return sum(len(p) + len(r) for p, r in zip(self.prompt_ids, self.response_ids))


def shard_bounds(n: int, world_size: int, rank: int) -> tuple[int, int]:
    """Contiguous, near-equal shard of n rows for ``rank`` (sizes differ by at most one)."""
    if n < world_size:
        raise ValueError(f"a batch of {n} sequences cannot feed {world_size} workers")
    base, extra = divmod(n, world_size)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)


@dataclass
class InitInfo:
    """What ``LearnerJob.start`` returns.

    ``init_payload`` is the adapter to sample the next step with; its version is
    ``model.adapter.adapter_version(step)`` (1 on a fresh run, the checkpoint's step + 1 on a
    resume). On a fresh run without ``init_adapter`` LoRA B is 0, so it is numerically the base
    model (``init_is_identity``: sampling BASE_MODEL_VERSION instead is exact); with an
    ``init_adapter`` or a resume it is a real adapter.
    """

    adapter_sha256: str
    init_payload: AdapterPayload | AdapterRef  # a ref from the Ray workers (learner/worker.py)
    step: int
    lr_rebase_note: str | None = None
    data_position: dict[str, Any] | None = None
    init_is_identity: bool = True
    base_weights: dict[str, Any] | None = None  # PolicyLearner.base_weights: "shared" or "own", and why
    adapter_transport: dict[str, str] | None = None  # how adapters reach the replica: "device" or "host", and why
    learner_layers: dict[str, Any] | None = None  # PolicyLearner.layers: compiled or eager, fused LoRA, and why


@dataclass
class StepResult:
    metrics: dict[str, float]
    phases_s: dict[str, float]  # old_log_prob, ref, update_actor (seconds)
    adapter: AdapterPayload | AdapterRef  # version = adapter_version(steps trained) = the next step to sample
