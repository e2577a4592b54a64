"""Grader replica counts and scale events, read from Serve's controller.

Serve scales the grader app (`autoscaling_config` from config/grader.py: min/max replicas,
target_ongoing_requests, upscale/downscale delays, look-back). No replica knows how many
replicas there are, so the count is read where the app was started, through `serve.status()`:
the trainer's driver (exported on its `/metrics`, `--metrics-port`) or `grader serve --ray`
(on its `--metrics-port`). `ReplicaWatch` reads it every `grader.replica_poll_s` in a daemon
thread; `ScaleTally` (pure) turns the reads into:

- `counterpoint_grader_replicas{state}`: replicas of the grader deployment per Serve replica
  state, lower-cased (REPLICA_STATES, Serve's ReplicaState values, plus `other` for a state a
  later Ray adds: bounded). Every state is exported, 0 included, so a panel's line never gaps.
- `counterpoint_grader_replica_bounds{bound}`: `min` and `max` of the autoscaling config.
- `counterpoint_grader_scale_events_total{direction}`: one per replica that joined (`up`) or
  left (`down`) the RUNNING set between two reads; a step of 1 -> 3 replicas is 2 up, so the
  counter does not depend on how often it is read. The first read is the baseline (the initial
  replicas are no event). A replica that dies and is replaced counts one down and one up.

Serve's own `ray_serve_*` series would need Ray's metrics agent and name replicas (unbounded
labels); these are the dashboard's (deploy/grafana/dashboards/counterpoint.json, "Grader
replicas").
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from graders.progress import GraderStalled

log = logging.getLogger("counterpoint")

REPLICAS = "counterpoint_grader_replicas"
BOUNDS = "counterpoint_grader_replica_bounds"
SCALE_EVENTS = "counterpoint_grader_scale_events"  # exposed as ..._total
METRIC_NAMES = (REPLICAS, BOUNDS, f"{SCALE_EVENTS}_total")
# ray.serve._private.common.ReplicaState (Ray 2.60), lower-cased; anything else is `other`.
REPLICA_STATES = ("starting", "updating", "recovering", "running", "stopping", "stopped",
                  "pending_migration", "other")
DIRECTIONS = ("up", "down")
HISTORY_LIMIT = 1000  # changes of the running count kept for the receipt (a bounded list)


def replica_counts(replica_states: Mapping) -> dict[str, int]:
    """Serve's ``{ReplicaState: n}`` (enum members or their names) as a count for every state
    of REPLICA_STATES."""
    counts = dict.fromkeys(REPLICA_STATES, 0)
    for state, n in replica_states.items():
        name = str(getattr(state, "value", state)).lower()
        counts[name if name in counts else "other"] += int(n)
    return counts


def scale_step(previous: int | None, running: int) -> dict[str, int]:
    """Scale events between two reads of the running count (None: no earlier read)."""
    if previous is None:
        return dict.fromkeys(DIRECTIONS, 0)
    return {"up": max(0, running - previous), "down": max(0, previous - running)}


@dataclass
class ScaleTally:
    """The reads so far: the last replica counts, the events, the changes of the running count
    (time, running) and its range."""

    bounds: tuple[int, int]
    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(REPLICA_STATES, 0))
    events: dict[str, int] = field(default_factory=lambda: dict.fromkeys(DIRECTIONS, 0))
    history: list[tuple[float, int]] = field(default_factory=list)
    # Spells with no running replica that have ended: (unix start, seconds), until taken.
    empty_spells: list[tuple[float, float]] = field(default_factory=list)
    empty_since: float | None = None
    _last: int | None = None

    def observe(self, replica_states: Mapping, now: float) -> dict[str, int]:
        """One read of Serve's replica states at unix time ``now``; returns its events."""
        counts = replica_counts(replica_states)
        running = counts["running"]
        step = scale_step(self._last, running)
        for direction, n in step.items():
            self.events[direction] += n
        if running != self._last and len(self.history) < HISTORY_LIMIT:
            self.history.append((now, running))
        if running == 0 and self._last and self.empty_since is None:  # every replica gone
            self.empty_since = now
        elif running > 0 and self.empty_since is not None:  # serving again
            self.empty_spells.append((self.empty_since, now - self.empty_since))
            self.empty_since = None
        self.counts, self._last = counts, running
        return step

    def summary(self) -> dict:
        """For run.json: the bounds, the range of running replicas seen, the events and the
        changes as [seconds since the first read, running]."""
        seen = [n for _, n in self.history]
        t0 = self.history[0][0] if self.history else 0.0
        return {
            "min_replicas": self.bounds[0], "max_replicas": self.bounds[1],
            "running_min": min(seen, default=None), "running_max": max(seen, default=None),
            "scale_events": dict(self.events),
            "changes": [[round(t - t0, 1), n] for t, n in self.history],
        }

    def snapshot(self) -> dict:
        return {"counts": dict(self.counts), "events": dict(self.events), "bounds": self.bounds}


