"""`counterpoint plot`: curves.png from metrics.jsonl."""

from __future__ import annotations

from pathlib import Path

import matplotlib.image
import pytest
import typer
from typer.testing import CliRunner

from records.run_dir import RunDir
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


def test_binary_reward_drops_the_duplicate_panel_and_heldout_panel_shows_the_interval(tmp_path: Path) -> None:
    from heldoutharness import write_before_after

    from evals.heldout import heldout_section
    from services.plot import curve_panels
    from services.receipt import Receipt

    run = write_before_after(tmp_path / "binary", [i < 16 for i in range(40)], [i < 24 for i in range(40)])
    for step in range(1, 5):  # voice-leading's binary reward: reward mean == pass rate every step
        run.append_metrics(step, {"reward_mean": step / 8, "pass_rate": step / 8, "ppl_ratio": 1.0})
        run.append_timing(step, 1.0, {"gen": 0.5})
    records = run.metrics()
    assert [title for _, title in curve_panels(records)] == ["reward mean = pass rate", "ppl_ratio (train / rollout)"]

    # No held-out eval: two panels (800 px wide), no empty held-out panel.
    assert matplotlib.image.imread(plot_run(run.root)).shape[:2] == (350, 800)

    receipt = Receipt(run.receipt_path, kind="train", run_name="binary")
    receipt.start(config={"seed": 7}, seeds={"seed": 7})
    receipt.update(heldout=heldout_section(run.heldout_path("before"), run.heldout_path("after"), seed=7, argv=[]))
    image = matplotlib.image.imread(plot_run(run.root))
    assert image.shape[:2] == (350, 1200)  # + the held-out panel
    rgb = image[..., :3]
    red = (rgb[..., 0] > 0.7) & (rgb[..., 1] < 0.3) & (rgb[..., 2] < 0.3)  # tab:red interval bar
    blue = (rgb[..., 2] > 0.6) & (rgb[..., 0] < 0.3)  # tab:blue "after" bar
    assert red[:, 800:].sum() > 50 and red[:, :800].sum() == 0
    assert blue[:, 800:].sum() > 1000


def test_reward_that_differs_from_pass_rate_keeps_both_panels(tmp_path: Path) -> None:
    from services.plot import curve_panels

    run = make_run(tmp_path)
    assert [key for key, _ in curve_panels(run.metrics())] == ["reward_mean", "pass_rate", "ppl_ratio"]
