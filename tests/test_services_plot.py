"""`counterpoint plot`: curves.png from metrics.jsonl."""

from __future__ import annotations

from pathlib import Path

import matplotlib.image
import pytest
import typer
from typer.testing import CliRunner

from services.archive import RunDir
from services.plot import plot_command, plot_run

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def make_run(root: Path, steps: int = 6) -> RunDir:
    run = RunDir(root / "demo").create()
    for step in range(1, steps + 1):
        run.append_metrics(step, {"reward_mean": step / 10, "pass_rate": step / 12,
                                  "ppl_ratio": 1.0 + 0.001 * step, "grad_norm": 0.5})
        run.append_timing(step, 1.0, {"gen": 0.5})
    return run


def test_plot_run_writes_a_png_that_reads_back(tmp_path: Path) -> None:
    run = make_run(tmp_path)
    out = plot_run(run.root)
    assert out == run.root / "curves.png"
    data = out.read_bytes()
    assert data[:8] == PNG_MAGIC and len(data) > 10_000
    image = matplotlib.image.imread(out)
    assert image.shape[:2] == (350, 1200)
    # Curves were drawn: plenty of non-white pixels.
    assert (image[..., :3] < 0.9).any(axis=-1).mean() > 0.02


def test_plot_run_without_metrics_names_the_file(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="metrics.jsonl"):
        plot_run(tmp_path)


def test_plot_run_with_missing_series_still_plots(tmp_path: Path) -> None:
    run = RunDir(tmp_path / "partial").create()
    run.append_metrics(1, {"reward_mean": 0.2, "ppl_ratio": None})
    out = plot_run(run.root)
    assert matplotlib.image.imread(out).shape[:2] == (350, 1200)


def test_plot_command_cli(tmp_path: Path) -> None:
    app = typer.Typer()
    app.command("plot")(plot_command)
    run = make_run(tmp_path, steps=3)
    result = CliRunner().invoke(app, [str(run.root)])
    assert result.exit_code == 0, result.output
    assert result.output.strip() == str(run.root / "curves.png")
    assert (run.root / "curves.png").stat().st_size > 0
    empty = tmp_path / "empty"
    empty.mkdir()
    failed = CliRunner().invoke(app, [str(empty)])
    assert failed.exit_code == 2 and "metrics.jsonl" in failed.output
