"""File-based evaluation commands: `counterpoint prior-shape` and `counterpoint compare`.

Plain typer command functions; services/commands.py registers them on the root app. ``eval_app``
registers the same functions for standalone use (``python -m evals.cli``) and tests.
numpy, pydantic and matplotlib are imported when a command runs, so `--help` stays instant.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

if TYPE_CHECKING:
    from evals.eval_file import EvalFile, EvalSummary

EVAL_FILE_HELP = "An EVAL.jsonl written by `counterpoint eval`."


def _consoles() -> tuple[Console, Console]:
    # made per call, not at import: width and colour follow the environment of the invocation
    return Console(), Console(stderr=True)


def _fmt(x: float | int | None, digits: int = 3) -> str:
    if x is None:
        return "–"
    if isinstance(x, float) and math.isnan(x):
        return "nan"
    if isinstance(x, int):
        return str(x)
    return f"{x:.{digits}f}"


def _read(path: Path) -> EvalFile:
    from evals.eval_file import EvalFileError, read_eval

    try:
        return read_eval(path)
    except EvalFileError as e:
        raise _fail(str(e)) from None


def _fail(message: str) -> typer.Exit:
    _, err_console = _consoles()
    err_console.print(f"[bold red]error:[/] {escape(message)}", highlight=False, soft_wrap=True)
    return typer.Exit(code=1)


def eval_summary_table(summary: EvalSummary, title: str = "held-out evaluation") -> Table:
    """The table `counterpoint eval` prints (shares in percent)."""
    table = Table(title=title)
    for col in ("items", "completions", "pass rate", "coverage", "unparseable", "mean length"):
        table.add_column(col, justify="right")
    table.add_row(
        str(summary.n_items),
        str(summary.n_completions),
        f"{_fmt(summary.pass_rate * 100, 2)} %",
        f"{_fmt(summary.coverage * 100, 2)} %",
        f"{_fmt(summary.unparseable_share * 100, 2)} %",
        _fmt(summary.mean_length, 1),
    )
    return table


def eval_summary_command(
    eval_file: Annotated[Path, typer.Argument(metavar="EVAL_JSONL", help=EVAL_FILE_HELP)],
) -> None:
    """Print pass rate, coverage, unparseable share and mean length of an EVAL.jsonl."""
    from evals.eval_file import summarize

    console, _ = _consoles()
    ev = _read(eval_file)
    console.print(eval_summary_table(summarize(ev.items), title=escape(str(eval_file))))


def prior_shape_command(
    eval_file: Annotated[Path, typer.Argument(metavar="EVAL_JSONL", help=EVAL_FILE_HELP)],
    out_json: Annotated[
        Path | None, typer.Option("--out-json", help="Default: <eval>.prior_shape.json")
    ] = None,
    out_png: Annotated[
        Path | None, typer.Option("--out-png", help="Default: <eval>.prior_shape.png")
    ] = None,
) -> None:
    """Prior shape per item (support, modal share, ...) and its distribution across items."""
    from evals.prior_shape import prior_shape, write_prior_shape_json, write_prior_shape_png

    console, err_console = _consoles()
    shape = prior_shape(_read(eval_file))
    out_json = out_json or eval_file.with_suffix(".prior_shape.json")
    out_png = out_png or eval_file.with_suffix(".prior_shape.png")
    write_prior_shape_json(shape, out_json)
    write_prior_shape_png(shape, out_png)

    table = Table(
        title=f"prior shape: {shape.n_items} items × G={shape.generations}, "
        f"alphabet {shape.alphabet_size} (N={shape.voices})"
    )
    for col in ("statistic", "items", "mean", "median", "min", "max"):
        table.add_column(col, justify="left" if col == "statistic" else "right")
    for name, d in shape.stats.items():
        table.add_row(name, str(d.n), _fmt(d.mean), _fmt(d.median), _fmt(d.min), _fmt(d.max))
    table.add_row(
        "modal_share (reference mean)", str(shape.n_items),
        _fmt(shape.modal_share_mean_reference), "", "", "",
    )
    console.print(table)
    pooled = Table(title="pooled over all items")
    pooled.add_column("statistic")
    pooled.add_column("value", justify="right")
    for name, value in shape.pooled.items():
        pooled.add_row(name, _fmt(value))
    console.print(pooled)
    if shape.prefix_mode == "forced_opening":
        err_console.print(
            "[yellow]warning:[/] this eval forced the openings (prefix_mode=forced_opening): "
            "the opening statistics describe the prefixes, not the model's prior",
            highlight=False, soft_wrap=True,
        )
    if math.isnan(shape.modal_share_mean_reference):
        console.print(
            "note: the reference modal-share mean is NaN because some item has no parseable "
            "completion; modal_share_parseable_items is the NaN-free variant."
        )
    console.print(f"wrote {out_json} and {out_png}", markup=False, highlight=False, soft_wrap=True)


def compare_command(
    base: Annotated[
        Path, typer.Argument(metavar="BASE_EVAL", help="The base EVAL.jsonl (one run).")
    ],
    arms: Annotated[
        list[Path], typer.Argument(metavar="ARM_EVAL", help="Arm EVAL.jsonl files, one per run.")
    ],
    paired: Annotated[
        bool, typer.Option("--paired", help="Share each item resample between base and arm.")
    ] = False,
    seed: Annotated[int, typer.Option("--seed", help="Bootstrap seed.")] = 0,
    n_boot: Annotated[int, typer.Option("--n-boot", min=1, help="Bootstrap replicates.")] = 2000,
    out_png: Annotated[
        Path | None,
        typer.Option("--out-png", help="Default: compare_<base>_vs_<arm>.png by the first arm."),
    ] = None,
    out_json: Annotated[Path | None, typer.Option("--out-json", help="Also write JSON.")] = None,
) -> None:
    """Held-out pass-rate and coverage difference, arm minus base, with a 95% bootstrap interval."""
    from evals.compare import (
        NotComparableError,
        compare,
        write_comparison_json,
        write_comparison_png,
    )

    console, err_console = _consoles()
    base_eval, arm_evals = _read(base), [_read(a) for a in arms]
    try:
        result = compare([base_eval], arm_evals, paired=paired, n_boot=n_boot, seed=seed)
    except NotComparableError as e:
        raise _fail(str(e)) from None

    table = Table(title=f"arm ({len(arms)} run(s)) vs base, {result.n_items} items")
    for col in ("metric", "base", "arm runs", "arm mean", "Δ points", "95% interval"):
        # only the per-run list may wrap; numbers are never cut
        table.add_column(
            col, justify="left" if col == "metric" else "right", no_wrap=col != "arm runs"
        )
    for m in result.metrics.values():
        table.add_row(
            m.metric,
            " ".join(f"{x:.2f}" for x in m.base_runs),
            " ".join(f"{x:.2f}" for x in m.arm_runs),
            f"{m.arm_mean:.2f}",
            f"{m.difference:+.2f}",
            f"[{m.low:+.2f}, {m.high:+.2f}]",
        )
    console.print(table)
    for m in result.metrics.values():
        console.print(f"{m.metric}: {m.sentence()}", markup=False, highlight=False, soft_wrap=True)
    console.print(f"method: {result.method}", markup=False, highlight=False, soft_wrap=True)
    for w in result.warnings:
        err_console.print(f"[yellow]warning:[/] {escape(w)}", highlight=False, soft_wrap=True)
    out_png = out_png or arms[0].parent / f"compare_{base.stem}_vs_{arms[0].stem}.png"
    write_comparison_png(result, out_png)
    written = [str(out_png)]
    if out_json is not None:
        write_comparison_json(result, out_json)
        written.append(str(out_json))
    console.print(f"wrote {' and '.join(written)}", markup=False, highlight=False, soft_wrap=True)


eval_app = typer.Typer(
    add_completion=False, no_args_is_help=True, pretty_exceptions_show_locals=False
)
eval_app.command("prior-shape")(prior_shape_command)
eval_app.command("compare")(compare_command)
eval_app.command("eval-summary")(eval_summary_command)

if __name__ == "__main__":
    eval_app()
