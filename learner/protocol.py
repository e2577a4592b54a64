"""The driver <-> Ray Train worker protocol: typed commands in, typed answers out.

The driver (learner/job.py) appends commands to a coordinator actor's ordered log; every worker
takes each in order (learner/worker.py); rank 0 posts the answer. Plain dataclasses: they cross
Ray's object store pickled.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Union

from learner.types import InitInfo, StepResult


@dataclass(frozen=True)
class Init:
    """Build the policy; rank 0 saves the init adapter and answers InitInfo."""


@dataclass(frozen=True)
class Step:
    """Train step ``step`` on the global batch behind ``batch`` (one ObjectRef, inside a list so
    Ray hands the worker the reference, not the value); rank 0 answers StepResult."""

    step: int
    batch: list[Any] | None


@dataclass(frozen=True)
class Save:
    """checkpoints/step_<step>/ (every rank) and adapters/step_<step>/ (rank 0); answers Saved."""

    step: int
    data_position: dict[str, Any] | None = None


@dataclass(frozen=True)
class Stop:
    """Leave the loop; the fit() returns."""


Command = Union[Init, Step, Save, Stop]


@dataclass(frozen=True)
class Saved:
    path: str  # the checkpoint directory, relative to the run directory
    adapter_sha256: str | None


@dataclass(frozen=True)
class Failed:
    """A worker's exception, posted before it dies so the driver raises it instead of waiting."""

    where: str  # "learner rank R (pid P)"
    traceback: str


Answer = Union[InitInfo, StepResult, Saved, Failed, None]
