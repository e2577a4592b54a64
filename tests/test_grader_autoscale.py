"""Grader autoscaling shown (issue 25): a Serve grader app with min 1 / max 3 replicas, started
the way a trainer starts its own (services/launch.py start_grader, the grpcio front), scales up
under concurrent clients (replica count read from serve.status()), answers every call correctly
while it scales, and scales back down once the load stops; the trainer's /metrics (the real
TrainerMetrics with the replica watch) carries the replica count and the scale events, scraped
by a real Prometheus and queried with the dashboard panel's own queries. Once for voice-leading
and once for code-exec, whose replicas reserve more CPU (their scripts run inside them).

The load is concurrency, not CPU (2 shared cores): in-flight ScoreBatch calls of a few thousand
completions, or scripts that sleep 1 s. Serve's delays are the config's, small here; Ray 2.60
pushes the in-flight counts every metrics_interval_s, here 1 s, so a scale step takes seconds.
"""

from __future__ import annotations

import contextlib
import threading
import time
from types import SimpleNamespace
from contextlib import ExitStack

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from config import RunConfig
from graders.autoscale import (
    REPLICA_STATES,
    ReplicaWatch,
    ScaleCollector,
    ScaleTally,
    replica_counts,
    scale_step,
)
from graders.client import GraderClient
from promharness import DASHBOARD, PromServer, assert_all_queries_return_data, panel_exprs
from rayharness import local_ray

PANEL = "Grader replicas and scale events"
# Small delays so a test sees both directions in seconds (the defaults are Serve's: 30 s up,
# 600 s down). Serve pushes in-flight counts every metrics_interval_s (10 s by default, which made
# each scale step take 10-20 s); here every second. The look-back stays above that interval
# (Serve warns below). The downscale delay is longer than the look-back: Serve averages in-flight
# requests over that window, so for a while after the load stops it still holds the load's calls;
# with a delay shorter than the window the app went 3 -> 1 and straight back to 2 on that stale
# average (seen here), then down again.
QUICK = {"min_replicas": 1, "max_replicas": 3, "upscale_delay_s": 1.0, "downscale_delay_s": 6.0,
         "look_back_period_s": 4.0, "metrics_interval_s": 1.0, "replica_poll_s": 0.5}
HEAVY_CLIENTS = 6
SCALE_WAIT_S = 180  # bound on each scale step; Serve needs ~10-20 s here


# --- the pure parts -----------------------------------------------------------------------


def test_replica_counts_name_every_state_and_fold_unknown_ones():
    from ray.serve._private.common import ReplicaState

    counts = replica_counts({ReplicaState.RUNNING: 2, "STARTING": 1, "WARMING_UP": 1})
    assert set(counts) == set(REPLICA_STATES)
    assert (counts["running"], counts["starting"], counts["other"], counts["stopping"]) == (2, 1, 1, 0)
    assert {s.value.lower() for s in ReplicaState} <= set(REPLICA_STATES)  # Ray's states all named


def test_scale_step_counts_replicas_not_reads():
    assert scale_step(None, 3) == {"up": 0, "down": 0}  # the baseline
    assert scale_step(1, 3) == {"up": 2, "down": 0}
    assert scale_step(3, 1) == {"up": 0, "down": 2}
    assert scale_step(2, 2) == {"up": 0, "down": 0}


def test_tally_exports_counts_bounds_and_events():
    tally = ScaleTally(bounds=(1, 3))
    for t, running in enumerate([1, 1, 2, 3, 3, 1]):
        tally.observe({"RUNNING": running, **({"STARTING": 1} if running == 2 else {})}, 100.0 + t)
    summary = tally.summary()
    assert summary["scale_events"] == {"up": 2, "down": 2}
    assert (summary["running_min"], summary["running_max"]) == (1, 3)
    assert summary["changes"] == [[0.0, 1], [2.0, 2], [3.0, 3], [5.0, 1]]
    registry = CollectorRegistry()
    registry.register(ScaleCollector(tally.snapshot))
    text = generate_latest(registry).decode()
    assert 'counterpoint_grader_replicas{state="running"} 1.0' in text
    assert 'counterpoint_grader_replicas{state="starting"} 0.0' in text
    assert 'counterpoint_grader_replica_bounds{bound="max"} 3.0' in text
    assert 'counterpoint_grader_scale_events_total{direction="up"} 2.0' in text
    assert 'counterpoint_grader_scale_events_total{direction="down"} 2.0' in text


