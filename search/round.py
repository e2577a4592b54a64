"""One round of tree search = one training step, as a pure function of two injected callables.

    generate(prompts: list[messages], n) -> n completions per prompt (here always one prompt)
        each with .text, .prompt_token_ids, .token_ids, .logprobs, .adapter_version,
        .finish_reason and optionally .assistant_prefix (search.tree.Generation, or the
        rollout's Sample as is); with a scaffold (search.scaffold) it is called as
        generate(prompts, n, assistant_prefix=..., stop=...): the forced head and the strings
        that end the block, and the script executed is head + block + tail
    execute(items: list[(case_id, completion)]) -> one records.exec_result.ExecResult per item,
        in order (what the code-exec verifier returns, or what the grader's reply carries), kept
        whole on the node it grades

The driver plugs in the rollout client and the grader client; tests plug in a scripted policy
and the real CodeExecTask. Expansions run one after another (each choice depends on the grades
before it); the N/E siblings of one expansion are generated in one call and executed in one call,
so the grader runs them concurrently. The input tree is not modified: the round works on a copy
and returns it, so a step that fails half way leaves the caller's tree as it was.
"""

from __future__ import annotations

import statistics
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from config.search import SearchConfig
from search.policy import choose_expansion
from search.prompts import render_prompt
from search.scaffold import scaffold_of
from records.exec_result import ExecResult
from records.rows import node_id
from search.tree import Node, Tree, oriented_value

Generate = Callable[[list[list[dict[str, str]]], int], Sequence[Any]]
Execute = Callable[[list[tuple[str, str]]], Sequence[ExecResult]]


class RoundError(RuntimeError):
    """A collaborator broke its contract (wrong count, missing field): never a partial round."""


@dataclass
class Round:
    step: int
    round: int  # the tree's round counter (0 for the first round of a tree)
    task_id: str
    nodes: list[Node]  # this round's nodes, in creation order
    groups: list[int]  # sibling_group of each node (the GRPO group ids of the step)
    expansions: list[dict[str, Any]]
    summary: dict[str, Any]
    tree: Tree  # the tree after this round


def new_tree(case: Mapping[str, Any]) -> Tree:
    task = case.get("task") or {}
    if "metric" not in task or "direction" not in task:
        raise ValueError(f"case {case.get('id')!r}: needs task.metric and task.direction")
    return Tree(task_id=str(case["id"]), metric=task["metric"], direction=task["direction"])


def _get(obj: Any, name: str, default: Any = None) -> Any:
    if isinstance(obj, Mapping):
        return obj.get(name, default)
    return getattr(obj, name, default)


