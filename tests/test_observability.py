"""deploy/prometheus and deploy/grafana against a real Prometheus scraping real /metrics endpoints.

Needs Debian's `prometheus` package (promtool + server): `make prometheus`.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from promharness import (
    ALERTS,
    DASHBOARD,
    PROM_DIR,
    PromServer,
    alert_series_exprs,
    assert_all_queries_return_data,
    condition_series,
    dashboard_exprs,
    restrict_to_job,
    rule_exprs,
    shipped_job_settings,
    substitute_grafana_variables,
)

REPO = Path(__file__).resolve().parents[1]


def promtool(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["promtool", *args], capture_output=True, text=True, timeout=60)


def test_promtool_check_config():
    result = promtool("check", "config", str(PROM_DIR / "prometheus.yml"))
    assert result.returncode == 0, result.stdout + result.stderr


def test_promtool_check_rules():
    result = promtool("check", "rules", str(ALERTS))
    assert result.returncode == 0, result.stdout + result.stderr


def test_prometheus_config_scrapes_every_component():
    config = yaml.safe_load((PROM_DIR / "prometheus.yml").read_text())
    jobs = {job["job_name"] for job in config["scrape_configs"]}
    assert jobs == {"counterpoint-trainer", "counterpoint-graders", "counterpoint-ray"}
    assert config["rule_files"] == ["alerts.yml"]


def test_alerts_cover_ppl_band_and_stalled_steps():
    _, alerts = rule_exprs(ALERTS)
    assert "counterpoint_ppl_ratio < 0.9 and counterpoint_step > 0 or counterpoint_ppl_ratio > 1.1" in alerts
    assert ("time() - counterpoint_last_step_timestamp_seconds > 600"
            " and counterpoint_last_step_timestamp_seconds > 0") in alerts


@pytest.mark.parametrize(
    "expr, series",
    [
        ("a < 0.9 or a > 1.1", ["a"]),
        ("time() - x > 600", ["time() - x"]),
        ('up{job=~"c-.*"} == 0', ['up{job=~"c-.*"}']),
        ("sum by (le) (rate(h[5m])) >= 1e-3 unless b != 2", ["sum by (le) (rate(h[5m]))", "b"]),
        ('x{a="p or q"} > 1', ['x{a="p or q"}']),
    ],
)
def test_condition_series(expr, series):
    assert condition_series(expr) == series


@pytest.mark.parametrize("expr", ["absent(x)", "a > b", "x > 1 or y"])
def test_condition_series_refuses_what_it_cannot_strip(expr):
    with pytest.raises(ValueError, match="is not `<series> <cmp> <number>`"):
        condition_series(expr)


@pytest.mark.parametrize(
    "expr, restricted",
    [
        ("sum by (verdict) (rate(counterpoint_grader_requests_total[1m]))",
         'sum by (verdict) (rate(counterpoint_grader_requests_total{job="g"}[1m]))'),
        ('counterpoint_grader_requests_total{verdict="admitted"} > 1',
         'counterpoint_grader_requests_total{job="g", verdict="admitted"} > 1'),
        ("sum(counterpoint_grader_latency_seconds_bucket) by (le)",
         'sum(counterpoint_grader_latency_seconds_bucket{job="g"}) by (le)'),
    ],
)
def test_restrict_to_job(expr, restricted):
    assert restrict_to_job(expr, "g", "counterpoint_grader_") == restricted


@pytest.mark.parametrize("expr", ["counterpoint:grader_requests:rate5m", 'x{a="counterpoint_grader_y"}'])
def test_restrict_to_job_refuses_an_expr_without_the_series(expr):
    with pytest.raises(ValueError, match="no counterpoint_grader_"):
        restrict_to_job(expr, "g", "counterpoint_grader_")


def test_grafana_variables_substituted():
    assert substitute_grafana_variables("rate(x[$__rate_interval])") == "rate(x[1m])"
    with pytest.raises(ValueError, match="unsubstituted"):
        substitute_grafana_variables("x{job=$job}")


@contextlib.contextmanager
def demo_exporter(*args: str):
    """A subprocess serving services/metrics.py, graders/metrics.py and rollout series, stepping."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), str(REPO / "tests")]))
    proc = subprocess.Popen(
        [sys.executable, str(REPO / "tests" / "promharness.py"), "demo-exporter", *args],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO,
    )
    try:
        line = proc.stdout.readline()
        if not line:
            proc.wait(timeout=30)
            raise RuntimeError(f"demo exporter died: {proc.stderr.read()}")
        yield json.loads(line)
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def scrape_jobs(ports: dict[str, int]) -> dict[str, list[str]]:
    return {
        "counterpoint-trainer": [f"127.0.0.1:{ports['trainer']}"],
        "counterpoint-graders": [f"127.0.0.1:{ports['graders']}"],
        "counterpoint-ray": [f"127.0.0.1:{ports['ray']}"],
    }


