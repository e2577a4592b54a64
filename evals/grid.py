"""A replicate grid's results per cell, across seeds (`counterpoint replicate --grid`).

The reference asked whether the learning rate or the learning signal bound its round-best score
with runs that could not be compared. A grid answers it: every cell (one combination of config
values) is trained once per seed, and each cell's figures are put side by side with an interval
across seeds. This module reads what the arms wrote and aggregates; it runs nothing.

Per arm (one cell, one seed), from its files:

- flat runs (trainer.rollout_mode "flat"): the held-out pass rate and mean reward of the arm's
  EVAL.jsonl after training (`counterpoint eval --run`), and after − before against the base
  model's EVAL.jsonl of the same seed and settings (points for the pass rate); the training
  signal from metrics.jsonl (mean over steps of `pass_rate` and `frac_reward_zero_std`).
- tree runs ("tree"): from the round summaries of TRAINED steps only (a round without a
  timing.jsonl line was generated, never trained), per task (a run may draw several tasks, whose
  metrics do not share a scale): round-best = `best_test_metric` (the best test metric among the
  round's valid nodes: an oracle on the test rows) of the final round and its mean over the last k
  rounds; honest = `honest_test_metric` (the test metric of the node chosen on validation) of the
  final round and over the last k. The signal diagnostics are metrics.jsonl's `search_*` scalars
  averaged over the trained rounds: valid share, share of groups with zero reward spread, debug
  and improve success rates, distinct model families among valid nodes. With eval.before_and_after
  the run also holds drafts per task before and after training, scored on the TEST rows
  (heldout_before/after.jsonl): their mean test reward after, and after − before, per task.

Across seeds: the mean and a 95 % Student-t interval, mean ± t(0.975, n−1)·s/√n with s the sample
standard deviation over the n seeds that produced the figure (a failed arm produces none, and the
cell's n says so). With one seed there is no interval ("n=1, no interval").
"""

from __future__ import annotations

import json
import math
import statistics
import textwrap
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from evals.compare import NotComparableError, check_comparable
from evals.eval_file import EvalFileError, read_eval, summarize
from records.run_dir import RunDir

LEVEL = 0.95
INTERVAL_METHOD = ("95% Student-t interval across seeds: mean ± t(0.975, n-1)·s/√n, s the sample standard "
                   "deviation of the per-seed values; n=1 gives no interval")
NO_INTERVAL = "n=1, no interval"
LAST_K = 3  # rounds averaged for the "last k" tree figures

# Metric name -> (label, headline?) in display order. Tree metrics that depend on the task carry
# "/<task>" after the name (round_best_final/tabular-binary).
FLAT_METRICS = {
    "heldout_pass_rate": "held-out pass rate after (%)",
    "heldout_pass_rate_delta": "held-out pass rate after - before (points)",
    "heldout_reward": "held-out mean reward after",
    "heldout_reward_delta": "held-out mean reward after - before",
    "train_pass_rate": "training pass rate, mean over steps (%)",
    "train_frac_reward_zero_std": "groups with zero reward spread, mean over steps",
}
TREE_TASK_METRICS = {
    "round_best_final": "round-best test metric, final round (oracle)",
    "round_best_last_k": "round-best test metric, mean of last k rounds (oracle)",
    "honest_final": "honest held-out metric (node chosen on validation), final round",
    "honest_last_k": "honest held-out metric, mean of last k rounds",
    "heldout_test_reward": "held-out drafts' test-rows reward after training (eval.before_and_after)",
    "heldout_test_reward_delta": "held-out drafts' test-rows reward after - before",
}
DIAGNOSTICS = {  # metrics.jsonl search_<name> -> label; averaged over trained rounds
    "valid_share": "valid share",
    "frac_groups_zero_reward_std": "groups with zero reward spread",
    "debug_success_rate": "debug success rate",
    "improve_success_rate": "improve success rate",
    "model_families": "distinct model families",
}
HEADLINE = ("heldout_pass_rate_delta", "heldout_pass_rate", "round_best_last_k", "honest_last_k",
            "heldout_test_reward_delta")
DIAGNOSTIC_NAMES = ("train_frac_reward_zero_std", *DIAGNOSTICS)


class GridError(ValueError):
    """Files of an arm that do not say what the aggregation needs; the message names the file."""


# ------------------------------------------------------------------------------- intervals