def grow_round(tree: Tree | None, case: Mapping[str, Any], cfg: SearchConfig, generate: Generate,
               execute: Execute, round_index: int, *, run_seed: int) -> Round:
    """Grow cfg.expansions_per_round expansions of cfg.siblings nodes each on (a copy of) `tree`
    (a fresh tree when None) for task `case`; `round_index` is the training step and, with
    `run_seed` (RunConfig.seed), keys the policy's random stream (search/policy.py)."""
    tree = new_tree(case) if tree is None else tree.copy()
    if tree.task_id != str(case["id"]):
        raise ValueError(f"tree is of task {tree.task_id!r}, case is {case['id']!r}")
    scaffold = scaffold_of(case.get("task")) if cfg.scaffold else None
    if cfg.scaffold and scaffold is None:
        raise ValueError(f"search.scaffold is on but task {case['id']!r} has no scaffold in its task.json")
    tround = tree.rounds
    nodes: list[Node] = []
    expansions: list[dict[str, Any]] = []
    llm_s = exec_s = 0.0
    for group in range(cfg.expansions_per_round):
        choice = choose_expansion(tree, cfg, run_seed=run_seed, step=round_index)
        parent = tree.get(choice.parent_id) if choice.parent_id else None
        messages = render_prompt(choice.mode, case, parent, cfg, scaffold)
        where = f"step {round_index} expansion {group} ({choice.mode})"
        t0 = time.perf_counter()
        if scaffold is None:
            gens = list(generate([messages], cfg.siblings))
        else:
            gens = list(generate([messages], cfg.siblings, assistant_prefix=scaffold.prefix, stop=scaffold.stop))
        t1 = time.perf_counter()
        if len(gens) != cfg.siblings:
            raise RoundError(f"{where}: generate returned {len(gens)} completions, asked {cfg.siblings}")
        if scaffold is None:
            items = [(tree.task_id, _get(g, "assistant_prefix", "") + _get(g, "text")) for g in gens]
        else:  # what runs: head + block (the text cut at the stop) + tail
            items = [(tree.task_id, scaffold.completion(_get(g, "text"))) for g in gens]
        results = list(execute(items))
        t2 = time.perf_counter()
        if len(results) != len(items):
            raise RoundError(f"{where}: execute returned {len(results)} results for {len(items)}")
        llm_s += t1 - t0
        exec_s += t2 - t1
        ids = []
        for k, (g, res) in enumerate(zip(gens, results)):
            if not isinstance(res, ExecResult):
                raise RoundError(f"{where} sibling {k}: execute gave a {type(res).__name__}, not an ExecResult")
            token_ids = [int(t) for t in _get(g, "token_ids", [])]
            logprobs = [float(x) for x in _get(g, "logprobs", [])]
            if len(token_ids) != len(logprobs):
                raise RoundError(f"{where} sibling {k}: {len(token_ids)} tokens, {len(logprobs)} log-probs")
            node = Node(
                id=node_id(step=round_index, round=tround, group=group, index=k), parent_id=choice.parent_id,
                mode=choice.mode, step=round_index, round=tround, expansion=tree.expansions,
                sibling_group=group, index=k, prompt_messages=[dict(m) for m in messages],
                assistant_prefix=scaffold.prefix if scaffold else _get(g, "assistant_prefix", ""),
                raw_completion=_get(g, "text"),
                prompt_token_ids=[int(t) for t in _get(g, "prompt_token_ids", [])],
                response_token_ids=token_ids, response_logprobs=logprobs,
                adapter_version=int(_get(g, "adapter_version", 0)),
                finish_reason=str(_get(g, "finish_reason", "stop")), result=res,
                debug_depth=parent.debug_depth + 1 if choice.mode == "debug" else 0,
            )
            nodes.append(tree.add(node))
            ids.append(node.id)
        expansions.append({"sibling_group": group, "expansion": tree.expansions, "mode": choice.mode,
                           "parent_id": choice.parent_id, "reason": choice.reason, "node_ids": ids,
                           "llm_seconds": t1 - t0, "exec_seconds": t2 - t1})
        tree.expansions += 1
    tree.rounds += 1
    summary = round_summary(tree, nodes, cfg.select_on, round_index, tround, llm_s, exec_s)
    return Round(step=round_index, round=tround, task_id=tree.task_id, nodes=nodes,
                 groups=[n.sibling_group for n in nodes], expansions=expansions, summary=summary,
                 tree=tree)


def round_summary(tree: Tree, nodes: Sequence[Node], select_on: str, step: int, tround: int,
                  llm_s: float, exec_s: float) -> dict[str, Any]:
    """The spec's per-round summary. `best_node_id` is chosen on the selection metric among this
    round's nodes and `honest_test_metric` is ITS test metric (what the search would submit);
    `best_test_metric` is the best test metric of the round (the reference's round-best: an
    oracle that peeks at the test rows, reported, never used to choose)."""
    valid = [n for n in nodes if not n.is_buggy]
    best = tree.best_valid(select_on, among=list(nodes))
    tree_best = tree.best_valid(select_on)
    tested = [n for n in valid if n.result.test_metric is not None]
    oracle = max(tested, key=lambda n: oriented_value(n.result.test_metric, tree.direction), default=None)
    return {
        "step": step,
        "round": tround,
        "task": tree.task_id,
        "metric": tree.metric,
        "direction": tree.direction,
        "select_on": select_on,
        "nodes": len(nodes),
        "valid": len(valid),
        "expansions": len({n.expansion for n in nodes}),
        "mode_counts": dict(Counter(n.mode for n in nodes)),
        "status_counts": dict(Counter(n.result.status for n in nodes)),
        "best_node_id": best.id if best else None,
        "best_val_metric": best.result.val_metric if best else None,
        "honest_test_metric": best.result.test_metric if best else None,
        "best_test_metric": oracle.result.test_metric if oracle else None,
        "best_test_node_id": oracle.id if oracle else None,
        "tree_nodes": len(tree.nodes),
        "tree_best_node_id": tree_best.id if tree_best else None,
        "tree_honest_test_metric": tree_best.result.test_metric if tree_best else None,
        "reward_mean": statistics.fmean(n.result.reward for n in nodes) if nodes else None,
        "gen_llm_seconds": llm_s,
        "gen_exec_seconds": exec_s,
        "exec_time_sum": sum(n.result.exec_time for n in nodes),
        "adapter_versions": sorted({n.adapter_version for n in nodes}),
        "exec_backend": ",".join(sorted({n.result.isolation for n in nodes if n.result.isolation})) or None,
    }
