"""Archive rows of tree nodes: the run directory's node-row fields (DESIGN.md, the ones
services.archive.NODE_FIELDS lists) plus the tree fields of mle-tree-spec.md.

The archive's `check_node_rows` accepts exactly CORE_FIELDS for flat rows (mode sample) and
CORE_FIELDS + TREE_FIELDS for tree rows (draft|improve|debug); the driver (services/tree_round.py)
writes these full rows.

For a tree node: `verdict` is its status (so the archive's pass_rate counts `ok` when called with
pass_verdicts=("ok",)), `failing_rules` is empty (code execution has no rules), `is_buggy` is
AIDE's (status != ok), `advantage` is filled once the learner's estimator ran.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from search.tree import Node

CORE_FIELDS = (
    "id", "step", "round", "exp_id", "parent_id", "sibling_group", "mode", "prompt_messages",
    "assistant_prefix", "prompt_token_ids", "raw_completion", "response_token_ids",
    "response_logprobs", "adapter_version", "status", "is_buggy", "verdict", "failing_rules",
    "test_metric", "reward", "advantage", "exec_time", "n_children",
)
TREE_FIELDS = (
    "expansion", "debug_depth", "val_metric", "oriented", "code", "plan", "thinking",
    "finish_reason", "term_tail", "exc_type", "grade_error", "limits", "isolation", "queue_wait",
)
ROW_FIELDS = CORE_FIELDS + TREE_FIELDS

_THINK = re.compile(r"<think>(.*?)(?:</think>|\Z)", re.S)
_FENCED = re.compile(r"```.*?(?:```|\Z)", re.S)


def split_completion(text: str) -> tuple[str, str]:
    """(plan, thinking): the prose around the code blocks, and what was inside <think> tags."""
    thinking = "\n".join(m.strip() for m in _THINK.findall(text))
    plan = _FENCED.sub("", _THINK.sub("", text)).strip()
    return plan, thinking


def node_row(node: Node, exp_id: str, advantage: float | None = None) -> dict[str, Any]:
    """The full archive row of a node (CORE_FIELDS + TREE_FIELDS, in that order)."""
    plan, thinking = split_completion(node.raw_completion)
    row = {
        "id": node.id, "step": node.step, "round": node.round, "exp_id": exp_id,
        "parent_id": node.parent_id, "sibling_group": node.sibling_group, "mode": node.mode,
        "prompt_messages": [dict(m) for m in node.prompt_messages],
        "assistant_prefix": node.assistant_prefix,
        "prompt_token_ids": list(node.prompt_token_ids), "raw_completion": node.raw_completion,
        "response_token_ids": list(node.response_token_ids),
        "response_logprobs": list(node.response_logprobs),
        "adapter_version": node.adapter_version, "status": node.status,
        "is_buggy": node.is_buggy, "verdict": node.status, "failing_rules": [],
        "test_metric": node.test_metric, "reward": node.reward,
        "advantage": None if advantage is None else float(advantage),
        "exec_time": node.exec_time, "n_children": node.n_children,
        "expansion": node.expansion, "debug_depth": node.debug_depth,
        "val_metric": node.val_metric, "oriented": node.oriented, "code": node.code,
        "plan": plan, "thinking": thinking, "finish_reason": node.finish_reason,
        "term_tail": node.term_tail, "exc_type": node.exc_type, "grade_error": node.message,
        "limits": dict(node.limits), "isolation": node.isolation, "queue_wait": node.queue_wait,
    }
    assert tuple(row) == ROW_FIELDS  # one list of fields, kept in step with the dict above
    return row


def round_rows(nodes: Sequence[Node], exp_id: str,
               advantages: Sequence[float] | None = None) -> list[dict[str, Any]]:
    if advantages is not None and len(advantages) != len(nodes):
        raise ValueError(f"{len(advantages)} advantages for {len(nodes)} nodes")
    return [node_row(n, exp_id, None if advantages is None else advantages[i])
            for i, n in enumerate(nodes)]