def test_watch_skips_a_failed_read_rather_than_count_replicas_gone():
    reads = iter([{"RUNNING": 2}, RuntimeError("controller restarting"), None, {"RUNNING": 3}])

    def read():
        item = next(reads)
        if isinstance(item, Exception):
            raise item
        return item

    watch = ReplicaWatch("app", "Grader", (1, 3), poll_s=3600, read=read)
    for _ in range(4):
        watch.poll()
    assert watch.snapshot()["events"] == {"up": 1, "down": 0}
    assert watch.summary()["failed_reads"] == 2


def test_a_spell_with_no_running_replica_is_timed_and_taken_once():
    """Every replica gone (killed: Serve starts others) until one runs again is one spell, timed
    from the read that saw none running to the read that saw one; the baseline and a failed read
    start none, and the spells are handed out once (ReplicaWatch.take_empty_spells)."""
    reads = iter([{"RUNNING": 0, "STARTING": 2}, {"RUNNING": 2}, {"RUNNING": 0, "STOPPING": 2}, None,
                  {"RUNNING": 0, "STARTING": 2}, {"RUNNING": 1, "STARTING": 1}, {"RUNNING": 2}])
    clock = iter([100.0, 101.0, 102.5, 104.0, 109.0, 110.0])  # a failed read reads no clock
    watch = ReplicaWatch("app", "Grader", (2, 2), poll_s=3600, read=lambda: next(reads), clock=lambda: next(clock))
    for _ in range(7):
        watch.poll()
    # the baseline (0 running while the app starts) is no spell; 102.5 -> 109.0 is one
    assert watch.take_empty_spells() == [(102.5, 6.5)]
    assert watch.take_empty_spells() == []


def test_grader_outages_become_recovery_entries_on_the_step_loop():
    from services.orchestrator import record_grader_outages
    from services.recovery import RecoveryLog

    log = RecoveryLog(attempt=1)
    spells = [[(1000.0, 6.5)], []]
    parts = SimpleNamespace(grader_outages=lambda: spells.pop(0), recoveries=log)
    record_grader_outages(parts, 3)
    record_grader_outages(parts, 4)
    (entry,) = log.all()
    assert (entry["part"], entry["step"], entry["outcome"], entry["outage_s"]) == ("grader", 3, "recovered", 6.5)
    assert entry["what"] == "the grader app had no running replica for 6.5 s; Serve started new ones"


def test_quiet_replicas_are_those_that_answered_once_then_left_a_ping_unanswered():
    from graders.autoscale import quiet_replicas

    last = {"a": 100.0, "b": 100.0, "c": 109.0}
    pending = {"a": 101.0, "b": 106.0, "c": 110.0, "new": 100.0}  # "new" never answered: left alone
    assert quiet_replicas(last, pending, now=111.0, liveness_s=5.0) == [("a", 11.0), ("b", 11.0)]
    assert quiet_replicas(last, pending, now=105.9, liveness_s=5.0) == []
    assert quiet_replicas(last, {}, now=500.0, liveness_s=5.0) == []  # nothing outstanding: all answered


