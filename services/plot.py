"""``counterpoint plot RUN_DIR``: learning curves of a run from its metrics.jsonl, and the held-out
before/after of its run.json.

Panels: reward mean, pass rate (one panel when every step's reward mean equals its pass rate, as
with a binary reward), ppl_ratio, and, when the run evaluated held-out before and after training,
the two pass rates with the 95 % interval of their paired difference (one seed's result).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import typer

from records.run_dir import RunDir

# (metrics.jsonl key, panel title); a key a run never logged gives an empty panel saying so.
PANELS = (
    ("reward_mean", "reward mean"),
    ("pass_rate", "pass rate"),
    ("ppl_ratio", "ppl_ratio (train / rollout)"),
)
PANEL_WIDTH_IN = 4.0


def _series(records: list[dict], key: str) -> tuple[list[int], list[float]]:
    steps, values = [], []
    for record in records:
        value = record.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            steps.append(int(record["step"]))
            values.append(float(value))
    return steps, values


def curve_panels(records: list[dict]) -> list[tuple[str, str]]:
    """PANELS, with reward mean and pass rate merged when they are the same series."""
    reward, passed = _series(records, "reward_mean"), _series(records, "pass_rate")
    same = bool(reward[0]) and reward[0] == passed[0] and all(
        math.isclose(a, b, rel_tol=0, abs_tol=1e-12) for a, b in zip(reward[1], passed[1]))
    if not same:
        return list(PANELS)
    return [("reward_mean", "reward mean = pass rate"), *(p for p in PANELS if p[0] not in ("reward_mean", "pass_rate"))]


def heldout_of(run: RunDir) -> dict[str, Any] | None:
    """run.json's ``heldout`` section when it holds a before or an after eval, else None."""
    try:
        section = json.loads(run.receipt_path.read_text()).get("heldout")
    except (OSError, ValueError):
        return None
    if not isinstance(section, dict) or not any(isinstance(section.get(w), dict) for w in ("before", "after")):
        return None
    return section


def _heldout_panel(ax: Any, section: dict[str, Any]) -> None:
    whens = [w for w in ("before", "after") if isinstance(section.get(w), dict)]
    rates = [section[w]["summary"]["pass_rate"] * 100 for w in whens]
    n_items = section[whens[0]]["summary"]["n_items"]
    ax.bar(range(len(whens)), rates, color=["tab:gray", "tab:blue"][: len(whens)], width=0.6)
    ax.set_xticks(range(len(whens)), [f"{w}\n{r:.1f} %" for w, r in zip(whens, rates)])
    ax.set_ylabel("pass rate (%)")
    ax.set_ylim(0, 100)
    ax.grid(alpha=0.3, axis="y")
    d = section.get("difference")
    if d is None:
        ax.set_title(f"held-out pass rate, {n_items} items")
        return
    p = d["pass_rate"]
    # The interval is on after - before; drawn around `after` as before + [low, high].
    ax.errorbar([1], [p["before"] + p["difference"]], yerr=[[p["difference"] - p["low"]], [p["high"] - p["difference"]]],
                fmt="o", color="tab:red", capsize=8, label="before + 95% interval of the difference")
    ax.set_title(f"held-out pass rate, {n_items} items, one seed\n"
                 f"after - before {p['difference']:+.1f} pts, 95% [{p['low']:+.1f}, {p['high']:+.1f}]",
                 fontsize=9)
    ax.legend(fontsize=7, loc="upper left")


def plot_run(run_dir: str | Path) -> Path:
    """Write ``<run_dir>/curves.png`` (reward mean, pass rate, ppl_ratio vs step; held-out
    before/after when the run has it)."""
    from evals.figures import pyplot, save_figure

    plt = pyplot()

    run = RunDir(run_dir)
    if not run.metrics_path.is_file():
        raise FileNotFoundError(f"{run.metrics_path} does not exist: not a run directory?")
    records = run.metrics()
    panels = curve_panels(records)
    heldout = heldout_of(run)
    n = len(panels) + (heldout is not None)
    fig, axes = plt.subplots(1, n, figsize=(PANEL_WIDTH_IN * n, 3.5), dpi=100, constrained_layout=True)
    for ax, (key, title) in zip(axes, panels):
        steps, values = _series(records, key)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.xaxis.get_major_locator().set_params(integer=True)  # steps are whole numbers
        ax.grid(alpha=0.3)
        if steps:
            ax.plot(steps, values, marker="o", markersize=3)
        else:
            message = f"no '{key}' in metrics.jsonl"
            ax.text(0.5, 0.5, message, ha="center", va="center", transform=ax.transAxes)
        if "pass rate" in title:  # a share: 0..1
            ax.set_ylim(-0.02, 1.02)
        if key == "ppl_ratio" and steps:
            ax.axhline(1.0, color="grey", linestyle="--", linewidth=1)
    if heldout is not None:
        _heldout_panel(axes[-1], heldout)
    fig.suptitle(run.root.name)
    return save_figure(fig, run.curves_path)


def plot_command(
    run_dir: Path = typer.Argument(  # noqa: B008 (typer's declaration style)
        ..., help="A run directory (runs/<run_name>).", exists=True, file_okay=False
    ),
) -> None:
    """Plot reward mean, pass rate and ppl_ratio against step, and the held-out before/after, into RUN_DIR/curves.png."""
    try:
        out = plot_run(run_dir)
    except FileNotFoundError as err:
        typer.echo(f"error: {err}", err=True)
        raise typer.Exit(code=2) from None
    typer.echo(str(out))
