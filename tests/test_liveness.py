"""Liveness as plain logic (no Ray): the stall deadline (config/liveness.py), the learner's
progress book (learner/progress.py), the registry's quiet replicas (rollout/registry.py) and what
a stalled learner's restore records (services/learner_recovery.py). The same rules with real
frozen processes are tests/test_multinode_e2e.py's SIGSTOP tests."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from pydantic import ValidationError

from config.liveness import LivenessConfig
from config.run import RunConfig
from learner.progress import ProgressBook
from rollout.registry import RegistryState
from services.recovery import RecoveryLog, learner_failure_retryable


def test_the_deadline_is_the_floor_until_measured_then_scales_with_the_slowest_interval():
    live = LivenessConfig(factor=4, floor_s=30, notice_s=5)
    assert live.deadline_s(None) == live.deadline_s(0.0) == 30  # first step: nothing measured
    assert live.deadline_s(2.0) == 30  # 4 x 2 s is below the floor
    assert live.deadline_s(12.5) == 50
    # nothing measured: half the floor (the tree default's first CPU micro-batch took 29 s, not a stall)
    assert not live.notice_due(14.9, None) and live.notice_due(15.0, None)
    assert not live.notice_due(4.9, 1.0) and live.notice_due(5.0, 1.0)  # notice_s
    assert not live.notice_due(9.0, 5.0) and live.notice_due(10.0, 5.0)  # twice the slowest interval
    # a stall that healed is recorded when it came within a factor 2 of its deadline
    assert not live.worth_recording(14.9, None) and live.worth_recording(15.0, None)
    assert not live.worth_recording(24.9, 12.5) and live.worth_recording(25.0, 12.5)
    assert RunConfig().liveness == LivenessConfig()  # a section of the run's one schema
    with pytest.raises(ValidationError, match="liveness.notice_s=30 must be below liveness.floor_s=30"):
        LivenessConfig(floor_s=30, notice_s=30)
    with pytest.raises(ValidationError, match="greater than 1"):
        LivenessConfig(factor=1)


def test_progress_book_times_the_quietest_rank_on_a_step_and_measures_intervals():
    book = ProgressBook(world_size=2)
    book.sent(0, now=0.0, judged=False)  # Init: a model load, not judged
    book.asked(0, 0, 0.0), book.asked(1, 0, 0.0)
    assert book.quiet(0, now=500.0) == (0.0, [])
    book.asked(0, 1, 40.0), book.asked(1, 1, 41.0)  # both done with Init, waiting for command 1
    assert book.slowest_interval_s == 0.0  # Init's time is not a measure
    book.sent(1, now=100.0, judged=True)  # a step: quiet counts from when it was sent, not the asking
    assert book.quiet(1, 103.0) == (3.0, [0, 1])
    book.heard(0, 1, 102.0), book.heard(1, 1, 102.5)
    book.heard(0, 1, 105.0), book.heard(1, 1, 103.0)
    assert book.slowest_interval_s == 3.0 and book.reports == {0: 2, 1: 2}
    assert book.quiet(1, 106.0) == (3.0, [1])  # rank 1 last reported at 103.0
    book.heard(1, 0, 106.0)  # a late report for a command it left: ignored
    assert book.quiet(1, 106.0) == (3.0, [1])
    book.asked(0, 2, 107.0)  # rank 0 finished the step (2 s after its last micro-batch)
    assert book.quiet(1, 110.0) == (7.0, [1]) and book.slowest_interval_s == 3.0
    book.asked(1, 2, 110.0)
    assert book.quiet(1, 200.0) == (0.0, [])  # no rank is on it any more
    assert book.slowest_interval_s == 7.0  # rank 1's last micro-batch to its end of the step
    book.sent(2, 300.0, judged=True)  # a rank frozen while idle never takes the next step
    book.asked(0, 3, 301.0)
    assert book.quiet(2, 330.0) == (30.0, [1])


def test_registry_names_silent_and_stuck_replicas_and_forgets_them_once_replaced():
    live = LivenessConfig(factor=4, floor_s=20, notice_s=5)
    state = RegistryState(keep=2, liveness_s=10)
    state.heartbeat("a", "app#R#a", 1, 100, now=0.0, node_id="n1")
    state.heartbeat("b", "app#R#b", 1, 100, now=0.0, node_id="n2", busy_s=1.0, slowest_call_s=3.0)
    assert state.quiet(4.0, live.deadline_s, live.notice_due) == []  # b: busy 5 s < 2 x its slowest 3 s
    state.heartbeat("b", "app#R#b", 1, 100, now=9.0, busy_s=10.0, slowest_call_s=3.0)  # in a call since -1.0
    notices = state.quiet(9.0, live.deadline_s, live.notice_due)
    assert [(q["replica_id"], q["replace"], q["quiet_s"]) for q in notices] == [("b", False, 10.0)]
    state.heartbeat("b", "app#R#b", 1, 100, now=21.0, busy_s=22.0, slowest_call_s=3.0)
    quiet = {q["replica_id"]: q for q in state.quiet(21.0, live.deadline_s, live.notice_due)}
    # a: silent 21 s (> replica_liveness_s 10); b: one call for 22 s > max(20, 4 x 3 s)
    assert quiet["a"]["replace"] and quiet["a"]["quiet_s"] == 21.0 and quiet["a"]["node_id"] == "n1"
    assert "no report for 21 s" in quiet["a"]["why"] and quiet["a"]["actor_name"] == "app#R#a"
    assert quiet["b"]["replace"] and quiet["b"]["quiet_s"] == 22.0 and "running for 22 s" in quiet["b"]["why"]
    assert state.snapshot(21.0)["replicas"] == {"b": 1}  # a is not live, but is not forgotten as quiet
    state.replaced("a")
    state.replaced("b")
    assert state.quiet(22.0, live.deadline_s, live.notice_due) == [] and state.snapshot(22.0)["replicas"] == {}
    assert state.tokens_total() == 200  # what they generated still counts
    state.heartbeat("c", "app#R#c", 1, 0, now=30.0)
    assert [q["replica_id"] for q in state.quiet(45.0, live.deadline_s, live.notice_due)] == ["c"]
    state.heartbeat("c", "app#R#c", 1, 0, now=46.0)  # it spoke again: slow, not dead
    assert state.quiet(46.0, live.deadline_s, live.notice_due) == []


def test_a_replica_that_stalled_and_went_on_is_kept_when_it_came_near_its_deadline():
    """registry.went_on: of the replicas noticed busy in one generate call, those that finished it
    by themselves after at least half their deadline (worth_recording) are the 'stalled' entries;
    a replaced one, a notice far from its deadline, and a 'replace' entry are not."""
    from rollout.registry import went_on

    live = LivenessConfig(factor=4, floor_s=20, notice_s=5)
    state = RegistryState(keep=2, liveness_s=30)
    for rid, busy in (("near", 12.0), ("far", 8.0), ("killed", 15.0), ("fresh", 11.0)):
        state.heartbeat(rid, f"app#R#{rid}", 1, 0, now=50.0, busy_s=busy, slowest_call_s=2.0)
    state.heartbeat("fresh", "app#R#fresh", 1, 0, now=50.0, busy_s=11.0)  # nothing measured: floor 20
    noticed = {q["replica_id"]: q for q in state.quiet(50.0, live.deadline_s, live.notice_due)}
    assert set(noticed) == {"near", "far", "killed", "fresh"} and not any(q["replace"] for q in noticed.values())
    assert noticed["near"]["slowest_s"] == 2.0 and noticed["fresh"]["slowest_s"] is None
    # deadline max(20, 4 x 2) = 20: near (12) and fresh (11) reached half of it, far (8) did not
    healed = went_on(noticed, replaced={"killed"}, worth=live.worth_recording)
    assert [q["replica_id"] for q in healed] == ["fresh", "near"]
    assert went_on({"x": {**noticed["near"], "replace": True}}, set(), live.worth_recording) == []


def test_a_grader_replica_counts_cases_and_batches_and_stalls_past_its_deadline():
    """graders/progress.py: a replica is judged only while a batch is in flight; each case it
    reports (code-exec's scripts) is progress, so a long batch of short cases is no stall, where
    one case that never ends is; the deadline is the liveness rule and never below the client's
    call timeout; the failure survives pickling (it crosses Ray to the pinger)."""
    import pickle

    from graders.autoscale import stall_of
    from graders.progress import GraderStalled, ScoringProgress

    now = [100.0]
    progress = ScoringProgress(clock=lambda: now[0])
    live = LivenessConfig(factor=4, floor_s=20, notice_s=5)
    now[0] = 500.0
    progress.check(live, call_timeout_s=10)  # idle for 400 s: nothing in flight, nothing judged
    assert progress.quiet_s() == 0.0
    progress.begin()
    assert progress.deadline_s(live, 10) == 20  # nothing measured: the floor
    for _ in range(30):  # a 90 s batch of 3 s cases: far past the floor, but never quiet
        now[0] += 3.0
        progress.case_done()
        progress.check(live, 10)
    assert progress.cases == 30 and progress.slowest_interval_s == 3.0
    now[0] += 1.0
    progress.end()
    assert progress.quiet_s() == 0.0 and progress.in_flight == 0
    now[0] += 1000.0  # idle time is no interval
    progress.begin()
    progress.begin()  # a second batch while the first is in flight: one replica, one clock
    now[0] += 19.9
    progress.check(live, 10)
    now[0] += 0.1
    with pytest.raises(GraderStalled, match="no progress for 20 s") as raised:
        progress.check(live, 10)
    assert (raised.value.quiet_s, raised.value.deadline_s) == (20.0, 20.0)
    assert progress.deadline_s(live, 45.0) == 45.0  # never sooner than the client gives a call up
    progress.check(live, 45.0)
    assert progress.deadline_s(LivenessConfig(factor=10, floor_s=20, notice_s=5), 10) == 30.0  # 10 x 3 s
    back = pickle.loads(pickle.dumps(raised.value))
    assert isinstance(back, GraderStalled) and (back.quiet_s, back.why) == (20.0, raised.value.why)
    assert stall_of(back) is back and stall_of(SimpleNamespace(cause=back)) is back
    assert stall_of(RuntimeError("the actor died")) is None


class _StallingJob:
    """A LearnerJob's driver-side surface, scripted: ``outcomes`` per step() call."""

    def __init__(self, outcomes, started):
        self.outcomes, self.started_jobs = outcomes, started
        self.last_stall = None
        started.append(self)

    def begin(self):
        pass

    def started(self):
        return SimpleNamespace(init_payload="adapter-v0")

    def start(self):
        return self.started()

    def step(self, batch):
        outcome = self.outcomes.pop(0)
        if isinstance(outcome, Exception):
            raise outcome
        self.last_stall = outcome.get("stall")
        return outcome["result"]

    def stop(self):
        pass


def test_a_stalled_learner_is_restored_with_its_outage_and_a_stall_that_healed_is_recorded():
    from learner.job import LearnerLost
    from services.learner_recovery import RecoveringLearner

    assert learner_failure_retryable("stalled")
    jobs: list = []
    r1, replayed, r2 = (SimpleNamespace(adapter=f"adapter-{n}") for n in ("r1", "r1-again", "r2"))
    script = [
        [{"result": r1, "stall": (12.0, [0])}, LearnerLost("stalled", "learner rank [0] made no progress", quiet_s=41.0,
                                                             deadline_s=40.0)],
        [{"result": replayed}, {"result": r2}],
    ]
    log = RecoveryLog()
    learner = RecoveringLearner(lambda resume: _StallingJob(script.pop(0), jobs), lambda step: None, 1, log)
    learner.start()
    assert learner.step("b1") is r1
    assert learner.step("b2") is r2  # step 2 stalled: the learner was restored, b1 re-fed, b2 trained
    healed, restored = log.all()
    assert healed["outcome"] == "stalled" and healed["step"] == 1 and healed["outage_s"] == 12.0
    assert healed["what"] == "learner rank [0] made no progress for 12 s in step 1, then went on by itself"
    assert restored["outcome"] == "recovered" and restored["step"] == 2 and "stalled" in restored["what"]
    assert restored["details"]["quiet_before_seen_s"] == 41.0 and restored["details"]["stall_deadline_s"] == 40.0
    assert restored["outage_s"] == pytest.approx(41.0 + restored["seconds"], abs=1e-3)
    assert len(jobs) == 2


class _PlacedJob(_StallingJob):
    def __init__(self, outcomes, started, node):
        super().__init__(outcomes, started)
        self.node = node

    def workers(self):
        return [{"rank": 0, "node_id": self.node, "pid": 1}]


def test_a_learner_restored_after_its_node_died_is_a_node_entry_naming_where_it_moved():
    from learner.job import LearnerLost
    from services.learner_recovery import RecoveringLearner

    jobs: list = []
    script = [([LearnerLost("train_run_ended", "the learner's Ray Train run ended during 'step'")], "node-a" * 4),
              ([{"result": SimpleNamespace(adapter="a1")}], "node-b" * 4)]

    def make(resume):
        outcomes, node = script.pop(0)
        return _PlacedJob(outcomes, jobs, node)

    log = RecoveryLog()
    from services.placement import Node

    cluster = [Node(node_id="node-a" * 4, alive=False, labels={}, resources={}),
               Node(node_id="node-b" * 4, alive=True, labels={}, resources={})]
    learner = RecoveringLearner(make, lambda step: None, 1, log, nodes=lambda: cluster)
    learner.start()
    learner.step("b1")
    (entry,) = log.all()
    assert entry["part"] == "node" and entry["outcome"] == "recovered", entry
    assert entry["what"].startswith("node node-anode-a (learner) is gone; learner lost (train_run_ended: ")
    assert entry["what"].endswith("on node node-bnode-b")
    assert entry["details"]["lost_nodes"] == ["node-a" * 4] and entry["details"]["moved_to"] == ["node-b" * 4]
    # the node alive: the same loss is the learner's
    script[:] = [([LearnerLost("train_run_ended", "ended")], "node-b" * 4), ([{"result": SimpleNamespace(adapter="a")}] * 2, "node-b" * 4)]
    log2 = RecoveryLog()
    learner = RecoveringLearner(make, lambda step: None, 1, log2, nodes=lambda: cluster)
    learner.start()
    learner.step("b1")
    assert [e["part"] for e in log2.all()] == ["learner"]
