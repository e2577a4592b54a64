"""The node rows of a round (DESIGN.md "Run directory": one row per completion or tree node), as
``round_<step>/<task>__<epoch>.jsonl`` holds them.

Flat GRPO rows (mode sample) carry exactly NODE_FIELDS; tree rows (modes draft|improve|debug,
mle-tree-spec.md) carry NODE_FIELDS and then TREE_FIELDS. ``node_row`` builds either, checked;
``tree_row`` builds a tree row from what the search knows about a node and the script's
ExecResult, which fills the execution fields (status, reward, metrics, code, output tail, ...).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Literal

from records.exec_result import ExecResult
from records.jsonl import RecordError

NODE_FIELDS = (
    "id", "step", "round", "exp_id", "parent_id", "sibling_group", "mode", "prompt_messages",
    "assistant_prefix", "prompt_token_ids", "raw_completion", "response_token_ids",
    "response_logprobs", "adapter_version", "status", "is_buggy", "verdict", "failing_rules",
    "test_metric", "reward", "advantage", "exec_time", "n_children",
)
TREE_FIELDS = (
    "expansion", "debug_depth", "val_metric", "oriented", "code", "plan", "thinking",
    "finish_reason", "term_tail", "exc_type", "grade_error", "limits", "isolation", "queue_wait",
)
TREE_NODE_FIELDS = (*NODE_FIELDS, *TREE_FIELDS)

NodeMode = Literal["sample", "draft", "improve", "debug"]
NODE_MODES = ("sample", "draft", "improve", "debug")
TREE_MODES = ("draft", "improve", "debug")


def node_id(*, step: int, round: int, group: int, index: int) -> str:
    """Stable node id ``s<step>-r<round>-g<group>-<index>`` (flat rows are round 0). Keyword-only:
    four ints in a row are too easy to pass in the wrong order."""
    return f"s{step}-r{round}-g{group}-{index}"


def node_row(
    *,
    id: str,
    step: int,
    exp_id: str,
    sibling_group: int,
    prompt_messages: Sequence[Mapping[str, str]],
    assistant_prefix: str,
    prompt_token_ids: Sequence[int],
    raw_completion: str,
    response_token_ids: Sequence[int],
    response_logprobs: Sequence[float],
    adapter_version: int,
    status: str,
    verdict: str | None,
    failing_rules: Sequence[str],
    reward: float | None,
    advantage: float | None,
    is_buggy: bool | None = None,
    round: int = 0,
    parent_id: str | None = None,
    mode: NodeMode = "sample",
    test_metric: float | None = None,
    exec_time: float | None = None,
    n_children: int = 0,
    tree: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """One archived completion/node with exactly the DESIGN.md node-row fields.

    What the model saw and wrote: ``prompt_token_ids`` are the tokens the engine was conditioned
    on (``prompt_messages`` through the chat template with the generation prompt, then the forced
    ``assistant_prefix``; rollout.engines.base.tokenize_prompt), ``response_token_ids`` the
    sampled tokens after them with their rollout log-probs, and ``raw_completion`` the decoded
    sampled text only. The grader scored ``assistant_prefix + raw_completion``.

    Flat GRPO: mode "sample", round 0, parent_id None, sibling_group = the prompt's group index
    in the step, n_children 0. ``status`` says what happened to the completion ("ok",
    "truncated", "grader_error", ...); ``is_buggy`` is True when the completion failed to be
    scored at all (None = unknown), ``exec_time`` the grader's seconds for it. A tree row (mode
    draft|improve|debug) gives its TREE_FIELDS as ``tree``.
    """
    if mode not in NODE_MODES:
        raise RecordError(f"node mode must be {'|'.join(NODE_MODES)}, got {mode!r}")
    if (mode in TREE_MODES) != (tree is not None) or tree is not None and set(tree) != set(TREE_FIELDS):
        raise RecordError(f"node {id}: a {mode} row needs exactly the tree fields {list(TREE_FIELDS)} "
                          f"(tree rows only), got {sorted(tree or {})}")
    if not prompt_token_ids:
        raise RecordError(f"node {id}: no prompt_token_ids (what the model was conditioned on)")
    if len(response_logprobs) != len(response_token_ids):
        raise RecordError(
            f"node {id}: {len(response_token_ids)} response tokens but "
            f"{len(response_logprobs)} log-probs"
        )
    return {
        "id": id,
        "step": step,
        "round": round,
        "exp_id": exp_id,
        "parent_id": parent_id,
        "sibling_group": sibling_group,
        "mode": mode,
        "prompt_messages": [dict(m) for m in prompt_messages],
        "assistant_prefix": assistant_prefix,
        "prompt_token_ids": [int(t) for t in prompt_token_ids],
        "raw_completion": raw_completion,
        "response_token_ids": [int(t) for t in response_token_ids],
        "response_logprobs": [float(x) for x in response_logprobs],
        "adapter_version": adapter_version,
        "status": status,
        "is_buggy": is_buggy,
        "verdict": verdict,
        "failing_rules": list(failing_rules),
        "test_metric": test_metric,
        "reward": None if reward is None else float(reward),
        "advantage": None if advantage is None else float(advantage),
        "exec_time": exec_time,
        "n_children": n_children,
        **{k: (tree or {})[k] for k in (TREE_FIELDS if tree is not None else ())},
    }


_THINK = re.compile(r"<think>(.*?)(?:</think>|\Z)", re.S)
_FENCED = re.compile(r"```.*?(?:```|\Z)", re.S)


def split_completion(text: str) -> tuple[str, str]:
    """(plan, thinking): the prose around the code blocks, and what was inside <think> tags."""
    thinking = "\n".join(m.strip() for m in _THINK.findall(text))
    plan = _FENCED.sub("", _THINK.sub("", text)).strip()
    return plan, thinking


def tree_row(*, result: ExecResult, expansion: int, debug_depth: int, finish_reason: str,
             **node: Any) -> dict[str, Any]:
    """The row of one tree node: what the search knows of it (``node``: node_row's id, step,
    round, exp_id, parent_id, sibling_group, mode, the prompt and sampled tokens, advantage,
    n_children) plus its script's ExecResult, which fills the rest. ``verdict`` is the status (so
    the round's pass_rate counts ``ok`` with pass_verdicts=("ok",)), ``failing_rules`` is empty
    (code execution has no rules), ``is_buggy`` is AIDE's (status != ok), ``grade_error`` is the
    result's message; ``plan`` and ``thinking`` come from the completion (split_completion)."""
    plan, thinking = split_completion(node["raw_completion"])
    return node_row(
        **node, status=result.status, is_buggy=not result.ok, verdict=result.status, failing_rules=(),
        test_metric=result.test_metric, reward=result.reward, exec_time=result.exec_time,
        tree={"expansion": expansion, "debug_depth": debug_depth, "val_metric": result.val_metric,
              "oriented": result.oriented, "code": result.code, "plan": plan, "thinking": thinking,
              "finish_reason": finish_reason, "term_tail": result.term_tail, "exc_type": result.exc_type,
              "grade_error": result.message, "limits": dict(result.limits), "isolation": result.isolation,
              "queue_wait": result.queue_wait},
    )


def check_node_rows(rows: Iterable[Mapping[str, Any]]) -> None:
    """Flat rows (mode sample) hold exactly NODE_FIELDS; tree rows exactly TREE_NODE_FIELDS."""
    for i, row in enumerate(rows):
        keys = set(row)
        expected = set(TREE_NODE_FIELDS if row.get("mode") in TREE_MODES else NODE_FIELDS)
        if keys != expected:
            missing, extra = sorted(expected - keys), sorted(keys - expected)
            raise RecordError(f"node row {i}: missing fields {missing}, unexpected fields {extra}")