def test_a_frozen_replica_the_driver_killed_is_named_in_the_grader_entry():
    """services/orchestrator.py: the replicas the pinger killed reach the step's grader entry,
    with the outage counted from their last answer (the ScoreBatch's own retry seconds count
    from its first error only)."""
    from services.orchestrator import record_grader_retry
    from services.recovery import RecoveryLog

    log = RecoveryLog(attempt=1)
    parts = SimpleNamespace(recoveries=log)
    now = time.monotonic()
    killed = [(now - 2.0, {"replica_id": "grader#GraderDeployment#x1", "quiet_s": 6.0, "why": "no answer"})]
    record_grader_retry(parts, 4, "ScoreBatch (step 4) retried", 1.5, killed, errors=["ScoreBatch UNAVAILABLE"])
    (entry,) = log.all()
    assert entry["what"] == ("ScoreBatch (step 4) retried; grader replica grader#GraderDeployment#x1 made no "
                             "progress and was replaced")
    assert entry["seconds"] == 1.5 and 8.0 <= entry["outage_s"] < 9.0  # 6 s quiet before the kill, 2 s since
    assert entry["details"]["replaced_quiet"] == [{"replica_id": "grader#GraderDeployment#x1", "why": "no answer",
                                                   "quiet_s": 6.0}]


# --- a real Serve app, real clients, a real Prometheus ----------------------------------------


@pytest.fixture(scope="module")
def ray_cluster(request):
    with local_ray(request, num_cpus=2):
        yield


def _running(app: str) -> int:
    """RUNNING replicas of the app's grader deployment, as Serve's controller reports them."""
    from ray import serve

    from graders.serve_app import DEPLOYMENT_NAME

    status = serve.status().applications.get(app)
    if status is None or DEPLOYMENT_NAME not in status.deployments:
        return 0
    return status.deployments[DEPLOYMENT_NAME].replica_states.get("RUNNING", 0)


class Load:
    """``clients`` threads, each with its own GraderClient, calling ``ask(client, tag)`` in a
    loop until stopped; ``ask`` returns (problem or None, who answered). Every answer is checked
    as it arrives; a wrong one or an error ends its thread and is kept in ``errors``."""

    def __init__(self, address: str, ask, clients: int, name: str) -> None:
        self.address, self.ask, self.name = address, ask, name
        self.stop = threading.Event()
        self.answers: list[tuple[float, str]] = []  # (monotonic time, who answered)
        self.errors: list[str] = []
        self.threads = [threading.Thread(target=self._run, args=(k,), daemon=True) for k in range(clients)]

    def _run(self, k: int) -> None:
        with GraderClient(self.address, timeout_s=120, max_retries=2) as client:
            i = 0
            while not self.stop.is_set():
                tag = f"{self.name}{k}-{i}"
                i += 1
                try:
                    problem, who = self.ask(client, tag)
                except Exception as exc:  # noqa: BLE001 - reported with its type below
                    problem, who = f"{type(exc).__name__}: {exc}", None
                if problem:
                    self.errors.append(f"{tag}: {problem}")
                    return
                self.answers.append((time.monotonic(), who))

    def start(self) -> Load:
        for t in self.threads:
            t.start()
        return self

    def finish(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=300)
        assert not any(t.is_alive() for t in self.threads), f"{self.name} clients hung"


