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
