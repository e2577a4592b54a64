"""The console of `counterpoint train` (services/console.py, services/progress.py).

Pure parts directly; the fd routing in a subprocess; a real run of the CLI on the smoke config
whose rollout replica fails in its constructor (the cause and the log paths on the console). What a
healthy run's console shows is ``check_healthy_console``, asserted on tests/test_run_paths_e2e.py's
run (the way users start one, so one run checks both).
"""

from __future__ import annotations

import json
import logging
import os
import re
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from cliharness import REPO, cli
from services.console import (RunLogs, console_wants, copy_logs, failing_logs, failure_lines, first_lines,
                              stage_line, traceback_cause)
from services.progress import phase_split, step_line

REPLICA_LOG = textwrap.dedent("""\
    :actor_name:ServeController
    INFO 2026-11-30 09:04:50,001 controller 1 -- Adding 1 replica
    Traceback (most recent call last):
      File "ray/serve/_private/replica.py", line 1, in initialize_and_get_metadata
        await self._user_callable_wrapper.initialize_callable()
    ray.exceptions.RayTaskError(RuntimeError): ray::ServeReplica:counterpoint-rollout (pid=2)
      File "vllm/engine/arg_utils.py", line 1955, in create_model_config
    RuntimeError: Traceback (most recent call last):
      File "vllm/engine/arg_utils.py", line 1955, in create_model_config
        return ModelConfig(
    pydantic_core._pydantic_core.ValidationError: 1 validation error for ModelConfig
      Value error, User-specified max_model_len (4096) is greater than the derived max_model_len
        For further information visit https://errors.pydantic.dev/2.14/v/value_error
    INFO 2026-11-30 09:04:58,882 controller 1 -- Adding 1 replica
    """)


def test_console_wants_our_info_and_others_errors_only():
    assert console_wants("counterpoint.train", logging.INFO)
    assert not console_wants("rollout.deployment", logging.INFO)
    assert console_wants("rollout.deployment", logging.WARNING)
    assert not console_wants("ray.serve", logging.WARNING)
    assert not console_wants("vllm", logging.INFO)
    assert console_wants("ray.serve", logging.ERROR)


def test_step_line_has_every_figure_and_the_phase_split_in_loop_order():
    m = {"reward_mean": 0.25, "pass_rate": 0.5, "ppl_ratio": 1.0012, "step_seconds": 3.04}
    phases = {"update_actor": 0.8, "gen": 1.5, "score": 0.02, "update_weights": 0.3, "old_log_prob": 0.1}
    line = step_line(4, 8, m, phases)
    assert line.startswith("step 4/8  reward 0.250  pass 0.500  ppl_ratio 1.0012  3.0 s/step")
    assert line.endswith("[gen 1.5 score 0.0 old_lp 0.1 update 0.8 sync 0.3 s]")
    assert phase_split({}) == "" and step_line(1, 1, m).endswith("s/step")
    # one_step_off: the part of the sync the next generation still ran beside is named (from 0.05 s)
    beside = step_line(4, 8, {**m, "update_weights_beside_gen_s": 0.26}, phases)
    assert beside.endswith("[gen 1.5 score 0.0 old_lp 0.1 update 0.8 sync 0.3 (0.3 beside gen) s]")
    assert step_line(4, 8, {**m, "update_weights_beside_gen_s": 0.01}, phases) == line
    assert stage_line("rollout replicas", 22.71) == "  rollout replicas     22.7 s"


def test_first_lines_drops_blanks_and_colours_and_cuts_long_lines():
    assert first_lines("\n\x1b[36ma\x1b[0m\n\nb\nc\n", 2) == ["a", "b"]
    assert first_lines("x" * 300, 1, width=10) == ["x" * 9 + "…"]


def test_traceback_cause_is_the_innermost_exception_with_its_detail():
    assert traceback_cause(REPLICA_LOG) == [
        "pydantic_core._pydantic_core.ValidationError: 1 validation error for ModelConfig",
        "  Value error, User-specified max_model_len (4096) is greater than the derived max_model_len",
        "    For further information visit https://errors.pydantic.dev/2.14/v/value_error",
    ]
    assert traceback_cause("INFO all fine\nValueError: not in a traceback\n") == []


