"""One live driver per run directory: an exclusive flock on ``runs/<run>/.driver.lock``.

Two `counterpoint train --run-name twin` started together both started clusters and wrote one
run directory (interleaved metrics, rounds written twice, one of them dying on an RecordError).
A pid in run.json cannot prevent that: both drivers pass the check before either writes it. An
flock can: the kernel grants it to one open file at a time and drops it when its holder dies,
however it dies (SIGKILL included), so a dead driver never needs cleaning up after. The file
holds the holder's pid, host and start time only so a refusal can name it.

``probe`` refuses early (before preflight) without creating anything; ``acquire`` takes the lock
(creating the run directory) right before anything starts and is the one that decides a race.
The descriptor is non-inheritable (Python's default, PEP 446): the Ray processes a driver starts,
which can outlive it by minutes, never hold the lock.
"""

from __future__ import annotations

import datetime as dt
import fcntl
import os
import platform
from pathlib import Path

LOCK_NAME = ".driver.lock"


class RunInUse(RuntimeError):
    """A run directory another live driver owns (or --resume of a run still running)."""


class RunLock:
    """The held lock of one run directory; released when closed or when the process ends."""

    def __init__(self, fd: int, path: Path) -> None:
        self.fd, self.path = fd, path

    def release(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)  # closing the only descriptor drops the flock
            self.fd = -1


def _holder(fd: int) -> str:
    try:
        text = os.pread(fd, 512, 0).decode("utf-8", "replace").strip()
    except OSError:
        text = ""
    return text or "a driver that has not written its pid yet"


def _refusal(run_dir: Path, fd: int) -> RunInUse:
    return RunInUse(f"run directory {run_dir} is in use by another driver ({_holder(fd)}); wait for it to end, "
                    "or give another --run-name")


def probe(run_dir: Path) -> None:
    """Raise RunInUse when a live driver holds ``run_dir``'s lock; creates nothing."""
    try:
        fd = os.open(run_dir / LOCK_NAME, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        raise _refusal(run_dir, fd) from None
    finally:
        os.close(fd)


def acquire(run_dir: Path) -> RunLock:
    """Take ``run_dir``'s lock for this process (creating the directory), or raise RunInUse."""
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / LOCK_NAME
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        err = _refusal(run_dir, fd)
        os.close(fd)
        raise err from None
    since = dt.datetime.now(dt.UTC).isoformat(timespec="seconds")
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"pid {os.getpid()} on {platform.node()} since {since}\n".encode(), 0)
    return RunLock(fd, path)
