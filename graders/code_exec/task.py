"""A code-exec task on disk (MLE-bench layout) and where the bundled ones live.

    <task_dir>/task.json            id, metric, direction, id_column, target_columns,
                                    grading_rules (mle-bench | counterpoint), ...
    <task_dir>/public/              what a script sees: train.csv, test.csv,
                                    sample_submission.csv, description.md (or the task's own names)
    <task_dir>/private/answers.csv  id, answer column(s) and `split` (val|test) — never copied out

Validation vs test: public/test.csv holds the inputs of BOTH held-out splits, shuffled together
under random ids, so a script cannot tell them apart and predicts every row. The harness grades
one submission twice from private/answers.csv: `val_metric` on the val rows (what a search
selects on and, by default, what the reward uses) and `test_metric` on the test rows (what is
reported). An answers file without a `split` column (e.g. an MLE-bench prepared competition's
private/test.csv named in task.json) is all test: val_metric is then None.

Grading rules (grading.py): task.json `grading_rules` names the rule set; without it the grader's
`code_exec.grading_rules` applies (TaskSpec.grading_rules is then None). Log-loss answers are
either one label column (`answer_columns`, default ["label"]) or one-hot, one column per class
(`answer_columns` = the classes: MLE-bench's spooky private/test.csv).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from config.runtime_env import cache_root as runtime_cache_root
from graders.code_exec.grading import METRICS, REWARD_MAPS, RULE_SETS


class TaskError(ValueError):
    """A task directory or task.json is malformed (one-line message naming what)."""


@dataclass(frozen=True)
class TaskSpec:
    id: str
    dir: Path
    metric: str
    direction: str
    id_column: str
    target_columns: tuple[str, ...]
    answer_columns: tuple[str, ...]
    classes: tuple[str, ...] = ()
    reward: str = ""
    answers: str = "private/answers.csv"
    description: str = "description.md"
    split_seed: int | None = None
    rows: dict = field(default_factory=dict)
    source: str = ""
    scaffold: dict | None = None  # template script for small policies (search/scaffold.py)
    grading_rules: str | None = None  # as task.json names it; None = code_exec.grading_rules

    def rules(self, default: str) -> str:
        """The rule set grading this task: its own, else the grader's configured default."""
        return self.grading_rules or default

    @property
    def public(self) -> Path:
        return self.dir / "public"

    @property
    def answers_path(self) -> Path:
        return self.dir / self.answers

    def summary(self) -> dict:
        """The JSON object `grader list --task code-exec` prints for this task."""
        return {"id": self.id, "metric": self.metric, "direction": self.direction,
                "id_column": self.id_column, "target_columns": list(self.target_columns),
                "reward": self.reward, "rows": self.rows, "dir": str(self.dir)}


def load_task(task_dir: str | os.PathLike) -> TaskSpec:
    d = Path(task_dir).resolve()
    tj = d / "task.json"
    try:
        raw = json.loads(tj.read_text())
    except FileNotFoundError:
        raise TaskError(f"{tj}: missing task.json") from None
    except json.JSONDecodeError as e:
        raise TaskError(f"{tj}: not JSON ({e})") from None
    for key in ("id", "metric", "id_column", "target_columns"):
        if key not in raw:
            raise TaskError(f"{tj}: missing key {key!r}")
    metric = raw["metric"]
    if metric not in METRICS:
        raise TaskError(f"{tj}: metric {metric!r} is not one of {sorted(METRICS)}")
    direction = raw.get("direction", METRICS[metric])
    if direction != METRICS[metric]:
        raise TaskError(f"{tj}: direction {direction!r} contradicts {metric} ({METRICS[metric]})")
    reward = raw.get("reward", REWARD_MAPS[metric])
    if reward != REWARD_MAPS[metric]:
        raise TaskError(f"{tj}: reward {reward!r} != {REWARD_MAPS[metric]!r} for {metric}")
    targets = tuple(raw["target_columns"])
    classes = tuple(raw.get("classes", targets if metric == "log_loss" else ()))
    if metric == "log_loss" and (len(classes) < 2 or set(classes) != set(targets)):
        raise TaskError(f"{tj}: log_loss needs target_columns = the class names")
    if metric == "roc_auc" and len(targets) != 1:
        raise TaskError(f"{tj}: roc_auc takes one target column, got {list(targets)}")
    answer_cols = tuple(raw.get("answer_columns", ["label"] if metric == "log_loss" else targets))
    if metric == "log_loss" and len(answer_cols) != 1 and set(answer_cols) != set(classes):
        raise TaskError(f"{tj}: log_loss answer_columns must be one label column or the classes "
                        f"(one-hot), got {list(answer_cols)}")
    rules = raw.get("grading_rules")
    if rules is not None and rules not in RULE_SETS:
        raise TaskError(f"{tj}: grading_rules {rules!r} is not one of {list(RULE_SETS)}")
    spec = TaskSpec(
        id=str(raw["id"]), dir=d, metric=metric, direction=direction,
        id_column=raw["id_column"], target_columns=targets, answer_columns=answer_cols,
        classes=classes, reward=reward, answers=raw.get("answers", "private/answers.csv"),
        description=raw.get("description", "description.md"), split_seed=raw.get("split_seed"),
        rows=raw.get("rows", {}), source=raw.get("source", ""), scaffold=raw.get("scaffold"),
        grading_rules=rules,
    )
    if not spec.public.is_dir():
        raise TaskError(f"{d}: missing public/ directory")
    if not spec.answers_path.is_file():
        raise TaskError(f"{d}: missing answers file {spec.answers}")
    if spec.answers_path.resolve().is_relative_to(spec.public.resolve()):
        raise TaskError(f"{d}: answers file {spec.answers} lies inside public/")
    return spec


def load_tasks(tasks_dir: str | os.PathLike) -> dict[str, TaskSpec]:
    """Every task folder (one holding task.json) directly under `tasks_dir`, by id."""
    root = Path(tasks_dir)
    if not root.is_dir():
        raise TaskError(f"tasks dir {root} does not exist")
    tasks = {}
    for sub in sorted(root.iterdir()):
        if (sub / "task.json").is_file():
            t = load_task(sub)
            if t.id in tasks:
                raise TaskError(f"{root}: task id {t.id!r} appears twice")
            tasks[t.id] = t
    if not tasks:
        raise TaskError(f"tasks dir {root} holds no task (no */task.json)")
    return tasks


def cache_root() -> Path:
    """The process's cache (config/runtime_env.py cache_root), as model/base.py's models use it."""
    return runtime_cache_root()


def bundled_tasks_dir(seed: int) -> Path:
    """Where the bundled tasks of ``seed`` are built in the cache (built or not)."""
    from graders.code_exec.build import BUILD_VERSION

    return cache_root() / "code-exec" / f"tasks-v{BUILD_VERSION}-seed{seed}"


def resolve_tasks_dir(tasks_dir: str | None, seed: int) -> Path:
    """The configured tasks dir, or the bundled tasks built once (atomically) in the cache."""
    if tasks_dir is not None:
        p = Path(tasks_dir)
        if not p.is_absolute():
            raise TaskError(f"code_exec.tasks_dir must be absolute, got {tasks_dir!r}")
        return p
    from graders.code_exec.build import ensure_built

    return ensure_built(bundled_tasks_dir(seed), seed)
