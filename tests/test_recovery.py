"""services/recovery.py's pure parts, the orchestrator's retry reporting, and what a learner restore records of
serving its adapter again. No Ray."""

from __future__ import annotations

import pytest

from services.orchestrator import with_retries
from services.recovery import Budget, RecoveryLog, backoff_delays, resume_what, retried_what


def test_log_keeps_earlier_attempts_and_feeds_late_subscribers():
    log = RecoveryLog(attempt=2, earlier=[{"part": "driver", "step": 3, "attempt": 1}])
    log.record("rollout", 4, "generate failed", 1.23456, errors=["RayActorError: died"])
    seen = []
    log.subscribe(seen.append)  # subscribed after the first entry: still sees it
    log.record("grader", 5, "ScoreBatch failed", 0.5)
    assert [e.part for e in seen] == ["rollout", "grader"]
    assert [e["part"] for e in log.all()] == ["driver", "rollout", "grader"]
    assert log.all()[1] == {"part": "rollout", "step": 4, "what": "generate failed", "seconds": 1.235,
                            "outcome": "recovered", "attempt": 2, "details": {"errors": ["RayActorError: died"]},
                            "outage_s": 1.235}  # no earlier quiet time known: the outage is the seconds
    log.record("learner", 6, "learner lost (stalled: ...)", 20.0, outage_s=52.5)
    assert (log.all()[-1]["seconds"], log.all()[-1]["outage_s"]) == (20.0, 52.5)
    with pytest.raises(ValueError, match="recovery outcome 'hung' is not one of"):
        log.record("learner", 6, "x", 1.0, outcome="hung")


def test_parts_are_a_bounded_set():
    with pytest.raises(ValueError, match="recovery part 'gpu' is not one of"):
        RecoveryLog().record("gpu", 1, "x", 0.0)


def test_budget_and_backoff():
    b = Budget(2)
    assert [b.take(), b.take(), b.take()] == [True, True, False] and b.used == 2
    assert backoff_delays(3, 0.5) == [0.5, 1.0, 2.0]


def test_with_retries_waits_the_backoff_delays(monkeypatch):
    """The orchestrator's retries (generate, score) sleep backoff_delays between attempts: one
    wait per failure, none after the call that answers or the last one that fails."""
    slept: list[float] = []
    monkeypatch.setattr("services.orchestrator.time.sleep", slept.append)
    failures = iter([ConnectionError("a"), ConnectionError("b"), ConnectionError("c")])

    def flaky():
        err = next(failures, None)
        if err is not None:
            raise err
        return "ok"

    assert with_retries(flaky, "generate (step 1)", 4, 0.5) == "ok"
    assert slept == backoff_delays(3, 0.5) == [0.5, 1.0, 2.0]
    slept.clear()
    with pytest.raises(ConnectionError, match="down"):
        with_retries(lambda: (_ for _ in ()).throw(ConnectionError("down")), "x", 2, 0.25)
    assert slept == backoff_delays(2, 0.25) == [0.25, 0.5]


def test_resume_line_only_after_an_attempt_that_did_not_complete():
    assert resume_what({"status": "completed"}, 3, 4) is None
    assert resume_what(None, 0, 1) is None
    line = resume_what({"status": "running"}, 2, 3)
    assert line.startswith("previous attempt died") and line.endswith("resumed from checkpoint step 2, training again from step 3")
    assert "(RuntimeError: boom)" not in resume_what({"status": "failed", "error": "boom"}, 0, 1)
    assert resume_what({"status": "failed", "error": "boom\ntrace"}, 0, 1) == (
        "previous attempt failed (boom); resumed from its start point, training again from step 1")


