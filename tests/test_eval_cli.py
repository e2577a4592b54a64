"""`prior-shape`, `compare` and `eval-summary` commands on hand-made eval files."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from typer.testing import CliRunner

from evals.cli import eval_app
from evals.eval_file import NO_OPENING, GenerationSettings, header_for, item_record, write_eval

G = 4


@dataclass
class Score:
    admitted: bool
    verdict: str


def write_run(path: Path, rows: dict[str, list[tuple[str, bool]]], seed=0, temperature=1.0,
              prefix_mode="none"):
    """rows: item id -> G (opening, admitted) pairs."""
    items = []
    for item_id, pairs in rows.items():
        openings = [o for o, _ in pairs]
        scores = [Score(a, "admitted" if a else "structure") for _, a in pairs]
        completions = [f"{item_id}/{k}: {o}" for k, o in enumerate(openings)]
        items.append(item_record(item_id, completions, [3] * G, scores, 16, openings=openings))
    generation = GenerationSettings(generations=G, max_new_tokens=32, temperature=temperature,
                                    top_p=1.0, top_k=-1, seed=seed)
    header = header_for(items, generation=generation, model="m", voices=2, prefix_mode=prefix_mode)
    return write_eval(path, header, items)


P, F = True, False
BASE_ROWS = {
    "a": [("0,1", P), ("0,1", F), ("2,2", F), (NO_OPENING, F)],
    "b": [("0,0", F)] * 4,
    "c": [(NO_OPENING, F)] * 4,
}


def arm_rows(k: int) -> dict[str, list[tuple[str, bool]]]:
    return {
        "a": [("0,1", P)] * (2 + k % 2) + [("1,1", F)] * (2 - k % 2),
        "b": [("0,0", P), ("0,0", F), ("3,3", P), ("0,2", F)],
        "c": [(NO_OPENING, F)] * 4,
    }


@pytest.fixture
def runner() -> CliRunner:
    return CliRunner(env={"COLUMNS": "200", "NO_COLOR": "1"})


def test_prior_shape_writes_json_and_png_and_prints_the_nan_note(tmp_path, runner):
    ev = write_run(tmp_path / "base.jsonl", BASE_ROWS)
    result = runner.invoke(eval_app, ["prior-shape", str(ev)])
    assert result.exit_code == 0, result.output
    assert "support" in result.stdout and "modal_share_parseable_items" in result.stdout
    assert "reference modal-share mean is NaN" in result.stdout
    data = json.loads((tmp_path / "base.prior_shape.json").read_text())
    assert data["stats"]["support"]["mean"] == pytest.approx((2 + 1 + 0) / 3)
    assert data["modal_share_mean_reference"] is None
    assert data["stats"]["modal_share_parseable_items"]["mean"] == pytest.approx((2 / 3 + 1) / 2)
    assert (tmp_path / "base.prior_shape.png").read_bytes()[:4] == b"\x89PNG"


def test_prior_shape_explicit_outputs(tmp_path, runner):
    ev = write_run(tmp_path / "arm.jsonl", {"a": [("0,1", P)] * 4})
    out_json, out_png = tmp_path / "o" / "ps.json", tmp_path / "o" / "ps.png"
    result = runner.invoke(
        eval_app, ["prior-shape", str(ev), "--out-json", str(out_json), "--out-png", str(out_png)]
    )
    assert result.exit_code == 0, result.output
    assert "NaN" not in result.stdout
    assert json.loads(out_json.read_text())["modal_share_mean_reference"] == 1.0
    assert out_png.is_file()


def test_prior_shape_warns_when_openings_were_forced(tmp_path, runner):
    ev = write_run(tmp_path / "f.jsonl", BASE_ROWS, prefix_mode="forced_opening")
    result = runner.invoke(eval_app, ["prior-shape", str(ev)])
    assert result.exit_code == 0, result.output
    assert "prefix_mode=forced_opening" in result.stderr
    assert json.loads((tmp_path / "f.prior_shape.json").read_text())["prefix_mode"] == (
        "forced_opening"
    )
    plain_file = write_run(tmp_path / "p.jsonl", BASE_ROWS)
    plain = runner.invoke(eval_app, ["prior-shape", str(plain_file)])
    assert "forced" not in plain.stderr


def test_prior_shape_bad_file_exits_with_the_line(tmp_path, runner):
    ev = write_run(tmp_path / "e.jsonl", BASE_ROWS)
    lines = ev.read_text().splitlines()
    ev.write_text("\n".join([lines[0], lines[1], "[1, 2]", lines[3]]) + "\n")
    result = runner.invoke(eval_app, ["prior-shape", str(ev)])
    assert result.exit_code == 1
    assert "e.jsonl:3: expected a JSON object" in result.stderr


def test_compare_prints_interval_and_method_and_writes_png(tmp_path, runner):
    base = write_run(tmp_path / "base.jsonl", BASE_ROWS)
    arms = [write_run(tmp_path / f"arm{k}.jsonl", arm_rows(k), seed=k) for k in (1, 2, 3)]
    out_png, out_json = tmp_path / "cmp.png", tmp_path / "cmp.json"
    args = ["compare", str(base), *map(str, arms), "--paired", "--seed", "5", "--n-boot", "300",
            "--out-png", str(out_png), "--out-json", str(out_json)]
    result = runner.invoke(eval_app, args)
    assert result.exit_code == 0, result.output
    # base 1/12 pass; arms 5/12, 4/12, 5/12 -> mean 14/36
    diff = (14 / 36 - 1 / 12) * 100
    line = re.search(r"pass_rate: ([+-]\d+\.\d\d) points, 95% interval \[([+-]\d+\.\d\d), "
                     r"([+-]\d+\.\d\d)\]", result.stdout)
    assert line is not None, result.stdout
    assert float(line.group(1)) == pytest.approx(diff, abs=0.005)
    assert float(line.group(2)) <= float(line.group(1)) <= float(line.group(3))
    assert re.search(r"coverage: \+33\.33 points", result.stdout)
    assert "method: percentile bootstrap, B=300, seed=5" in result.stdout
    assert "paired" in result.stdout
    assert out_png.read_bytes()[:4] == b"\x89PNG"
    assert json.loads(out_json.read_text())["paired"] is True
    again = runner.invoke(eval_app, args)
    assert again.stdout == result.stdout  # deterministic under --seed


def test_compare_default_png_beside_the_first_arm(tmp_path, runner):
    base = write_run(tmp_path / "base.jsonl", BASE_ROWS)
    arm = write_run(tmp_path / "arm1.jsonl", arm_rows(1), seed=1)
    result = runner.invoke(eval_app, ["compare", str(base), str(arm), "--n-boot", "50"])
    assert result.exit_code == 0, result.output
    assert "unpaired" in result.stdout
    assert (tmp_path / "compare_base_vs_arm1.png").is_file()


def test_compare_refuses_mismatched_prompt_sets_and_settings(tmp_path, runner):
    base = write_run(tmp_path / "base.jsonl", BASE_ROWS)
    other = write_run(tmp_path / "other.jsonl", {"a": BASE_ROWS["a"], "z": BASE_ROWS["b"]})
    result = runner.invoke(eval_app, ["compare", str(base), str(other)])
    assert result.exit_code == 1
    assert "cannot compare" in result.stderr and "prompt_set.ids_sha256" in result.stderr
    forced = write_run(tmp_path / "forced.jsonl", BASE_ROWS, prefix_mode="forced_opening")
    result = runner.invoke(eval_app, ["compare", str(base), str(forced)])
    assert result.exit_code == 1
    assert "prompt_set.prefix_mode: 'none' vs 'forced_opening'" in result.stderr
    cold = write_run(tmp_path / "cold.jsonl", BASE_ROWS, temperature=0.5)
    result = runner.invoke(eval_app, ["compare", str(base), str(cold)])
    assert result.exit_code == 1
    assert "generation.temperature: 1.0 vs 0.5" in result.stderr
    assert not list(tmp_path.glob("*.png"))


def test_eval_summary_table(tmp_path, runner):
    ev = write_run(tmp_path / "base.jsonl", BASE_ROWS)
    result = runner.invoke(eval_app, ["eval-summary", str(ev)])
    assert result.exit_code == 0, result.output
    row = next(line for line in result.stdout.splitlines() if "12" in line and "%" in line)
    # 1/12 admitted, 1/3 items covered, 5/12 unparseable, mean length 3
    for cell in ("8.33 %", "33.33 %", "41.67 %", "3.0"):
        assert cell in row


def test_module_entry_point_runs(tmp_path):
    ev = write_run(tmp_path / "base.jsonl", BASE_ROWS)
    out = subprocess.run(
        [sys.executable, "-m", "evals.cli", "prior-shape", str(ev)],
        capture_output=True, text=True, check=False, cwd=Path(__file__).resolve().parents[1],
    )
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "base.prior_shape.json").is_file()


def test_help_names_the_options(runner):
    compare_help = runner.invoke(eval_app, ["compare", "--help"])
    assert compare_help.exit_code == 0
    for option in ("--paired", "--seed", "--n-boot", "--out-png", "--out-json"):
        assert option in compare_help.stdout
    shape_help = runner.invoke(eval_app, ["prior-shape", "--help"])
    assert "--out-json" in shape_help.stdout and "--out-png" in shape_help.stdout


@pytest.mark.parametrize("command", ["eval", "replicate"])
def test_help_keeps_the_config_keys_the_options_stand_for(runner, command):
    """The options' help names their config key in brackets ([eval.seed]); Rich markup once took
    those for style tags and printed 'Sampling seed .'."""
    from services.cli import app as counterpoint

    text = " ".join(runner.invoke(counterpoint, [command, "--help"], terminal_width=200).stdout.split())
    assert "[eval.generations]" in text and "[eval.max_tokens, else rollout's]" in text, text

