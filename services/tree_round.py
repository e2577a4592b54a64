"""Tree mode of the step loop (trainer.rollout_mode = "tree", issue 14): one training step's data
is one round of tree search (search/round.py) on one code-exec task.

grow_round gets the two services as plain callables:

- generate(prompts, n): the rollout client, one call per expansion asking for the n = N/E
  siblings (the same prompt n times with n=1 each, so the siblings spread over the rollout
  replicas like a flat group; each carries its token ids, log-probs and adapter version);
- execute(items): the grader client's ScoreBatch, sent in chunks of grader.chunk_for (the task's
  scripts per replica, code_exec.max_concurrent, unless grader.score_chunk is set; graders/spread.py)
  so every grader replica runs scripts at once; each Score carries the
  script's whole ExecResult in its details (the script the grader extracted and ran included),
  which the node keeps as it is.

What comes back is the same `Rollouts` + scores the flat path trains on: one sample per node,
groups = sibling groups, the grader's Score records (format_ok = status "ok", what the
valid-only estimators read). With search.scaffold the prompt's assistant turn opens with the
task's template head (Prompt.assistant_prefix, part of the prompt tokens the learner sees) and
generation stops at the scaffold's stop strings; the grader runs head + block + tail. `gen_llm_seconds` is the step's `gen` phase, `gen_exec_seconds`
its `score` phase. With search.carry_tree the tree continues from round to round; a resumed run
reads the previous round's round_<step-1>/tree.json.

The task's reference ladder, which the diagnostics compare a round with, is the task's to find
(graders/tasks.py task_profile(...).ladder): the driver reads none of the task's files.

`tree_round_record` turns a trained step into the archive's tree rows, the merged summary and
the per-round diagnostics (metrics.jsonl `search_*`, Prometheus counterpoint_search_*).
"""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path
from typing import Any

from graders.tasks import task_profile
from records.exec_result import ExecResult
from records.run_dir import RunDir
from rollout.types import Prompt
from search.diagnostics import round_diagnostics
from search.round import Round, grow_round
from search.rows import round_rows
from search.tree import Tree
from services.orchestrator import (RoundRecord, Rollouts, RunParts, StepRecord, generate_checked, sampling_params,
                                   score_checked)

log = logging.getLogger("counterpoint.train")


def case_dict(case: Any) -> dict[str, Any]:
    """A grader CaseInfo as search's case: id, prompt_messages, task (metric, direction, ...)."""
    return {"id": case.id, "prompt_messages": [dict(m) for m in case.messages], "task": dict(case.details)}


class TreeRounds:
    """The `collect` of tree mode: holds the trees between rounds (search.carry_tree)."""

    def __init__(self, run_dir: Path | None = None) -> None:
        self.run_dir = run_dir
        self.trees: dict[str, Tree] = {}
        self.last: Round | None = None
        self.ladders: dict[str, dict[str, Any]] = {}

    def _tree(self, parts: RunParts, case_id: str, step: int) -> Tree | None:
        if not parts.cfg.search.carry_tree:
            return None
        if case_id not in self.trees and step > 1 and self.run_dir is not None:
            saved = RunDir(self.run_dir).tree_path(step - 1)  # a resumed run continues its tree
            if saved.is_file():
                tree = Tree.loads(saved.read_text())
                if tree.task_id == case_id:
                    self.trees[case_id] = tree
                    log.info("tree of %s continued from %s (%d nodes)", case_id, saved, len(tree.nodes))
        return self.trees.get(case_id)

    def __call__(self, parts: RunParts, step: int, version: int, timer, ahead=None) -> tuple[Rollouts, list[Any]]:
        if ahead is not None:
            raise RuntimeError("tree rounds do not run one step off (config refuses it)")
        cfg = parts.cfg
        (case_id,) = parts.sampler.batch_for_step(step)  # prompts_per_step is 1 in tree mode
        case = case_dict(parts.cases[case_id])
        base = sampling_params(cfg, step)
        samples: list[Any] = []
        scores: list[Any] = []
        prompts: list[Prompt] = []
        calls = [0]

        def generate(batch: list[list[dict[str, str]]], n: int, assistant_prefix: str = "",
                     stop: tuple[str, ...] = ()) -> list[Any]:
            (messages,) = batch
            prompt = Prompt(messages=tuple(dict(m) for m in messages), assistant_prefix=assistant_prefix)
            # A distinct seed per expansion: prompt i of call k samples with seed + k*n + i.
            params = replace(base, n=1, seed=None if base.seed is None else base.seed + 10_007 * calls[0],
                             stop=tuple(stop))
            got = generate_checked(parts, step, version, [prompt] * n, params, f"step {step}, expansion {calls[0]}")
            calls[0] += 1
            samples.extend(got)
            prompts.extend([prompt] * len(got))
            return got

        def execute(items: list[tuple[str, str]]) -> list[ExecResult]:
            got = score_checked(parts, step, items, cfg.grader.chunk_for(len(items)))
            scores.extend(got)
            return [ExecResult.from_details(s.details) for s in got]

        rnd = grow_round(self._tree(parts, case_id, step), case, cfg.search, generate, execute, step,
                         run_seed=cfg.seed)
        self.trees[case_id] = rnd.tree
        self.last = rnd
        if case_id not in self.ladders:
            self.ladders[case_id] = task_profile(cfg.grader.task).ladder(cfg.grader, case_id)
        rnd.summary["diagnostics"] = round_diagnostics(rnd.nodes, rnd.tree, cfg.search.select_on,
                                                       self.ladders[case_id])
        timer.add({"gen": rnd.summary["gen_llm_seconds"], "score": rnd.summary["gen_exec_seconds"]})
        ro = Rollouts(step=step, case_ids=[case_id] * len(samples), prompts=prompts, samples=samples,
                      groups=list(rnd.groups), gen_seconds=rnd.summary["gen_llm_seconds"], search=rnd)
        return ro, scores


def tree_round_record(run: RunDir, rec: RoundRecord | StepRecord, task: str, epoch: int) -> dict[str, float | int | None]:
    """Write a tree step's round (tree rows, summary with the search summary merged, tree.json)
    as soon as it is scored, and return its diagnostics as `search_*` scalars for metrics.jsonl."""
    rnd: Round = rec.rollouts.search
    tree = rnd.tree
    diag = rnd.summary["diagnostics"]  # computed by TreeRounds, against the task's ladder
    rows = round_rows(rnd.nodes, run.root.name, rec.advantages)
    # n_children as of the end of the round (a node's children may come in later expansions).
    for row in rows:
        row["n_children"] = tree.get(row["id"]).n_children
    run.write_round(rec.step, task, epoch, rows, pass_verdicts=("ok",),
                    search_summary={**rnd.summary, "expansion_choices": rnd.expansions},
                    tree_json=tree.dumps())
    out = {f"search_{k}": v for k, v in diag.items() if v is None or isinstance(v, (int, float))}
    out["search_gen_llm_seconds"] = rnd.summary["gen_llm_seconds"]
    out["search_gen_exec_seconds"] = rnd.summary["gen_exec_seconds"]
    out["search_tree_nodes"] = rnd.summary["tree_nodes"]
    return out
