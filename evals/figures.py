"""The two steps every PNG the CLI writes shares: a headless pyplot, and saving a figure.

matplotlib is imported lazily (a CLI command that writes no figure never pays for it), and with
the Agg backend so a run on a cluster node without a display can still plot.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def pyplot() -> Any:
    """matplotlib.pyplot on the Agg backend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig: Any, path: str | Path, dpi: int = 100) -> Path:
    """Write `fig` to `path` (creating its folder) and free it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi)
    pyplot().close(fig)
    return path


def interval_panel(ax: Any, labels: list[str], stats: list[dict | None], offset: float = 0.0,
                   label: str | None = None) -> None:
    """On `ax`, one x position per label: the per-seed values as dots, the mean with its 95 %
    interval as an error bar (a mean without an interval, n=1, as an open marker); `stats` are
    evals.grid Interval dicts ({"mean", "low", "high", "values"}) or None (nothing to show).
    `offset` shifts the points so several series share the axis; `label` names the series."""
    xs = [i + offset for i in range(len(labels))]
    color = None
    for x, s in zip(xs, stats):
        if not s or s.get("mean") is None:
            continue
        dots = ax.scatter([x] * len(s["values"]), s["values"], s=12, alpha=0.5, color=color)
        color = dots.get_facecolor()[0]
        if s.get("low") is not None:
            ax.errorbar([x], [s["mean"]], yerr=[[s["mean"] - s["low"]], [s["high"] - s["mean"]]], fmt="o",
                        capsize=5, color=color, label=label)
        else:
            ax.plot([x], [s["mean"]], "o", mfc="none", color=color, label=label)
        label = None  # one legend entry per series
    ax.set_xticks(range(len(labels)))
    ax.set_xticklabels(labels, rotation=20, ha="right", fontsize=7)
    ax.set_xlim(-0.6, len(labels) - 0.4)
