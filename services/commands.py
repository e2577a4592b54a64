"""Top-level commands: train, plot, eval, ... (filled in by the orchestrator work)."""

from services.cli import app  # noqa: F401
