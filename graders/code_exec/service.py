"""The `code-exec` grader task (graders/tasks.py): CodeExecTask as the grader service's records.

- cases: one per bundled (or user) task, the same for every split (the task's own val/test
  rows are its held-out data); ``messages`` are the prompt, ``details`` the task's metadata
  (id, metric, direction, id_column, target_columns, reward, rows, dir).
- score: the batch's scripts run concurrently, at most ``code_exec.max_concurrent`` at once in
  this process (`CodeExecTask.score_many`); every id is checked first (NOT_FOUND). A script
  that waits past ``code_exec.queue_wait_s`` for a slot (other requests hold them) fails the
  request with `Overloaded` (RESOURCE_EXHAUSTED; not retried by the client: the replica already
  waited, see graders/types.py). Score: ``status`` (no_code | crashed | timeout |
  invalid_submission | ok), ``reward`` (the sentinel for every failure), ``format_ok`` and
  ``admitted`` = status ok, ``verdict`` = status, ``test_metric``; ``details`` holds the whole
  ExecResult (records/exec_result.py: the script that ran, its metrics, output tail, limits,
  isolation, ...; ``ExecResult.from_details`` reads it back) and ``worker`` (host:pid of the
  process that ran it).
- health: the isolation level in force (and why), the limits that matter to callers, and which
  grading rule set grades (graders/code_exec/grading.py): ``checker`` names it (tasks graded
  under different rule sets: ``task=rules`` pairs), so the run receipt's ``checker`` and
  ``grader_health.checker`` record it and evals refuse to compare rewards across rule sets;
  ``details.grading_rules`` maps every task to its rule set.

The factory refuses to build the task (a ValueError naming the cause, so `grader serve` exits 2
before anything starts and a Serve replica fails its constructor) when the host offers less
isolation than ``code_exec.min_isolation``.

Which process runs a batch: the one that received the ScoreBatch. Spreading one batch over
Serve replicas is the caller's split (graders/spread.py): see deploy/README.md.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable, Sequence

from graders import metrics
from graders.code_exec.sandbox import IsolationUnavailable, ResourceExhausted
from graders.code_exec.task import load_tasks, resolve_tasks_dir
from graders.code_exec.verifier import CodeExecTask
from graders.types import CaseInfo, Overloaded, PoolError, PoolTooSmall, Score, TaskInfo, UnknownCase, UnknownSplit
from graders.tasks import register_task
from records.exec_result import ExecResult

NAME = "code-exec"
SPLITS = ("train", "heldout")  # both list every task; a task's val/test rows are inside it
WORKER = f"{socket.gethostname()}:{os.getpid()}"


class IsolationRefused(ValueError):
    """The host is below ``code_exec.min_isolation``: the grader must not start."""


def score_record(case_id: str, r: ExecResult) -> Score:
    """A verifier result as the service's Score (pure)."""
    ok = r.status == "ok"
    return Score(
        case_id=case_id, reward=r.reward, format_ok=ok, admitted=ok, verdict=r.status, status=r.status,
        test_metric=r.test_metric, details={**r.as_details(), "worker": WORKER},
    )


def score_row(r: ExecResult) -> dict:
    """The JSON row `grader score --task code-exec` prints for one input (the script left out)."""
    row = r.as_details()
    row.pop("code")
    return row


def list_tasks(cfg) -> list[dict]:
    """The tasks' summaries ({"id", "metric", "direction", ...}) from a GraderConfig, without
    starting a sandbox (`grader list --task code-exec`)."""
    ce = cfg.code_exec
    tasks = sorted(load_tasks(resolve_tasks_dir(ce.tasks_dir, ce.seed)).items())
    return [{**t.summary(), "grading_rules": t.rules(ce.grading_rules)} for _, t in tasks]


def rules_checker(grading_rules: dict[str, str]) -> str:
    """Health's `checker` for code-exec: the one rule set grading every task, else each task's
    as `task=rules` (comma-separated, by task id)."""
    names = set(grading_rules.values())
    if len(names) == 1:
        return names.pop()
    return ",".join(f"{tid}={rules}" for tid, rules in sorted(grading_rules.items()))


