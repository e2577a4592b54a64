"""Grader counters and Prometheus metrics (DESIGN.md "Prometheus metric names").

- `counterpoint_grader_requests_total{task, verdict}`: completions scored; `verdict` is bounded by
  the task's profile (graders/tasks.py ``verdict_label``): voice-leading's `admitted` | `structure`
  (format or structure gate failed) | `rule_failure` (a part-writing rule rejected it), code-exec's
  script status. Never a per-request label.
- `counterpoint_grader_latency_seconds{task, rpc}`: wall time per RPC (`rpc` is one of the four
  method names).
Code-exec (graders/code_exec/service.py), one sample per script:
- `counterpoint_grader_executions_total{task, status}`: `status` is one of EXEC_STATUSES
  (`ok`, `no_code`, `crashed`, `timeout`, `invalid_submission`, and `overloaded` for a request
  refused with RESOURCE_EXHAUSTED after its queue wait).
- `counterpoint_grader_exec_seconds{task, status}`: a script's wall time in the sandbox.
- `counterpoint_grader_queue_wait_seconds{task}`: time waiting for an execution slot.
- `counterpoint_grader_isolation_level{task}`: the sandbox level in force, as an index of
  ISOLATION_LEVELS (0 = none, 1 = namespaces); set when the task starts.
The metric objects live in the process's default registry, created once per process (several
servers in one process share them). Inside Ray Serve replicas `use_ray_metrics()` swaps them for
`ray.util.metrics` objects of the same names: Ray's per-node metrics agent exports them (as
`ray_<name>`, which deploy/prometheus/prometheus.yml strips), so every replica is scraped
without a port of its own.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from config.grader import GraderConfig
from records.exec_result import EXEC_STATUSES as SCRIPT_STATUSES

_GRADER = GraderConfig()  # the schema's defaults: declared there, read here

# A script's statuses, and "overloaded": no execution slot freed up in time (nothing ran).
EXEC_STATUSES = (*SCRIPT_STATUSES, "overloaded")
ISOLATION_LEVELS = ("none", "namespaces")  # graders/code_exec/sandbox.py LEVELS, in order
EXEC_BUCKETS = (0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300)
WAIT_BUCKETS = (0.001, 0.01, 0.1, 0.5, 1, 2, 5, 10, 30, 60, 120)


@dataclass
class Counters:
    """Counts since the server started (reported by Health); thread-safe."""

    scored: int = 0
    unparsed: int = 0
    admitted: int = 0
    first_measure_wrong: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, *, format_ok: bool, admitted: bool, first_measure_ok: bool) -> None:
        with self._lock:
            self.scored += 1
            self.unparsed += not format_ok
            self.admitted += admitted
            self.first_measure_wrong += not first_measure_ok

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return {
                "scored": self.scored,
                "unparsed": self.unparsed,
                "admitted": self.admitted,
                "first_measure_wrong": self.first_measure_wrong,
            }


_metrics_lock = threading.Lock()
_metrics: tuple | None = None


def prometheus_metrics():
    """(requests_total Counter, latency_seconds Histogram), registered once per process."""
    global _metrics
    with _metrics_lock:
        if _metrics is None:
            from prometheus_client import Counter, Histogram

            requests = Counter(
                "counterpoint_grader_requests_total",
                "Completions scored by the grader, by task and bounded verdict class.",
                ["task", "verdict"],
            )
            latency = Histogram(
                "counterpoint_grader_latency_seconds",
                "Grader RPC wall time.",
                ["task", "rpc"],
                buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5),
            )
            _metrics = (requests, latency)
        return _metrics


class _RayLabelled:
    """prometheus_client's `.labels(**tags).inc()/.observe()` over a ray.util.metrics object."""

    def __init__(self, metric, tags: dict[str, str]) -> None:
        self._metric, self._tags = metric, tags

    def inc(self, value: float = 1.0) -> None:
        self._metric.inc(value, tags=self._tags)

    def observe(self, value: float) -> None:
        self._metric.observe(value, tags=self._tags)

    def set(self, value: float) -> None:
        self._metric.set(value, tags=self._tags)


class _RayMetric:
    def __init__(self, metric) -> None:
        self._metric = metric

    def labels(self, **tags: str) -> _RayLabelled:
        return _RayLabelled(self._metric, tags)


