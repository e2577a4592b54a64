"""The suite's own rule (tests/conftest.py): a test marked neither `slow` nor `subprocess` starts
no process, under `make test` (its body) as under `make test-fast` (everywhere). CI runs only
`make test`, so without the first a process-starting test left unmarked would be seen only by
whoever runs the fast set by hand. These tests are themselves unmarked: their bodies are held to
the rule they check."""

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
