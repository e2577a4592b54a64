"""A real Prometheus server for tests, and the checks we run against it.

``PromServer`` starts the Debian ``prometheus`` binary on 127.0.0.1 with a temp config scraping the
given targets every second (temp storage, free port), waits for /-/ready, answers PromQL through
/api/v1/query, and tears everything down. ``dashboard_exprs`` and ``alert_series_exprs`` pull the
queries out of deploy/ (Grafana JSON, rule files); ``assert_all_queries_return_data`` polls until
every query returns data and otherwise names each failing one.

Alert conditions (``x < 0.9 or x > 1.1``) are non-empty only while they fire, so the check runs on
their series instead: ``condition_series`` splits an expr at top-level ``or``/``and``/``unless`` and
removes each part's trailing comparison with a number. alerts.yml keeps every alert in that form.

Also ``python tests/promharness.py demo-exporter``: a process serving several steps' worth of
trainer, grader and rollout metrics (see ``run_demo_exporter``).
"""

from __future__ import annotations

import json
import math
import re
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import yaml

# Grafana's interval variables, replaced by a window holding many 1 s scrapes.
GRAFANA_VARIABLES = {
    "$__rate_interval": "1m",
    "${__rate_interval}": "1m",
    "$__interval": "1m",
    "${__interval}": "1m",
    "$__range": "5m",
    "${__range}": "5m",
}


REPO = Path(__file__).resolve().parents[1]
PROM_DIR = REPO / "deploy" / "prometheus"
DASHBOARD = REPO / "deploy" / "grafana" / "dashboards" / "counterpoint.json"
ALERTS = PROM_DIR / "alerts.yml"


def shipped_job_settings(job: str) -> dict:
    """The relabelling of one job of deploy/prometheus/prometheus.yml (not its targets)."""
    config = yaml.safe_load((PROM_DIR / "prometheus.yml").read_text())
    (shipped,) = [j for j in config["scrape_configs"] if j["job_name"] == job]
    return {k: v for k, v in shipped.items() if k.endswith("relabel_configs")}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class PromQueryError(RuntimeError):
    """Prometheus answered a query with an error (bad PromQL, unknown function ...)."""