def _scale_up_and_down(app: str, address: str, ask, answered_by) -> dict:
    """Drive the app through a scale-up and a scale-down; returns the timeline.

    Six clients load it until Serve runs 3 replicas and all three have answered, then stop; one
    client keeps calling through the scale-down (so answers are checked while replicas go)."""
    assert _running(app) == 1, "the app should start at min_replicas"
    timeline: list[tuple[float, int]] = [(time.monotonic(), 1)]

    def wait(until, what: str, loads) -> None:
        deadline = time.monotonic() + SCALE_WAIT_S
        while True:
            running = _running(app)
            if running != timeline[-1][1]:
                timeline.append((time.monotonic(), running))
            errors = [e for load in loads for e in load.errors]
            assert not errors, f"wrong answers or errors while scaling: {errors[:5]}"
            if until(running):
                return
            assert time.monotonic() < deadline, (
                f"{what} not within {SCALE_WAIT_S} s; running replicas over time (s, n): "
                f"{[(round(t - timeline[0][0], 1), n) for t, n in timeline]}")
            time.sleep(0.5)

    heavy = Load(address, ask, HEAVY_CLIENTS, "heavy").start()
    trickle = Load(address, ask, 1, "trickle").start()
    try:
        wait(lambda n: n == 3, "scale-up to 3 replicas", [heavy, trickle])
        t_three = time.monotonic()
        wait(lambda n: len(answered_by(heavy)) == 3 or n < 3,
             "all 3 replicas answering", [heavy, trickle])
        assert len(answered_by(heavy)) == 3, f"replicas answered: {answered_by(heavy)}"
        heavy.finish()
        t_stopped = time.monotonic()
        wait(lambda n: n == 1, "scale-down to 1 replica after the load stopped", [trickle])
        t_one = time.monotonic()
        deadline = time.monotonic() + 60  # one answer from the scaled-down app, too
        while not any(t > t_one for t, _ in trickle.answers) and time.monotonic() < deadline:
            time.sleep(0.2)
    finally:
        heavy.finish()
        trickle.finish()
    errors = heavy.errors + trickle.errors
    assert not errors, f"wrong answers or errors while scaling: {errors[:5]}"
    answers = heavy.answers + trickle.answers
    t0 = timeline[0][0]
    phases = {
        "scaling up": sum(t0 < t <= t_three for t, _ in answers),
        "at 3 replicas": sum(t_three < t <= t_stopped for t, _ in answers),
        "scaling down": sum(t_stopped < t <= t_one for t, _ in answers),
        "back at 1": sum(t > t_one for t, _ in answers),
    }
    assert all(phases.values()), f"correct answers per phase: {phases}"
    return {"running (s, n)": [(round(t - t0, 1), n) for t, n in timeline], "answers": phases}


def _serve_with_trainer_metrics(cfg: RunConfig, stack: ExitStack):
    """The trainer's path: its own grader app (start_grader), its /metrics (TrainerMetrics)
    with the replica watch (watch_grader), a Prometheus scraping it every second."""
    from ray import serve

    from services.launch import start_grader, watch_grader
    from services.metrics import TrainerMetrics

    client = start_grader(cfg, stack)
    stack.callback(serve.delete, cfg.grader.app_name)  # frees its CPUs for the next test
    metrics = TrainerMetrics(port=0)
    watch = watch_grader(cfg, stack, metrics.registry)
    port = metrics.start()
    stack.callback(metrics.stop)
    prom = stack.enter_context(PromServer({"counterpoint-trainer": [f"127.0.0.1:{port}"]}))
    # The baseline (1 replica) must be scraped before the load starts.
    assert_all_queries_return_data(prom, ['counterpoint_grader_replicas{state="running"}'])
    return client, watch, prom


def _check_metrics_and_panel(prom: PromServer, watch, start_wall: float) -> None:
    """What /metrics carried, as Prometheus scraped it and the dashboard panel queries it."""
    time.sleep(2.5)  # two scrapes after the last change
    end = time.time()
    exprs = panel_exprs(DASHBOARD, PANEL)
    assert_all_queries_return_data(prom, exprs)
    (running,) = prom.query_range('counterpoint_grader_replicas{state="running"}', start_wall, end)
    values = [float(v) for _, v in running["values"]]
    assert (values[0], max(values), values[-1]) == (1.0, 3.0, 1.0), values
    events = {s["metric"]["direction"]: float(s["value"][1])
              for s in prom.query("counterpoint_grader_scale_events_total")}
    shown = watch.summary()["scale_events"]
    assert events == {k: float(v) for k, v in shown.items()}, (events, shown)
    assert events["up"] == events["down"] >= 2, events  # 1 -> 3 -> 1, through 2 or not
    # The panel's bars: replicas added and removed at some instant of the run.
    (bars,) = [e for e in exprs if "scale_events" in e]
    peaks = {s["metric"]["direction"]: max(float(v) for _, v in s["values"])
             for s in prom.query_range(bars, start_wall, end)}
    assert peaks.get("up", 0) > 0 and peaks.get("down", 0) > 0, peaks