def metric_families(snapshot: Mapping) -> list:
    """Prometheus families from a ScaleTally snapshot (pure)."""
    replicas = GaugeMetricFamily(
        REPLICAS, "Grader Serve replicas per replica state, read from Serve's controller.",
        labels=["state"])
    for state in REPLICA_STATES:
        replicas.add_metric([state], float(snapshot["counts"].get(state, 0)))
    bounds = GaugeMetricFamily(BOUNDS, "Autoscaling bounds of the grader app (min, max replicas).",
                               labels=["bound"])
    low, high = snapshot["bounds"]
    bounds.add_metric(["min"], float(low))
    bounds.add_metric(["max"], float(high))
    events = CounterMetricFamily(
        SCALE_EVENTS, "Grader replicas that joined (up) or left (down) the running set.",
        labels=["direction"])
    for direction in DIRECTIONS:
        events.add_metric([direction], float(snapshot["events"].get(direction, 0)))
    return [replicas, bounds, events]


class ScaleCollector(Collector):
    """Register with a prometheus_client CollectorRegistry; reads the tally at scrape time."""

    def __init__(self, snapshot_fn: Callable[[], Mapping]) -> None:
        self._snapshot_fn = snapshot_fn

    def collect(self) -> Iterator:
        return iter(metric_families(self._snapshot_fn()))


def serve_replica_states(app_name: str, deployment: str) -> Mapping | None:
    """``{ReplicaState: n}`` of one deployment from Serve's controller (None: app not there)."""
    from ray import serve

    app = serve.status().applications.get(app_name)
    if app is None or deployment not in app.deployments:
        return None
    return app.deployments[deployment].replica_states


def quiet_replicas(last_answer: Mapping[str, float], pending_since: Mapping[str, float], now: float,
                   liveness_s: float) -> list[tuple[str, float]]:
    """The replicas to count as frozen: each answered a ping before (``last_answer``: when) and has
    left the one sent at ``pending_since`` unanswered for ``liveness_s``; (replica id, seconds
    since its last answer), the quietest first. A replica that never answered is left alone:
    a starting replica's constructor may hold its event loop, and Serve handles start failures."""
    quiet = [(rid, now - last_answer[rid]) for rid, sent in pending_since.items()
             if rid in last_answer and now - sent >= liveness_s]
    return sorted(quiet, key=lambda q: -q[1])


def stall_of(exc: BaseException) -> GraderStalled | None:
    """The GraderStalled a replica's health check raised, from the error Ray hands back (an
    instance of it, or a RayTaskError whose ``cause`` it is); None for any other failure."""
    for candidate in (exc, getattr(exc, "cause", None)):
        if isinstance(candidate, GraderStalled):
            return candidate
    return None


SERVE_REPLICA_PREFIX = "SERVE_REPLICA::"  # Serve's name for a replica's actor, in the "serve" namespace


def grader_replica_names(app_name: str, deployment: str) -> list[str]:
    """The replica ids of the deployment's live replicas (Serve names each replica's actor
    ``SERVE_REPLICA::<app>#<deployment>#<id>`` in the "serve" namespace)."""
    import ray

    prefix = f"{SERVE_REPLICA_PREFIX}{app_name}#{deployment}#"
    return [a["name"].removeprefix(SERVE_REPLICA_PREFIX) for a in ray.util.list_named_actors(all_namespaces=True)
            if a.get("namespace") == "serve" and a["name"].startswith(prefix)]


class ReplicaPinger:
    """The driver's liveness check of the grader replicas: every poll, a ping (Serve's
    ``check_health`` on the replica actor) to each replica without one outstanding; a replica
    that answered before and leaves a ping unanswered ``liveness_s`` is killed (``ray.kill``;
    Serve starts its successor), and so is one whose check fails with GraderStalled (it answers,
    but its scoring makes no progress: graders/progress.py). Each is kept in ``replaced`` as
    (when, {replica_id, quiet_s, why}),
    which the step loop records with the call it held (services/orchestrator.py)."""

    def __init__(self, app_name: str, deployment: str, liveness_s: float,
                 list_replicas: Callable[[], list[str]] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.liveness_s = liveness_s
        self._list = list_replicas or (lambda: grader_replica_names(app_name, deployment))
        self._clock = clock
        self.last_answer: dict[str, float] = {}
        self._actors: dict[str, object] = {}  # replica id -> actor handle, looked up once
        self._pending: dict[str, tuple[object, float]] = {}  # replica id -> (ping ref, when sent)
        self.replaced: list[tuple[float, dict]] = []

    def _forget(self, rid: str) -> None:
        for known in (self._actors, self._pending, self.last_answer):
            known.pop(rid, None)

    def _kill(self, rid: str, now: float, quiet_s: float, why: str) -> dict:
        import ray

        log.warning("grader replica %s made no progress: %s; killing it (Serve starts its successor)", rid, why)
        ray.kill(self._actors[rid], no_restart=True)
        self._forget(rid)
        event = {"replica_id": rid, "quiet_s": round(quiet_s, 3), "why": why}
        self.replaced.append((now, event))
        return event

    def poll(self) -> list[dict]:
        import ray

        now = self._clock()
        live = set(self._list())
        for rid in [r for r in self._actors if r not in live]:  # gone (Serve stopped it)
            self._forget(rid)
        refs = {ref: rid for rid, (ref, _) in self._pending.items()}
        ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=0) if refs else ([], [])
        killed = []
        for ref in ready:
            rid = refs[ref]
            del self._pending[rid]
            try:
                ray.get(ref)
                self.last_answer[rid] = now
            except Exception as exc:  # noqa: BLE001 - a dying replica: Serve's to replace, not a freeze
                self.last_answer.pop(rid, None)
                stalled = stall_of(exc)
                if stalled is not None:  # alive, answering, but its scoring makes no progress
                    killed.append(self._kill(rid, now, stalled.quiet_s, f"{stalled.why} (its health check)"))
        pending_since = {rid: sent for rid, (_, sent) in self._pending.items()}
        for rid, quiet_s in quiet_replicas(self.last_answer, pending_since, now, self.liveness_s):
            killed.append(self._kill(rid, now, quiet_s, f"no answer to a ping for {now - pending_since[rid]:.0f} s "
                                     f"(grader.replica_liveness_s={self.liveness_s:g})"))
        for rid in live - set(self._pending) - {e["replica_id"] for e in killed}:
            if rid not in self._actors:
                try:
                    self._actors[rid] = ray.get_actor(SERVE_REPLICA_PREFIX + rid, namespace="serve")
                except ValueError:  # gone since the listing
                    continue
            self._pending[rid] = (self._actors[rid].check_health.remote(), now)
        return killed