@dataclass(frozen=True)
class Interval:
    """A figure across seeds: the per-seed values, their mean and the 95 % t-interval (None
    with fewer than two values)."""

    values: tuple[float, ...]
    mean: float | None
    low: float | None
    high: float | None
    method: str

    @property
    def n(self) -> int:
        return len(self.values)

    def as_dict(self) -> dict[str, Any]:
        return {"n": self.n, "mean": self.mean, "low": self.low, "high": self.high, "values": list(self.values),
                "interval": self.method}

    def text(self, digits: int = 3) -> str:
        if self.mean is None:
            return "n/a"
        if self.low is None:
            return f"{self.mean:.{digits}f} ({NO_INTERVAL})"
        return f"{self.mean:.{digits}f} [{self.low:.{digits}f}, {self.high:.{digits}f}]"


def t_quantile(p: float, df: int) -> float:
    """The p-quantile of Student's t with df degrees of freedom."""
    if df < 1:
        raise ValueError(f"degrees of freedom must be >= 1, got {df}")
    from scipy.stats import t

    return float(t.ppf(p, df))


def t_interval(values: Sequence[float], level: float = LEVEL) -> Interval:
    """Mean and two-sided `level` Student-t interval of `values` (the seeds of one cell)."""
    xs = tuple(float(v) for v in values)
    if any(not math.isfinite(v) for v in xs):
        raise ValueError(f"values must be finite, got {list(xs)}")
    if not xs:
        return Interval(xs, None, None, None, "no values")
    mean = statistics.fmean(xs)
    if len(xs) == 1:
        return Interval(xs, mean, None, None, NO_INTERVAL)
    half = t_quantile(0.5 + level / 2, len(xs) - 1) * statistics.stdev(xs) / math.sqrt(len(xs))
    return Interval(xs, mean, mean - half, mean + half, f"{level:.0%} t-interval, n={len(xs)}")


# ------------------------------------------------------------------------------- one arm


def _mean(xs: Sequence[float | None]) -> float | None:
    got = [float(x) for x in xs if x is not None]
    return statistics.fmean(got) if got else None


def _step_metrics(run_dir: Path) -> list[dict[str, Any]]:
    """metrics.jsonl lines of trained steps (a corrupt line raises records' RecordError)."""
    run = RunDir(run_dir)
    trained = set(run.trained_steps())
    return [m for m in run.metrics() if m.get("step") in trained]


def eval_figures(path: Path) -> dict[str, float]:
    """Pass rate (%) and mean reward over every completion of an EVAL.jsonl."""
    ev = read_eval(path)
    rewards = [r for item in ev.items for r in item.rewards]
    return {"pass_rate": summarize(ev.items).pass_rate * 100, "reward": statistics.fmean(rewards) if rewards else math.nan}


def flat_arm_metrics(run_dir: Path, after: Path, before: Path | None) -> tuple[dict[str, float | None], list[str]]:
    """A flat arm's figures (FLAT_METRICS) and notes on anything missing."""
    notes: list[str] = []
    out: dict[str, float | None] = {}
    steps = _step_metrics(run_dir)
    out["train_pass_rate"] = None if (v := _mean([m.get("pass_rate") for m in steps])) is None else v * 100
    out["train_frac_reward_zero_std"] = _mean([m.get("frac_reward_zero_std") for m in steps])
    try:
        a = eval_figures(after)
    except EvalFileError as err:
        notes.append(f"no after-eval: {err}")
        return out, notes
    out["heldout_pass_rate"], out["heldout_reward"] = a["pass_rate"], a["reward"]
    if before is None:
        notes.append("no before-eval: after - before not computed")
        return out, notes
    try:
        check_comparable(read_eval(before), [read_eval(after)])
        b = eval_figures(before)
    except (EvalFileError, NotComparableError) as err:
        notes.append(f"after - before not computed: {err}")
        return out, notes
    out["heldout_pass_rate_delta"] = a["pass_rate"] - b["pass_rate"]
    out["heldout_reward_delta"] = a["reward"] - b["reward"]
    return out, notes


def round_summaries(run_dir: Path) -> list[dict[str, Any]]:
    """The summary of every TRAINED round of a tree run, in step order (round_<step>/
    <task>__summary_<epoch>.json; a round whose step has no timing line is left out)."""
    out = []
    run = RunDir(run_dir)
    for step in run.trained_steps():
        for path in sorted(run.round_dir(step).glob("*__summary_*.json")):
            summary = json.loads(path.read_text(encoding="utf-8"))
            if "best_test_metric" not in summary:
                raise GridError(f"{path}: not a tree round summary (no best_test_metric)")
            out.append(summary)
    return out


