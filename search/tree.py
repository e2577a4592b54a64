"""Search-tree nodes and the tree. Pure data; JSON round-trips exactly (resume mid tree run).

A node is what the search sampled (prompt, completion, tokens) plus its script's execution result
as the grader returned it (records.exec_result.ExecResult, `Node.result`), kept whole. Two metrics
per valid node, kept apart (mle-tree-spec.md "What went wrong"): `result.val_metric` on the
validation rows chooses (improve parents, the round's best node); `result.test_metric` on the
test rows is reported and never chooses, unless `select_on="test"` asks for the reference's leaky
behaviour.
"""

from __future__ import annotations

import copy
import json
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Literal

from config.search import SearchConfig
from records.exec_result import ExecResult

_SEARCH = SearchConfig()  # the schema's defaults: declared there, read here

Mode = Literal["draft", "improve", "debug"]
MODES: tuple[str, ...] = ("draft", "improve", "debug")
# tree.json's layout: 2 keeps each node's execution result as one object ("result"); 1 had its
# fields spread over the node, and is still read (a run resumed across the change).
TREE_FORMAT = 2


class TreeError(ValueError):
    """A node or tree that breaks the tree's invariants (one-line message naming what)."""


@dataclass
class Generation:
    """One sampled completion as `generate` returns it. The grader scores
    `assistant_prefix + text` (a forced opening is part of the script, not of the sample)."""

    text: str
    prompt_token_ids: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    adapter_version: int = 0
    finish_reason: str = "stop"
    assistant_prefix: str = ""

    @property
    def completion(self) -> str:
        return self.assistant_prefix + self.text


@dataclass
class Node:
    """One executed and graded script.

    `sibling_group` is the expansion's index within its round (the GRPO group id of the step);
    `expansion` the expansion's index within the whole tree; `index` the sibling's position.
    `debug_depth` counts consecutive debug steps ending here (0 for draft/improve nodes)."""

    id: str
    parent_id: str | None
    mode: str
    step: int
    round: int
    expansion: int
    sibling_group: int
    index: int
    prompt_messages: list[dict[str, str]]
    assistant_prefix: str
    raw_completion: str
    prompt_token_ids: list[int]
    response_token_ids: list[int]
    response_logprobs: list[float]
    adapter_version: int
    finish_reason: str
    result: ExecResult  # what running its script gave (status, reward, metrics, code, output)
    debug_depth: int = 0
    n_children: int = 0

    @property
    def is_buggy(self) -> bool:
        """AIDE's notion: the node did not produce a gradable submission."""
        return not self.result.ok

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Node":
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise TreeError(f"node {d.get('id')!r}: unknown fields {unknown}")
        return cls(**{**d, "result": ExecResult.from_details(d["result"])})


def _node_of_format_1(d: dict[str, Any], task_id: str) -> dict[str, Any]:
    """A format-1 node (execution fields spread over the node) as a format-2 one."""
    spread = [f.name for f in fields(ExecResult) if f.name != "task_id"]
    node = {k: v for k, v in d.items() if k not in spread}
    node["result"] = {"task_id": task_id, "queue_wait": 0.0, **{k: d[k] for k in spread if k in d}}
    return node


def oriented_value(value: float | None, direction: str) -> float | None:
    """Higher is better across tasks: the metric itself, or its negation for `lower`."""
    if value is None:
        return None
    if direction not in ("higher", "lower"):
        raise TreeError(f"metric direction must be higher|lower, got {direction!r}")
    return float(value) if direction == "higher" else -float(value)


