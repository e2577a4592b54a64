"""What one execution of a model-written script produced: the code-exec grader's result, typed
once and passed on whole. The verifier (graders/code_exec/verifier.py) returns it, the grader's
Score carries it in ``details`` (``as_details`` / ``from_details``), the tree search keeps it on
its node (search/tree.py ``Node.result``) and a tree row spreads it into its fields
(records/rows.py ``tree_row``)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any, Mapping

from records.jsonl import RecordError

# What a script's execution ended as (the one list: grader metrics, search diagnostics and the
# trainer's gauges take it); every status but ok earns the task's sentinel reward.
EXEC_STATUSES = ("ok", "no_code", "crashed", "timeout", "invalid_submission")


@dataclass(frozen=True)
class ExecResult:
    """One graded script. ``test_metric``, ``val_metric`` and ``oriented`` are None unless status
    is ok.

    ``reward`` and ``oriented`` (higher is better across tasks) come from the selection split
    (``code_exec.reward_split``, val by default); ``test_metric`` is the reported one and never
    feeds them unless reward_split="test" or the task has no val rows. ``code`` is the script the
    grader extracted from the completion and ran ("" when there was none: status no_code)."""

    task_id: str
    status: str
    reward: float
    test_metric: float | None
    val_metric: float | None
    oriented: float | None
    exec_time: float  # seconds the script ran (0 when nothing ran)
    term_tail: str  # the end of its stdout+stderr
    exc_type: str | None  # the exception that ended it, or the signal that killed it
    message: str | None  # why it failed, in words (None when ok)
    isolation: str  # the sandbox's isolation level when it ran
    limits: dict[str, Any] = field(default_factory=dict)  # the resource limits it ran under
    code: str = ""
    queue_wait: float = 0.0  # seconds waited for an execution slot (0 when nothing ran)

    @property
    def ok(self) -> bool:
        """A gradable submission came out (AIDE's "not buggy")."""
        return self.status == "ok"

    def as_details(self) -> dict[str, Any]:
        """Every field, as JSON-ready values (the grader's Score.details)."""
        return asdict(self)

    @classmethod
    def from_details(cls, details: Mapping[str, Any]) -> ExecResult:
        """From ``as_details()`` output (other keys, e.g. the grader's ``worker``, are left out).
        A missing field means a grader that does not send the result whole: RecordError naming
        what is missing, never a default standing in for it."""
        names = [f.name for f in fields(cls)]
        missing = [n for n in names if n not in details]
        if missing:
            raise RecordError(f"code-exec result lacks {missing} (a grader older than its client?)")
        values = {n: details[n] for n in names}
        return cls(**{**values, "limits": dict(values["limits"] or {}), "exec_time": float(values["exec_time"]),
                      "queue_wait": float(values["queue_wait"]), "reward": float(values["reward"])})