class CodeExecGraderTask:
    """A CodeExecTask behind the registry's protocol (info / cases / score)."""

    name = NAME

    def __init__(self, verifier: CodeExecTask) -> None:
        self.verifier = verifier
        self._cases = [
            CaseInfo(id=c["id"], split="", task=NAME, messages=c["prompt_messages"], details=c["task"])
            for c in verifier.cases()
        ]
        metrics.set_isolation(NAME, verifier.isolation)

    def info(self) -> TaskInfo:
        cfg, sandbox = self.verifier.cfg, self.verifier.sandbox
        return TaskInfo(
            pool_size=len(self._cases), heldout_pool_size=len(self._cases),
            pool_source=str(self.verifier.tasks_dir),
            checker=rules_checker(self.verifier.grading_rules),
            details={"grading_rules": dict(self.verifier.grading_rules),
                     "grading_rules_default": cfg.grading_rules,"isolation": sandbox.isolation, "isolation_reason": sandbox.isolation_reason,
                     "min_isolation": cfg.min_isolation, "max_concurrent": cfg.max_concurrent,
                     "queue_wait_s": cfg.queue_wait_s, "timeout_s": cfg.timeout_s,
                     "reward_split": cfg.reward_split, "sentinel": cfg.sentinel,
                     "tasks": [c.id for c in self._cases], "worker": WORKER},
        )

    def cases(self, limit: int, split: str) -> list[CaseInfo]:
        if split not in SPLITS:
            raise UnknownSplit(f"unknown split {split!r}; one of {list(SPLITS)}")
        if limit < 0:
            raise PoolError(f"limit must be >= 0, got {limit}")
        if limit > len(self._cases):
            raise PoolTooSmall(f"asked for {limit} cases but code-exec holds {len(self._cases)} tasks")
        return [CaseInfo(id=c.id, split=split, task=NAME, messages=[dict(m) for m in c.messages],
                         details=dict(c.details)) for c in self._cases[: limit or None]]

    def score_one(self, case_id: str, completion: str) -> ExecResult:
        try:
            r = self.verifier.score(case_id, completion)
        except ResourceExhausted as exc:
            metrics.observe_execution(NAME, "overloaded", None, exc.waited_s)
            raise
        ran = r.status != "no_code"
        metrics.observe_execution(NAME, r.status, r.exec_time if ran else None, r.queue_wait if ran else None)
        return r

    def score(self, pairs: Sequence[tuple[str, str]], on_case: Callable[[], None] | None = None) -> list[Score]:
        """``on_case``: called as each script finishes (the replica's progress: a batch of
        scripts takes minutes, each script seconds)."""
        for i, (case_id, _) in enumerate(pairs):  # every id before any script runs
            if case_id not in self.verifier.tasks:
                where = f"requests[{i}]: " if len(pairs) > 1 else ""
                raise UnknownCase(f"{where}unknown case_id {case_id!r}; code-exec tasks: "
                                  f"{', '.join(sorted(self.verifier.tasks))}")

        def scored(case_id: str, completion: str) -> ExecResult:
            result = self.score_one(case_id, completion)
            if on_case is not None:
                on_case()
            return result

        try:
            results = self.verifier.score_many(list(pairs), score=scored)
        except ResourceExhausted as exc:
            raise Overloaded(str(exc)) from None
        return [score_record(case_id, r) for (case_id, _), r in zip(pairs, results, strict=True)]


@register_task(NAME)
def code_exec_task(cfg) -> CodeExecGraderTask:
    """From a GraderConfig: its ``code_exec`` section. Raises IsolationRefused (a ValueError)
    when the host is below ``code_exec.min_isolation``, TaskError for a bad tasks dir."""
    try:
        verifier = CodeExecTask(cfg.code_exec)
    except IsolationUnavailable as exc:
        raise IsolationRefused(f"code-exec refuses to start: {exc}") from None
    return CodeExecGraderTask(verifier)
