"""A grader replica's scoring progress, and when its silence counts as a stall (issue 33).

Why: a replica whose scoring wedges (a deadlocked verifier, a sandbox that never returns) is
alive to the OS, to Ray and to Serve, and it still answers the driver's pings, which run on
the replica's event loop while scoring holds a thread of its pool. Its call is bounded only by
the client's ``grader.timeout_s``, retried elsewhere, and the replica keeps its slot for good.

What counts as progress: a ScoreBatch begun or finished, and each case a task reports finished
(``on_case``: code-exec's scripts take seconds each, so a batch of them is many reports; the
tasks whose cases take milliseconds report per batch). A replica with work in flight is stalled
once it has been quiet for the run's liveness deadline (config/liveness.py: factor x the slowest
interval between two of its reports, never below the floor) and never sooner than
``grader.timeout_s``: by then the client has given the call up anyway, so a case that may
legitimately take as long as a call is never a stall. The replica judges itself in its health
check (graders/serve_app.py ``check_health``), which Serve and the driver's pinger both call:
the pinger kills it at once and records the entry, Serve's own check replaces it where no
driver watches (a standalone ``grader serve --ray`` app).

Plain Python: no Ray, no gRPC."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from config.liveness import LivenessConfig


class GraderStalled(RuntimeError):
    """A replica's health check, failed because its scoring made no progress: ``quiet_s`` since
    its last report, against ``deadline_s``. Picklable, so the pinger gets it back through Ray."""

    def __init__(self, quiet_s: float, deadline_s: float, why: str) -> None:
        super().__init__(why)
        self.quiet_s, self.deadline_s, self.why = quiet_s, deadline_s, why

    def __reduce__(self):
        return type(self), (self.quiet_s, self.deadline_s, self.why)


class ScoringProgress:
    """Thread-safe: scoring threads report, the health check reads."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self.in_flight = 0  # batches being scored
        self.cases = 0  # cases reported finished
        self.last: float | None = None  # the last report while busy
        self.slowest_interval_s = 0.0  # between two reports while busy

    def _report(self, now: float) -> None:
        if self.last is not None:
            self.slowest_interval_s = max(self.slowest_interval_s, now - self.last)
        self.last = now

    def begin(self) -> None:
        with self._lock:
            now = self._clock()
            if self.in_flight == 0:  # busy from now: time spent idle is no interval
                self.last = now
            self.in_flight += 1

    def case_done(self) -> None:
        with self._lock:
            self.cases += 1
            self._report(self._clock())

    def end(self) -> None:
        with self._lock:
            self._report(self._clock())
            self.in_flight -= 1
            if self.in_flight == 0:
                self.last = None

    def quiet_s(self) -> float:
        """Seconds since the last report while a batch is in flight; 0 when idle."""
        with self._lock:
            return 0.0 if self.in_flight == 0 or self.last is None else self._clock() - self.last

    def deadline_s(self, liveness: LivenessConfig, call_timeout_s: float) -> float:
        return max(liveness.deadline_s(self.slowest_interval_s or None), call_timeout_s)

    def check(self, liveness: LivenessConfig, call_timeout_s: float) -> None:
        """Raise GraderStalled when scoring has made no progress past its deadline."""
        quiet, deadline = self.quiet_s(), self.deadline_s(liveness, call_timeout_s)
        if quiet >= deadline:
            raise GraderStalled(quiet, deadline, f"scoring made no progress for {quiet:.0f} s (deadline {deadline:.0f} s: "
                                f"liveness.factor x the slowest interval {self.slowest_interval_s:.1f} s between its "
                                f"reports, at least liveness.floor_s and grader.timeout_s)")