def test_failure_lines_name_the_cause_from_a_service_log_and_every_path(tmp_path):
    ray_logs = tmp_path / "logs" / "ray"
    ray_logs.mkdir(parents=True)
    (ray_logs / "worker-aa-01000000-7.err").write_text(REPLICA_LOG)
    (ray_logs / "worker-bb-01000000-8.err").write_text("INFO nothing went wrong\n")
    assert failing_logs(ray_logs) == [ray_logs / "worker-aa-01000000-7.err"]
    lines = failure_lines(RuntimeError("Deploying application counterpoint-rollout failed: see logs"),
                          tmp_path / "logs")
    assert lines[0] == "error: RuntimeError: Deploying application counterpoint-rollout failed: see logs"
    assert lines[1] == "cause, from worker-aa-01000000-7.err:"
    assert "max_model_len (4096)" in lines[3]
    assert f"full log: {tmp_path / 'logs' / 'driver.log'}" in lines
    assert f"service log with a traceback: {ray_logs / 'worker-aa-01000000-7.err'}" in lines
    # An error that carries its traceback (a learner worker's report): the cause comes from it.
    worker = failure_lines(RuntimeError("learner command 'step' failed in rank 0:\n" + REPLICA_LOG), tmp_path / "x")
    assert worker[1].strip().startswith("pydantic_core._pydantic_core.ValidationError")
    assert worker[-1].endswith("(not written: Ray did not start)")


def test_copy_logs_replaces_the_link_with_regular_files_only(tmp_path):
    session = tmp_path / "session" / "logs"
    (session / "serve").mkdir(parents=True)
    (session / "serve" / "replica_x.log").write_text("replica\n")
    (session / "worker-1.err").write_text("err\n")
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(session / "agent.sock"))
    dest = tmp_path / "run" / "logs" / "ray"
    dest.parent.mkdir(parents=True)
    dest.symlink_to(session, target_is_directory=True)
    copy_logs(session, dest)
    sock.close()
    assert not dest.is_symlink() and dest.is_dir()
    assert (dest / "serve" / "replica_x.log").read_text() == "replica\n"
    assert (dest / "worker-1.err").read_text() == "err\n"
    assert not (dest / "agent.sock").exists()


def test_keep_ray_logs_says_whether_the_run_now_holds_the_copy(tmp_path):
    session = tmp_path / "session" / "logs"
    session.mkdir(parents=True)
    logs = RunLogs(tmp_path / "run" / "logs", verbose=False, console=sys.stdout)
    logs.dir.mkdir(parents=True)
    logs.link_ray_logs(session)
    assert not logs.keep_ray_logs(session)  # no file to copy: no copy made
    (session / "raylet.out").write_text("raylet\n")
    logs.link_ray_logs(session)
    assert logs.keep_ray_logs(session) and (logs.ray_dir / "raylet.out").read_text() == "raylet\n"
    assert not logs.keep_ray_logs(session)  # no link left to replace


def test_run_logs_send_people_lines_to_the_terminal_and_the_rest_to_driver_log(tmp_path):
    """fd-level writes (C++ cores, subprocesses), stderr, library logs and other threads' stdout
    land in driver.log; print, our log lines and echo reach the terminal."""
    script = textwrap.dedent(f"""
        import logging, os, subprocess, sys, threading
        from services.console import run_logs
        with run_logs({str(tmp_path / 'logs')!r}) as logs:
            logs.echo("PEOPLE-echo")
            print("PEOPLE-print")
            logging.getLogger("counterpoint.train").info("PEOPLE-ours")
            logging.getLogger("ray.serve").warning("LOG-ray-warning")
            os.write(1, b"LOG-fd1\\n"); os.write(2, b"LOG-fd2\\n")
            subprocess.run([sys.executable, "-c", "print('LOG-child')"])
            print("LOG-stderr", file=sys.stderr)
            t = threading.Thread(target=lambda: print("LOG-thread")); t.start(); t.join()
        print("PEOPLE-after")
        """)
    out = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    assert out.returncode == 0, out.stderr
    terminal = out.stdout + out.stderr
    log = (tmp_path / "logs" / "driver.log").read_text()
    for word in ("PEOPLE-echo", "PEOPLE-print", "PEOPLE-ours", "PEOPLE-after"):
        assert word in terminal
    for word in ("LOG-ray-warning", "LOG-fd1", "LOG-fd2", "LOG-child", "LOG-stderr", "LOG-thread"):
        assert word in log and word not in terminal, word
    assert "PEOPLE-echo" in log and "PEOPLE-ours" in log  # the log also holds what people saw


# ---------------------------------------------------------------- real runs (heavy)
def _train(tmp_path: Path, name: str, *extra: str) -> tuple[subprocess.CompletedProcess, list[str], Path]:
    out = cli("train", "--config", "configs/smoke.yaml", "--run-name", name, "--set",
              f"trainer.runs_dir={tmp_path}", *extra, timeout=900)
    lines = [line for line in (out.stdout + out.stderr).splitlines()]
    return out, lines, tmp_path / name


