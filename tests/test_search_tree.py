"""search.tree: invariants, selection on validation (never test), debuggable leaves, JSON."""

from __future__ import annotations

import json

import pytest

from records.exec_result import ExecResult
from records.jsonl import RecordError
from search.tree import Node, Tree, TreeError, oriented_value


def mk(id, mode="draft", parent=None, status="ok", val=None, test=None, depth=0, code=""):
    return Node(id=id, parent_id=parent, mode=mode, step=1, round=0, expansion=0, sibling_group=0, index=0,
                prompt_messages=[{"role": "user", "content": "p"}], assistant_prefix="",
                raw_completion=f"```python\n{code}\n```", prompt_token_ids=[1], response_token_ids=[2, 3],
                response_logprobs=[-0.1, -0.2], adapter_version=0, finish_reason="stop", debug_depth=depth,
                result=ExecResult(task_id="t", status=status, reward=-0.5 if status != "ok" else 0.3,
                                  test_metric=test, val_metric=val, oriented=val, exec_time=0.1, term_tail="",
                                  exc_type=None if status == "ok" else "E", message=None, isolation="none",
                                  limits={"cpu_s": 1}, code=code))


def small_tree(direction="higher") -> Tree:
    t = Tree("t", "roc_auc", direction)
    t.add(mk("a", val=0.60, test=0.50))
    t.add(mk("b", val=0.55, test=0.70))  # best on test, not on validation
    t.add(mk("c", status="crashed"))
    t.add(mk("d", "debug", "c", status="crashed", depth=1))
    t.add(mk("e", "improve", "a", val=0.62, test=0.40))
    return t


def test_add_counts_children_and_keeps_order():
    t = small_tree()
    assert list(t.nodes) == ["a", "b", "c", "d", "e"]
    assert (t.get("a").n_children, t.get("c").n_children, t.get("b").n_children) == (1, 1, 0)
    assert [n.id for n in t.children("a")] == ["e"]
    assert [n.id for n in t.leaves()] == ["b", "d", "e"]
    assert [n.id for n in t.draft_nodes()] == ["a", "b", "c"]
    assert [n.id for n in t.buggy_nodes()] == ["c", "d"] and t.get("c").is_buggy
    assert t.depth("e") == 1 and t.depth("a") == 0


@pytest.mark.parametrize("node, msg", [
    (mk("a"), "already in the tree"),
    (mk("x", "improve", "c"), "improve of buggy parent"),
    (mk("x", "debug", "a"), "debug of valid parent"),
    (mk("x", "improve", None), "needs a parent"),
    (mk("x", "debug", "nope"), "needs a parent"),
    (mk("x", "draft", "a"), "a draft has no parent"),
    (mk("x", "sample"), "mode must be one of"),
])
def test_add_refuses_broken_nodes(node, msg):
    with pytest.raises(TreeError, match=msg):
        small_tree().add(node)


def test_best_valid_uses_validation_never_test():
    t = small_tree()
    assert t.best_valid().id == "e"  # val 0.62; "b" has the best test metric (0.70)
    assert t.best_valid(among=[t.get("a"), t.get("b")]).id == "a"
    assert t.best_valid("test").id == "b"  # only when asked for the leaky behaviour
    assert t.best_valid(among=[t.get("c")]) is None


def test_best_valid_lower_is_better_and_ties_keep_the_earliest():
    t = Tree("t", "rmsle", "lower")
    t.add(mk("a", val=0.3, test=0.1))
    t.add(mk("b", val=0.2, test=0.9))
    t.add(mk("c", val=0.2, test=0.0))
    assert t.best_valid().id == "b"
    assert oriented_value(0.2, "lower") == -0.2 and oriented_value(None, "higher") is None
    with pytest.raises(TreeError, match="direction"):
        oriented_value(1.0, "up")


def test_selection_without_validation_metric_is_a_clear_error():
    t = Tree("t", "roc_auc", "higher")
    t.add(mk("a", val=None, test=0.6))
    with pytest.raises(TreeError, match="no val_metric.*select_on=test"):
        t.best_valid()
    assert t.best_valid("test").id == "a"


def test_debuggable_depth_and_leaves():
    t = small_tree()
    assert [n.id for n in t.debuggable(3)] == ["d"]  # c has a child
    assert [n.id for n in t.debuggable(3, leaves_only=False)] == ["c", "d"]
    assert [n.id for n in t.debuggable(1)] == ["d"]  # depth 1 <= 1
    assert t.debuggable(0) == []


def test_json_round_trip_is_exact():
    t = small_tree()
    t.rounds, t.expansions = 2, 7
    back = Tree.loads(t.dumps())
    assert back == t and back.to_dict() == t.to_dict()
    assert json.loads(back.dumps()) == json.loads(t.dumps())
    back.add(mk("f", "improve", "e", val=0.7, test=0.6))  # a loaded tree keeps growing
    assert back.get("e").n_children == 1 and t.get("e").n_children == 0


def test_a_format_1_tree_json_is_read_as_the_same_tree():
    """tree.json before ExecResult (format 1) spread the execution fields over each node; a run
    resumed across the change continues the tree it saved."""
    t = small_tree()
    t.get("a").result.limits["cpu_s"] = 7  # a value that must survive the fold, not a default
    old = {**t.to_dict(), "format": 1,
           "nodes": [{**{k: v for k, v in n.items() if k != "result"},
                      **{k: v for k, v in n["result"].items() if k != "task_id"}} for n in t.to_dict()["nodes"]]}
    assert "status" in old["nodes"][0] and "result" not in old["nodes"][0]
    back = Tree.from_dict(old)
    assert back.to_dict() == t.to_dict() and back.dumps() == t.dumps()
    with pytest.raises(RecordError, match=r"lacks \['status'\]"):  # a format-1 node missing a field
        Tree.from_dict({**old, "nodes": [{k: v for k, v in old["nodes"][0].items() if k != "status"}]})


def test_loading_a_corrupt_tree_names_the_problem():
    d = small_tree().to_dict()
    d["nodes"][0]["n_children"] = 5
    with pytest.raises(TreeError, match="node a: n_children 5 but 1 children"):
        Tree.from_dict(d)
    d = small_tree().to_dict()
    d["nodes"] = d["nodes"][::-1]
    with pytest.raises(TreeError, match="is not before it"):
        Tree.from_dict(d)
    d = small_tree().to_dict()
    d["nodes"][0]["score"] = 1
    with pytest.raises(TreeError, match="unknown fields"):
        Tree.from_dict(d)
    with pytest.raises(TreeError, match="format"):
        Tree.from_dict({**small_tree().to_dict(), "format": 99})
