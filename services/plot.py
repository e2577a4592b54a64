"""``counterpoint plot RUN_DIR``: learning curves of a run from its metrics.jsonl."""

from __future__ import annotations

import math
from pathlib import Path

import typer

from services.archive import RunDir

# (metrics.jsonl key, panel title); a key a run never logged gives an empty panel saying so.
PANELS = (
    ("reward_mean", "reward mean"),
    ("pass_rate", "pass rate"),
    ("ppl_ratio", "ppl_ratio (train / rollout)"),
)


def _series(records: list[dict], key: str) -> tuple[list[int], list[float]]:
    steps, values = [], []
    for record in records:
        value = record.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            steps.append(int(record["step"]))
            values.append(float(value))
    return steps, values


def plot_run(run_dir: str | Path) -> Path:
    """Write ``<run_dir>/curves.png`` (reward mean, pass rate, ppl_ratio vs step)."""
    from services.figures import pyplot, save_figure

    plt = pyplot()

    run = RunDir(run_dir)
    if not run.metrics_path.is_file():
        raise FileNotFoundError(f"{run.metrics_path} does not exist: not a run directory?")
    records = run.metrics()
    fig, axes = plt.subplots(1, len(PANELS), figsize=(12, 3.5), dpi=100, constrained_layout=True)
    for ax, (key, title) in zip(axes, PANELS, strict=True):
        steps, values = _series(records, key)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if steps:
            ax.plot(steps, values, marker="o", markersize=3)
        else:
            message = f"no '{key}' in metrics.jsonl"
            ax.text(0.5, 0.5, message, ha="center", va="center", transform=ax.transAxes)
        if key == "pass_rate":
            ax.set_ylim(-0.02, 1.02)
        if key == "ppl_ratio" and steps:
            ax.axhline(1.0, color="grey", linestyle="--", linewidth=1)
    fig.suptitle(run.root.name)
    return save_figure(fig, run.curves_path)


def plot_command(
    run_dir: Path = typer.Argument(  # noqa: B008 (typer's declaration style)
        ..., help="A run directory (runs/<run_name>).", exists=True, file_okay=False
    ),
) -> None:
    """Plot reward mean, pass rate and ppl_ratio against step into RUN_DIR/curves.png."""
    try:
        out = plot_run(run_dir)
    except FileNotFoundError as err:
        typer.echo(f"error: {err}", err=True)
        raise typer.Exit(code=2) from None
    typer.echo(str(out))
