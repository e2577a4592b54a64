"""deploy/prometheus/alerts.yml under promtool's rule unit tests (deploy/prometheus/alerts_test.yml).

The unit tests must pass, cover every alert (tripped, not before its `for:`, and quiet on a
healthy run) and every recording rule, and fail when a rule is broken: each alert is mutated
in turn into one that never fires, one that always fires and one without its `for:`, each
recording rule into a constant, and promtool must then report that rule.

Needs Debian's `prometheus` package (promtool): `make prometheus`.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import yaml

from promharness import ALERTS, PROM_DIR

UNIT_TESTS = PROM_DIR / "alerts_test.yml"


def promtool_test(test_file: Path) -> subprocess.CompletedProcess:
    return subprocess.run(["promtool", "test", "rules", str(test_file)], capture_output=True, text=True,
                          timeout=120, cwd=test_file.parent)


def rules() -> list[dict]:
    return [r for g in yaml.safe_load(ALERTS.read_text())["groups"] for r in g["rules"]]


ALERT_NAMES = [r["alert"] for r in rules() if "alert" in r]
RECORD_NAMES = [r["record"] for r in rules() if "record" in r]


def unit_tests() -> list[dict]:
    return yaml.safe_load(UNIT_TESTS.read_text())["tests"]


def test_promtool_rule_unit_tests_pass():
    done = promtool_test(UNIT_TESTS)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS" in done.stdout


def test_unit_tests_use_the_shipped_rule_file():
    assert yaml.safe_load(UNIT_TESTS.read_text())["rule_files"] == [ALERTS.name]


def test_every_alert_is_tripped_after_its_for_and_quiet_on_the_healthy_run():
    fired: dict[str, list[float]] = {}
    quiet_before: dict[str, list[float]] = {}
    quiet_healthy: set[str] = set()
    for case in unit_tests():
        for check in case.get("alert_rule_test", []):
            minutes = _minutes(check["eval_time"])
            if check.get("exp_alerts"):
                fired.setdefault(check["alertname"], []).append(minutes)
            else:
                quiet_before.setdefault(check["alertname"], []).append(minutes)
                if case["name"] == "healthy run":
                    quiet_healthy.add(check["alertname"])
    assert set(ALERT_NAMES) <= set(fired), f"never shown to fire: {sorted(set(ALERT_NAMES) - set(fired))}"
    assert set(ALERT_NAMES) <= quiet_healthy, f"not checked quiet on the healthy run: {sorted(set(ALERT_NAMES) - quiet_healthy)}"
    for alert in ALERT_NAMES:  # a check one minute before it fires pins the `for:` duration
        assert any(t - 1 in quiet_before.get(alert, []) for t in fired[alert]), f"{alert}: no check just before it fires"


def test_every_recording_rule_has_an_exact_value():
    checked = {c["expr"] for case in unit_tests() for c in case.get("promql_expr_test", [])}
    assert set(RECORD_NAMES) <= checked, f"recording rules without a value check: {sorted(set(RECORD_NAMES) - checked)}"


def _minutes(duration: str) -> float:
    units = {"s": 1 / 60, "m": 1, "h": 60}
    return float(duration[:-1]) * units[duration[-1]]


def _mutated(tmp_path: Path, name: str, change) -> Path:
    """A copy of alerts.yml with rule `name` changed by `change(rule)`, beside a copy of the tests."""
    doc = yaml.safe_load(ALERTS.read_text())
    (rule,) = [r for g in doc["groups"] for r in g["rules"] if name in (r.get("alert"), r.get("record"))]
    change(rule)
    (tmp_path / ALERTS.name).write_text(yaml.safe_dump(doc, sort_keys=False))
    (tmp_path / UNIT_TESTS.name).write_text(UNIT_TESTS.read_text())
    return tmp_path / UNIT_TESTS.name


MUTATIONS = {
    "never fires": lambda rule: rule.update(expr="vector(1) < 0"),
    "always fires": lambda rule: rule.update(expr="vector(1) > 0"),
    "fires at once (no for:)": lambda rule: rule.pop("for"),
}


@pytest.mark.parametrize("mutation", list(MUTATIONS))
@pytest.mark.parametrize("alert", ALERT_NAMES)
def test_unit_tests_catch_a_broken_alert(tmp_path, alert, mutation):
    done = promtool_test(_mutated(tmp_path, alert, MUTATIONS[mutation]))
    assert done.returncode != 0, f"{alert} {mutation}: the unit tests still pass\n{done.stdout}"
    report = done.stdout + done.stderr
    assert f"alertname: {alert}," in report, report


@pytest.mark.parametrize("record", RECORD_NAMES)
def test_unit_tests_catch_a_broken_recording_rule(tmp_path, record):
    done = promtool_test(_mutated(tmp_path, record, lambda rule: rule.update(expr="vector(3)")))
    assert done.returncode != 0, f"{record} as a constant: the unit tests still pass\n{done.stdout}"
    report = done.stdout + done.stderr
    assert f'expr: "{record}"' in report, report
