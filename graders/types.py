"""The grader's plain records: what a task hands out (cases), what it returns (scores) and what
it reports (health). No gRPC or Ray import: tasks build them, graders/wire.py converts them to
and from the proto, and clients receive them.

Fields every task fills come first; the voice-leading fields that the contract has carried since
v1 keep their place (with neutral values for other tasks), and anything else a task reports
travels in ``details`` (``details_json`` on the wire), so adding a task never changes the proto.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


class PoolError(Exception):
    """A request a task cannot answer. ``code`` names the gRPC status it maps to."""

    code = "INVALID_ARGUMENT"


class UnknownSplit(PoolError):
    code = "INVALID_ARGUMENT"


class UnknownCase(PoolError):
    code = "NOT_FOUND"


class PoolTooSmall(PoolError):
    code = "FAILED_PRECONDITION"


class Overloaded(PoolError):
    """Every execution slot of the replica stayed busy past the task's queue wait (code-exec's
    ``code_exec.queue_wait_s``). Clients do not retry it blindly: the replica already waited,
    and an immediate resend only adds load; the caller backs off or sends fewer at once."""

    code = "RESOURCE_EXHAUSTED"


@dataclass(frozen=True)
class CaseInfo:
    """One prompt of a task's pool."""

    id: str
    split: str
    task: str
    messages: list[dict[str, str]]  # system + user
    prefixes: list[str] = field(default_factory=list)  # forced assistant openings, if the task has them
    # voice-leading's own (neutral for other tasks)
    voices: int = 0
    style: str = ""
    chords: int = 0
    openings: list[str] = field(default_factory=list)
    progression: dict = field(default_factory=dict)
    details: dict[str, Any] = field(default_factory=dict)  # task-specific extras


@dataclass(frozen=True)
class Score:
    """What one completion earned.

    ``status`` is "ok" when the completion was graded, else the task's failure status (e.g.
    code-exec's no_code, crashed, timeout, invalid_submission); ``format_ok`` says whether the
    completion was well-formed enough to be judged (the valid-only advantage estimators use it);
    ``admitted`` whether it earned the task's reward in full."""

    case_id: str
    reward: float
    format_ok: bool
    admitted: bool
    verdict: str
    status: str = "ok"
    test_metric: float | None = None
    failing_rules: tuple[str, ...] = ()
    # voice-leading's own (neutral for other tasks)
    sounding_frames: int = 0
    expected_frames: int = 0
    opening: str = ""
    first_measure_ok: bool = True
    details: dict[str, Any] = field(default_factory=dict)  # task-specific extras


@dataclass(frozen=True)
class Health:
    task: str
    pool_size: int
    pool_source: str
    counters: dict[str, int]
    heldout_pool_size: int
    version: str
    replica: str = ""  # which server or Serve replica answered (its counters are its own)
    # voice-leading's own (neutral for other tasks)
    voices: int = 0
    style: str = ""
    checker: str = ""
    openings_histogram: dict[int, int] = field(default_factory=dict)
    details: dict[str, Any] = field(default_factory=dict)  # task-specific settings


@dataclass(frozen=True)
class TaskInfo:
    """What a task says about itself in Health, beside the counters the core keeps."""

    pool_size: int
    heldout_pool_size: int
    pool_source: str
    voices: int = 0
    style: str = ""
    checker: str = ""
    openings_histogram: dict[int, int] = field(default_factory=dict)
    details: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class ProbeOption:
    """One option a five-options probe answer states (a task's ``probe_options``): an opening,
    written as the task writes its openings, and the probability the model gave it (None = none)."""

    opening: str
    probability: float | None
