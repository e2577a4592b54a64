"""The run receipt: written at start, completed at the end on every way out."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from config import load_config
from services.launch import remove_ray_session
from services.receipt import (
    LIBRARIES,
    Receipt,
    Terminated,
    collect_environment,
    dry_run_preview,
    git_state,
    install_sigterm_handler,
)

REPO = Path(__file__).resolve().parents[1]


def read(path: Path) -> dict:
    return json.loads(path.read_text())


def test_environment_records_interpreter_libraries_devices_git() -> None:
    env = collect_environment()
    assert env["python"]["executable"] == sys.executable
    assert env["python"]["version"].startswith(f"{sys.version_info.major}.{sys.version_info.minor}")
    assert set(env["libraries"]) == set(LIBRARIES)
    assert env["libraries"]["pydantic"] is not None  # imported by the config schema
    assert env["devices"]["cpu_count"] == os.cpu_count()
    assert env["devices"]["kind"] in ("cpu", "cuda")
    assert set(env["git"]) == {"commit", "dirty"}
    json.dumps(env)  # serialisable as is


def test_git_state_is_null_outside_a_checkout(tmp_path: Path) -> None:
    assert git_state(tmp_path) == {"commit": None, "dirty": None}


def test_git_state_of_a_real_checkout(tmp_path: Path) -> None:
    def git(*args: str) -> None:
        subprocess.run(["git", *args], cwd=tmp_path, check=True, capture_output=True)

    git("init", "-q")
    (tmp_path / "a.txt").write_text("a")
    git("add", "a.txt")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "a")
    state = git_state(tmp_path)
    assert len(state["commit"]) == 40 and state["dirty"] is False
    (tmp_path / "a.txt").write_text("b")
    assert git_state(tmp_path)["dirty"] is True


def test_written_at_start_updated_and_completed(tmp_path: Path) -> None:
    path = tmp_path / "run" / "run.json"
    receipt = Receipt(path, run_name="run").start(config={"seed": 3}, seeds={"run": 3})
    first = read(path)
    assert first["status"] == "running" and first["end_time"] is None
    assert first["config"] == {"seed": 3} and first["seeds"] == {"run": 3}
    assert first["environment"]["python"]["executable"] == sys.executable
    receipt.set_grader_health(
        task="voice-leading", pool_size=40, pool_source="graders/voice_leading/data/train.json",
        checker="reference", voices=2, style="common-practice",
    )
    receipt.update(init_adapter_sha256="ab" * 32, metric_series={"reward_mean": 4})
    assert read(path)["grader_health"]["pool_size"] == 40
    with pytest.raises(KeyError, match="seedz"):
        receipt.update(seedz=1)
    with receipt.guard():
        pass
    done = read(path)
    assert done["status"] == "completed" and done["error"] is None and done["end_time"]
    assert done["metric_series"] == {"reward_mean": 4}
    assert not [p for p in path.parent.iterdir() if p.name.endswith(".tmp")]


@pytest.mark.parametrize(
    "exc,status,error",
    [
        (RuntimeError("grader down"), "failed", "RuntimeError: grader down"),
        (KeyboardInterrupt(), "interrupted", "KeyboardInterrupt"),
        (Terminated(), "interrupted", "signal SIGTERM"),
        (SystemExit(3), "failed", "SystemExit(3)"),
    ],
)
def test_guard_records_status_and_reraises(tmp_path: Path, exc, status, error) -> None:
    receipt = Receipt(tmp_path / "run.json").start()
    with pytest.raises(type(exc)):
        with receipt.guard():
            raise exc
    data = read(tmp_path / "run.json")
    assert (data["status"], data["error"]) == (status, error)
    assert data["end_time"] is not None


def test_sigterm_in_a_subprocess_is_recorded_as_interrupted(tmp_path: Path) -> None:
    path = tmp_path / "run.json"
    script = textwrap.dedent(f"""
        import sys, time; sys.path.insert(0, {str(REPO)!r})
        from services.receipt import Receipt, install_sigterm_handler
        install_sigterm_handler()
        receipt = Receipt({str(path)!r}).start()
        with receipt.guard():
            print("ready", flush=True)
            time.sleep(300)
    """)
    with subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE) as child:
        assert child.stdout is not None and child.stdout.readline().strip() == b"ready"
        assert read(path)["status"] == "running"
        child.send_signal(signal.SIGTERM)
        assert child.wait(timeout=120) == 128 + signal.SIGTERM
    data = read(path)
    assert data["status"] == "interrupted" and data["error"] == "signal SIGTERM"


def test_sigterm_inside_a_blocking_ray_get_is_still_an_interruption(tmp_path: Path) -> None:
    """Ray's ray.get checks signals itself and re-raises the handler's Terminated as a new
    SystemExit(1): the guard finds the SIGTERM again, records "interrupted" and re-raises it as
    Terminated (exit 143), as a SIGTERM anywhere else does. The script first asserts what Ray
    does, so this test fails if the guard's recovery were not needed or did not run."""
    path = tmp_path / "run.json"
    script = textwrap.dedent(f"""
        import os, signal, sys, threading, time; sys.path.insert(0, {str(REPO)!r})
        import ray
        from services.receipt import Receipt, Terminated, install_sigterm_handler
        context = ray.init(num_cpus=1, include_dashboard=False, address="local")
        print("session", context.address_info["session_dir"], flush=True)
        install_sigterm_handler()

        @ray.remote(num_cpus=0)
        def slow():
            time.sleep(120)

        kill = lambda: (time.sleep(2), os.kill(os.getpid(), signal.SIGTERM))
        ref = slow.remote()
        threading.Thread(target=kill, daemon=True).start()
        try:
            ray.get(ref)
        except SystemExit as err:  # what Ray raises in its place
            assert type(err) is SystemExit and err.code == 1, repr(err)
        receipt = Receipt({str(path)!r}).start()
        threading.Thread(target=kill, daemon=True).start()
        try:
            with receipt.guard():
                ray.get(ref)
        except Terminated as err:
            print("terminated", err.code, type(err.__context__).__name__, flush=True)
            sys.exit(err.code)
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=180)
    assert proc.returncode == 128 + signal.SIGTERM, proc.stderr[-3000:]
    assert "terminated 143 SystemExit" in proc.stdout, proc.stdout
    data = read(path)
    assert data["status"] == "interrupted" and data["error"] == "signal SIGTERM"
    # the child's local cluster ended with it: its /tmp/ray session goes, as a finished run's does
    (session,) = [line.split(" ", 1)[1] for line in proc.stdout.splitlines() if line.startswith("session ")]
    remove_ray_session(Path(session), logs_kept=True)


def test_install_sigterm_handler_returns_previous_and_raises(tmp_path: Path) -> None:
    previous = install_sigterm_handler()
    try:
        with pytest.raises(Terminated) as info:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)  # the handler interrupts the sleep
        assert info.value.code == 143
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_resumed_run_keeps_previous_attempts(tmp_path: Path) -> None:
    path = tmp_path / "run.json"
    first = Receipt(path).start()
    first.update(steps_trained=3)
    first.finish("interrupted", "KeyboardInterrupt")
    second = Receipt(path).start(resumed_from_step=3)
    data = read(path)
    assert data["status"] == "running" and data["resumed_from_step"] == 3
    assert len(data["previous_attempts"]) == 1
    assert data["previous_attempts"][0]["status"] == "interrupted"
    assert data["previous_attempts"][0]["steps_trained"] == 3
    second.finish("completed")
    third = Receipt(path).start()
    assert [a["status"] for a in third.data["previous_attempts"]] == ["interrupted", "completed"]


def test_dry_run_preview_resolves_config_and_plans_sampling() -> None:
    cfg = load_config(None, ["seed=11", "trainer.steps=6", "trainer.prompts_per_step=3"])
    preview = dry_run_preview(cfg, pool=[f"c{i}" for i in range(9)])
    assert preview["status"] == "dry_run"
    assert preview["config"]["trainer"]["steps"] == 6
    assert preview["config"]["learner"]["lr"] == cfg.learner.lr  # defaults included
    assert preview["seeds"]["run"] == 11
    assert preview["prompt_sampling"]["epochs"] == 2.0
    assert preview["rollout_quantization"] == cfg.rollout_quantization() and preview["rollout_quantization"]["mode"] == "none"
    json.dumps(preview)
