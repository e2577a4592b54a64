"""The search section of a run (tree-search GRPO, issue 14): how a round's tree grows. Pydantic
only (the config layer imports nothing of ours); search/ reads it, RunConfig composes it."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class SearchConfig(BaseModel):
    """One round = one training step: `nodes_per_round` nodes grown in `expansions_per_round`
    expansions; an expansion picks ONE (mode, parent) and samples nodes_per_round /
    expansions_per_round siblings from the same prompt, which form one GRPO group. The mode and
    parent follow AIDE's search policy (defaults = AIDE's)."""

    model_config = ConfigDict(extra="forbid")

    nodes_per_round: int = Field(
        32, ge=1, description="N: nodes generated, executed and graded per round (= per step)."
    )
    expansions_per_round: int = Field(
        4, ge=1, description="E: expansions per round; each samples N/E siblings from one "
        "(mode, parent) prompt, one GRPO group. N must be a multiple of E."
    )
    num_drafts: int = Field(
        5, ge=0, description="Draft (fresh script, no parent) while the tree holds fewer draft "
        "nodes than this (AIDE: 5). Counted in nodes, so one expansion of N/E >= 5 drafts "
        "satisfies it."
    )
    debug_prob: float = Field(
        0.5, ge=0.0, le=1.0, description="After the initial drafts, probability that an "
        "expansion debugs a buggy node (when one qualifies) instead of improving the best one."
    )
    max_debug_depth: int = Field(
        3, ge=0, description="A buggy node may be debugged while its debug depth (consecutive "
        "debug steps leading to it) is <= this (AIDE: 3)."
    )
    debug_leaves_only: bool = Field(
        True, description="Debug only buggy nodes without children (AIDE); False also allows a "
        "buggy node that was debugged before."
    )
    select_on: Literal["val", "test"] = Field(
        "val", description="Metric that chooses the improve parent and the round's best node: "
        "`val` keeps the reported test metric out of the search; `test` is the reference's "
        "original (leaky) behaviour. A valid node without the chosen metric is an error."
    )
    carry_tree: bool = Field(
        False, description="False: every round grows a fresh tree (round-best measures the "
        "policy). True: a round continues the previous round's tree (AIDE's one long search)."
    )
    debug_tail_chars: int = Field(
        2000, ge=0, description="Last characters of a failed parent's output (term_tail) shown "
        "in a debug prompt."
    )
    max_parent_code_chars: int = Field(
        20000, ge=100, description="Longest parent script quoted in an improve/debug prompt; a "
        "longer one is cut in the middle with a marker."
    )
    scaffold: bool = Field(
        False, description="Write only the block of the task's template script (task.json "
        "`scaffold`: head, tail, hint, stop; search/scaffold.py): the assistant turn is forced to "
        "open with the head, generation stops at the block's end, and head + block + tail runs. "
        "For small policies (the embedded default); a task without a scaffold is then an error. "
        "False: the policy writes the whole script."
    )
    seed: int = Field(
        0, ge=0, description="Seed of the policy's random choices; each expansion draws from "
        "Random(f'{run seed}:{seed}:{step}:{expansion index in the tree}'): every round (step) "
        "draws new coins, also when each round grows a fresh tree, and a resumed run chooses the "
        "same way."
    )

    @model_validator(mode="after")
    def _divisible(self) -> "SearchConfig":
        if self.nodes_per_round % self.expansions_per_round:
            raise ValueError(
                f"search.nodes_per_round ({self.nodes_per_round}) must be a multiple of "
                f"search.expansions_per_round ({self.expansions_per_round})"
            )
        return self

    @property
    def siblings(self) -> int:
        """Nodes per expansion (the GRPO group size)."""
        return self.nodes_per_round // self.expansions_per_round
