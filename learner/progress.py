"""Learner progress as plain state (no Ray import): what the coordinator actor (learner/job.py)
knows of each worker's progress on the command it works on, so the driver can tell a slow step
from a frozen worker (config/liveness.py).

A worker is *on* command i from the moment i is in the log (or it asked for i, if later) until it
asks for i+1. While it is on a step it reports each micro-batch (``heard``); its quiet time is
how long since its last report, or since the step was sent when that is later. The run's slowest
interval between two reports of one worker on a step is the measure the deadline scales with.
Init and Save carry no micro-batch reports (a model load, a checkpoint write): only steps are
measured and judged.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ProgressBook:
    world_size: int
    sent_at: dict[int, float] = field(default_factory=dict)  # command index -> when it entered the log
    judged: set[int] = field(default_factory=set)  # indexes of commands whose progress is judged (steps)
    on: dict[int, int] = field(default_factory=dict)  # rank -> the command index it works on
    last: dict[int, float] = field(default_factory=dict)  # rank -> its last report (or asking for `on`)
    reports: dict[int, int] = field(default_factory=dict)  # rank -> micro-batch reports, whole run
    slowest_interval_s: float = 0.0  # the longest interval between two reports of one rank on a step

    def sent(self, index: int, now: float, judged: bool) -> None:
        self.sent_at[index] = now
        if judged:
            self.judged.add(index)

    def asked(self, rank: int, index: int, now: float) -> None:
        """Rank finished index-1 (if any) and waits for (or takes) command ``index``."""
        if self.on.get(rank) == index - 1:
            self._interval(rank, now)  # its last micro-batch to the end of the step
        self.on[rank], self.last[rank] = index, now

    def heard(self, rank: int, index: int, now: float) -> None:
        """Rank reported progress (a micro-batch done) on command ``index``."""
        if self.on.get(rank) != index:
            return  # a report that arrived after the rank moved on (reports are not awaited)
        self._interval(rank, now)
        self.last[rank] = now
        self.reports[rank] = self.reports.get(rank, 0) + 1

    def _interval(self, rank: int, now: float) -> None:
        index = self.on.get(rank)
        if index in self.judged:
            since = max(self.last.get(rank, now), self.sent_at.get(index, now))
            self.slowest_interval_s = max(self.slowest_interval_s, now - since)

    def quiet(self, index: int, now: float) -> tuple[float, list[int]]:
        """(seconds, ranks): how long the quietest rank still on command ``index`` has made no
        progress, and which ranks are that quiet (0.0 and [] once no rank is on it, or for a
        command that is not judged). A rank that never asked for it counts from when it was sent."""
        if index not in self.judged or index not in self.sent_at:
            return 0.0, []
        quiet: dict[int, float] = {}
        for rank in range(self.world_size):
            if self.on.get(rank, -1) > index:
                continue  # done with it
            since = max(self.last.get(rank, 0.0), self.sent_at[index]) if self.on.get(rank) == index \
                else self.sent_at[index]
            quiet[rank] = now - since
        if not quiet:
            return 0.0, []
        worst = max(quiet.values())
        return worst, sorted(r for r, q in quiet.items() if q == worst)
