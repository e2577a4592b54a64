"""The vowel-share task's section of the grader config (grader.task: vowel-share). Pydantic only."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class VowelShareConfig(BaseModel):
    """A synthetic task for speed benchmarks: long prompts, a dense reward every completion earns."""

    model_config = ConfigDict(extra="forbid")

    prompt_words: int = Field(
        180, ge=1, description="Words in each prompt's user message (about one token each with "
        "Qwen3's or SmolLM2's tokenizer: the GPU benches' ~200-token prompts)."
    )
    train_cases: int = Field(64, ge=1, description="Prompts in the train split.")
    heldout_cases: int = Field(16, ge=1, description="Prompts in the held-out split.")
    pass_share: float = Field(
        0.4, ge=0, le=1, description="A completion is admitted (the pass rate) when at least this "
        "share of its letters are vowels."
    )
