"""services/launch.py's rules that need no cluster: which train runs start the learner beside the
rollout replicas, the local Ray start tried again after Ray's start-up timeout, and what of Ray's
session directory a run removes when it ends."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from config import load_config
from services import launch
from services.launch import (STARTUP_TIMEOUT, init_retrying_startup_timeout, learner_starts_beside_rollout,
                             leftover_shared_memory, ray_session_leftovers, remove_path, remove_ray_session,
                             torch_shm_maker)

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


@pytest.mark.parametrize("name, overrides, beside", [
    ("smoke.yaml", [], True),  # CPU only: nothing to share
    ("voice-leading.yaml", [], True),
    ("gpu-bench.yaml", [], False),  # replica and learner share ONE GPU by halves: one after the other
    ("gpu-bench-2gpu.yaml", [], True),  # each on a GPU of its own
    # a replica on a GPU of its own, the learner on a fraction: Ray may put the learner on its GPU
    ("gpu-bench-2gpu.yaml", ["learner.gpus_per_worker=0.4"], False),
    ("gpu-bench-2gpu.yaml", ["rollout.num_gpus=0"], True),  # a CPU replica, a GPU learner
    ("gpu-bench.yaml", ["learner.use_gpu=false", "learner.strategy=ddp"], True),  # only the replica on the GPU
])
def test_the_learner_starts_beside_the_rollout_unless_they_may_share_a_gpu(name, overrides, beside):
    cfg = load_config(CONFIGS / name, overrides)
    assert learner_starts_beside_rollout(cfg) is beside


def _sleeper() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])


@pytest.mark.parametrize("name, maker", [
    ("torch_1234_3168904391_16", 1234), ("torch_7_0_0", 7),
    ("torch_1234_316890439116", None), ("torch_x_1_2", None), ("sem.loky-22353-6dv3jd9h", None),
    ("cp-adapter-v3-abc.safetensors", None),
])
def test_torch_shared_memory_files_are_told_by_their_name(name, maker):
    assert torch_shm_maker(name) == maker


def test_only_new_torch_files_of_dead_makers_are_left_over():
    names = ["torch_10_1_1", "torch_10_1_2", "torch_20_5_1", "torch_30_9_9", "cp-adapter-v3-x.safetensors",
             "torch_40_2_2"]
    before = {"torch_30_9_9"}  # there before the run: not the run's, even with its maker dead
    dead = {10, 30, 40}.__contains__
    assert leftover_shared_memory(names, before, lambda pid: not dead(pid)) == \
        ["torch_10_1_1", "torch_10_1_2", "torch_40_2_2"]  # 20 lives: its files are its own still
    assert leftover_shared_memory([], set(), lambda pid: False) == []


SESSION = "/tmp/ray/session_2026-12-01_10-00-00_123_4567"
LATEST = Path("/tmp/ray/session_latest")


@pytest.mark.parametrize("started_here, session_dir, copied, latest_target, removed", [
    (True, SESSION, True, SESSION, [LATEST, Path(SESSION)]),
    (True, SESSION, True, "session_2026-12-01_10-00-00_123_4567", [LATEST, Path(SESSION)]),  # a relative link
    (True, SESSION, True, "/tmp/ray/session_2026-12-01_11-00-00_9_99", [Path(SESSION)]),  # a newer cluster's
    (True, SESSION, True, None, [Path(SESSION)]),  # no session_latest
    (True, SESSION, False, SESSION, []),  # the logs were not copied: Ray's copy is the only one
    (False, SESSION, True, SESSION, []),  # a joined cluster: the session is its head's
    (False, SESSION, False, None, []),
    (True, None, True, SESSION, []),  # Ray said no session directory
])
def test_only_a_started_clusters_session_whose_logs_were_copied_is_removed(started_here, session_dir, copied,
                                                                           latest_target, removed):
    assert ray_session_leftovers(started_here, session_dir, copied, latest_target) == removed
    # files a worker wrote under the session's artifacts/ keep it whatever else holds
    assert ray_session_leftovers(started_here, session_dir, copied, latest_target,
                                 written_under=[f"{SESSION}/artifacts/x/runs/r/rounds.jsonl"]) == []


def _session(root: Path, name: str = "session_1") -> Path:
    session = root / name
    (session / "logs" / "serve").mkdir(parents=True)
    (session / "logs" / "serve" / "replica.log").write_text("replica\n")
    (session / "sockets").mkdir()
    return session


def test_the_session_and_its_latest_link_are_removed_once_the_logs_are_copied(tmp_path):
    session = _session(tmp_path)
    (tmp_path / "session_latest").symlink_to(session)
    assert remove_ray_session(session, logs_kept=True) == [tmp_path / "session_latest", session]
    assert os.listdir(tmp_path) == []


def test_another_sessions_latest_link_stays(tmp_path):
    session, newer = _session(tmp_path), _session(tmp_path, "session_2")
    (tmp_path / "session_latest").symlink_to(newer)
    assert remove_ray_session(session, logs_kept=True) == [session]
    assert sorted(os.listdir(tmp_path)) == ["session_2", "session_latest"]


def test_files_written_under_the_sessions_artifacts_keep_it_and_a_line_says_so(tmp_path, caplog):
    """A relative path in a Ray Train worker lands under the session's artifacts/ (its working
    directory): removing the session would delete what the run wrote there."""
    session = _session(tmp_path)
    astray = session / "artifacts" / "2026-12-06" / "runs" / "r" / "rounds.jsonl"
    astray.parent.mkdir(parents=True)
    astray.write_text("{}\n")
    with caplog.at_level(logging.INFO, logger="counterpoint"):
        assert remove_ray_session(session, logs_kept=True) == []
    assert astray.is_file()
    assert [r.getMessage() for r in caplog.records] == [
        f"Ray's session directory {session} is kept: 1 file(s) were written under its artifacts/ (a relative "
        f"path in a Ray worker?), e.g. {astray}"]


def test_an_artifacts_directory_that_cannot_be_read_keeps_the_session(tmp_path, caplog, monkeypatch):
    session = _session(tmp_path)

    def vanished(root):
        raise FileNotFoundError(2, "No such file or directory", str(root / "x"))

    monkeypatch.setattr(launch, "files_under", vanished)
    with caplog.at_level(logging.WARNING, logger="counterpoint"):
        assert remove_ray_session(session, logs_kept=True) == []
    assert session.is_dir() and "is kept: 1 file(s)" in caplog.records[0].getMessage()


def test_logs_not_copied_keep_the_session_and_say_where_they_are(tmp_path, caplog):
    session = _session(tmp_path)
    with caplog.at_level(logging.INFO, logger="counterpoint"):
        assert remove_ray_session(session, logs_kept=False) == []
    assert (session / "logs" / "serve" / "replica.log").is_file()
    assert [r.getMessage() for r in caplog.records] == [
        f"Ray's logs stay in {session / 'logs'} (not copied into a run directory)"]


def test_removing_retries_past_files_that_vanish_and_never_raises(tmp_path, monkeypatch, caplog):
    session = _session(tmp_path)
    real_rmtree, calls = shutil.rmtree, []

    def racing_rmtree(path, *args, **kwargs):  # Ray's exiting processes remove a file mid-walk
        calls.append(path)
        if len(calls) == 1:
            raise FileNotFoundError(2, "No such file or directory", str(path / "sockets" / "raylet"))
        real_rmtree(path, *args, **kwargs)

    monkeypatch.setattr(shutil, "rmtree", racing_rmtree)
    assert remove_path(session, pause_s=0) and not session.exists() and len(calls) == 2

    def denied(path, *args, **kwargs):
        raise PermissionError(13, "Permission denied", str(path))

    stuck = _session(tmp_path, "session_stuck")
    monkeypatch.setattr(shutil, "rmtree", denied)
    with caplog.at_level(logging.DEBUG, logger="counterpoint"):
        assert remove_path(stuck, attempts=2, pause_s=0) is False
    assert stuck.is_dir() and [r.levelno for r in caplog.records] == [logging.DEBUG, logging.DEBUG]


def test_a_local_start_that_timed_out_is_cleaned_up_and_tried_again():
    started: list[subprocess.Popen] = []
    shutdowns: list[int] = []

    def init():
        started.append(_sleeper())  # what Ray's head processes are to the driver: its children
        if len(started) == 1:
            raise Exception(f"The current node {STARTUP_TIMEOUT}. This could happen because ...")
        return "context"

    try:
        assert init_retrying_startup_timeout(init, lambda: shutdowns.append(1)) == "context"
        assert len(started) == 2 and shutdowns == [1]
        started[0].wait(timeout=10)  # the failed attempt's process was killed (and reaped): gone long before 120 s
        assert not psutil.pid_exists(started[0].pid)
        assert started[1].poll() is None  # the second attempt's lives on
    finally:
        for proc in started:
            proc.kill()
            proc.wait()


def test_a_process_that_was_running_before_the_start_is_left_alone():
    older = _sleeper()
    calls = []

    def init():
        calls.append(1)
        if len(calls) == 1:
            raise Exception(f"The current node {STARTUP_TIMEOUT}.")
        return "context"

    try:
        assert init_retrying_startup_timeout(init, lambda: None) == "context"
        assert psutil.Process(older.pid).status() != psutil.STATUS_ZOMBIE and older.poll() is None
    finally:
        older.kill()
        older.wait()


def test_other_start_errors_are_not_retried():
    calls = []

    def init():
        calls.append(1)
        raise RuntimeError("address already in use")

    with pytest.raises(RuntimeError, match="address already in use"):
        init_retrying_startup_timeout(init, lambda: None)
    assert calls == [1]


def test_a_second_timeout_is_raised():
    def init():
        raise Exception(f"The current node {STARTUP_TIMEOUT}.")

    with pytest.raises(Exception, match=STARTUP_TIMEOUT):
        init_retrying_startup_timeout(init, lambda: None)


STALLED_RAYLET = '''
import signal, threading, time
import psutil, ray
from services.launch import init_retrying_startup_timeout

stopped = []
def stall_the_first_raylet():
    me = psutil.Process()
    while True:
        for proc in me.children(recursive=True):
            try:
                if proc.name() == "raylet":
                    proc.send_signal(signal.SIGSTOP)
                    stopped.append(proc.pid)
                    return
            except psutil.NoSuchProcess:
                pass
        time.sleep(0.005)

threading.Thread(target=stall_the_first_raylet, daemon=True).start()
init_retrying_startup_timeout(lambda: ray.init(num_cpus=1, include_dashboard=False), ray.shutdown)
gone = not psutil.pid_exists(stopped[0]) or psutil.Process(stopped[0]).status() == psutil.STATUS_ZOMBIE
print("first raylet gone:", gone, "answer:", ray.get(ray.remote(lambda: 41 + 1).remote()))
ray.shutdown()
'''


@pytest.mark.slow
def test_a_real_raylet_that_cannot_register_is_killed_and_the_cluster_started_again():
    """The first raylet is stopped (SIGSTOP) as soon as it exists, so it misses Ray's 30 s to
    register, as CI's loaded box once made it: the retry kills it and the second cluster runs a task."""
    done = subprocess.run([sys.executable, "-c", STALLED_RAYLET], cwd=Path(__file__).resolve().parents[1],
                          capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert "Ray's local node timed out during startup; starting it again" in done.stderr, done.stderr[-3000:]
    assert "first raylet gone: True answer: 42" in done.stdout, done.stdout + done.stderr[-3000:]