class ReplicaWatch:
    """Reads a grader app's replica states every ``poll_s`` into a ScaleTally.

    ``start()`` takes the baseline read before it returns (call it once the app is deployed);
    a read that fails (the controller restarting, the app being deleted) is skipped, never
    counted as replicas gone."""

    def __init__(self, app_name: str, deployment: str, bounds: tuple[int, int], poll_s: float,
                 read: Callable[[], Mapping | None] | None = None, clock: Callable[[], float] = time.time,
                 pinger: ReplicaPinger | None = None) -> None:
        self.tally = ScaleTally(bounds=bounds)
        self.pinger = pinger
        self._taken = 0  # pinger.replaced entries handed to take_replaced
        self._read = read or (lambda: serve_replica_states(app_name, deployment))
        self._clock = clock
        self._poll_s = poll_s
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.failed_reads = 0

    def poll(self) -> None:
        try:
            states = self._read()
        except Exception:  # noqa: BLE001 - a read must never end the run; counted instead
            states = None
        with self._lock:
            if states is None:
                self.failed_reads += 1
                return
            went_empty = self.tally.empty_since is None
            self.tally.observe(states, self._clock())
            went_empty = went_empty and self.tally.empty_since is not None
        if self.pinger is not None:
            try:
                with self._lock:
                    self.pinger.poll()
            except Exception:  # noqa: BLE001 - like a failed read: the next poll tries again
                self.failed_reads += 1
        if went_empty:  # a console line now; the outage is recorded once the app serves again
            log.warning("the grader app has no running replica (Serve is starting new ones); scoring waits for them")

    def start(self) -> ReplicaWatch:
        self.poll()
        self._thread = threading.Thread(target=self._loop, name="grader-replica-watch", daemon=True)
        self._thread.start()
        return self

    def _loop(self) -> None:
        while not self._stop.wait(self._poll_s):
            self.poll()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def snapshot(self) -> dict:
        with self._lock:
            return self.tally.snapshot()

    def take_empty_spells(self) -> list[tuple[float, float]]:
        """The ended spells with no running replica not taken before: (unix start, seconds)."""
        with self._lock:
            spells, self.tally.empty_spells = self.tally.empty_spells, []
            return spells

    def take_replaced(self) -> list[tuple[float, dict]]:
        """The frozen replicas the pinger killed since the last call: (time.monotonic(), entry)."""
        if self.pinger is None:
            return []
        with self._lock:
            new = self.pinger.replaced[self._taken:]
            self._taken = len(self.pinger.replaced)
            return list(new)

    def summary(self) -> dict:
        with self._lock:
            return {**self.tally.summary(), "failed_reads": self.failed_reads}

    def collector(self) -> ScaleCollector:
        return ScaleCollector(self.snapshot)


def watch_app(cfg, app_name: str | None = None) -> ReplicaWatch:
    """A started ReplicaWatch of the grader app deployed from GraderConfig ``cfg``."""
    from graders.serve_app import DEPLOYMENT_NAME, deployment_options

    scaling = deployment_options(cfg)["autoscaling_config"]
    app = app_name or cfg.app_name
    return ReplicaWatch(app, DEPLOYMENT_NAME, (scaling["min_replicas"], scaling["max_replicas"]), cfg.replica_poll_s,
                        pinger=ReplicaPinger(app, DEPLOYMENT_NAME, cfg.replica_liveness_s)).start()