def test_with_retries_reports_a_saved_call_with_its_errors():
    calls, reports = [], []

    def flaky():
        calls.append(1)
        if len(calls) < 3:
            raise ConnectionError(f"replica gone #{len(calls)}\ntraceback")
        return "ok"

    assert with_retries(flaky, "generate (step 2)", 3, 0.0, lambda e, s: reports.append((e, s))) == "ok"
    (errors, seconds), = reports
    assert errors == ["ConnectionError: replica gone #1", "ConnectionError: replica gone #2"] and seconds >= 0
    assert retried_what("generate (step 2)", errors).startswith("generate (step 2) failed 2 times (ConnectionError")
    reports.clear()
    assert with_retries(lambda: 1, "x", 3, 0.0, lambda e, s: reports.append(e)) == 1 and reports == []
    with pytest.raises(ConnectionError):  # out of retries: the error, and no recovery reported
        with_retries(lambda: (_ for _ in ()).throw(ConnectionError("down")), "x", 1, 0.0, lambda e, s: reports.append(e))
    assert reports == []


def test_a_restored_learners_adapter_is_offered_again_and_the_answer_recorded():
    """What a learner restore records of serving the live version again (services/
    learner_recovery.py): taken, refused with the registry's reason, or the registry unreachable;
    nothing when no rollout takes re-exports. The restore itself is tests/test_multinode_e2e.py's."""
    from services.learner_recovery import RecoveringLearner
    from model.adapter import AdapterRef

    ref = AdapterRef(version=3, box=["ref"], checksum=7)

    def learner(reexport):
        return RecoveringLearner(lambda _: None, lambda step: None, 1, RecoveryLog(), reexport=reexport)

    offered = []
    assert learner(lambda r: offered.append(r))._serve_again(ref) == {"adapter_reexported": True}
    assert offered == [ref]
    assert learner(lambda r: "adapter v3 re-exported with other bytes")._serve_again(ref) == {
        "adapter_reexported": False, "reexport_refused": "adapter v3 re-exported with other bytes"}

    def unreachable(r):
        raise ConnectionError("registry actor died\nmore")

    assert learner(unreachable)._serve_again(ref) == {
        "adapter_reexported": False,
        "reexport_refused": "the registry did not answer (ConnectionError: registry actor died)"}
    assert learner(None)._serve_again(ref) == {}


def test_a_lost_learners_entry_names_the_workers_exception():
    from learner.job import LearnerLost
    from services.recovery import lost_learner_line

    tb = ("Traceback (most recent call last):\n  File \"learner/policy.py\", line 370, in _fence_read\n"
          "    check_owner(self.base_owner_pid)\n"
          "model.shared_base.OwnerGone: the replica that owned the shared base weights (pid 6449) is gone\n")
    err = LearnerLost("worker_error", f"learner command 'step' failed in learner rank 0 (pid 7):\n{tb}", detail=tb)
    assert lost_learner_line(err) == ("learner command 'step' failed in learner rank 0 (pid 7): "
                                      "OwnerGone: the replica that owned the shared base weights (pid 6449) is gone")
    lost = LearnerLost("timeout", "learner command 'step' took more than 1800 s")
    assert lost_learner_line(lost) == "learner command 'step' took more than 1800 s"


def test_a_nonfinite_step_is_not_retried_and_its_line_says_why():
    """A learner whose gradients went nan would go nan again from the same checkpoint and batch:
    the run stops with the worker's own words, it does not restart the learner."""
    import traceback

    import torch

    from learner.job import LearnerLost
    from learner.passes import NonFiniteGradients, refuse_nonfinite
    from services.recovery import learner_failure_retryable, lost_learner_line

    w = torch.nn.Parameter(torch.ones(2))
    try:
        refuse_nonfinite(float("nan"), torch.optim.AdamW([w]))
    except NonFiniteGradients:
        tb = traceback.format_exc()
    err = LearnerLost("worker_error", f"learner command 'step' failed in learner rank 0 (pid 7):\n{tb}", detail=tb)
    assert not learner_failure_retryable(err.kind, err.detail)
    assert lost_learner_line(err).startswith("learner command 'step' failed in learner rank 0 (pid 7): "
                                             "NonFiniteGradients: the learner's gradient norm is nan")
