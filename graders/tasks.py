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
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from graders.records import CaseInfo, Score, TaskInfo


class Task(Protocol):
    name: str

    def info(self) -> TaskInfo: ...
    def cases(self, limit: int, split: str) -> list[CaseInfo]: ...
    def score(self, pairs: Sequence[tuple[str, str]]) -> list[Score]: ...


TaskFactory = Callable[[Any], Task]  # GraderConfig -> Task
_REGISTRY: dict[str, TaskFactory] = {}
_BUILTIN_MODULES = {"voice-leading": "graders.voice_leading.task", "code-exec": "graders.code_exec.service",
                    "vowel-share": "graders.vowel_share"}


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