class PromServer:
    """A Prometheus process scraping ``jobs`` (job name -> ["host:port", ...]) every second.

    ``job_settings`` adds scrape-config keys per job (e.g. the ``metric_relabel_configs`` of
    deploy/prometheus/prometheus.yml), so a test scrapes with the shipped rules.
    """

    def __init__(
        self,
        jobs: Mapping[str, Iterable[str]],
        rule_files: Iterable[Path] = (),
        scrape_interval: str = "1s",
        binary: str = "prometheus",
        job_settings: Mapping[str, Mapping[str, Any]] | None = None,
    ) -> None:
        exe = shutil.which(binary)
        if exe is None:
            raise FileNotFoundError(
                f"{binary!r} not on PATH; install Debian's package: `make prometheus`"
            )
        self.binary = exe
        self.jobs = {name: list(targets) for name, targets in jobs.items()}
        self.job_settings = {name: dict(extra) for name, extra in (job_settings or {}).items()}
        unknown = set(self.job_settings) - set(self.jobs)
        if unknown:
            raise ValueError(f"job_settings for unknown job(s) {sorted(unknown)}")
        self.rule_files = [Path(p).resolve() for p in rule_files]
        self.scrape_interval = scrape_interval
        self.port: int | None = None
        self._proc: subprocess.Popen | None = None
        self._tmp: tempfile.TemporaryDirectory | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def config(self) -> dict[str, Any]:
        return {
            "global": {
                "scrape_interval": self.scrape_interval,
                "evaluation_interval": self.scrape_interval,
                "scrape_timeout": self.scrape_interval,
            },
            "rule_files": [str(p) for p in self.rule_files],
            "scrape_configs": [
                {"job_name": name, "static_configs": [{"targets": targets}],
                 **self.job_settings.get(name, {})}
                for name, targets in self.jobs.items()
            ],
        }

    def start(self, ready_timeout_s: float = 60.0, attempts: int = 3) -> PromServer:
        """Prometheus on a free port, ready. Its port is picked here (it cannot report one it
        chose itself), so another process may bind it first: then it starts again on another."""
        for attempt in range(attempts):
            try:
                return self._start_once(ready_timeout_s)
            except RuntimeError:
                if attempt + 1 == attempts or "address already in use" not in self.log():
                    raise
                self.stop()
        raise AssertionError("unreachable")

    def _start_once(self, ready_timeout_s: float) -> PromServer:
        self._tmp = tempfile.TemporaryDirectory(prefix="promharness-")
        tmp = Path(self._tmp.name)
        (tmp / "prometheus.yml").write_text(yaml.safe_dump(self.config(), sort_keys=False))
        self.port = free_port()
        self._log = open(tmp / "prometheus.log", "wb")
        self._proc = subprocess.Popen(
            [
                self.binary,
                f"--config.file={tmp / 'prometheus.yml'}",
                f"--storage.tsdb.path={tmp / 'data'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
                "--log.level=warn",
            ],
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + ready_timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise RuntimeError(f"prometheus exited with {self._proc.returncode}:\n{self.log()}")
            try:
                with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as resp:
                    if resp.status == 200:
                        return self
            except OSError:  # not up yet; or, its port taken meanwhile, another listener that never answers
                pass
            time.sleep(0.2)
        self.stop()
        raise TimeoutError(f"prometheus not ready after {ready_timeout_s}s")

    def log(self) -> str:
        if self._tmp is None:
            return ""
        path = Path(self._tmp.name) / "prometheus.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def query(self, expr: str, at: float | None = None) -> list[dict[str, Any]]:
        """Instant query (now, or at unix time `at`); the result vector (a scalar result becomes
        one unlabelled sample)."""
        params = urllib.parse.urlencode({"query": expr, **({"time": f"{at:.3f}"} if at is not None else {})})
        try:
            with urllib.request.urlopen(f"{self.url}/api/v1/query?{params}", timeout=10) as resp:
                body = json.load(resp)
        except urllib.error.HTTPError as err:  # 400/422: bad expression, body says why
            body = json.load(err)
        if body.get("status") != "success":
            raise PromQueryError(f"{expr!r}: {body.get('errorType')}: {body.get('error')}")
        data = body["data"]
        if data["resultType"] == "vector":
            return data["result"]
        if data["resultType"] == "scalar":
            return [{"metric": {}, "value": data["result"]}]
        return data["result"]

    def query_range(self, expr: str, start: float, end: float, step: float = 1.0) -> list[dict[str, Any]]:
        """Range query: one {"metric", "values": [[t, "v"], ...]} per series."""
        params = urllib.parse.urlencode({"query": expr, "start": f"{start:.3f}", "end": f"{end:.3f}", "step": f"{step:g}"})
        try:
            with urllib.request.urlopen(f"{self.url}/api/v1/query_range?{params}", timeout=30) as resp:
                body = json.load(resp)
        except urllib.error.HTTPError as err:
            body = json.load(err)
        if body.get("status") != "success":
            raise PromQueryError(f"{expr!r}: {body.get('errorType')}: {body.get('error')}")
        return body["data"]["result"]

    def _get(self, path: str) -> Any:
        with urllib.request.urlopen(f"{self.url}{path}", timeout=10) as resp:
            body = json.load(resp)
        if body.get("status") != "success":
            raise PromQueryError(f"{path}: {body.get('error')}")
        return body["data"]

    def rules(self) -> list[dict[str, Any]]:
        """Every loaded rule with its `health` ("ok" | "err" | "unknown") and `lastError`."""
        return [rule for group in self._get("/api/v1/rules")["groups"] for rule in group["rules"]]

    def alerts(self) -> list[dict[str, Any]]:
        """Active alerts (pending or firing), each with `labels.alertname` and `state`."""
        return self._get("/api/v1/alerts")["alerts"]

    def targets_up(self) -> dict[str, bool]:
        """scrape URL -> whether the last scrape succeeded."""
        targets = self._get("/api/v1/targets")["activeTargets"]
        return {t["scrapeUrl"]: t["health"] == "up" for t in targets}

    def stop(self) -> None:
        if self._proc is not None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
            self._proc = None
            self._log.close()
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def __enter__(self) -> PromServer:
        return self.start() if self._proc is None else self

    def __exit__(self, *exc: object) -> None:
        self.stop()


# ---------------------------------------------------------------- query extraction (pure)


def substitute_grafana_variables(expr: str) -> str:
    for name in sorted(GRAFANA_VARIABLES, key=len, reverse=True):
        expr = expr.replace(name, GRAFANA_VARIABLES[name])
    if "$" in expr:
        raise ValueError(f"unsubstituted Grafana variable in {expr!r}")
    return expr


def _walk_exprs(node: Any) -> Iterable[str]:
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "expr" and isinstance(value, str):
                yield value
            else:
                yield from _walk_exprs(value)
    elif isinstance(node, list):
        for item in node:
            yield from _walk_exprs(item)


def dashboard_exprs(path: Path) -> list[str]:
    """Every "expr" anywhere in a Grafana dashboard JSON, Grafana variables substituted."""
    dashboard = json.loads(Path(path).read_text())
    exprs = [substitute_grafana_variables(e) for e in _walk_exprs(dashboard)]
    return list(dict.fromkeys(exprs))


def panel_exprs(path: Path, title: str) -> list[str]:
    """The queries of the one panel titled ``title``, Grafana variables substituted."""
    panels = [p for p in json.loads(Path(path).read_text())["panels"] if p.get("title") == title]
    if len(panels) != 1:
        raise ValueError(f"{len(panels)} panels titled {title!r} in {path}")
    return [substitute_grafana_variables(e) for e in _walk_exprs(panels[0])]


_LOGICAL_OPS = ("or", "and", "unless")
_TRAILING_COMPARISON = re.compile(
    r"\s*(==|!=|>=|<=|>|<)\s*(bool\s+)?[-+]?(\d+(\.\d*)?|\.\d+)([eE][-+]?\d+)?\s*$"
)


def _split_top_level(expr: str) -> list[str]:
    """Split at `or`/`and`/`unless` outside parentheses, braces, brackets and strings."""
    parts, depth, start, i, quote = [], 0, 0, 0, None
    while i < len(expr):
        ch = expr[i]
        if quote:
            if ch == "\\":
                i += 1
            elif ch == quote:
                quote = None
        elif ch in "\"'`":
            quote = ch
        elif ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif depth == 0:
            for op in _LOGICAL_OPS:
                if (expr.startswith(op, i) and i > 0 and expr[i - 1].isspace()
                        and i + len(op) < len(expr) and expr[i + len(op)].isspace()):
                    parts.append(expr[start:i])
                    start = i + len(op)
                    i = start - 1
                    break
        i += 1
    parts.append(expr[start:])
    return [p.strip() for p in parts]


def condition_series(expr: str) -> list[str]:
    """The series an alert condition compares: `a < 0.9 or a > 1.1` -> ['a'].

    Raises ValueError when a part has no trailing comparison with a number: such an alert would
    have no series to check, so alerts.yml must not hold one.
    """
    series = []
    for part in _split_top_level(expr):
        base, n = _TRAILING_COMPARISON.subn("", part)
        if n != 1 or not base.strip():
            raise ValueError(f"alert part {part!r} of {expr!r} is not `<series> <cmp> <number>`")
        series.append(base.strip())
    return list(dict.fromkeys(series))


def rule_exprs(path: Path) -> tuple[list[str], list[str]]:
    """(recording-rule exprs, alert-rule exprs) of a Prometheus rule file."""
    doc = yaml.safe_load(Path(path).read_text())
    records, alerts = [], []
    for group in doc["groups"]:
        for rule in group["rules"]:
            (alerts if "alert" in rule else records).append(rule["expr"])
    return records, alerts


def alert_series_exprs(path: Path) -> list[str]:
    """What to check of a rule file: recording exprs, their recorded names, alert series."""
    doc = yaml.safe_load(Path(path).read_text())
    exprs: list[str] = []
    for group in doc["groups"]:
        for rule in group["rules"]:
            if "alert" in rule:
                exprs.extend(condition_series(rule["expr"]))
            else:
                exprs.extend([rule["expr"], rule["record"]])
    return list(dict.fromkeys(exprs))


_SERIES_NAME = r"\b({prefix}[a-zA-Z0-9_:]*)(\{{([^}}]*)\}})?(?=\s*[\[)\s,]|$)"


def restrict_to_job(expr: str, job: str, prefix: str) -> str:
    """Add `job="<job>"` to every selector of a series named `<prefix>...` in `expr`:
    `rate(x_total[1m])` -> `rate(x_total{job="j"}[1m])`, `x{a="b"}` -> `x{job="j", a="b"}`."""
    def add(m: re.Match) -> str:
        inner = m.group(3)
        return f'{m.group(1)}{{job="{job}"' + (f", {inner}}}" if inner and inner.strip() else "}")

    out, n = re.subn(_SERIES_NAME.format(prefix=re.escape(prefix)), add, expr)
    if not n:
        raise ValueError(f"no {prefix}* series in {expr!r}")
    return out


# ---------------------------------------------------------------- the reusable check


def queries_without_data(prom: PromServer, exprs: Iterable[str], at: float | None = None) -> dict[str, str]:
    """One pass over `exprs`: expr -> why it has no data (empty, only NaN, or Prometheus's error).

    NaN counts as no data (a histogram_quantile over no observations).
    """
    failures: dict[str, str] = {}
    for expr in dict.fromkeys(exprs):
        try:
            result = prom.query(expr, at)
        except PromQueryError as err:
            failures[expr] = f"error: {err}"
            continue
        values = [float(sample["value"][1]) for sample in result]
        if not values:
            failures[expr] = "empty result"
        elif all(v != v for v in values):
            failures[expr] = f"only NaN ({len(values)} series)"
    return failures


def describe_failures(failures: Mapping[str, str]) -> str:
    return "queries without data:\n" + "\n".join(f"  {expr}  -> {why}" for expr, why in failures.items())


def assert_all_queries_return_data(
    prom: PromServer, exprs: Iterable[str], wait_s: float = 60.0, poll_s: float = 1.0,
    at: float | None = None,
) -> None:
    """Poll until every expr returns at least one sample with a number; else fail naming each.

    Waiting is only how long scraping may take to fill the windows. `at` evaluates at a past
    instant (a run that has ended leaves stale series: instant queries at "now" are empty by
    design, so a finished run is queried at a time it was alive).
    """
    pending = list(dict.fromkeys(exprs))
    deadline = time.monotonic() + wait_s
    while True:
        failures = queries_without_data(prom, pending, at)
        pending = list(failures)
        if not pending or time.monotonic() > deadline:
            break
        time.sleep(poll_s)
    assert not failures, describe_failures(failures)


# ---------------------------------------------------------------- demo exporter process


def run_demo_exporter(
    step_interval_s: float = 0.25, ppl_ratio: float = 1.0, ray_prefix: bool = False
) -> None:
    """Serve trainer (services/metrics.py), grader (graders/metrics.py) and rollout metrics.

    Prints one JSON line {"trainer": port, "graders": port, "ray": port} then records a step
    every `step_interval_s` with realistic values until terminated. `ppl_ratio` centres the
    exported ratio (1.3 trips the alert); `ray_prefix` names the series on the "ray" port as
    Ray's metrics agent exposes ray.util.metrics (`ray_counterpoint_...`).
    """
    import math
    import random

    from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server

    from graders import metrics as grader_metrics
    from graders.tasks import task_profile
    from services.metrics import TrainerMetrics

    trainer = TrainerMetrics(host="127.0.0.1", port=0)
    ports = {"trainer": trainer.start()}

    # The grader's own metrics module (its default registry), on a port of its own as in a run.
    ports["graders"] = grader_metrics.start_metrics_server(0, host="127.0.0.1")

    # Rollout replicas report to the adapter registry and the driver exports them: the real
    # collector of rollout/metrics.py, fed a snapshot as the registry would give it.
    from rollout.metrics import RolloutCollector

    snapshot = {"replicas": {"0": 0, "1": 0}, "tokens_total": 0}
    trainer.registry.register(RolloutCollector(lambda: dict(snapshot)))

    # The driver reads the grader app's replicas from Serve (graders/autoscale.py): the real
    # tally and collector, fed a replica count that scales 1 -> 3 -> 1 over twelve steps.
    from graders.autoscale import ScaleCollector, ScaleTally

    scaling = ScaleTally(bounds=(1, 3))
    scaling.observe({"RUNNING": 1}, time.time())
    trainer.registry.register(ScaleCollector(scaling.snapshot))

    # Recoveries reach /metrics as in a run: services/recovery.py's log, the trainer subscribed.
    from services.recovery import PARTS as RECOVERY_PARTS, RecoveryLog

    recoveries = RecoveryLog()
    recoveries.subscribe(trainer.record_recovery)

    # Grader Serve replicas export through Ray's metrics agent, which names them `ray_<name>`:
    # with ray_prefix the same grader series are also served that way on a port of their own.
    prefix = "ray_" if ray_prefix else ""
    ray_reg = CollectorRegistry()
    ray_requests = Counter(f"{prefix}counterpoint_grader_requests", "scored", ["task", "verdict"], registry=ray_reg)
    server, _ = start_http_server(0, addr="127.0.0.1", registry=ray_reg)
    ports["ray"] = server.server_port
    print(json.dumps(ports), flush=True)

    rng = random.Random(0)
    step = 0
    while True:
        step += 1
        tokens = 32 * rng.randint(60, 128)
        gen = 4.0 + rng.random()
        phases = {"gen": gen, "score": 0.2, "old_log_prob": 1.1, "ref": 1.0, "adv": 0.002,
                  "update_actor": 3.0 + rng.random(), "update_weights": 0.05}
        if step % 3 == 0:
            phases["save_checkpoint"] = 0.8
        phases["total"] = sum(phases.values()) + 0.1
        pass_rate = min(1.0, 0.1 + 0.02 * step)
        trainer.record_step(
            step,
            {"ppl_ratio": ppl_ratio + rng.gauss(0, 0.002), "rollout_kl": abs(rng.gauss(0, 1e-3)),
             "rollout_k3_kl": abs(rng.gauss(0, 1e-4)), "reward_mean": min(1.0, pass_rate + 0.1),
             "pass_rate": pass_rate, "frac_reward_zero_std": max(0.0, 0.75 - 0.05 * step),
             "kl": 0.001 * step, "entropy": 1.8 - 0.01 * step, "grad_norm": 0.5 + rng.random(),
             "learning_rate": 1e-5 * min(1.0, step / 5), "adapter_staleness": 1},
            phases,
            generated_tokens=tokens,
            adapter_version=step,
        )
        verdicts = [
            "admitted" if rng.random() < pass_rate else rng.choice(["structure", "parallel_fifths"])
            for _ in range(32)
        ]
        grader_metrics.observe_scores("voice-leading", verdicts)
        latency_s = math.exp(rng.gauss(-4.5, 0.5))  # ~11 ms median
        grader_metrics.observe_latency("voice-leading", "ScoreBatch", latency_s)
        snapshot["tokens_total"] += tokens
        snapshot["replicas"] = {"0": step, "1": step}
        running = (1, 1, 2, 3, 3, 3, 3, 3, 2, 1, 1, 1)[step % 12]
        scaling.observe({"RUNNING": running, **({"STARTING": 1} if step % 12 == 2 else {})}, time.time())
        if step % 5 == 0:  # a part fails now and then and is recovered
            part = RECOVERY_PARTS[(step // 5) % len(RECOVERY_PARTS)]
            recoveries.record(part, step, f"demo: {part} failed, recovered", 1.5)
        for verdict in verdicts:
            ray_requests.labels(task="voice-leading", verdict=task_profile("voice-leading").verdict_label(verdict)).inc()
        time.sleep(step_interval_s)


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(prog="python tests/promharness.py")
    parser.add_argument("command", choices=["demo-exporter"])
    parser.add_argument("--step-interval-s", type=float, default=0.25)
    parser.add_argument("--ppl-ratio", type=float, default=1.0)
    parser.add_argument("--ray-prefix", action="store_true")
    args = parser.parse_args()
    run_demo_exporter(args.step_interval_s, args.ppl_ratio, args.ray_prefix)


# ---------------------------------------------------------------- after the fact (range queries)


def instants_with_data(prom: PromServer, exprs: Iterable[str], start: float, end: float) -> tuple[list[int], dict[str, int]]:
    """Whole seconds in [start, end] at which EVERY expr returned a number, and for each expr
    at how many of those seconds it did. Evaluates a finished run at times it was alive,
    without racing it: no live wait."""
    start, end = int(math.ceil(start)), int(math.floor(end))
    common: set[int] | None = None
    answered: dict[str, int] = {}
    for expr in dict.fromkeys(exprs):
        try:
            series = prom.query_range(expr, start, end, 1.0)
        except PromQueryError:
            series = []
        times = {int(round(float(t))) for s in series for t, v in s["values"] if not math.isnan(float(v))}
        answered[expr] = len(times)
        common = times if common is None else common & times
    return sorted(common or ()), answered


def alert_states(prom: PromServer, start: float, end: float) -> dict[tuple[str, str], list[dict[str, Any]]]:
    """(alertname, alertstate) -> every alert that was pending or firing at some second of
    [start, end] (Prometheus's ALERTS series): its labels, and its first and last second as
    offsets from `start` ("from_s", "to_s")."""
    seen: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for series in prom.query_range("ALERTS", start, end, 1.0):
        labels = {k: v for k, v in series["metric"].items() if k != "__name__"}
        times = [float(t) for t, _ in series["values"]]
        seen.setdefault((labels["alertname"], labels["alertstate"]), []).append(
            {**labels, "from_s": round(min(times) - start), "to_s": round(max(times) - start)})
    return seen
