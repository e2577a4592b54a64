"""services/metrics.py: the trainer's /metrics endpoint, scraped over a real socket."""

from __future__ import annotations

import re
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from services.metrics import METRIC_NAMES, PHASES, STEP_GAUGES, TrainerMetrics

# The names DESIGN.md fixes, plus the three the brief adds; spelled out, not imported, so a
# rename in services/metrics.py fails here.
DESIGN_NAMES = {
    "counterpoint_ppl_ratio", "counterpoint_rollout_kl", "counterpoint_rollout_k3_kl",
    "counterpoint_phase_seconds", "counterpoint_phase_duration_seconds", "counterpoint_step",
    "counterpoint_reward_mean", "counterpoint_pass_rate", "counterpoint_frac_reward_zero_std",
    "counterpoint_kl", "counterpoint_entropy", "counterpoint_grad_norm",
    "counterpoint_learning_rate", "counterpoint_adapter_version",
    "counterpoint_generated_tokens_total", "counterpoint_last_step_timestamp_seconds",
    "counterpoint_step_seconds", "counterpoint_adapter_staleness", "counterpoint_tokens_per_second",
    # issue 25 (README "What survives what"); DESIGN.md's list is to gain it with the issue
    "counterpoint_recoveries_total",
    # issue 34: the part of a one_step_off sync that waited for the next generation
    "counterpoint_update_weights_beside_gen_seconds",
}

STEP_METRICS = {
    "ppl_ratio": 1.0004, "rollout_kl": 0.0012, "rollout_k3_kl": 0.0003, "reward_mean": 0.41,
    "pass_rate": 0.25, "frac_reward_zero_std": 0.5, "kl": 0.002, "entropy": 1.7,
    "grad_norm": 0.83, "learning_rate": 1e-5, "adapter_staleness": 1, "update_weights_beside_gen_s": 0.04,
    "loss": 0.12,  # not exported: accepted and ignored
}
PHASES_S = {
    "gen": 4.0, "score": 0.2, "old_log_prob": 1.1, "ref": 1.0, "adv": 0.001,
    "update_actor": 3.2, "update_weights": 0.05, "total": 9.6,
}


