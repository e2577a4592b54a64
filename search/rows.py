"""A round's nodes as the run directory's tree rows (records/rows.py ``tree_row``: the node-row
fields of DESIGN.md plus the tree fields of mle-tree-spec.md); the driver
(services/tree_round.py) writes them. ``advantage`` is filled once the learner's estimator ran."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from records.rows import tree_row
from search.tree import Node


def round_rows(nodes: Sequence[Node], exp_id: str,
               advantages: Sequence[float] | None = None) -> list[dict[str, Any]]:
    """One tree row per node, in order; ``advantages`` (one per node) when the step has them."""
    if advantages is not None and len(advantages) != len(nodes):
        raise ValueError(f"{len(advantages)} advantages for {len(nodes)} nodes")
    return [tree_row(id=n.id, step=n.step, round=n.round, exp_id=exp_id, parent_id=n.parent_id,
                     sibling_group=n.sibling_group, mode=n.mode, expansion=n.expansion,
                     debug_depth=n.debug_depth, prompt_messages=n.prompt_messages,
                     assistant_prefix=n.assistant_prefix, prompt_token_ids=n.prompt_token_ids,
                     raw_completion=n.raw_completion, response_token_ids=n.response_token_ids,
                     response_logprobs=n.response_logprobs, adapter_version=n.adapter_version,
                     finish_reason=n.finish_reason, result=n.result,
                     advantage=None if advantages is None else advantages[i], n_children=n.n_children)
            for i, n in enumerate(nodes)]
