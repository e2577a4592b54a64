"""Shared test set-up: the runtime environment every entry point uses, and repo paths."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from config.runtime_env import apply_defaults

apply_defaults()

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # bench.synthetic (test helpers shared with the benches)
    sys.path.insert(0, str(REPO))
SHARED = REPO.parent / "shared"


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return REPO


@pytest.fixture(scope="session")
def shared_dir() -> Path:
    return SHARED
