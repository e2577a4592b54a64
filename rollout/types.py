"""Typed boundary of the rollout service: what the orchestrator sends and gets back.

No torch, Ray or vLLM import here: these objects cross process boundaries (Ray object store,
Serve handles) and are shared by every engine.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# Adapter versions, one numbering end to end (DESIGN.md): 0 is the bare base model (no adapter);
# the adapter after k optimizer steps is version k + 1, stamped by the learner where it is made,
# so step s samples with version s and the init adapter is version 1.
BASE_MODEL_VERSION = 0


def adapter_version(updates: int) -> int:
    """The version of the adapter that ``updates`` optimizer steps produced."""
    return updates + 1


FIRST_ADAPTER_VERSION = adapter_version(0)  # also what a lone adapter dir is served as (eval, probe)


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


@dataclass(frozen=True)
class AdapterPayload:
    """A published LoRA adapter: a safetensors state dict (peft naming) and its adapter_config.
    Small (MBs), so it travels through the Ray object store; never through a shared disk."""

    version: int
    safetensors: bytes
    config: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class AdapterRef:
    """An AdapterPayload left in Ray's object store by the process that made it (the learner's
    rank 0), as the driver sees it: the version, and the ref boxed in a list so that Ray hands
    the ref on rather than the value. The driver publishes the ref to the adapter registry and
    the replicas fetch it once, so a 4B r=32 adapter (126 MiB in bf16) no longer crosses the
    coordinator, the driver and a second put on its way (bench/results/gpu-vs-trl.md).
    ``fetch()`` (and ``safetensors``/``config``) get the payload itself, for whoever needs it."""

    version: int
    box: list

    def fetch(self) -> AdapterPayload:
        import ray

        return ray.get(self.box[0])

    @property
    def safetensors(self) -> bytes:
        return self.fetch().safetensors

    @property
    def config(self) -> dict[str, Any]:
        return self.fetch().config