def use_ray_metrics() -> None:
    """Record through Ray's metrics agent from now on (call once in a Serve replica)."""
    global _metrics, _exec_metrics
    from ray.util.metrics import Counter, Histogram

    with _metrics_lock:
        requests = Counter(
            "counterpoint_grader_requests_total",
            "Completions scored by the grader, by task and bounded verdict class.",
            tag_keys=("task", "verdict"),
        )
        latency = Histogram(
            "counterpoint_grader_latency_seconds",
            "Grader RPC wall time.",
            boundaries=[0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5],
            tag_keys=("task", "rpc"),
        )
        _metrics = (_RayMetric(requests), _RayMetric(latency))
        _exec_metrics = _ray_exec_metrics()


_exec_metrics: dict | None = None


def _prometheus_exec_metrics() -> dict:
    from prometheus_client import Counter, Gauge, Histogram

    return {
        "executions": Counter("counterpoint_grader_executions_total",
                              "Code-exec scripts by outcome status.", ["task", "status"]),
        "exec_seconds": Histogram("counterpoint_grader_exec_seconds",
                                  "Code-exec script wall time in the sandbox.", ["task", "status"],
                                  buckets=EXEC_BUCKETS),
        "queue_wait": Histogram("counterpoint_grader_queue_wait_seconds",
                                "Code-exec wait for an execution slot.", ["task"], buckets=WAIT_BUCKETS),
        "isolation": Gauge("counterpoint_grader_isolation_level",
                           "Code-exec sandbox isolation in force (0 = none, 1 = namespaces).", ["task"]),
    }


def _ray_exec_metrics() -> dict:
    from ray.util.metrics import Counter, Gauge, Histogram

    return {
        "executions": _RayMetric(Counter("counterpoint_grader_executions_total",
                                         "Code-exec scripts by outcome status.", tag_keys=("task", "status"))),
        "exec_seconds": _RayMetric(Histogram("counterpoint_grader_exec_seconds",
                                             "Code-exec script wall time in the sandbox.",
                                             boundaries=list(EXEC_BUCKETS), tag_keys=("task", "status"))),
        "queue_wait": _RayMetric(Histogram("counterpoint_grader_queue_wait_seconds",
                                           "Code-exec wait for an execution slot.",
                                           boundaries=list(WAIT_BUCKETS), tag_keys=("task",))),
        "isolation": _RayMetric(Gauge("counterpoint_grader_isolation_level",
                                      "Code-exec sandbox isolation in force (0 = none, 1 = namespaces).",
                                      tag_keys=("task",))),
    }


def exec_metrics() -> dict:
    """The code-exec metric objects (prometheus_client, or Ray's after `use_ray_metrics`)."""
    global _exec_metrics
    with _metrics_lock:
        if _exec_metrics is None:
            _exec_metrics = _prometheus_exec_metrics()
        return _exec_metrics


def observe_execution(task: str, status: str, exec_seconds: float | None, queue_wait_s: float | None) -> None:
    """One script (or one request refused after its queue wait: status ``overloaded``, no exec
    time; or one with no code: neither). ``status`` outside EXEC_STATUSES is a programming error."""
    if status not in EXEC_STATUSES:
        raise ValueError(f"unknown execution status {status!r}; one of {EXEC_STATUSES}")
    m = exec_metrics()
    m["executions"].labels(task=task, status=status).inc()
    if exec_seconds is not None:
        m["exec_seconds"].labels(task=task, status=status).observe(exec_seconds)
    if queue_wait_s is not None:
        m["queue_wait"].labels(task=task).observe(queue_wait_s)


def set_isolation(task: str, level: str) -> None:
    exec_metrics()["isolation"].labels(task=task).set(ISOLATION_LEVELS.index(level))


def observe_scores(task: str, verdicts: list[str]) -> None:
    from graders.tasks import task_profile

    requests, _ = prometheus_metrics()
    profile = task_profile(task)
    for verdict in verdicts:
        requests.labels(task=task, verdict=profile.verdict_label(verdict)).inc()


def observe_latency(task: str, rpc: str, seconds: float) -> None:
    _, latency = prometheus_metrics()
    latency.labels(task=task, rpc=rpc).observe(seconds)


def start_metrics_server(port: int, host: str = _GRADER.host) -> int:
    """Expose /metrics on host:port (0 = a free port); returns the bound port."""
    from prometheus_client import start_http_server

    prometheus_metrics()
    server, _thread = start_http_server(port, addr=host)
    return server.server_port
