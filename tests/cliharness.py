"""The real `counterpoint` CLI as a subprocess, for the end-to-end tests."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CLI = [sys.executable, "-m", "services.cli"]


def cli(*args: str, timeout: float = 600, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run `counterpoint ARGS...` in the repo root; output captured as text. `env`: the whole
    environment (a run joining tests/rayharness.py's head passes its `env`)."""
    return subprocess.run(CLI + list(args), cwd=REPO, capture_output=True, text=True, timeout=timeout,
                          env={**(os.environ if env is None else env), "PYTHONUNBUFFERED": "1"})


LOOPBACK = {"127.0.0.1", "::ffff:127.0.0.1", "::1"}


def listeners_of(pid: int) -> list[tuple[str, int, str]]:
    """(address, port, process name) of every listening TCP socket of `pid` and its descendants."""
    import psutil

    root = psutil.Process(pid)
    family = {p.pid: p for p in [root, *root.children(recursive=True)]}
    out = []
    for conn in psutil.net_connections(kind="tcp"):
        if conn.status == psutil.CONN_LISTEN and conn.pid in family:
            try:
                name = family[conn.pid].name()
            except psutil.Error:
                name = "?"
            out.append((conn.laddr.ip, conn.laddr.port, name))
    return out
