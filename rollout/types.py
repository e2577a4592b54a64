"""Typed boundary of the rollout service: what the orchestrator sends and gets back (the
adapter it samples with is model/adapter.py's).

No torch, Ray or vLLM import here: these objects cross process boundaries (Ray object store,
Serve handles) and are shared by every engine.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class SamplingParams:
    """How one generate call samples. The sampling knobs have no defaults here: they come from
    the rollout section of the config (``from_rollout``) or the eval section, never from a
    second set of defaults."""

    n: int
    temperature: float
    top_p: float
    top_k: int
    max_tokens: int
    stop_token_ids: tuple[int, ...] = ()  # added to the model's own stop set, never replacing it
    seed: int | None = None
    # Stop strings (e.g. the end of a scaffold's block): generation ends once the decoded text
    # holds one; the tokens up to and including the one that completed it are returned, so the
    # text may run past the string (callers cut at it: search.scaffold.cut_at_stop).
    stop: tuple[str, ...] = ()

    @classmethod
    def from_rollout(cls, rollout_cfg: Any, **overrides: Any) -> "SamplingParams":
        """The rollout section's temperature, top_p, top_k and max_tokens (a RolloutConfig), n=1,
        then ``overrides``."""
        fields = dict(n=1, temperature=rollout_cfg.temperature, top_p=rollout_cfg.top_p, top_k=rollout_cfg.top_k,
                      max_tokens=rollout_cfg.max_tokens)
        return cls(**{**fields, **overrides})


@dataclass(frozen=True)
class Prompt:
    """One chat prompt; ``assistant_prefix`` is a forced start of the assistant turn."""

    messages: tuple[dict[str, str], ...]
    assistant_prefix: str = ""


@dataclass
class Sample:
    """One sampled completion. ``logprobs[i]`` is the log-prob of ``token_ids[i]`` under the
    sampling distribution (after temperature)."""

    prompt_index: int
    sample_index: int
    text: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" | "length"
    adapter_version: int  # 0 = base model, no adapter
