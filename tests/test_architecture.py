"""The dependency direction of the packages (README, "Architecture"), read from the source:

    config  <-  graders, rollout, learner, search  <-  evals  <-  services

config imports nothing of ours; graders/, rollout/, learner/ and search/ import neither services/
nor evals/; evals/ does not import services/; and no two of our modules import each other, directly
or through others (imports inside functions included: a lazy import is still a dependency).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("config", "graders", "rollout", "learner", "search", "evals", "services")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def modules() -> dict[str, Path]:
    out = {}
    for package in PACKAGES:
        for path in (REPO / package).rglob("*.py"):
            if "proto" in path.parts:  # generated stubs
                continue
            out[module_name(path)] = path
    return out


def imports_of(path: Path, known: set[str]) -> set[str]:
    """Our modules that ``path`` imports (the longest known prefix of each imported name)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        for name in names:
            parts = name.split(".")
            for k in range(len(parts), 0, -1):
                candidate = ".".join(parts[:k])
                if candidate in known:
                    found.add(candidate)
                    break
    return found


MODULES = modules()
GRAPH = {name: imports_of(path, set(MODULES)) - {name} for name, path in MODULES.items()}


def top(name: str) -> str:
    return name.split(".")[0]


@pytest.mark.parametrize("package, forbidden", [
    ("config", {"graders", "rollout", "learner", "search", "evals", "services"}),
    ("search", {"services", "evals"}),
    ("graders", {"services", "evals"}),
    ("rollout", {"services", "evals"}),
    ("learner", {"services", "evals"}),
    ("evals", {"services"}),
])
def test_no_module_imports_upward(package: str, forbidden: set[str]):
    bad = sorted(f"{m} -> {d}" for m, deps in GRAPH.items() if top(m) == package for d in deps if top(d) in forbidden)
    assert not bad, bad


def test_no_import_cycles():
    """Tarjan's strongly connected components over our modules: every one must be a single module
    (a package's __init__ re-exporting its own submodules is not a cycle)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []
    counter = [0]

    def edges(v: str) -> set[str]:
        # A package's __init__ importing its own submodules is how a package exports; it is not a
        # dependency of those submodules on anything.
        return {w for w in GRAPH[v] if not (w.startswith(v + ".") and MODULES[v].name == "__init__.py")}

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in edges(v):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(GRAPH):
        if v not in index:
            visit(v)
    assert not cycles, cycles


def test_the_checker_sees_imports():
    """The graph is not empty by accident: known edges are found."""
    assert "config.run" in GRAPH["services.train"] or "config" in GRAPH["services.train"]
    assert "learner.policy" in GRAPH["learner.worker"]
