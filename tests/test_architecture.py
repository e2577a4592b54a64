"""The dependency direction of the packages (README, "Architecture"), read from the source:

    config  <-  model, records  <-  graders, rollout, learner, search  <-  evals  <-  services

Each package may import only the packages DEPENDS_ON declares for it (so two siblings of one
layer never import each other unless declared), the package graph has no cycle, and no two of
our modules import each other, directly or through others. Every import counts: lazy ones inside
functions, relative ones (``from .x import y``), and ``importlib.import_module`` / ``__import__``
calls whose module name is a literal string.

A task is one folder under graders/: services/ and evals/ import none of its modules (they ask
the task's profile, graders/tasks.py), nor does any other grader module but the grader CLI.
"""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# Which of our packages each package may import. One layer may use the layers below it; inside
# the middle layer nothing is declared, so graders, rollout, learner and search stay apart.
DEPENDS_ON: dict[str, set[str]] = {
    "config": set(),
    "records": set(),
    "model": {"config"},
    "graders": {"config", "records"},
    "rollout": {"config", "model"},
    "learner": {"config", "model"},
    "search": {"config", "records"},
    "evals": {"config", "records", "graders", "rollout", "search"},
    "services": {"config", "model", "records", "graders", "rollout", "learner", "search", "evals"},
}
PACKAGES = tuple(DEPENDS_ON)


def module_name(path: Path, root: Path = REPO) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def modules(root: Path = REPO, packages: tuple[str, ...] = PACKAGES) -> dict[str, Path]:
    out = {}
    for package in packages:
        for path in (root / package).rglob("*.py"):
            if "proto" in path.parts:  # generated stubs
                continue
            out[module_name(path, root)] = path
    return out


def _literal(node: ast.AST | None) -> str | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def _absolute(name: str, level: int, package: str) -> str:
    """``from <level dots><name>`` seen from a module of package ``package`` (dotted)."""
    base = package.split(".")
    if level > 1:
        base = base[: len(base) - (level - 1)]
    return ".".join([*base, *([name] if name else [])])


