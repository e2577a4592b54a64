"""The liveness section: when a part that is alive to the OS and to Ray but makes no progress
(a SIGSTOPped process, a hung collective, a wedged engine) counts as failed.

A part's progress is what it reports while it works: a learner worker each micro-batch of a step
(learner/progress.py), a rollout replica each heartbeat and each finished generate call
(rollout/registry.py), a grader replica each batch and each case it scores (graders/progress.py:
its own health check applies the rule, never sooner than grader.timeout_s). The deadline is
derived from what the run has measured, not fixed: a part is stalled once it has been quiet for
``factor`` times the slowest interval between two of its reports seen so far in the run, and
never sooner than ``floor_s`` (which is also the whole
deadline before anything has been measured: the run's first step). A stalled part is killed and
replaced by the recovery paths a crash takes (README, "What survives what"); the recovery entry's
``outage_s`` counts from the part's last progress to service restored.

This module imports pydantic only.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator


class LivenessConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    factor: float = Field(
        4.0, gt=1, description="A part is stalled once it has made no progress for factor x the slowest "
        "interval between two of its progress reports seen so far in the run (a learner worker reports "
        "every micro-batch; a rollout replica every generate call it finishes)."
    )
    floor_s: float = Field(
        120.0, gt=0, description="The stall deadline is never shorter than this, and is this alone until "
        "an interval has been measured (the first step, which also pays one-time costs: kernels "
        "compiled, graphs captured, caches filled)."
    )
    notice_s: float = Field(
        10.0, gt=0, description="A console line once a part has been quiet this long and longer than twice "
        "its slowest measured interval (half of floor_s before anything is measured). A part that then "
        "goes on by itself is a recovery entry with outcome 'stalled' if it was quiet half its deadline."
    )

    @model_validator(mode="after")
    def _notice_before_the_deadline(self) -> "LivenessConfig":
        if self.notice_s >= self.floor_s:
            raise ValueError(f"liveness.notice_s={self.notice_s:g} must be below liveness.floor_s={self.floor_s:g}: "
                             "the notice would come after the part is already killed")
        return self

    def deadline_s(self, slowest_interval_s: float | None) -> float:
        """Seconds of no progress after which a part whose slowest measured interval between two
        progress reports is ``slowest_interval_s`` (None: nothing measured yet) counts as stalled."""
        if not slowest_interval_s:
            return self.floor_s
        return max(self.floor_s, self.factor * slowest_interval_s)

    def notice_due(self, quiet_s: float, slowest_interval_s: float | None) -> bool:
        """Whether a part quiet for ``quiet_s`` deserves a console line (it may still go on):
        past notice_s and twice its slowest interval; before anything is measured, past half the
        floor (a first step's one-time costs are not a stall: the tree default's first CPU
        micro-batch takes ~30 s)."""
        if not slowest_interval_s:
            return quiet_s >= max(self.notice_s, self.floor_s / 2)
        return quiet_s >= max(self.notice_s, 2 * slowest_interval_s)

    def worth_recording(self, quiet_s: float, slowest_interval_s: float | None) -> bool:
        """Whether a part that went quiet and then went on by itself is a recovery entry (outcome
        'stalled'): it came within a factor 2 of being killed."""
        return quiet_s >= self.deadline_s(slowest_interval_s) / 2
