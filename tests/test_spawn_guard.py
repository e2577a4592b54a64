"""The suite's own rule (tests/conftest.py): a test marked neither `slow` nor `subprocess` starts
no process, under `make test` (its body) as under `make test-fast` (everywhere). CI runs only
`make test`, so without the first a process-starting test left unmarked would be seen only by
whoever runs the fast set by hand. These tests are themselves unmarked: their bodies are held to
the rule they check (but the last, which starts a child to kill it)."""

from __future__ import annotations

import multiprocessing
import subprocess
import sys
import threading

import pytest

SpawnInFastTests = sys.modules["conftest"].SpawnInFastTests  # tests/conftest.py, as pytest loaded it


def test_an_unmarked_test_cannot_start_a_process():
    with pytest.raises(SpawnInFastTests, match="mark it `subprocess`"):
        subprocess.Popen([sys.executable, "-c", "pass"])
    with pytest.raises(SpawnInFastTests, match="fork_exec"):  # multiprocessing starts it below the audit events
        multiprocessing.get_context("spawn").Process(target=print).start()


def test_the_receipts_look_ups_stay_allowed():
    assert subprocess.run(["uname", "-s"], capture_output=True, text=True, check=True).stdout.strip()


def test_another_threads_process_is_not_this_tests():
    """Threads an earlier slow test left running (an engine's, Ray's) start processes of their own
    on the same worker: under `make test` they are not failed for it (under `make test-fast`,
    where no such thread exists, everything is)."""
    got: list[object] = []

    def start() -> None:
        try:
            got.append(subprocess.run(["true"]).returncode)
        except SpawnInFastTests:
            got.append("refused")

    thread = threading.Thread(target=start)
    thread.start()
    thread.join()
    assert got == (["refused"] if sys.modules["conftest"]._FORBID_EVERYWHERE else [0])


@pytest.mark.subprocess
def test_a_killed_multiprocessing_child_is_reaped_between_tests():
    """vLLM SIGKILLs a slow engine core and never joins it; the suite joins such children around
    every test (tests/conftest.py), so none stays a zombie for a later test's waitpid to find."""
    import os
    import signal
    import time

    import psutil

    reap = sys.modules["conftest"].reap_finished_multiprocessing_children
    child = multiprocessing.get_context("spawn").Process(target=time.sleep, args=(60,))
    child.start()
    os.kill(child.pid, signal.SIGKILL)  # as vllm/v1/utils.py shutdown does, without a join
    deadline = time.monotonic() + 30
    while psutil.Process(child.pid).status() != psutil.STATUS_ZOMBIE:
        assert time.monotonic() < deadline, "the killed child never ended"
        time.sleep(0.01)
    reap()
    assert not psutil.pid_exists(child.pid) or child.pid not in {p.pid for p in psutil.Process().children()}
    assert child.exitcode == -signal.SIGKILL
