"""A run the way users start one: from their own directory, relative paths everywhere (config,
the default `runs` directory, --resume, eval --run). Everything the run produced must be in the
run directory (not in Ray's session directory), a resume from that relative path must find its
checkpoint, and eval --run must find its last adapter. The first run is also the suite's healthy
console run (tests/test_console.py ``check_healthy_console``: few lines, every stage and step, the
logs copied into the run directory).

The first run leaves checkpoints of steps 1 and 2. Then the run is made to look like a driver
that was SIGKILLed after training step 2 but before checkpointing it (its step-2 checkpoint
removed, run.json still "running" with a dead pid): `--resume runs/paths` must say the driver
died, re-train step 2 from checkpoint 1 and go on to step 3, each step recorded once.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from cliharness import CLI, REPO
from tests.test_console import check_healthy_console, check_ray_session_removed

pytestmark = [pytest.mark.slow, pytest.mark.subprocess]
RUN = "paths"


def cli_in(cwd: Path, *args: str, timeout: float = 840) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(REPO)}
    return subprocess.run(CLI + list(args), cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env)


def timing_steps(run: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (run / "timing.jsonl").read_text().splitlines() if line.strip()]


def ray_session_leftovers() -> list[str]:
    """Anything of this run written under Ray's session directories (where a relative path
    handed to a Train worker lands). A run removes its session directory at the end, but keeps it
    when files were written under its artifacts/ (services/launch.py), so this still sees them."""
    return glob.glob(f"/tmp/ray/session_*/artifacts/**/runs/{RUN}", recursive=True)


def test_relative_paths_from_the_users_directory_then_resume_then_eval(tmp_path: Path):
    user_dir = tmp_path / "work"
    (user_dir / "configs").mkdir(parents=True)
    shutil.copy(REPO / "configs" / "smoke.yaml", user_dir / "configs" / "smoke.yaml")
    assert not ray_session_leftovers()

    first = cli_in(user_dir, "train", "--config", "configs/smoke.yaml", "--run-name", RUN,
                   "--set", "trainer.steps=2", "--set", "grader.replicas=1")
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    run = user_dir / "runs" / RUN
    check_healthy_console((first.stdout + first.stderr).splitlines(), run, steps=2, grader_replicas=1)
    for part in ("run.json", "timing.jsonl", "adapters/init/adapter_config.json",
                 "adapters/step_1/adapter_config.json", "adapters/step_2/adapter_config.json",
                 "checkpoints/step_1/state.json", "checkpoints/step_2/state.json"):
        assert (run / part).exists(), f"{part} missing from {run}: {sorted(p.name for p in run.iterdir())}"
    assert not ray_session_leftovers()
    assert timing_steps(run) == [1, 2]
    receipt = json.loads((run / "run.json").read_text())
    assert receipt["config"]["trainer"]["runs_dir"] == str(user_dir / "runs")
    assert receipt["gpu_sharing"] == {"mode": "timeslice", "requested": "auto", "daemon": "none",
                                      "reason": "gpu_sharing.mode=auto: time-sliced, as rollout.num_gpus=0 (a CPU-only rollout)"}

    # A driver killed after training step 2, before its checkpoint: no end recorded, pid gone.
    shutil.rmtree(run / "checkpoints" / "step_2")
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    receipt.update(status="running", end_time=None, pid=dead.pid)
    (run / "run.json").write_text(json.dumps(receipt))

    resumed = cli_in(user_dir, "train", "--resume", f"runs/{RUN}", "--set", "trainer.steps=3")
    output = resumed.stdout + resumed.stderr
    assert resumed.returncode == 0, output[-4000:]
    assert f"its process {dead.pid} is gone" in output
    assert timing_steps(run) == [1, 2, 3]  # step 2 re-trained once, then step 3; no gap, no repeat
    aside = run / "superseded" / "attempt_1"  # the dead attempt's step 2, kept as it left it
    assert json.loads((aside / "superseded.json").read_text())["trained_steps"] == [2]
    assert timing_steps(aside) == [2] and (aside / "round_2").is_dir()
    assert (aside / "adapters" / "step_2" / "adapter_config.json").exists()
    receipt = json.loads((run / "run.json").read_text())
    assert receipt["superseded"] == [str(aside)]
    assert receipt["status"] == "completed" and receipt["resumed_from_step"] == 1
    assert receipt["resume_changes"] == {"trainer.steps": {"from": 2, "to": 3}}  # applied, and recorded
    assert receipt["previous_attempts"][-1]["status"] == "died"
    assert (run / "checkpoints" / "step_3" / "state.json").exists()
    assert (run / "adapters" / "step_3" / "adapter_config.json").exists()
    assert not ray_session_leftovers()
    check_ray_session_removed(run)  # the resume's own session, as the first run's (check_healthy_console)

    evaluated = cli_in(user_dir, "eval", "--config", "configs/smoke.yaml", "--run", f"runs/{RUN}",
                       "--out", "evals/paths.jsonl", "--limit", "2", "-g", "1", "--max-new-tokens", "8")
    assert evaluated.returncode == 0, (evaluated.stdout + evaluated.stderr)[-4000:]
    header = json.loads((user_dir / "evals" / "paths.jsonl").read_text().splitlines()[0])
    assert header["adapter"] == str(run / "adapters" / "step_3"), header
    # eval has no run directory for Ray's logs: a finished eval leaves nothing of its session either
    session = json.loads((user_dir / "evals" / "paths.receipt.json").read_text())["ray_session"]
    assert session["cluster"] == "started" and not Path(session["session_dir"]).exists(), session
