"""Bad input fails in one line before any service starts; paths handed to other processes are
absolute; a run whose driver died is told apart from a live one."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from config import ConfigError, load_config, with_absolute_paths
from services.preflight import PreflightError, check_grader_pool, check_model, check_ports, preflight
from services.receipt import Receipt, liveness, read_receipt

REPO = Path(__file__).resolve().parents[1]
SMOKE = REPO / "configs" / "smoke.yaml"


def test_relative_paths_become_absolute_against_the_callers_directory(tmp_path: Path, monkeypatch):
    (tmp_path / "models" / "m").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    cfg = load_config(SMOKE, ["grader.fixture=data/train.json", "model.cache_dir=cache",
                              "model.name_or_path=models/m"])
    assert cfg.trainer.runs_dir == str(tmp_path / "runs")
    assert cfg.grader.fixture == str(tmp_path / "data" / "train.json")
    assert cfg.model.cache_dir == str(tmp_path / "cache")
    assert cfg.model.name_or_path == str(tmp_path / "models" / "m")
    # Built-in names and hub ids are names, not paths.
    assert load_config(SMOKE).model.name_or_path == "tiny-random"
    assert load_config(SMOKE, ["model.name_or_path=Qwen/Qwen3-4B"]).model.name_or_path == "Qwen/Qwen3-4B"
    # Idempotent, and absolute paths are kept as given.
    assert with_absolute_paths(cfg, base=Path("/elsewhere")) == cfg


def test_yaml_syntax_error_is_one_line_naming_file_and_position(tmp_path: Path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("trainer:\n  steps: [1\n")
    with pytest.raises(ConfigError) as info:
        load_config(bad)
    message = str(info.value)
    assert "\n" not in message and str(bad) in message and "line 3" in message


def test_model_checks(tmp_path: Path):
    check_model(load_config(SMOKE))  # built-in
    with pytest.raises(PreflightError, match=r"model\.name_or_path=.*no such directory"):
        check_model(load_config(SMOKE, [f"model.name_or_path={tmp_path / 'nope'}"]))
    (tmp_path / "empty").mkdir()
    with pytest.raises(PreflightError, match="no config.json"):
        check_model(load_config(SMOKE, [f"model.name_or_path={tmp_path / 'empty'}"]))
    if os.environ.get("HF_HUB_OFFLINE") == "1":
        with pytest.raises(PreflightError, match="offline"):
            check_model(load_config(SMOKE, ["model.name_or_path=nobody/no-such-model-xyz"]))


def test_grader_pool_check_names_the_fixture(tmp_path: Path):
    check_grader_pool(load_config(SMOKE))
    broken = tmp_path / "fx.json"
    broken.write_text("{not json")
    with pytest.raises(PreflightError, match=r"grader pool: .*fx\.json.*JSON"):
        check_grader_pool(load_config(SMOKE, [f"grader.fixture={broken}"]))
    with pytest.raises(PreflightError, match="not found"):
        check_grader_pool(load_config(SMOKE, [f"grader.fixture={tmp_path / 'missing.json'}"]))
    # A grader elsewhere checks its own pool.
    check_grader_pool(load_config(SMOKE, [f"grader.fixture={broken}", "grader.address=127.0.0.1:1"]))


def test_the_pool_check_is_the_tasks_own(tmp_path: Path, monkeypatch):
    """Preflight asks the configured task to check its pool (graders/tasks.py TaskProfile): the
    voice-leading pool is loaded for voice-leading only, and a task without a pool check passes."""
    from graders.tasks import task_profile

    broken = tmp_path / "fx.json"
    broken.write_text("{not json")
    asked = []
    monkeypatch.setattr(type(task_profile("vowel-share")), "check_pool",
                        lambda self, grader: asked.append(grader.task))
    check_grader_pool(load_config(SMOKE, ["grader.task=vowel-share", f"grader.fixture={broken}"]))
    assert asked == ["vowel-share"]  # the voice-leading fixture, broken, was not read
    with pytest.raises(PreflightError, match=r"grader pool: .*fx\.json.*JSON"):
        check_grader_pool(load_config(SMOKE, ["grader.task=voice-leading", f"grader.fixture={broken}"]))


def test_metrics_port_in_use_is_refused():
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        with pytest.raises(PreflightError, match=rf"trainer\.metrics_port={port}.*in use"):
            check_ports(load_config(SMOKE, [f"trainer.metrics_port={port}"]))
    check_ports(load_config(SMOKE, ["trainer.metrics_port=0"]))
    preflight(load_config(SMOKE))


def _receipt(tmp_path: Path, pid: int) -> dict:
    Receipt(tmp_path / "run.json").start(config={})
    data = json.loads((tmp_path / "run.json").read_text())
    data["pid"] = pid
    (tmp_path / "run.json").write_text(json.dumps(data))
    return data


def test_liveness_tells_a_dead_driver_from_a_live_one(tmp_path: Path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert liveness(_receipt(tmp_path, live.pid)) == "alive"
        assert liveness(_receipt(tmp_path, dead.pid)) == "dead"
        data = read_receipt(tmp_path / "run.json")
        assert data["status"] == "died" and str(dead.pid) in data["error"]
    finally:
        live.kill()
        live.wait()
    assert liveness({"status": "completed", "pid": live.pid}) == "ended"
    other = {"status": "running", "pid": 1, "environment": {"platform": {"hostname": "another-host"}}}
    assert liveness(other, hostname="this-host") == "elsewhere"
    # A resumed run keeps the dead attempt as "died", not "running".
    Receipt(tmp_path / "run.json").start(config={})
    attempts = json.loads((tmp_path / "run.json").read_text())["previous_attempts"]
    assert attempts[-1]["status"] == "died"


def _cli(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "services.cli", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)})


def test_bad_input_fails_in_one_line_before_ray_starts(tmp_path: Path):
    import torch
    from safetensors.torch import save_file

    (tmp_path / "bad.yaml").write_text("trainer:\n  steps: [1\n")
    (tmp_path / "fx.json").write_text("{not json")
    gone_nan = tmp_path / "gone-nan"  # an adapter of a run that went nan: it would load and generate
    gone_nan.mkdir()
    (gone_nan / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 2}))
    save_file({"base_model.model.layers.0.q_proj.lora_A.weight": torch.zeros(2, 4),
               "base_model.model.layers.0.q_proj.lora_B.weight": torch.tensor([[1.0, float("nan")]] * 4)},
              str(gone_nan / "adapter_model.safetensors"))
    cases = [
        (("train", "--config", "bad.yaml"), "YAML syntax error"),
        (("train", "--config", str(SMOKE), "--set", "model.name_or_path=./no-model"), "no such directory"),
        (("train", "--config", str(SMOKE), "--set", "grader.fixture=fx.json"), "not valid JSON"),
        (("eval", "--config", str(SMOKE), "--run", "runs/none", "--out", "e.jsonl"), "no adapters"),
        (("train", "--resume", "runs/none"), "no run.json"),
        (("train", "--config", str(SMOKE), "--init-adapter", "gone-nan"),
         f"--init-adapter {gone_nan}: 4 non-finite values (nan or inf) in 1 of its tensors, first "
         "base_model.model.layers.0.q_proj.lora_B.weight: a policy that went nan"),
        (("eval", "--config", str(SMOKE), "--adapter", "gone-nan", "--out", "e.jsonl"), "non-finite values"),
    ]
    for args, expected in cases:
        done = _cli(tmp_path, *args)
        assert done.returncode == 2, (args, done.stderr[-2000:])
        lines = [line for line in done.stderr.splitlines() if line.strip()]
        assert len(lines) == 1 and expected in lines[0], (args, done.stderr[-2000:])
        assert "ray" not in done.stdout.lower() + done.stderr.lower().replace("array", ""), args
    assert not (tmp_path / "runs").exists()


def test_resume_refuses_a_run_that_is_still_alive(tmp_path: Path):
    run = tmp_path / "runs" / "r"
    run.mkdir(parents=True)
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        cfg = load_config(SMOKE)
        receipt = Receipt(run / "run.json").start(config=cfg.model_dump(mode="json"))
        assert receipt.data["status"] == "running"
        receipt.data["pid"] = live.pid
        receipt.write()
        done = _cli(tmp_path, "train", "--resume", "runs/r")
        assert done.returncode == 2 and "still running" in done.stderr and str(live.pid) in done.stderr
    finally:
        live.kill()
        live.wait()


def test_a_run_directory_has_one_live_driver_and_a_dead_ones_lock_is_released(tmp_path: Path):
    """A process holding runs/twin (the driver's own lock, services/runlock.py) makes a second
    `counterpoint train --run-name twin`, new or --resume, fail in one line before anything
    starts; once the holder is SIGKILLed the directory is free again."""
    from services import runlock

    run = tmp_path / "runs" / "twin"
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from pathlib import Path; from services import runlock; "
         f"lock = runlock.acquire(Path({str(run)!r})); print('held', flush=True); time.sleep(120)"],
        cwd=REPO, stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        assert holder.stdout.readline().strip() == "held"
        twin = ("train", "--config", str(SMOKE), "--run-name", "twin", "--set", f"trainer.runs_dir={tmp_path / 'runs'}")
        for args in (twin, ("train", "--resume", str(run))):
            done = _cli(tmp_path, *args)
            lines = [line for line in done.stderr.splitlines() if line.strip()]
            assert done.returncode == 2 and len(lines) == 1, (args, done.stderr[-2000:])
            assert f"run directory {run} is in use by another driver (pid {holder.pid} on " in lines[0], lines
            assert "ray" not in done.stdout.lower() + done.stderr.lower().replace("array", ""), args
        assert sorted(p.name for p in run.iterdir()) == [runlock.LOCK_NAME]  # the refused twin wrote nothing
        with pytest.raises(runlock.RunInUse):
            runlock.acquire(run)
    finally:
        holder.kill()
        holder.wait()
    # The kernel dropped the dead holder's lock: the twin now gets past it (to the next check,
    # a metrics port in use, which starts nothing either) and the lock can be taken.
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        done = _cli(tmp_path, *twin, "--metrics-port", str(port))
    assert done.returncode == 2 and f"trainer.metrics_port={port}" in done.stderr, done.stderr[-2000:]
    runlock.acquire(run).release()


def test_resume_refuses_a_config_that_differs_and_applies_only_what_may_change(tmp_path: Path):
    """--config / --set with --resume used to be silently ignored (the run's own config won):
    a difference is now refused naming its keys, except the keys a resumed run may change
    (config.RESUME_MAY_CHANGE), which are applied and shown (and recorded in the receipt)."""
    run = tmp_path / "runs" / "r"
    run.mkdir(parents=True)
    recorded = load_config(SMOKE, [f"trainer.runs_dir={tmp_path / 'runs'}", "run_name=r"])
    Receipt(run / "run.json").start(config=recorded.model_dump(mode="json")).finish("completed")

    def dry(*args: str) -> subprocess.CompletedProcess:
        return _cli(REPO, "train", "--resume", str(run), "--dry-run", *args)

    refused = {
        ("--config", "configs/voice-leading.yaml"): ["model.name_or_path", "grader.bars", "learner.lr", "seed"],
        ("--set", "learner.lr=2e-4"): ["learner.lr"],
        ("--set", "trainer.steps=9", "--set", "seed=8"): ["seed"],
        ("--run-name", "other"): ["run_name"],
    }
    for args, keys in refused.items():
        done = dry(*args)
        lines = [line for line in done.stderr.splitlines() if line.strip()]
        assert done.returncode == 2 and len(lines) == 1, (args, done.stderr[-2000:])
        named = lines[0].split("recorded config in ", 1)[1].split(" (", 1)[0].split(", ")
        assert set(keys) <= set(named), (args, lines[0])
        assert "trainer.steps" not in named, lines[0]  # may change: never a reason to refuse
        assert "a resumed run may change only" in lines[0]
    for args, steps, changes in (
        ((), 3, {}),
        (("--config", str(SMOKE)), 3, {}),  # the run's own file: nothing differs
        (("--set", "trainer.steps=9", "--metrics-port", "0"), 9, {"trainer.steps": {"from": 3, "to": 9}}),
        (("--config", str(SMOKE), "--set", "trainer.steps=5"), 5, {"trainer.steps": {"from": 3, "to": 5}}),
    ):
        done = dry(*args)
        assert done.returncode == 0, (args, done.stderr[-2000:])
        shown = json.loads(done.stdout)
        assert shown["config"]["trainer"]["steps"] == steps and shown["resume_changes"] == changes, args
        assert shown["config"]["learner"]["lr"] == recorded.learner.lr and shown["config"]["run_name"] == "r"
