"""The real `counterpoint` CLI as a subprocess, for the end-to-end tests."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CLI = [sys.executable, "-m", "services.cli"]


def cli(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    """Run `counterpoint ARGS...` in the repo root; output captured as text."""
    return subprocess.run(CLI + list(args), cwd=REPO, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "PYTHONUNBUFFERED": "1"})