def scrape(port: int) -> dict[str, list]:
    """name -> samples, from a real HTTP GET of /metrics on 127.0.0.1."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    samples: dict[str, list] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append(sample)
    return samples


@pytest.fixture
def served():
    metrics = TrainerMetrics(host="127.0.0.1", port=0)
    port = metrics.start()
    yield metrics, port
    metrics.stop()


def test_design_names_match_module():
    assert set(METRIC_NAMES) == DESIGN_NAMES


def test_every_design_name_is_scraped_after_one_step(served):
    metrics, port = served
    assert port > 0
    metrics.record_step(3, STEP_METRICS, PHASES_S, generated_tokens=2048, adapter_version=3)
    samples = scrape(port)
    exposed = {re.sub(r"_(bucket|count|sum)$", "", name) for name in samples}
    missing = DESIGN_NAMES - exposed
    assert not missing, f"not on /metrics: {sorted(missing)}"

    def value(name, **labels):
        (match,) = [s for s in samples[name] if labels.items() <= s.labels.items()]
        return match.value

    assert value("counterpoint_ppl_ratio") == pytest.approx(1.0004)
    assert value("counterpoint_step") == 3
    assert value("counterpoint_adapter_version") == 3
    assert value("counterpoint_generated_tokens_total") == 2048
    assert value("counterpoint_step_seconds") == pytest.approx(9.6)
    assert value("counterpoint_tokens_per_second") == pytest.approx(2048 / 4.0)
    assert value("counterpoint_update_weights_beside_gen_seconds") == pytest.approx(0.04)
    assert value("counterpoint_phase_seconds", phase="update_actor") == pytest.approx(3.2)
    # save_checkpoint did not happen this step: the last-step gauge reads 0, the histogram is empty.
    assert value("counterpoint_phase_seconds", phase="save_checkpoint") == 0
    assert value("counterpoint_phase_duration_seconds_count", phase="gen") == 1
    assert not [s for s in samples["counterpoint_phase_duration_seconds_count"]
                if s.labels["phase"] == "save_checkpoint"]
    assert {s.labels["phase"] for s in samples["counterpoint_phase_seconds"]} == set(PHASES)
    assert "counterpoint_loss" not in samples


def test_counter_accumulates_and_series_counts(served):
    metrics, port = served
    for step in (1, 2, 3):
        phases = dict(PHASES_S, save_checkpoint=0.7) if step == 3 else PHASES_S
        metrics.record_step(step, STEP_METRICS, phases, generated_tokens=100, adapter_version=step)
    samples = scrape(port)
    assert samples["counterpoint_generated_tokens_total"][0].value == 300
    counts = metrics.series_counts()
    assert counts["counterpoint_step"] == 3
    assert counts["counterpoint_ppl_ratio"] == 3
    assert counts['counterpoint_phase_duration_seconds{phase="save_checkpoint"}'] == 1
    assert counts['counterpoint_phase_seconds{phase="save_checkpoint"}'] == 3
    # tokens_per_second was derived from phases_s["gen"], so every gauge got 3 points.
    assert {counts[name] for name, _ in STEP_GAUGES.values()} == {3}


@pytest.mark.parametrize(
    "phases, message",
    [
        ({"gen": 1.0}, "lacks 'total'"),
        ({"total": 1.0, "generate": 1.0}, "unknown phase"),
        ({"total": -1.0}, "finite and >= 0"),
    ],
)
def test_bad_phases_are_named(phases, message):
    metrics = TrainerMetrics(port=0)
    with pytest.raises(ValueError, match=message):
        metrics.record_step(1, {}, phases, generated_tokens=0, adapter_version=0)


def test_second_start_is_refused(served):
    metrics, _ = served
    with pytest.raises(RuntimeError, match="already serving"):
        metrics.start()


def test_none_leaves_a_gauge_untouched(served):
    metrics, port = served
    metrics.record_step(1, {"adapter_staleness": 1, "kl": 0.5}, PHASES_S, 10, 1)
    metrics.record_step(2, {"adapter_staleness": None, "kl": 0.25}, PHASES_S, 10, 2)
    samples = scrape(port)
    assert samples["counterpoint_adapter_staleness"][0].value == 1
    assert samples["counterpoint_kl"][0].value == 0.25
    assert metrics.series_counts()["counterpoint_adapter_staleness"] == 1


def test_port_in_use_is_named(served):
    _, port = served
    other = TrainerMetrics(host="127.0.0.1", port=port)
    with pytest.raises(OSError, match=f"cannot serve /metrics on 127.0.0.1:{port}"):
        other.start()


# Tree rounds against the task's reference ladder (search/diagnostics.py `<stat>_vs_<rung>`):
# one labelled series per (rung, stat), not one metric name per rung. Spelled out here so a
# dropped export fails.
LADDER_SCALARS = {
    "search_valid_share": 0.5, "search_best_val_metric": 0.59, "search_median_val_metric": 0.51,
    "search_best_vs_constant": 0.09, "search_median_vs_constant": 0.01, "search_honest_vs_constant": -0.002,
    "search_best_vs_gbm": -0.2, "search_median_vs_gbm": -0.28, "search_honest_vs_gbm": -0.25,
}


def test_ladder_gaps_are_exported_by_rung(served):
    metrics, port = served
    metrics.record_search(LADDER_SCALARS)
    samples = scrape(port)
    ladder = {(s.labels["rung"], s.labels["stat"]): s.value for s in samples["counterpoint_search_vs_ladder"]}
    assert ladder == {(rung, stat): pytest.approx(LADDER_SCALARS[f"search_{stat}_vs_{rung}"])
                      for rung in ("constant", "gbm") for stat in ("best", "median", "honest")}
    selection = {(s.labels["stat"], s.labels["split"]): s.value
                 for s in samples["counterpoint_search_selection_metric"]}
    assert selection == {("best", "val"): pytest.approx(0.59), ("median", "val"): pytest.approx(0.51)}
    assert not [n for n in samples if re.search(r"vs_(constant|gbm)", n)]  # no name per rung
    counts = metrics.series_counts()
    assert counts['counterpoint_search_vs_ladder{rung="gbm",stat="honest"}'] == 1
    assert counts['counterpoint_search_selection_metric{stat="best",split="val"}'] == 1

    # A round without a valid node has no best/median: those series go (no stale value), the
    # honest gap of a round that has one stays.
    metrics.record_search({**LADDER_SCALARS, "search_best_val_metric": None, "search_best_vs_gbm": None,
                           "search_median_vs_gbm": None, "search_honest_vs_gbm": -0.3})
    samples = scrape(port)
    ladder = {(s.labels["rung"], s.labels["stat"]): s.value for s in samples["counterpoint_search_vs_ladder"]}
    assert ("gbm", "best") not in ladder and ("gbm", "median") not in ladder
    assert ladder[("gbm", "honest")] == pytest.approx(-0.3) and ("constant", "best") in ladder
    assert {s.labels["stat"] for s in samples["counterpoint_search_selection_metric"]} == {"median"}
    assert metrics.series_counts()['counterpoint_search_vs_ladder{rung="gbm",stat="honest"}'] == 2
