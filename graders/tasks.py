"""Verifier tasks: a registry from a task name to a factory building it from the grader config.

A task is a plain object (no gRPC or Ray import) with three methods:

    info() -> TaskInfo                             pool sizes, source, task settings
    cases(limit: int, split: str) -> list[CaseInfo]  the first ``limit`` cases of a split (0 = all)
    score(pairs: list[(case_id, completion)]) -> list[Score]   in order; raises PoolError
                                                   (NOT_FOUND, ...) for a bad request

The gRPC servicer (graders/service.py), the Ray Serve app (graders/serve_app.py) and the client
(graders/client.py) only ever see these records, so adding a task is one module plus one
``@register_task`` (tests/grader_testtask.py registers a test-only one). ``grader.task`` may also
name ``module:factory`` for a task that is not registered (an import path the server can reach).

A task is one folder (graders/voice_leading/, graders/code_exec/, graders/vowel_share/): its pool,
its verifier and what the rest of counterpoint may know of it. The driver (services/) and evals/
never import a task's modules or read its files (tests/test_architecture.py); what they need
they ask of the task's ``TaskProfile``, which ``task_profile(name)`` returns without building the
task (no pool loaded, no sandbox started: the grader may run elsewhere):

    check_pool(cfg)              preflight: the pool a grader started by this run would serve loads
    ladder(cfg, case_id)         the case's reference ladder ({} when the task has none)
    opening_of(completion)       an eval completion's opening, where the grader's Score gave none
    test_reward(metric, value)   a held-out test metric as a reward (tasks graded on test rows)
    verdict_label(verdict)       a Score's verdict as the bounded `verdict` label of
                                 counterpoint_grader_requests_total (``verdict_labels``: all of them)
    probe_messages / probe_options   the five-options probe (`counterpoint probe-options`)

A task registers its profile with ``@register_profile``; a task without one (a ``module:factory``
or a test task) gets ``TaskProfile``'s defaults.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from graders.types import CaseInfo, Score, TaskInfo


class Task(Protocol):
    """``score`` may take ``on_case`` (a keyword, optional): a task whose cases take seconds
    calls it as each case finishes, so the replica's liveness counts cases, not whole batches
    (graders/progress.py); a task without it is judged per batch."""

    name: str

    def info(self) -> TaskInfo: ...
    def cases(self, limit: int, split: str) -> list[CaseInfo]: ...
    def score(self, pairs: Sequence[tuple[str, str]]) -> list[Score]: ...


TaskFactory = Callable[[Any], Task]  # GraderConfig -> Task
_REGISTRY: dict[str, TaskFactory] = {}
_BUILTIN_MODULES = {"voice-leading": "graders.voice_leading.task", "code-exec": "graders.code_exec.service",
                    "vowel-share": "graders.vowel_share.task"}
# Where a built-in task's profile registers: a light module, so the driver can ask it without
# importing the task's verifier (code-exec's sandbox, its Prometheus metrics).
_BUILTIN_PROFILES = {"voice-leading": "graders.voice_leading.profile", "code-exec": "graders.code_exec.profile",
                     "vowel-share": "graders.vowel_share.task"}


def register_task(name: str) -> Callable[[TaskFactory], TaskFactory]:
    """Decorator: ``@register_task("my-task")`` on a factory taking a GraderConfig."""

    def add(factory: TaskFactory) -> TaskFactory:
        if name in _REGISTRY and _REGISTRY[name] is not factory:
            raise ValueError(f"grader task {name!r} is registered twice")
        _REGISTRY[name] = factory
        return factory

    return add


def task_names() -> list[str]:
    for module in _BUILTIN_MODULES.values():
        importlib.import_module(module)
    return sorted(_REGISTRY)


def make_task(cfg: Any) -> Task:
    """The task ``cfg.task`` names, built from the grader config. Unknown names fail naming the
    registered ones."""
    name = cfg.task
    if name in _BUILTIN_MODULES:
        importlib.import_module(_BUILTIN_MODULES[name])  # registers it
    if name not in _REGISTRY and ":" in name:
        module, _, attr = name.partition(":")
        return getattr(importlib.import_module(module), attr)(cfg)
    if name not in _REGISTRY:
        raise ValueError(f"unknown grader task {name!r}; registered: {', '.join(task_names())} "
                         "(or give module:factory)")
    return _REGISTRY[name](cfg)


class NoProbe(ValueError):
    """The task has no five-options probe (only voice-leading's openings have one)."""


class TaskProfile:
    """What the driver and evals may ask of a task without building it. These are the answers of
    a task that has no pool to check, no ladder, no openings, no test rows and no probe; a task
    overrides what it has."""

    name = ""
    has_probe = False
    # The values of counterpoint_grader_requests_total's `verdict` label for this task: bounded,
    # whatever a completion says. A task without a profile gets admitted | rejected.
    verdict_labels: tuple[str, ...] = ("admitted", "rejected")

    def check_pool(self, cfg: Any) -> None:
        """Raise (ValueError, OSError) when the pool a grader built from GraderConfig ``cfg`` would
        serve does not load; the first line of the message is what preflight prints."""

    def verdict_label(self, verdict: str) -> str:
        """A Score's verdict as one of ``verdict_labels``."""
        return "admitted" if verdict == "admitted" else "rejected"

    def ladder(self, cfg: Any, case_id: str) -> dict[str, Any]:
        """The case's reference ladder, {rung: {"val_metric", "test_metric", ...}}; {} = none."""
        return {}

    def opening_of(self, completion: str) -> str | None:
        """A completion's opening for an EVAL.jsonl item; None = the task has no openings."""
        return None

    def test_reward(self, metric: str, value: float) -> float:
        """A held-out test metric of a case graded with ``metric``, as a reward."""
        raise ValueError(f"grader task {self.name or '(unregistered)'!r} has no test-rows reward")

    def probe_messages(self, case: Any) -> list[dict[str, str]]:
        """The five-options probe's prompt for a grader CaseInfo."""
        raise NoProbe(f"grader task {self.name or '(unregistered)'!r} has no five-options probe")

    def probe_options(self, completion: str) -> list[Any]:
        """The options (graders.types.ProbeOption) a probe answer states, in answer order."""
        raise NoProbe(f"grader task {self.name or '(unregistered)'!r} has no five-options probe")


_PROFILES: dict[str, TaskProfile] = {}


def register_profile(profile: type[TaskProfile]) -> type[TaskProfile]:
    """Class decorator: ``@register_profile`` on a TaskProfile subclass whose ``name`` is the
    task's registered name."""
    if profile.name in _PROFILES and type(_PROFILES[profile.name]) is not profile:
        raise ValueError(f"grader task {profile.name!r} has two profiles")
    _PROFILES[profile.name] = profile()
    return profile


def task_profile(name: str) -> TaskProfile:
    """The profile of grader task ``name`` (TaskProfile's defaults for one without a profile)."""
    if name in _BUILTIN_PROFILES:
        importlib.import_module(_BUILTIN_PROFILES[name])  # registers it
    return _PROFILES.get(name) or TaskProfile()
