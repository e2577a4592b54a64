"""Typed boundary of the rollout service: what the orchestrator sends and gets back.

No torch, Ray or vLLM import here: these objects cross process boundaries (Ray object store,
Serve handles) and are shared by every engine.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int = 128
    stop_token_ids: tuple[int, ...] = ()  # added to the model's own stop set, never replacing it
    seed: int | None = None


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