def tree_arm_metrics(run_dir: Path, last_k: int = LAST_K) -> tuple[dict[str, float | None], list[str]]:
    """A tree arm's figures: TREE_TASK_METRICS per task ("<name>/<task>") and DIAGNOSTICS."""
    if last_k < 1:
        raise ValueError(f"last_k must be >= 1, got {last_k}")
    summaries = round_summaries(run_dir)
    notes = [] if summaries else [f"{run_dir}: no trained tree rounds"]
    out: dict[str, float | None] = {}
    by_task: dict[str, list[dict[str, Any]]] = {}
    for s in summaries:
        by_task.setdefault(str(s.get("case") or s.get("task")), []).append(s)
    for task, rounds in sorted(by_task.items()):
        last = rounds[-last_k:]
        out[f"round_best_final/{task}"] = rounds[-1].get("best_test_metric")
        out[f"round_best_last_k/{task}"] = _mean([r.get("best_test_metric") for r in last])
        out[f"honest_final/{task}"] = rounds[-1].get("honest_test_metric")
        out[f"honest_last_k/{task}"] = _mean([r.get("honest_test_metric") for r in last])
    # A tree run with eval.before_and_after: drafts per task before and after, on the TEST rows.
    before, after = RunDir(run_dir).heldout_path("before"), RunDir(run_dir).heldout_path("after")
    if before.is_file() and after.is_file():
        try:
            b = {i.item_id: statistics.fmean(i.rewards) for i in read_eval(before).items if i.rewards}
            a = {i.item_id: statistics.fmean(i.rewards) for i in read_eval(after).items if i.rewards}
        except EvalFileError as err:
            notes.append(f"held-out eval not read: {err}")
        else:
            for task in sorted(set(a) & set(b)):
                out[f"heldout_test_reward/{task}"] = a[task]
                out[f"heldout_test_reward_delta/{task}"] = a[task] - b[task]
    steps = _step_metrics(run_dir)
    for name in DIAGNOSTICS:
        out[name] = _mean([m.get(f"search_{name}") for m in steps])
    return out, notes


# ------------------------------------------------------------------------------- the grid


@dataclass(frozen=True)
class ArmFiles:
    """Where one arm's results are (replicate's receipt records each arm so)."""

    cell: str
    seed: int
    status: str  # completed | failed
    run_dir: Path
    eval_file: Path | None  # flat: the after-eval; tree: None
    before_file: Path | None = None
    mode: str = "flat"  # trainer.rollout_mode of the cell
    error: str | None = None


def _ordered(names: Sequence[str]) -> list[str]:
    order = [*FLAT_METRICS, *TREE_TASK_METRICS, *DIAGNOSTICS]
    return sorted(names, key=lambda n: (order.index(n.split("/")[0]), n))


def aggregate(cells: Sequence[Mapping[str, Any]], arms: Sequence[ArmFiles], last_k: int = LAST_K) -> dict[str, Any]:
    """grid.json: per cell (``cells``: {"cell", "overrides"} in grid order) its arms' figures and
    each figure's mean and interval across the seeds that produced it."""
    report_cells = []
    for cell in cells:
        mine = [a for a in arms if a.cell == cell["cell"]]
        per_arm = []
        for arm in mine:
            figures: dict[str, float | None] = {}
            notes: list[str] = []
            if arm.status == "completed":
                try:
                    if arm.mode == "tree":
                        figures, notes = tree_arm_metrics(arm.run_dir, last_k)
                    else:
                        figures, notes = flat_arm_metrics(arm.run_dir, arm.eval_file, arm.before_file)
                except (OSError, ValueError) as err:  # one arm's unreadable files never hide the others
                    figures, notes = {}, [f"unreadable results: {err}"]
            else:
                notes = [f"arm failed: {arm.error}"]
            per_arm.append({"seed": arm.seed, "status": arm.status, "run_dir": str(arm.run_dir),
                            "metrics": figures, "notes": notes})
        names = _ordered({k for a in per_arm for k in a["metrics"]})
        metrics = {name: t_interval([a["metrics"][name] for a in per_arm if a["metrics"].get(name) is not None]
                                    ).as_dict() for name in names}
        report_cells.append({"cell": cell["cell"], "overrides": list(cell["overrides"]),
                             "mode": mine[0].mode if mine else None,
                             "seeds": [a.seed for a in mine], "completed": sum(a.status == "completed" for a in mine),
                             "metrics": metrics, "arms": per_arm})
    return {"kind": "replicate_grid", "interval": INTERVAL_METHOD, "last_k": last_k,
            "labels": {**FLAT_METRICS, **TREE_TASK_METRICS, **DIAGNOSTICS}, "cells": report_cells}


