"""bench/gpu_overlap.py on CPU: the share it reports, the probe's layers, and its plumbing end to
end (real worker processes released together, the rows and the JSON) at tiny shapes; its GPU
variants are refused in one line off CUDA. The GPU figures themselves come from the H200
(bench/device/session.sh overlap)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.gpu_overlap import QWEN3_4B, VARIANTS, hidden_share, mps_settings, table_row

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("decode, update, wall, want", [
    (2.0, 1.0, 2.0, 1.0),  # the pair took as long as the decode alone: all of the update hid
    (2.0, 1.0, 3.0, 0.0),  # back to back
    (2.0, 1.0, 2.5, 0.5),
    (2.0, 1.0, 3.2, -0.2),  # worse than back to back
])
def test_hidden_share(decode, update, wall, want):
    assert hidden_share(decode, update, wall) == pytest.approx(want)


def _mps(learner=100, priority="normal", rollout=100):
    return {"learner_sm_percent": learner, "learner_priority": priority, "rollout_sm_percent": rollout}


@pytest.mark.parametrize("variant, want", [
    ("mps", _mps()), ("mps_low", _mps(priority="below_normal")),
    ("mps_cap50", _mps(50)), ("mps_cap30", _mps(30)), ("mps_low_cap25", _mps(25, "below_normal")),
    ("mps_cap30_r70", _mps(30, rollout=70)), ("mps_r80", _mps(rollout=80)),
    ("mps_cap0", None), ("mps_cap100", None), ("mps_cap101", None),  # a cap is 1-99; 100 is plain mps
    ("mps_cap30_r100", None), ("mps_capx", None), ("timeslice", None), ("streams", None), ("mps_cap50_", None),
])
def test_the_mps_settings_per_variant(variant, want):
    assert mps_settings(variant) == want


def test_the_probe_has_qwen3_4bs_linear_layers():
    per_layer = sum(i * o for i, o in QWEN3_4B.linears())
    assert QWEN3_4B.layers * per_layer == 36 * 100_925_440  # ~3.6 B of the model's 4.0 B are these


@pytest.mark.subprocess
def test_the_plumbing_on_cpu(tmp_path):
    out = tmp_path / "overlap.json"
    done = subprocess.run([sys.executable, "bench/gpu_overlap.py", "--device", "cpu", "--tiny", "--variants",
                           "timeslice", "--rows", "2,4", "--steps", "20", "--reps", "2", "--out", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(out.read_text())
    assert [(r["rows"], r["variant"]) for r in result["rows"]] == [(2, "alone"), (2, "timeslice"), (4, "alone"),
                                                                  (4, "timeslice")]
    for row in result["rows"]:
        assert row["decode"] > 0 and row["update"] > 0
        assert table_row(row) in done.stdout
    alone, pair = result["rows"][0], result["rows"][1]
    assert pair["wall"] >= max(pair["decode"], pair["update"]) and alone["wall"] is None
    assert pair["back_to_back"] == pytest.approx(alone["decode"] + alone["update"])
    assert pair["hidden"] == pytest.approx(hidden_share(alone["decode"], alone["update"], pair["wall"]))
    assert result["mps"] is None  # no MPS variant, no daemon


@pytest.mark.subprocess
@pytest.mark.parametrize("variants, match", [("mps_low", "need --device cuda"), ("streams", "need --device cuda"),
                                             ("mps_cap30", "need --device cuda"), ("nope", "unknown"),
                                             ("mps_cap100", "unknown")])
def test_what_cannot_run_here_is_refused_in_one_line(variants, match):
    done = subprocess.run([sys.executable, "bench/gpu_overlap.py", "--device", "cpu", "--tiny", "--variants", variants],
                          cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and match in done.stderr and len(done.stderr.strip().splitlines()) == 1
    assert set(VARIANTS) >= {"alone", "timeslice", "mps", "mps_low", "streams"}
