"""Shared test set-up: the runtime environment every entry point uses, and repo paths."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.runtime_env import apply_defaults

apply_defaults()

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return REPO


@pytest.fixture(scope="session")
def shared_dir() -> Path:
    return SHARED
