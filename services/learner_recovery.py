"""The learner as the step loop sees it, restored in the run when its Ray Train workers die.

``RecoveringLearner`` wraps learner/job.py's LearnerJob. A step whose learner is lost (a worker
process or its node died: ``LearnerLost``, judged by services/recovery.py
``learner_failure_retryable``) is not the run's end while ``learner.max_restarts`` allows: the
old job is stopped, a new one starts from the last checkpoint this run saved (or from the run's
start point: its init adapter, or the seeded one again), is fed the batches trained since that
checkpoint again (``BatchLedger``: the same batches in the same order; the optimizer and LR
scheduler come back with the checkpoint), and the lost step's batch is sent again. The replayed
steps' adapters are never published: the next version published is the lost step's, one newer
than any a replica holds, so DESIGN.md's "versions only grow" contract stands and a replica
cannot serve a rewound adapter. Each restore is one `recoveries` entry (part "learner").

The live version's payload was an object the old rank 0 owned, so it died with it: a replica
that starts (or restarts) before the next publish could not fetch it. After the replay the
restored learner holds that very adapter, so its export is handed to ``reexport`` (the rollout
client: the registry serves it from the new ref when its checksum is the published one). The
entry's details say whether it was taken (``adapter_reexported``) or why not
(``reexport_refused``: a replay that did not reproduce the bytes; requests for that version
then fail until the next step publishes, as before).

A worker that raised an error of its own (a bug, bad input) is not restored: it would fail again.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any, Callable

from services.placement import Held, Node, lost_parts
from services.recovery import BatchLedger, Budget, first_line, learner_failure_retryable, learner_what, lost_learner_line

log = logging.getLogger("counterpoint.train")


class RecoveringLearner:
    def __init__(self, make_job: Callable[[Path | None], Any], checkpoint_of: Callable[[int], Path],
                 max_restarts: int, recoveries: Any, trained: int = 0,
                 reexport: Callable[[Any], str | None] | None = None,
                 nodes: Callable[[], list[Node]] | None = None) -> None:
        """``make_job(resume_from)`` builds a LearnerJob (not started); ``checkpoint_of(step)`` is
        the run directory's checkpoints/step_<step>; ``trained``: the step the first job starts at
        (0, or the checkpoint a --resume starts from); ``reexport(adapter)``: where a restored
        learner's adapter goes (None when taken, else why not); ``nodes()``: the cluster's nodes
        (services/cluster.py), so a restore after the workers' node died is a ``node`` entry."""
        self._make_job, self._checkpoint_of = make_job, checkpoint_of
        self._reexport = reexport
        self._nodes = nodes
        self.budget = Budget(max_restarts)
        self.recoveries = recoveries
        self.trained = trained
        self.ledger = BatchLedger(trained)
        self.job: Any = None

    def start(self, resume_from: Path | None = None) -> Any:
        self.begin(resume_from)
        return self.started()

    def begin(self, resume_from: Path | None = None) -> None:
        """The first job's workers start; ``started()`` waits for them (the driver starts the
        rollout in between)."""
        self.job = self._make_job(resume_from)
        self.job.begin()

    def started(self) -> Any:
        return self.job.started()

    def workers(self) -> list[dict]:
        return self.job.workers() if self.job is not None else []

    def step(self, batch: Any) -> Any:
        from learner.job import LearnerLost

        step = self.trained + 1
        while True:
            try:
                result = self.job.step(batch)
                self._went_on(step)
                break
            except LearnerLost as err:
                if not learner_failure_retryable(err.kind, err.detail):
                    raise
                if not self.budget.take():
                    self.recoveries.record("learner", step, f"learner lost ({err.kind}: {first_line(str(err))}); "
                                           f"learner.max_restarts={self.budget.limit} spent: the run stops",
                                           0.0, outcome="stopped")
                    raise
                self._restore(step, err)
        self.ledger.add(step, batch)
        self.trained = step
        return result

    def _restore(self, step: int, err: Exception) -> None:
        t0 = time.monotonic()
        source = self.ledger.checkpoint_step
        log.warning("learner lost at step %d (%s); restoring it from %s (restart %d/%d)", step,
                    first_line(str(err)), f"checkpoint step {source}" if source else "the run's start point",
                    self.budget.used, self.budget.limit)
        lost_on = _workers(self.job)
        self.job.stop()
        self.job = self._make_job(self._checkpoint_of(source) if source else None)
        current = self.job.start().init_payload
        kept_since = self.ledger.replay(self.trained)
        for kept in kept_since:
            current = self.job.step(kept.batch).adapter  # not published again: that version is live
        replayed = [k.step for k in kept_since]
        served = self._serve_again(current)
        seconds = time.monotonic() - t0
        quiet = float(getattr(err, "quiet_s", 0.0) or 0.0)
        if getattr(err, "deadline_s", None) is not None:
            served["stall_deadline_s"] = round(err.deadline_s, 3)
        part, what = "learner", learner_what(getattr(err, "kind", "lost"), lost_learner_line(err), source, replayed,
                                             f"step {step}")
        dead = self._dead_nodes(lost_on)
        if dead:  # the workers' node is gone: a node outage, the learner moved
            moved_to = sorted({w["node_id"] for w in _workers(self.job)})
            part, what = "node", f"node {', '.join(n[:12] for n in dead)} (learner) is gone; {what} on node " \
                                 f"{', '.join(n[:12] for n in moved_to)}"
            served.update(lost_nodes=dead, moved_to=moved_to)
        self.recoveries.record(
            part, step, what,
            seconds, outage_s=quiet + seconds, quiet_before_seen_s=round(quiet, 3), restored_from_step=source,
            replayed_steps=replayed, restart=self.budget.used, max_restarts=self.budget.limit, **served)
        log.warning("learner serving again at step %d, %.0f s after its last progress", step, quiet + seconds)

    def _dead_nodes(self, workers: list[dict]) -> list[str]:
        if self._nodes is None or not workers:
            return []
        try:
            known = self._nodes()
        except Exception as err:  # a record: never the reason a restore fails
            log.warning("could not tell whether the learner's node is alive: %s", first_line(err))
            return []
        held = [Held("learner", f"rank {w['rank']}", w["node_id"], w.get("pid")) for w in workers]
        return sorted(lost_parts(held, known))

    def _went_on(self, step: int) -> None:
        """A step that went quiet past liveness.notice_s and then finished by itself: recorded
        (outcome 'stalled'), so an outage that healed is not lost."""
        stall = getattr(self.job, "last_stall", None)
        if stall:
            quiet, ranks = stall
            self.recoveries.record("learner", step, f"learner rank {ranks} made no progress for {quiet:.0f} s in "
                                   f"step {step}, then went on by itself", quiet, outcome="stalled",
                                   outage_s=quiet, quiet_ranks=ranks)

    def _serve_again(self, adapter: Any) -> dict[str, Any]:
        """The live version from the restored learner (see the module's note), for the entry."""
        if self._reexport is None:
            return {}
        try:
            why = self._reexport(adapter)
        except Exception as err:  # the registry unreachable, say: the restored run goes on without it
            why = f"the registry did not answer ({type(err).__name__}: {first_line(str(err))})"
        if why is not None:
            log.warning("the restored learner's adapter v%d is not served again: %s", adapter.version, why)
            return {"adapter_reexported": False, "reexport_refused": why}
        return {"adapter_reexported": True}

    def save_checkpoint(self, step: int, data_position: dict[str, Any] | None = None) -> Path:
        path = self.job.save_checkpoint(step, data_position)
        self.ledger.checkpointed(step)  # on the driver's disk: nothing before it is needed again
        return path

    def stop(self) -> None:
        if self.job is not None:
            self.job.stop()


def _workers(job: Any) -> list[dict]:
    """Where a job's workers run ([] when its coordinator cannot say)."""
    try:
        return list(job.workers())
    except Exception:
        return []