@pytest.mark.slow
def test_voice_leading_grader_scales_up_and_down(ray_cluster):
    from graders.voice_leading import score

    cfg = RunConfig(grader={**QUICK, "app_name": "grader-vl-scale", "num_cpus": 0.2,
                            "target_ongoing_requests": 2})
    with ExitStack() as stack:
        client, watch, prom = _serve_with_trainer_metrics(cfg, stack)
        cases = client.cases(8)
        shapes = ['[{"measure": 1, "degrees": [0, 1]}]', "prose", '[{"measure": 1, "degrees": [0, 0]}]']
        # ~0.1-0.5 s of scoring per call: several calls stay in flight per client thread's turn
        pairs = [(cases[i % 8].id, shapes[i % 3]) for i in range(2000)]
        expected = [score(cases[i % 8].progression, shapes[i % 3]).verdict for i in range(len(pairs))]

        def ask(c: GraderClient, tag: str):
            got = [s.verdict for s in c.score_batch(pairs)]
            return (None if got == expected else f"verdicts differ at {_first_difference(got, expected)}"), None

        def answered_by(_load) -> set[str]:
            # Health answers from one replica; its counter says whether that replica scored.
            for _ in range(5):
                health = client.health()
                if health.counters["scored"] > 0:
                    scored.add(health.replica)
            return set(scored)

        scored: set[str] = set()
        start_wall = time.time()
        run = _scale_up_and_down(cfg.grader.app_name, client.address, ask, answered_by)
        _check_metrics_and_panel(prom, watch, start_wall)
        # every replica answered the driver's pings while it scored under load: none taken for frozen
        assert watch.pinger.last_answer and watch.take_replaced() == []
    print("voice-leading:", run)


def _first_difference(got, expected) -> str:
    i = next((i for i, (a, b) in enumerate(zip(got, expected)) if a != b), min(len(got), len(expected)))
    return f"{i}: {got[i:i + 1]} vs {expected[i:i + 1]} (lengths {len(got)}, {len(expected)})"


@pytest.mark.slow
def test_code_exec_grader_scales_up_and_down(ray_cluster, tmp_path_factory):
    """Code-exec replicas reserve the CPUs their scripts use (num_cpus 0.5 here, one script at
    a time): three take 1.5 of the cluster's 2 CPUs, so each scale-up is Ray placing one more
    CPU-heavy actor. Each script sleeps 1 s and prints its own tag; the answer must carry that
    tag back (the reply is this request's execution) and the sandbox's status for it."""
    from graders.code_exec.build import build_tasks

    tasks_dir = str(build_tasks(tmp_path_factory.mktemp("ce-scale") / "tasks", seed=0))
    cfg = RunConfig(grader={
        **QUICK, "task": "code-exec", "app_name": "grader-ce-scale", "num_cpus": 0.5,
        "target_ongoing_requests": 1,  # one script per replica at a time: each queued one is load
        "code_exec": {"tasks_dir": tasks_dir, "max_concurrent": 1, "timeout_s": 30, "grace_s": 0.5}})
    sentinel = cfg.grader.code_exec.sentinel
    with ExitStack() as stack:
        client, watch, prom = _serve_with_trainer_metrics(cfg, stack)
        assert client.health().details["isolation"] == "namespaces"

        def ask(c: GraderClient, tag: str):
            script = f"```python\nimport time\ntime.sleep(1)\nprint({tag!r})\n```\n"
            (got,) = c.score_batch([("tabular-binary", script)])  # the trainer's path: ScoreBatch
            seen = (got.status, got.reward, got.details["term_tail"].strip())
            want = ("invalid_submission", sentinel, tag)  # ran, printed its tag, wrote no submission
            return (None if seen == want else f"{seen} != {want}"), got.details["worker"]

        def answered_by(load: Load) -> set[str]:
            return {who for _, who in load.answers}

        start_wall = time.time()
        run = _scale_up_and_down(cfg.grader.app_name, client.address, ask, answered_by)
        _check_metrics_and_panel(prom, watch, start_wall)
    print("code-exec:", run)


