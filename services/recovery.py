"""What a run does when a part of it dies, as plain data and pure decisions (no Ray or gRPC
import: the Ray wiring is services/learner_recovery.py, services/orchestrator.py's retries and the
grader client's; README "What survives what" says what each covers).

- ``Recovery`` / ``RecoveryLog``: every recovery a run made (part, step, what happened, how long,
  how it ended), the receipt's ``recoveries`` list and the ``counterpoint_recoveries_total{part}``
  counter. ``PARTS`` bounds the label.
- ``BatchLedger``: the batches the learner trained since its last checkpoint. A learner that dies
  is restored from that checkpoint and fed them again (``replay``), so the run goes on exactly as
  an uninterrupted one would: same batches in the same order, the LR schedule restored with the
  optimizer, and no adapter version published twice (the next one published is the lost step's
  successor, newer than anything a replica holds: DESIGN.md's version contract is kept).
- ``learner_failure_retryable``: a dead worker, a dead node, a lost coordinator, a hung collective
  or a worker that stopped making progress (config/liveness.py) is worth a restore; a worker that raised an error of its own (a bug, bad input) is not: it
  would fail again, and a retry would only hide it.
- ``Budget``: bounded retries, counted.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

# The parts a recovery is counted for (the metric's only label: bounded).
PARTS = ("rollout", "grader", "learner", "node", "driver")
# "stalled": a part went quiet past liveness.notice_s and then went on by itself (nothing replaced).
OUTCOMES = ("recovered", "stopped", "stalled")


@dataclass(frozen=True)
class Recovery:
    part: str
    step: int  # the step the failure hit (the step being generated, scored, trained or resumed at)
    what: str  # one line: what failed, what was done
    seconds: float  # from the failure being seen to the part serving again (or to giving up)
    outcome: str = "recovered"
    attempt: int = 1  # which attempt of the run (1 = its first start, +1 per --resume)
    details: Mapping[str, Any] = field(default_factory=dict)
    # The outage as the run lived it: from the part's last progress (where it is known: a
    # learner step, a replica's last report) to service restored; ``seconds`` plus the quiet
    # time before the failure was seen. None = the same as ``seconds``.
    outage_s: float | None = None

    def __post_init__(self) -> None:
        if self.part not in PARTS:
            raise ValueError(f"recovery part {self.part!r} is not one of {PARTS}")
        if self.outcome not in OUTCOMES:
            raise ValueError(f"recovery outcome {self.outcome!r} is not one of {OUTCOMES}")

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["seconds"] = round(self.seconds, 3)
        out["outage_s"] = round(self.seconds if self.outage_s is None else self.outage_s, 3)
        out["details"] = dict(self.details)
        return out


class RecoveryLog:
    """Recoveries of this attempt, after those earlier attempts recorded (``earlier``: the
    receipt's list as the previous attempt left it). Subscribers (the receipt, the metrics)
    see every entry of this attempt, also those recorded before they subscribed."""

    def __init__(self, attempt: int = 1, earlier: Iterable[Mapping[str, Any]] = ()) -> None:
        self.attempt = attempt
        self.earlier = [dict(e) for e in earlier]
        self.entries: list[Recovery] = []
        self._subscribers: list[Callable[[Recovery], None]] = []

    def record(self, part: str, step: int, what: str, seconds: float, outcome: str = "recovered",
               outage_s: float | None = None, **details: Any) -> Recovery:
        entry = Recovery(part, step, what, seconds, outcome, self.attempt, details, outage_s)
        self.entries.append(entry)
        for notify in list(self._subscribers):
            notify(entry)
        return entry

    def subscribe(self, notify: Callable[[Recovery], None]) -> None:
        for entry in self.entries:
            notify(entry)
        self._subscribers.append(notify)

    def all(self) -> list[dict[str, Any]]:
        """Every attempt's recoveries, oldest first (what run.json's ``recoveries`` holds)."""
        return [*self.earlier, *(e.as_dict() for e in self.entries)]


def first_line(err: BaseException | str, width: int = 240) -> str:
    text = str(err).strip().splitlines()
    line = text[0] if text else ""
    name = "" if isinstance(err, str) else type(err).__name__
    line = f"{name}: {line}" if name and line else (name or line)
    return line if len(line) <= width else line[: width - 1] + "…"


def lost_learner_line(err: BaseException) -> str:
    """What a lost learner's recovery entry says of its error: the first line, and for a
    worker's own exception (LearnerLost "worker_error", whose first line only says where it
    failed) the traceback's last line, the exception itself: e.g. ``OwnerGone: the replica that
    owned the shared base weights (pid N) is gone``."""
    line = first_line(str(err))
    detail = str(getattr(err, "detail", "") or "")
    if getattr(err, "kind", "") == "worker_error" and detail.strip():
        cause = [x.strip() for x in detail.strip().splitlines() if x.strip()][-1]  # "pkg.mod.Error: message"
        name, sep, message = cause.partition(": ")
        line = first_line(f"{line.rstrip(':')}: {name.rpartition('.')[2]}{sep}{message}")
    return line


def retried_what(call: str, errors: list[str]) -> str:
    """The recovery line of a call that failed ``len(errors)`` times before it succeeded."""
    n = len(errors)
    return f"{call} failed {n} time{'s' if n != 1 else ''} ({errors[0]}); retried and answered"


# ------------------------------------------------------------------ bounded retries
@dataclass
class Budget:
    """At most ``limit`` retries (restarts, ...) over a run; ``take()`` spends one."""

    limit: int
    used: int = 0

    def take(self) -> bool:
        if self.used >= self.limit:
            return False
        self.used += 1
        return True


def backoff_delays(retries: int, first_s: float) -> list[float]:
    """The wait before each retry: first_s, then doubling (the sections' retry_backoff_s); what
    services/orchestrator.py's with_retries sleeps between attempts."""
    return [first_s * 2**k for k in range(retries)]


# ------------------------------------------------------------------ the learner
@dataclass(frozen=True)
class Kept:
    step: int
    batch: Any


class BatchLedger:
    """The batches trained since the learner's last checkpoint (``start_step``: the step that
    checkpoint holds, or the run's start point). What a restored learner is fed again."""

    def __init__(self, start_step: int = 0) -> None:
        self.checkpoint_step = start_step
        self._kept: list[Kept] = []

    def add(self, step: int, batch: Any) -> None:
        expected = self.checkpoint_step + len(self._kept) + 1
        if step != expected:
            raise ValueError(f"the learner ledger expected step {expected}, got {step}")
        self._kept.append(Kept(step, batch))

    def checkpointed(self, step: int) -> None:
        """A checkpoint of ``step`` is on the driver's disk: nothing at or before it is needed."""
        if step < self.checkpoint_step:
            raise ValueError(f"checkpoint of step {step} is older than the ledger's {self.checkpoint_step}")
        self.checkpoint_step = step
        self._kept = [k for k in self._kept if k.step > step]

    def replay(self, trained: int) -> list[Kept]:
        """What a learner restored at ``checkpoint_step`` is fed to be back where the run was,
        with ``trained`` the steps the lost learner had finished (the step in flight, if any, is
        re-sent by the caller itself)."""
        return [k for k in self._kept if k.step <= trained]

    @property
    def steps(self) -> list[int]:
        return [k.step for k in self._kept]


# Text of a worker's error that comes from a peer (or the process group) going away, not from
# our own code: the rank that lost its peer reports it first, the Train run ends right after.
_PEER_LOSS = re.compile(
    r"Connection (closed|reset) by peer|Gloo|NCCL (error|communicator)|DistBackendError|ProcessGroup|"
    r"RayActorError|ActorDiedError|OwnerDiedError|ObjectLostError|NodeDiedError|WorkerCrashedError|"
    r"The actor died unexpectedly|Broken pipe|timed out.*(collective|store)|"
    # a learner whose shared base weights' owner (the rollout replica) died: a restored one maps its successor
    r"OwnerGone", re.IGNORECASE)
LEARNER_FAILURES = ("worker_error", "train_run_ended", "coordinator_lost", "timeout", "stalled")


def learner_failure_retryable(kind: str, text: str = "") -> bool:
    """Whether a learner failure of ``kind`` (LEARNER_FAILURES) is a lost process worth a restore."""
    if kind not in LEARNER_FAILURES:
        raise ValueError(f"learner failure kind {kind!r} is not one of {LEARNER_FAILURES}")
    if kind == "worker_error":
        return bool(_PEER_LOSS.search(text))
    return True


def learner_what(kind: str, detail: str, restored_from: int, replayed: list[int], redone: str) -> str:
    source = f"checkpoint step {restored_from}" if restored_from else "the run's start point (no checkpoint yet)"
    again = f"re-fed steps {', '.join(map(str, replayed))} and " if replayed else ""
    return (f"learner lost ({kind}: {detail}); restored from {source}, {again}re-ran {redone}")


# ------------------------------------------------------------------ a resumed run
def resume_what(previous: Mapping[str, Any] | None, resumed_from_step: int, first_step: int) -> str | None:
    """The recovery line of a --resume after an attempt that did not complete (None when the
    previous attempt completed: extending a finished run is not a recovery)."""
    if previous is None or previous.get("status") == "completed":
        return None
    status = previous.get("status") or "unknown"
    if status == "running":  # its driver was killed before it could write how it ended
        status = "died (its run.json still said running: the driver was killed)"
    error = previous.get("error")
    source = f"checkpoint step {resumed_from_step}" if resumed_from_step else "its start point"
    return (f"previous attempt {status}" + (f" ({first_line(error)})" if error else "")
            + f"; resumed from {source}, training again from step {first_step}")
