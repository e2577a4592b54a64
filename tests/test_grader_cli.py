"""`counterpoint grader score` over stdin/stdout, and --help of every grader command."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from graders.voice_leading import score

pytestmark = pytest.mark.subprocess  # every test runs `counterpoint grader ...`

REPO = Path(__file__).resolve().parents[1]
CADENCE = {"key": "C major", "chords": [
    {"measure": 1, "chordSymbol": "C"}, {"measure": 2, "chordSymbol": "F"},
    {"measure": 3, "chordSymbol": "G7"}, {"measure": 4, "chordSymbol": "C"}]}
# Spec §14 example 2: tendencyLeadingTone; admitted only under film-ambient.
EXAMPLE_2 = ('[{"measure":1,"degrees":[0,0]},{"measure":2,"degrees":[0,1]},'
             '{"measure":3,"degrees":[0,1]},{"measure":4,"degrees":[1,1]}]')
FIELDS = ["reward", "format_ok", "admitted", "verdict", "failing_rules", "sounding_frames",
          "expected_frames"]


def _run(stdin: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "services.cli", "grader", "score", *args],
        input=stdin, cwd=REPO, capture_output=True, text=True, timeout=120,
    )


def test_score_jsonl_in_order_with_a_malformed_line():
    lines = [
        json.dumps({"progression": CADENCE, "completion": EXAMPLE_2}),
        json.dumps({"progression": CADENCE, "completion": EXAMPLE_2, "style": "film-ambient"}),
        '{"progression": {"key": "C major", "chords": [',  # truncated JSON
        json.dumps({"progression": CADENCE, "completion": 7}),
        json.dumps({"completion": "[]"}),
        json.dumps({"progression": CADENCE, "completion": "[]", "voices": 9}),
        json.dumps({"progression": CADENCE, "completion": "prose only", "voices": 4}),
    ]
    proc = _run("\n".join(lines) + "\n")
    assert proc.returncode == 0, proc.stderr
    out = [json.loads(x) for x in proc.stdout.splitlines()]
    assert len(out) == len(lines)
    assert out[0] == {
        "reward": 0.0, "format_ok": True, "admitted": False, "verdict": "tendencyLeadingTone",
        "failing_rules": ["tendencyLeadingTone"], "sounding_frames": 4, "expected_frames": 4,
    }
    assert (out[1]["verdict"], out[1]["reward"], out[1]["failing_rules"]) == (
        "admitted", 1.0, ["tendencyLeadingTone"])
    assert out[2]["line"] == 3 and "JSON" in out[2]["error"]
    assert out[3]["line"] == 4 and "completion" in out[3]["error"]
    assert out[4]["line"] == 5 and "progression" in out[4]["error"]
    assert out[5]["line"] == 6 and "voices" in out[5]["error"]
    expected = score(CADENCE, "prose only", voices=4)
    assert [out[6][f] for f in FIELDS] == [
        expected.reward, expected.format_ok, expected.admitted, expected.verdict,
        list(expected.failing_rules), expected.sounding_frames, expected.expected_frames]


def test_options_set_the_defaults():
    line = json.dumps({"progression": CADENCE, "completion": EXAMPLE_2}) + "\n"
    film = json.loads(_run(line, "--style", "film-ambient").stdout)
    assert film["verdict"] == "admitted"
    bad = _run(line, "--style", "baroque")
    assert bad.returncode != 0 and "style" in bad.stderr


@pytest.mark.parametrize("command", [[], ["serve"], ["score"], ["make-fixtures"]])
def test_help(command):
    proc = subprocess.run(
        [sys.executable, "-m", "services.cli", "grader", *command, "--help"],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0 and "Usage" in proc.stdout


def test_make_fixtures_regenerates_the_shipped_pools(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "services.cli", "grader", "make-fixtures", "--out", str(tmp_path)],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    for name in ("train.json", "heldout.json"):
        assert (tmp_path / name).read_bytes() == (REPO / "graders" / "voice_leading" / "data" / name).read_bytes()
    small = subprocess.run(
        [sys.executable, "-m", "services.cli", "grader", "make-fixtures", "--out", str(tmp_path),
         "--train", "2"],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )
    assert small.returncode != 0 and "cannot cover" in small.stderr