@pytest.mark.slow
def test_a_frozen_grader_replica_is_killed_by_the_driver_and_serve_replaces_it(ray_cluster):
    """A SIGSTOPped grader replica is alive to the OS, to Ray and to Serve (whose health check
    would stop it after 3 failed checks and a graceful wait). The driver's pinger finds it
    within grader.replica_liveness_s of its last answer and kills it; Serve starts another, and
    the ScoreBatch that was held on the frozen replica is retried and answered."""
    import os
    import signal

    import psutil

    from graders.voice_leading import score
    from services.launch import start_grader, watch_grader
    from services.metrics import TrainerMetrics

    cfg = RunConfig(grader={"replicas": 1, "app_name": "grader-frozen", "num_cpus": 0.2, "replica_poll_s": 0.5,
                            "replica_liveness_s": 3.0, "timeout_s": 60.0, "max_retries": 4})
    with ExitStack() as stack:
        from ray import serve

        client = start_grader(cfg, stack)
        stack.callback(serve.delete, cfg.grader.app_name)
        watch = watch_grader(cfg, stack, TrainerMetrics(port=0).registry)
        cases = client.cases(4)
        pairs = [(c.id, '[{"measure": 1, "degrees": [0, 1]}]') for c in cases]
        expected = [score(c.progression, pairs[0][1]).verdict for c in cases]
        assert [s.verdict for s in client.score_batch(pairs)] == expected
        deadline = time.monotonic() + 30
        while not watch.pinger.last_answer and time.monotonic() < deadline:
            time.sleep(0.2)
        (rid,) = watch.pinger.last_answer
        # the replica's process, by the title Ray gives a Serve replica's worker
        (frozen,) = [p for p in psutil.process_iter(["cmdline"])
                     if any("ServeReplica:grader-frozen:" in part for part in (p.info["cmdline"] or []))]
        os.kill(frozen.pid, signal.SIGSTOP)
        t0 = time.monotonic()
        try:
            got = [s.verdict for s in client.score_batch(pairs)]  # held on the frozen replica, then retried
            took = time.monotonic() - t0
        finally:
            with contextlib.suppress(psutil.Error):
                frozen.kill()
        assert got == expected
        (when, entry), = watch.take_replaced()
        assert entry["replica_id"] == rid and "grader.replica_liveness_s=3" in entry["why"], entry
        assert 3.0 <= entry["quiet_s"] <= 3.0 + 2.0, entry  # found within a poll or two of the deadline
        assert when - t0 < 10.0 and took < 60.0, (when - t0, took)  # long before Serve's own check would
        assert not frozen.is_running() or frozen.status() == psutil.STATUS_ZOMBIE
        assert watch.take_replaced() == []  # handed out once