def imported_names(source: str, module: str, is_package: bool) -> set[str]:
    """Every dotted name ``source`` (the text of ``module``) imports, absolute."""
    package = module if is_package else module.rpartition(".")[0]
    names: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(node.module or "", node.level, package) if node.level else node.module or ""
            names.add(base)
            names.update(f"{base}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Call):
            func = node.func
            called = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None
            name = _literal(node.args[0]) if node.args else None
            if called in ("import_module", "__import__") and name is not None:
                anchor = next((_literal(k.value) for k in node.keywords if k.arg == "package"), None)
                if called == "import_module" and name.startswith(".") and anchor is not None:
                    dots = len(name) - len(name.lstrip("."))
                    name = _absolute(name[dots:], dots, anchor)
                names.add(name)
    return names


def imports_of(path: Path, known: set[str], root: Path = REPO) -> set[str]:
    """Our modules that ``path`` imports (the longest known prefix of each imported name)."""
    found = set()
    for name in imported_names(path.read_text(), module_name(path, root), path.name == "__init__.py"):
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


def package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for m, deps in graph.items():
        out.setdefault(top(m), set()).update(top(d) for d in deps if top(d) != top(m))
    return out


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components of more than one node."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
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
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_every_package_pyproject_ships_is_checked():
    """A package added to pyproject.toml without an entry here would escape every check below."""
    from setuptools import find_packages

    include = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["include"]
    assert {name.split(".")[0] for name in find_packages(where=str(REPO), include=include)} == set(PACKAGES)


@pytest.mark.parametrize("package", PACKAGES)
def test_a_package_imports_only_what_it_declares(package: str):
    bad = sorted(f"{m} -> {d}" for m, deps in GRAPH.items() if top(m) == package
                 for d in deps if top(d) != package and top(d) not in DEPENDS_ON[package])
    assert not bad, bad


def test_the_declared_layers_and_the_imports_have_no_package_cycle():
    assert not cycles(DEPENDS_ON)
    assert not cycles(package_graph(GRAPH))


def test_no_import_cycles():
    """Every strongly connected component of the module graph is a single module (a package's
    __init__ importing its own submodules is how a package exports, not a dependency of them)."""

    def edges(v: str) -> set[str]:
        return {w for w in GRAPH[v] if not (w.startswith(v + ".") and MODULES[v].name == "__init__.py")}

    assert not cycles({v: edges(v) for v in GRAPH})


# A task is one folder under graders/ (graders/tasks.py): its pool, its verifier, its files. The
# driver (services/) and evals/ ask its TaskProfile (graders.tasks.task_profile) for what they
# need and import none of its modules; neither does anything else in graders/ but the grader
# CLI, whose subcommands are the tasks' own (`grader score --task voice-leading`, `grader list
# --task code-exec`, `grader make-fixtures`). Nothing then points back up into a task.
TASK_FOLDERS = sorted(f"graders.{p.parent.name}" for p in (REPO / "graders").glob("*/__init__.py")
                      if p.parent.name != "proto")
ASKS_TASKS_ONLY_THROUGH_THE_REGISTRY = ("services", "evals")
GRADER_MODULES_THAT_MAY_IMPORT_A_TASK = {"graders.cli"}


def task_of(module: str) -> str | None:
    """The task folder ``module`` belongs to (graders.voice_leading.pool -> graders.voice_leading)."""
    return next((f for f in TASK_FOLDERS if module == f or module.startswith(f + ".")), None)


def task_imports(graph: dict[str, set[str]], importers) -> list[str]:
    """``importer -> task module`` for every edge from a module ``importers(module)`` accepts into a
    task folder other than its own."""
    return sorted(f"{m} -> {d}" for m, deps in graph.items() if importers(m)
                  for d in deps if task_of(d) is not None and task_of(d) != task_of(m))


def test_every_task_folder_is_a_registered_task():
    """The task folders are the built-in tasks' (so a new task's folder is covered below)."""
    from graders import tasks

    registered = {".".join(m.split(".")[:2]) for m in (*tasks._BUILTIN_MODULES.values(),
                                                         *tasks._BUILTIN_PROFILES.values())}
    assert TASK_FOLDERS == sorted(registered) == ["graders.code_exec", "graders.voice_leading", "graders.vowel_share"]


def test_the_driver_and_evals_import_no_task_module():
    bad = task_imports(GRAPH, lambda m: top(m) in ASKS_TASKS_ONLY_THROUGH_THE_REGISTRY)
    assert not bad, bad


def test_only_a_task_folder_imports_its_modules():
    """Outside its folder only the grader CLI imports a task's modules: no task-agnostic grader
    module (the registry, the servicer, the records, ...) and no other task does."""
    bad = task_imports(GRAPH, lambda m: top(m) == "graders" and m not in GRADER_MODULES_THAT_MAY_IMPORT_A_TASK)
    assert not bad, bad


def test_the_task_rule_sees_lazy_imports(tmp_path):
    """A lazy import of a task's module from a driver function (what services/preflight.py did
    with the voice-leading pool) is an edge the rule finds."""
    (tmp_path / "services").mkdir()
    (tmp_path / "graders" / "voice_leading").mkdir(parents=True)
    for path in ("services/__init__.py", "graders/__init__.py", "graders/voice_leading/__init__.py",
                 "graders/voice_leading/pool.py", "graders/tasks.py"):
        (tmp_path / path).write_text("")
    (tmp_path / "services" / "preflight.py").write_text(
        "from graders.tasks import task_profile\n"
        "def check(cfg):\n"
        "    from graders.voice_leading.pool import load_pool\n")
    found = modules(tmp_path, ("services", "graders"))
    graph = {m: imports_of(p, set(found), tmp_path) - {m} for m, p in found.items()}
    assert task_imports(graph, lambda m: top(m) == "services") == ["services.preflight -> graders.voice_leading.pool"]


def test_the_checker_sees_imports():
    """The graph is not empty by accident: known edges are found."""
    assert "config.run" in GRAPH["services.train"] or "config" in GRAPH["services.train"]
    assert "learner.policy" in GRAPH["learner.worker"]
    assert "records.run_dir" in GRAPH["services.archive"]


def test_the_checker_follows_relative_lazy_and_importlib_imports(tmp_path):
    """The forms a package-level cycle could hide behind, in a throwaway tree: each is found."""
    (tmp_path / "low").mkdir()
    (tmp_path / "high" / "sub").mkdir(parents=True)
    for path in ("low/__init__.py", "low/a.py", "low/b.py", "high/__init__.py", "high/sub/__init__.py",
                 "high/sub/c.py"):
        (tmp_path / path).write_text("")
    (tmp_path / "high" / "sub" / "d.py").write_text(
        "import importlib\n"
        "from . import c\n"            # relative, same package
        "from ..x import y\n"          # relative, one up (high.x: not ours, not found)
        "def lazy():\n"
        "    from low import a\n"      # inside a function
        "    importlib.import_module('low.b')\n"
        "    return __import__('high')\n"
    )
    (tmp_path / "low" / "e.py").write_text("from importlib import import_module\nimport_module('.a', package='low')\n")
    found = modules(tmp_path, ("low", "high"))
    graph = {m: imports_of(p, set(found), tmp_path) - {m} for m, p in found.items()}
    # (a `from P import m` imports P's __init__ too)
    assert graph["high.sub.d"] == {"high.sub", "high.sub.c", "low", "low.a", "low.b", "high"}
    assert graph["low.e"] == {"low.a"}
    assert package_graph(graph) == {"low": set(), "high": {"low"}}
    assert cycles({"low": {"high"}, "high": {"low"}, "apart": set()}) == [["high", "low"]]


def test_the_step_loop_and_start_up_each_fit_on_one_screen():
    """STYLE.md: the driver's step loop fits on one screen, and so does start-up (train() is a
    list of named calls). 60 lines: a screen; the loop is ~50 today, train() ~20."""
    sources = {"services/orchestrator.py": "run_steps", "services/train.py": "train"}
    for path, name in sources.items():
        tree = ast.parse((REPO / path).read_text())
        (fn,) = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name]
        lines = fn.end_lineno - fn.lineno + 1
        assert lines <= 60, f"{path} {name}() is {lines} lines: split it into named calls"