@pytest.mark.subprocess
def test_a_prometheus_whose_port_was_taken_meanwhile_starts_on_another(monkeypatch):
    """The harness picks Prometheus's port (Prometheus cannot report one it chose): a port taken
    between the pick and Prometheus's bind, made certain here, is a restart on another port,
    not a failed test."""
    import socket

    import promharness

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        picks = [held.getsockname()[1]]
        real = promharness.free_port
        monkeypatch.setattr(promharness, "free_port", lambda: picks.pop() if picks else real())
        with PromServer({}) as server:
            assert server.port != held.getsockname()[1] and not picks
            assert server.query("vector(1)")[0]["value"][1] == "1"


@pytest.fixture(scope="module")
def prom():
    """A healthy run: ppl_ratio near 1, rollout series under their DESIGN.md names."""
    with demo_exporter() as ports, PromServer(scrape_jobs(ports), rule_files=[ALERTS]) as server:
        yield server


@pytest.fixture(scope="module")
def prom_drifting():
    """ppl_ratio near 1.3; rollout series as Ray's metrics agent names them (`ray_` prefix),
    scraped with the shipped relabelling of the rollout job."""
    settings = {"counterpoint-ray": shipped_job_settings("counterpoint-ray")}
    with demo_exporter("--ppl-ratio", "1.3", "--ray-prefix") as ports, PromServer(
        scrape_jobs(ports), rule_files=[ALERTS], job_settings=settings
    ) as server:
        yield server


def wait_for(predicate, what: str, wait_s: float = 60.0):
    deadline = time.monotonic() + wait_s
    while True:
        value = predicate()
        if value or time.monotonic() > deadline:
            assert value, f"timed out waiting for {what}"
            return value
        time.sleep(0.5)


def active_alerts(prom: PromServer) -> dict[str, str]:
    return {a["labels"]["alertname"]: a["state"] for a in prom.alerts()}


def test_every_dashboard_query_returns_data(prom):
    exprs = dashboard_exprs(DASHBOARD)
    assert len(exprs) >= 20
    assert_all_queries_return_data(prom, exprs)


def test_every_alert_and_recording_rule_series_returns_data(prom):
    exprs = alert_series_exprs(ALERTS)
    assert "counterpoint_ppl_ratio" in exprs
    assert "time() - counterpoint_last_step_timestamp_seconds" in exprs
    assert_all_queries_return_data(prom, exprs)


def test_assert_all_queries_names_every_failing_expr(prom):
    with pytest.raises(AssertionError) as info:
        assert_all_queries_return_data(
            prom, ["counterpoint_step", "counterpoint_no_such_metric", "rate(counterpoint_step["],
            wait_s=2,
        )
    lines = str(info.value).splitlines()[1:]
    reasons = dict(line.strip().split("  -> ", 1) for line in lines)
    assert set(reasons) == {"counterpoint_no_such_metric", "rate(counterpoint_step["}
    assert reasons["counterpoint_no_such_metric"] == "empty result"
    assert reasons["rate(counterpoint_step["].startswith("error: ")


def test_every_rule_loads_and_evaluates(prom):
    doc = yaml.safe_load(ALERTS.read_text())
    shipped = {r.get("alert") or r.get("record") for g in doc["groups"] for r in g["rules"]}
    assert {r["name"] for r in prom.rules()} == shipped

    def not_ok() -> dict:
        rules = prom.rules()
        return {r["name"]: (r["health"], r.get("lastError")) for r in rules if r["health"] != "ok"}
    deadline = time.monotonic() + 30
    while (pending := not_ok()) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not pending, f"rules not evaluating cleanly: {pending}"


def test_healthy_run_trips_no_band_alert(prom):
    assert_all_queries_return_data(prom, ["counterpoint_ppl_ratio", "counterpoint_step"])
    # One evaluation after data arrived (evaluation_interval 1 s).
    time.sleep(2)
    alerts = active_alerts(prom)
    for name in ("CounterpointPplRatioOutOfBand", "CounterpointNoStep",
                 "CounterpointNoLearningSignal", "CounterpointTargetDown"):
        assert name not in alerts, f"{name} is {alerts[name]} on a healthy run"


def test_drifting_ppl_ratio_trips_the_alert(prom_drifting):
    alerts = wait_for(
        lambda: "CounterpointPplRatioOutOfBand" in (a := active_alerts(prom_drifting)) and a,
        "CounterpointPplRatioOutOfBand to go pending",
    )
    # `for: 5m` keeps it pending first; firing would take five minutes.
    assert alerts["CounterpointPplRatioOutOfBand"] == "pending"


