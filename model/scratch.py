"""Per-process scratch directories in the temp directory, named ``<prefix><pid>-<random>``, and
the sweep that finds those whose process is gone. A process killed with SIGKILL (the OOM killer,
a lost node, a test) never runs its own clean-up; the next process of its kind on that node
removes what it left (a rollout engine's adapters, a learner worker's staged files)."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path


def make_scratch(prefix: str, tag: str = "") -> Path:
    """A new directory ``<tmp>/<prefix><this pid>-<tag><random>``."""
    return Path(tempfile.mkdtemp(prefix=f"{prefix}{os.getpid()}-{tag}"))


def dead_scratch(tmp: Path, prefix: str, pid_alive: Callable[[int], bool] | None = None) -> list[Path]:
    """The ``<prefix><pid>-*`` entries of ``tmp`` whose pid runs no process, sorted. A name without
    a pid after the prefix is never returned: it is not ours to judge."""
    if pid_alive is None:
        import psutil  # a Ray and vLLM dependency

        pid_alive = psutil.pid_exists
    dead = []
    for entry in tmp.glob(f"{prefix}*"):
        pid = entry.name[len(prefix):].split("-", 1)[0]
        if pid.isdigit() and not pid_alive(int(pid)):
            dead.append(entry)
    return sorted(dead)
