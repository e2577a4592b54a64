"""The step loop's timer: seconds per phase of one step. Phase names are fixed by DESIGN.md.
(The learner's own passes are learner/passes.py.)"""

from __future__ import annotations

import time
from concurrent.futures import Future
from contextlib import contextmanager
from typing import Callable, Iterator

from records.run_dir import PHASES  # DESIGN.md's phase names, as timing.jsonl records them


class PhaseTimer:
    """Collects seconds per phase for one step; `total()` is wall time since construction."""

    def __init__(self) -> None:
        self._start = time.perf_counter()
        self.seconds: dict[str, float] = {}
        self.spans: dict[str, tuple[float, float]] = {}  # each phase's last (start, end), perf_counter

    @contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        if phase not in PHASES:
            raise ValueError(f"unknown phase {phase!r}; phases are {', '.join(PHASES)}")
        t0 = time.perf_counter()
        try:
            yield
        finally:
            t1 = time.perf_counter()
            self.seconds[phase] = self.seconds.get(phase, 0.0) + t1 - t0
            self.spans[phase] = (t0, t1)

    def add(self, measured: dict[str, float]) -> None:
        """Merge phases measured elsewhere (the learner workers report their own)."""
        for phase, seconds in measured.items():
            if phase not in PHASES:
                raise ValueError(f"unknown phase {phase!r} reported")
            self.seconds[phase] = self.seconds.get(phase, 0.0) + float(seconds)

    def total(self) -> float:
        return time.perf_counter() - self._start


def finished_at(future: Future) -> Callable[[], float | None]:
    """A clock on ``future``: when it completed (perf_counter), None while it still runs (one
    already done reads the time the clock was put on it)."""
    done: list[float] = []
    future.add_done_callback(lambda _: done.append(time.perf_counter()))
    return lambda: done[0] if done else None


def seconds_beside(span: tuple[float, float] | None, ended_at: float | None) -> float:
    """Seconds of ``span`` (start, end) during which something that ended at ``ended_at`` (None:
    had not ended by the span's end) was still running. With one_step_off the adapter's sync runs
    while the next step's generation may still be in flight, and a replica that merges the adapter
    into its weights waits for that generation: those seconds are generation, not transfer."""
    if span is None:
        return 0.0
    start, end = span
    return max(0.0, (end if ended_at is None else min(end, ended_at)) - start)