@dataclass
class Tree:
    """The search tree of one task. Nodes are kept in creation order; `rounds` and `expansions`
    count what was grown so ids and the policy's seeds continue across rounds and resumes."""

    task_id: str
    metric: str
    direction: str
    nodes: dict[str, Node] = field(default_factory=dict)
    rounds: int = 0
    expansions: int = 0

    # ------------------------------------------------------------------ building
    def add(self, node: Node) -> Node:
        if node.id in self.nodes:
            raise TreeError(f"node id {node.id!r} is already in the tree")
        if node.mode not in MODES:
            raise TreeError(f"node {node.id}: mode must be one of {MODES}, got {node.mode!r}")
        if node.mode == "draft":
            if node.parent_id is not None:
                raise TreeError(f"node {node.id}: a draft has no parent, got {node.parent_id!r}")
        else:
            parent = self.nodes.get(node.parent_id) if node.parent_id else None
            if parent is None:
                raise TreeError(f"node {node.id}: {node.mode} needs a parent in the tree, "
                                f"got {node.parent_id!r}")
            if node.mode == "improve" and parent.is_buggy:
                raise TreeError(f"node {node.id}: improve of buggy parent {parent.id}")
            if node.mode == "debug" and not parent.is_buggy:
                raise TreeError(f"node {node.id}: debug of valid parent {parent.id}")
            parent.n_children += 1
        self.nodes[node.id] = node
        return node

    def copy(self) -> "Tree":
        return copy.deepcopy(self)

    # ------------------------------------------------------------------ queries
    def get(self, node_id: str) -> Node:
        try:
            return self.nodes[node_id]
        except KeyError:
            raise TreeError(f"no node {node_id!r} in the tree of {self.task_id}") from None

    def children(self, node_id: str) -> list[Node]:
        return [n for n in self.nodes.values() if n.parent_id == node_id]

    def leaves(self) -> list[Node]:
        return [n for n in self.nodes.values() if n.n_children == 0]

    def draft_nodes(self) -> list[Node]:
        return [n for n in self.nodes.values() if n.mode == "draft"]

    def buggy_nodes(self) -> list[Node]:
        return [n for n in self.nodes.values() if n.is_buggy]

    def debuggable(self, max_debug_depth: int, leaves_only: bool = True) -> list[Node]:
        """Buggy nodes (leaves unless told otherwise) whose debug depth <= max_debug_depth."""
        return [n for n in self.buggy_nodes()
                if n.debug_depth <= max_debug_depth and (n.n_children == 0 or not leaves_only)]

    def selection_value(self, node: Node, select_on: str = _SEARCH.select_on) -> float:
        """Oriented (higher is better) value of a valid node on the selection metric."""
        if node.is_buggy:
            raise TreeError(f"node {node.id} is {node.result.status}: it has no metric to select on")
        raw = node.result.val_metric if select_on == "val" else node.result.test_metric
        if raw is None:
            raise TreeError(f"node {node.id} of task {self.task_id} has no {select_on}_metric to "
                            f"select on (a task without a validation split needs search.select_on=test)")
        return oriented_value(raw, self.direction)

    def best_valid(self, select_on: str = _SEARCH.select_on, among: list[Node] | None = None) -> Node | None:
        """The valid node with the best selection metric (the earliest on ties); None if none is
        valid. `among` restricts the candidates (e.g. one round's nodes)."""
        pool = [n for n in (self.nodes.values() if among is None else among) if not n.is_buggy]
        best, best_value = None, None
        for n in pool:
            value = self.selection_value(n, select_on)  # every candidate: a missing metric raises
            if best is None or value > best_value:
                best, best_value = n, value
        return best

    def depth(self, node_id: str) -> int:
        """Edges from the root draft to this node."""
        d, n = 0, self.get(node_id)
        while n.parent_id is not None:
            d, n = d + 1, self.get(n.parent_id)
        return d

    # ------------------------------------------------------------------ JSON
    def to_dict(self) -> dict[str, Any]:
        return {"format": TREE_FORMAT, "task_id": self.task_id, "metric": self.metric,
                "direction": self.direction, "rounds": self.rounds, "expansions": self.expansions,
                "nodes": [n.to_dict() for n in self.nodes.values()]}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Tree":
        if d.get("format") not in (1, TREE_FORMAT):
            raise TreeError(f"tree format {d.get('format')!r} is not {TREE_FORMAT} (nor the older 1)")
        tree = cls(task_id=d["task_id"], metric=d["metric"], direction=d["direction"],
                   rounds=int(d["rounds"]), expansions=int(d["expansions"]))
        for raw in d["nodes"]:  # n_children is stored: restore it as is, do not recount
            node = Node.from_dict(raw if d["format"] == TREE_FORMAT else _node_of_format_1(raw, tree.task_id))
            if node.id in tree.nodes:
                raise TreeError(f"node id {node.id!r} appears twice in the saved tree")
            if node.parent_id is not None and node.parent_id not in tree.nodes:
                raise TreeError(f"node {node.id}: parent {node.parent_id!r} is not before it")
            tree.nodes[node.id] = node
        for n in tree.nodes.values():
            if n.n_children != len(tree.children(n.id)):
                raise TreeError(f"node {n.id}: n_children {n.n_children} but "
                                f"{len(tree.children(n.id))} children saved")
        return tree

    def dumps(self) -> str:
        return json.dumps(self.to_dict(), separators=(",", ":"))

    @classmethod
    def loads(cls, text: str) -> "Tree":
        return cls.from_dict(json.loads(text))