@pytest.mark.slow
def test_a_grader_replica_whose_scoring_makes_no_progress_is_killed_and_replaced(ray_cluster, tmp_path_factory):
    """A replica whose scoring never ends (here a script that sleeps past any deadline, under a
    code-exec limit set too long) is alive to the OS, Ray and Serve and still answers pings: its
    own health check (graders/progress.py) fails it once its scoring has been quiet for the
    run's liveness deadline, the driver's pinger kills it at once, and Serve starts another.
    A batch longer than the deadline whose scripts each finish within it is NOT a stall: the
    replica counts cases (code-exec's on_case), not whole batches. Both batches go through the
    app's DeploymentHandle (no client timeout to cut them short), the trainer's own grader path
    (start_grader, watch_grader) around it."""
    from ray import serve
    from ray.exceptions import RayActorError

    from graders.code_exec.build import build_tasks
    from services.launch import start_grader, watch_grader
    from services.metrics import TrainerMetrics

    tasks_dir = str(build_tasks(tmp_path_factory.mktemp("ce-wedged") / "tasks", seed=0))
    floor_s = 15.0
    cfg = RunConfig(
        grader={"task": "code-exec", "replicas": 1, "app_name": "grader-wedged", "num_cpus": 0.5,
                "replica_poll_s": 0.5, "timeout_s": 3.0,
                "code_exec": {"tasks_dir": tasks_dir, "max_concurrent": 1, "timeout_s": 600, "grace_s": 0.5}},
        liveness={"floor_s": floor_s, "notice_s": 2.0, "factor": 4.0})

    def script(seconds: float, tag: str) -> str:
        return f"```python\nimport time\ntime.sleep({seconds})\nprint({tag!r})\n```\n"

    with ExitStack() as stack:
        client = start_grader(cfg, stack)
        stack.callback(serve.delete, cfg.grader.app_name)
        watch = watch_grader(cfg, stack, TrainerMetrics(port=0).registry)
        handle = serve.get_app_handle(cfg.grader.app_name)
        deadline = time.monotonic() + 30
        while not watch.pinger.last_answer and time.monotonic() < deadline:
            time.sleep(0.2)
        (rid,) = watch.pinger.last_answer
        # healthy: 7 scripts of 3 s, one at a time: ~21 s in all, past the 15 s floor, a case every ~3 s
        t0 = time.monotonic()
        got = handle.score_batch.remote([("tabular-binary", script(3, f"ok{i}")) for i in range(7)]).result(timeout_s=300)
        long_batch_s = time.monotonic() - t0
        assert [s.details["term_tail"].strip() for s in got] == [f"ok{i}" for i in range(7)]
        assert long_batch_s > floor_s, long_batch_s  # a per-batch rule would have killed it
        assert watch.take_replaced() == [] and set(watch.pinger.last_answer) == {rid}

        # wedged: one script that sleeps for ten minutes
        t0 = time.monotonic()
        stuck = handle.score_batch.remote([("tabular-binary", script(600, "stuck"))])
        with pytest.raises(RayActorError):
            stuck.result(timeout_s=120)  # the replica died under the call: the pinger killed it
        took = time.monotonic() - t0
        (when, entry), = watch.take_replaced()
        assert entry["replica_id"] == rid, entry
        assert "scoring made no progress" in entry["why"] and "its health check" in entry["why"], entry
        # deadline: max(floor 15 s, 4 x the slowest ~3 s interval, grader.timeout_s 3 s); found within a poll or two
        assert floor_s <= entry["quiet_s"] <= 4 * 3.0 * 2 + 5.0, entry
        assert took < 60.0, took  # not the script's 600 s, nor Serve's three failed checks
        # Serve's successor scores again
        deadline = time.monotonic() + 120
        while set(watch.pinger.last_answer) - {rid} == set() and time.monotonic() < deadline:
            time.sleep(0.5)
        assert set(watch.pinger.last_answer) - {rid}, "Serve started no successor"
        (after,) = client.score_batch([("tabular-binary", script(0, "after"))])
        assert after.details["term_tail"].strip() == "after"


def test_the_rollouts_replaced_replicas_read_the_same_with_their_node():
    """services/orchestrator.py with_replaced serves both parts: a rollout replica's entry keeps
    its node, rounds quiet_s, and says 'replica'; nothing killed leaves the entry as it was."""
    from services.orchestrator import with_replaced

    now = time.monotonic()
    details: dict = {}
    killed = [(now, {"replica_id": "r1", "node_id": "n1", "why": "no report for 11 s", "quiet_s": 11.23456,
                     "replace": True})]
    what, outage = with_replaced("generate (step 2) retried", 3.0, killed, details, "replica")
    assert what == "generate (step 2) retried; replica r1 made no progress and was replaced"
    assert details == {"replaced_quiet": [{"replica_id": "r1", "node_id": "n1", "why": "no report for 11 s",
                                           "quiet_s": 11.235}]}
    assert 11.2 <= outage < 12.0
    assert with_replaced("x", 3.0, [], {}, "replica") == ("x", None)