def test_ray_prefixed_grader_series_are_relabelled(prom_drifting):
    assert_all_queries_return_data(
        prom_drifting,
        ['counterpoint_grader_requests_total{job="counterpoint-ray"}',
         "counterpoint_rollout_adapter_version", "counterpoint_rollout_tokens_total"],
    )
    assert prom_drifting.query('{__name__=~"ray_counterpoint_.*"}') == []


def test_dashboard_shows_every_exported_series():
    from graders.autoscale import METRIC_NAMES as SCALING_NAMES
    from services.metrics import METRIC_NAMES

    others = {  # DESIGN.md: graders and rollout replicas; the driver's grader replica watch
        "counterpoint_grader_requests_total", "counterpoint_grader_latency_seconds",
        "counterpoint_rollout_tokens_total", "counterpoint_rollout_adapter_version",
        *SCALING_NAMES,
    }
    text = " ".join(dashboard_exprs(DASHBOARD))
    missing = {n for n in {*METRIC_NAMES, *others} if not re.search(rf"\b{n}(_bucket)?\b", text)}
    assert not missing, f"no dashboard panel queries {sorted(missing)}"


SEARCH_DASHBOARD = DASHBOARD.with_name("counterpoint-search.json")


def test_search_dashboard_queries_exactly_what_tree_rounds_export():
    """The tree-search dashboard (a row of its own file, so flat runs' "every query answers"
    checks stay about flat runs) queries every counterpoint_search_* series that
    TrainerMetrics.record_search exports, and nothing it does not."""
    from prometheus_client import generate_latest

    from services.metrics import SEARCH_METRIC_NAMES, TrainerMetrics

    metrics = TrainerMetrics(port=0)
    assert b"counterpoint_search" not in generate_latest(metrics.registry)  # flat runs export none
    metrics.record_search({"search_valid_share": 0.5, "search_status_ok": 2, "search_mode_draft": 4,
                           "search_gen_llm_seconds": 1.0, "search_gen_exec_seconds": 2.0,
                           "search_debug_success_rate": None, "search_best_val_metric": 0.6,
                           "search_best_vs_constant": 0.1})
    exported = set(re.findall(r"^(counterpoint_search_\w+)", generate_latest(metrics.registry).decode(), re.M))
    assert exported == set(SEARCH_METRIC_NAMES)
    text = " ".join(dashboard_exprs(SEARCH_DASHBOARD))
    queried = set(re.findall(r"counterpoint_search_\w+", text))
    assert queried == set(SEARCH_METRIC_NAMES), (queried ^ set(SEARCH_METRIC_NAMES))
    panels = json.loads(SEARCH_DASHBOARD.read_text())["panels"]
    assert [p["type"] for p in panels][0] == "row" and len({p["id"] for p in panels}) == len(panels)


def test_grader_scaling_panel_shows_replicas_and_both_directions(prom):
    """The scaling panel over the demo's 1 -> 3 -> 1 cycle: the running line reaches the max
    bound and the bars show replicas added and removed (the real Serve scaling is in
    tests/test_grader_autoscale.py)."""
    from promharness import panel_exprs

    exprs = panel_exprs(DASHBOARD, "Grader replicas and scale events")
    assert_all_queries_return_data(prom, exprs)
    events = next(e for e in exprs if "scale_events" in e)

    def both_directions():
        seen = {s["metric"]["direction"]: float(s["value"][1]) for s in prom.query(events)}
        return seen.get("up", 0) > 0 and seen.get("down", 0) > 0

    wait_for(both_directions, "scale events up and down in the panel's query")
    peak = prom.query('max_over_time(counterpoint_grader_replicas{state="running"}[1m])')
    bound = prom.query('counterpoint_grader_replica_bounds{bound="max"}')
    assert [float(s["value"][1]) for s in peak] == [float(s["value"][1]) for s in bound] == [3.0]


def test_recoveries_panel_shows_each_part_that_recovered(prom):
    """The recoveries panel over the demo's run, where a part fails every fifth step (the real
    recoveries of a run are in tests/test_multinode_e2e.py): its query returns a series per part
    of services/recovery.py's bounded set, and the parts that failed show an increase."""
    from promharness import panel_exprs

    from services.recovery import PARTS

    (expr,) = panel_exprs(DASHBOARD, "Recoveries by part")
    assert_all_queries_return_data(prom, [expr])

    def recovered_parts():
        total = prom.query("counterpoint_recoveries_total")
        return {s["metric"]["part"] for s in total if float(s["value"][1]) > 0}

    wait_for(lambda: len(recovered_parts()) >= 2, "two parts with a recovery on /metrics")
    seen = {s["metric"]["part"] for s in prom.query(substitute_grafana_variables(expr))}
    assert seen == set(PARTS), seen
