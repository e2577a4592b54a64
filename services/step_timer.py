"""The step loop's timer: seconds per phase of one step. Phase names are fixed by DESIGN.md.
(The learner's own passes are learner/passes.py.)"""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Iterator

from records.run_dir import PHASES  # DESIGN.md's phase names, as timing.jsonl records them


class PhaseTimer:
    """Collects seconds per phase for one step; `total()` is wall time since construction."""

    def __init__(self) -> None:
        self._start = time.perf_counter()
        self.seconds: dict[str, float] = {}

    @contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        if phase not in PHASES:
            raise ValueError(f"unknown phase {phase!r}; phases are {', '.join(PHASES)}")
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[phase] = self.seconds.get(phase, 0.0) + time.perf_counter() - t0

    def add(self, measured: dict[str, float]) -> None:
        """Merge phases measured elsewhere (the learner workers report their own)."""
        for phase, seconds in measured.items():
            if phase not in PHASES:
                raise ValueError(f"unknown phase {phase!r} reported")
            self.seconds[phase] = self.seconds.get(phase, 0.0) + float(seconds)

    def total(self) -> float:
        return time.perf_counter() - self._start