def label_of(name: str, last_k: int = LAST_K) -> str:
    base, _, task = name.partition("/")
    label = {**FLAT_METRICS, **TREE_TASK_METRICS, **DIAGNOSTICS}.get(base, base).replace("last k", f"last {last_k}")
    return f"{label}, task {task}" if task else label


def write_grid_json(report: Mapping[str, Any], path: Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    return path


def read_grid_json(path: Path) -> dict[str, Any]:
    data = json.loads(Path(path).read_text(encoding="utf-8"))
    if data.get("kind") != "replicate_grid":
        raise GridError(f"{path}: not a grid report (kind {data.get('kind')!r})")
    return data


def _cell_text(m: Mapping[str, Any], digits: int = 3) -> str:
    return Interval(tuple(m["values"]), m["mean"], m["low"], m["high"], m["interval"]).text(digits)


def grid_table(report: Mapping[str, Any]) -> Any:
    """One rich table: a row per (cell, figure): n seeds, mean [95% interval], per-seed values."""
    from rich.markup import escape
    from rich.table import Table

    table = Table(title="replicate grid: per cell across seeds (mean [95% t-interval])",
                  caption=report["interval"], caption_justify="left")
    for col, justify in (("cell", "left"), ("overrides", "left"), ("figure", "left"), ("n", "right"),
                         ("mean [95% interval]", "right"), ("per seed", "left")):
        table.add_column(col, justify=justify, overflow="fold")
    for cell in report["cells"]:
        rows = list(cell["metrics"].items())
        head = [escape(cell["cell"]), escape(" ".join(cell["overrides"]))]
        if not rows:
            table.add_row(*head, "(no figures: every arm failed)", "0", "n/a", "", end_section=True)
        for i, (name, m) in enumerate(rows):
            table.add_row(*(head if i == 0 else ["", ""]), escape(label_of(name, report["last_k"])), str(m["n"]),
                          escape(_cell_text(m)), ", ".join(f"{v:.3f}" for v in m["values"]),
                          end_section=i == len(rows) - 1)
    return table


def failed_lines(report: Mapping[str, Any]) -> list[str]:
    """One line per arm that gave no figures or lacks some, saying why."""
    return [f"{c['cell']} seed {a['seed']}: {note}" for c in report["cells"] for a in c["arms"] for note in a["notes"]]


def write_grid_png(report: Mapping[str, Any], path: Path) -> Path:
    """Each headline figure per cell with its 95 % interval (one panel each), then a diagnostics
    panel: the signal diagnostics per cell with their intervals."""
    from evals.figures import interval_panel, pyplot, save_figure

    cells = report["cells"]
    names = sorted({n for c in cells for n in c["metrics"]})
    headline = sorted((n for n in names if n.split("/")[0] in HEADLINE),
                      key=lambda n: (HEADLINE.index(n.split("/")[0]), n))
    diagnostics = [n for n in DIAGNOSTIC_NAMES if n in names]
    panels = len(headline) + 1
    plt = pyplot()
    fig, axes = plt.subplots(1, panels, figsize=(4.5 * panels, 4.2), squeeze=False)
    labels = [c["cell"] for c in cells]
    for ax, name in zip(axes[0], headline):
        stats = [c["metrics"].get(name) for c in cells]
        interval_panel(ax, labels, stats)
        ax.set_title(textwrap.fill(label_of(name, report["last_k"]), 45), fontsize=9)
    ax = axes[0][-1]
    if diagnostics:
        width = 0.8 / len(diagnostics)
        for j, name in enumerate(diagnostics):
            interval_panel(ax, labels, [c["metrics"].get(name) for c in cells], offset=(j - (len(diagnostics) - 1) / 2) * width,
                           label=label_of(name, report["last_k"]))
        ax.legend(fontsize=7, loc="best")
    else:
        ax.text(0.5, 0.5, "no diagnostics", ha="center", va="center", transform=ax.transAxes)
    ax.set_title("signal diagnostics (mean over steps/rounds)", fontsize=9)
    fig.suptitle(f"replicate grid, {len(cells)} cells: mean and 95% t-interval across seeds", fontsize=10)
    fig.tight_layout()
    return save_figure(fig, path)
