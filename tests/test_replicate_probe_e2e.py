"""End to end on configs/smoke.yaml with the real services: `counterpoint replicate --pin-init`
(arms share one saved init, one arm fails and is reported), and `counterpoint probe-options`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cliharness import cli
from evals.records import read_eval

pytestmark = pytest.mark.slow


def test_replicate_pins_the_init_and_survives_a_failed_arm(tmp_path: Path):
    out = tmp_path / "rep"
    # Arm seed 9 cannot create its run directory (a file is in the way): a real failure, late
    # in the list, that must be reported while the other arms complete.
    (out / "runs").mkdir(parents=True)
    (out / "runs" / "seed9").write_text("not a directory")
    done = cli("replicate", "--config", "configs/smoke.yaml", "--seeds", "7,8,9", "--pin-init", "--out", str(out),
               "--set", "trainer.steps=2", "--set", "eval.before_and_after=false",
               "--generations", "2", "--max-new-tokens", "8", timeout=840)  # inside pytest's 900 s
    log = done.stdout[-3000:] + done.stderr[-3000:]
    assert done.returncode == 1, log  # one arm failed: the command says so
    assert "1 of 3 arms failed (seeds [9])" in done.stderr, log

    receipt = json.loads((out / "replicate.json").read_text())
    assert receipt["kind"] == "replicate" and receipt["status"] == "completed"
    arms = {a["seed"]: a for a in receipt["artifacts"]["arms"]}
    assert [arms[s]["status"] for s in (7, 8, 9)] == ["completed", "completed", "failed"], arms
    assert "exited" in arms[9]["error"] and "seed9.log" in arms[9]["error"]
    pinned = out / "runs" / "seed7" / "adapters" / "init"
    assert arms[7]["init_adapter"] == f"{pinned} (saved by this arm)"
    assert arms[8]["init_adapter"] == str(pinned)

    runs = {s: json.loads((out / "runs" / f"seed{s}" / "run.json").read_text()) for s in (7, 8)}
    assert runs[7]["init_adapter"] == "seeded (adapters/init)"
    assert runs[8]["init_adapter"] == str(pinned)
    # Same init bytes, different seeds: the pinned arm started from the first arm's artifact.
    assert runs[8]["init_adapter_sha256"] == runs[7]["init_adapter_sha256"]
    assert runs[7]["seeds"]["seed"] == 7 and runs[8]["seeds"]["seed"] == 8
    for s in (7, 8):
        assert runs[s]["status"] == "completed" and runs[s]["steps_trained"] == [1, 2]
        ev = read_eval(out / f"eval_seed{s}.jsonl")
        assert ev.header.generation.generations == 2 and len(ev.items) == ev.header.prompt_set.n_items > 0
        assert all(len(item.completions) == 2 for item in ev.items)
    # Both arms were evaluated on the same prompts with the same settings: compare accepts them.
    done = cli("compare", str(out / "eval_seed7.jsonl"), str(out / "eval_seed8.jsonl"), "--seed", "1")
    assert done.returncode == 0, done.stderr
    assert "95% interval" in done.stdout


def test_probe_options_on_smoke(tmp_path: Path):
    out = tmp_path / "probe.json"
    done = cli("probe-options", "--config", "configs/smoke.yaml", "--split", "heldout", "--limit", "3",
               "--max-new-tokens", "16", "--out", str(out))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "five-options probe (heldout, 3 items)" in done.stdout
    assert "probe answers parsed:" in done.stdout
    report = json.loads(out.read_text())
    assert len(report["items"]) == 3
    for item in report["items"]:
        assert item["item_id"] and isinstance(item["raw"], str) and isinstance(item["options"], list)
        assert item["distinct_admissible"] >= 0
    summary = report["summary"]
    assert 0.0 <= summary["probe_parsed_share"] <= 1.0
    assert set(summary["probe_distinct_admissible"]) >= {"mean", "median", "min", "max"}