def check_healthy_console(lines: list[str], run: Path, steps: int, grader_replicas: int) -> None:
    """What a healthy `counterpoint train` run shows and keeps (asserted on the relative-path run
    of tests/test_run_paths_e2e.py, which is such a run): few console lines, every step line, each
    start-up stage, the run directory last; Ray/Serve/vLLM/Train logs copied into runs/<run>/logs/;
    the grader app watched (a fixed replica count: no scale event); no PlacementGroupCleaner."""
    assert len(lines) <= 30, "\n".join(lines)
    pattern = rf"step \d/{steps}  reward \S+  pass \S+  ppl_ratio \S+  \S+ s/step  \[gen "
    assert len([line for line in lines if re.match(pattern, line)]) == steps, "\n".join(lines)
    for stage in ("Ray", "grader", "rollout replicas", "learner"):
        assert any(re.match(rf"  {stage} +\d+\.\d s$", line) for line in lines), stage
    assert lines[-1] == f"run directory: {run}"
    scaling = json.loads((run / "run.json").read_text())["grader_scaling"]
    n = grader_replicas
    assert (scaling["min_replicas"], scaling["max_replicas"], scaling["running_max"]) == (n, n, n), scaling
    assert scaling["scale_events"] == {"up": 0, "down": 0} and scaling["failed_reads"] == 0, scaling
    assert not any("(ServeReplica" in line or "(raylet)" in line or "vllm" in line.lower() for line in lines)
    logs = run / "logs"
    assert "Started a local Ray instance" in (logs / "driver.log").read_text()
    ray = logs / "ray"
    assert ray.is_dir() and not ray.is_symlink()  # a copy: Ray's /tmp session does not last
    assert list((ray / "serve").glob("replica_counterpoint-rollout_RolloutReplica_*.log"))
    assert list((ray / "serve").glob("replica_grader_Grader_*.log"))
    assert list((ray / "train").glob("ray-train-app-worker-*.log"))
    worker_err = "".join(p.read_text(errors="replace") for p in ray.glob("worker-*.err"))
    assert "vllm" in worker_err.lower()
    # The cause of the repeated message is gone: no PlacementGroupCleaner polling a missing State API.
    assert "PlacementGroupCleaner" not in worker_err and "Failed to query Ray Train Controller" not in worker_err
    check_ray_session_removed(run)


def check_ray_session_removed(run: Path) -> None:
    """The run's copy of Ray's logs is all that is left of the Ray session of a cluster it started:
    run.json `ray_session` names the /tmp directory, gone (nor pointed at by session_latest)."""
    ray = run / "logs" / "ray"
    assert ray.is_dir() and not ray.is_symlink() and any(ray.iterdir()), ray
    session = json.loads((run / "run.json").read_text())["ray_session"]
    assert session["cluster"] == "started", session
    session_dir = Path(session["session_dir"])
    assert not session_dir.exists(), f"{session_dir} left behind: {sorted(os.listdir(session_dir))[:20]}"
    latest = session_dir.parent / "session_latest"
    assert not latest.is_symlink() or os.readlink(latest) != str(session_dir)


@pytest.mark.slow
def test_a_replica_failing_in_its_constructor_shows_its_cause_and_the_log_paths(tmp_path):
    # tiny-random allows 2048 positions; only vLLM, inside the replica, checks max_model_len.
    out, lines, run = _train(tmp_path, "broken", "--set", "rollout.max_model_len=4096")
    assert out.returncode == 1, "\n".join(lines[-40:])
    assert len(lines) <= 30, "\n".join(lines)
    text = "\n".join(lines)
    assert "error: RuntimeError: Deploying application counterpoint-rollout failed" in text
    assert "max_model_len (4096) is greater than the derived max_model_len" in text
    full = next(line for line in lines if line.startswith("full log: "))
    assert Path(full.removeprefix("full log: ")).is_file()
    service = [Path(line.split(": ", 1)[1]) for line in lines if line.startswith("service log with a traceback: ")]
    assert service and all(p.is_file() and p.is_relative_to(run / "logs" / "ray") for p in service)
    # One start of the replica, not Serve's three: the same engine would refuse the same setting
    # again (rollout.start_attempts, default 1).
    controller = "".join(p.read_text() for p in (run / "logs" / "ray" / "serve").glob("controller_*.log"))
    starts = [ln for ln in controller.splitlines() if "Starting Replica(" in ln and "deployment='RolloutReplica'" in ln]
    assert len(starts) == 1, controller[-3000:]
    check_ray_session_removed(run)  # a failed run too, once its logs are copied


def test_ray_prefixed_lines_from_the_main_thread_go_to_the_log(tmp_path: Path):
    """Ray prints its processes' lines ('(raylet) Task ... failed', '(ServeReplica:.. pid=..)') from
    the main thread too, e.g. while ray.shutdown() drains them: they belong in driver.log."""
    import io

    from services.console import _MainThreadStdout

    console, log = io.StringIO(), io.StringIO()
    out = _MainThreadStdout(console, log)
    out.write("\x1b[33m(raylet)\x1b[0m Task ServeController.listen_for_change failed.\n")
    out.write("(ServeReplica:grader:Grader pid=4242) INFO ready\n")
    out.write("step 1/3  reward 0.000\n")
    assert console.getvalue() == "step 1/3  reward 0.000\n"
    assert "(raylet)" in log.getvalue() and "pid=4242" in log.getvalue()
