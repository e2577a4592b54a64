"""Top-level commands of `counterpoint`: train, plot, eval, prior-shape, compare, ...

Each command parses its options and calls a plain function elsewhere; nothing heavy is
imported until a command runs.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Optional

import typer

from services.cli import app
from services.eval_cli import compare_command, eval_summary_command, prior_shape_command
from services.plot import plot_command

app.command("plot", help="Regenerate a run's reward / pass-rate / ppl_ratio curves (curves.png).")(plot_command)
app.command("prior-shape")(prior_shape_command)
app.command("compare")(compare_command)
app.command("eval-summary")(eval_summary_command)


def _setup_logging() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")


@app.command("train")
def train_command(
    config: Optional[Path] = typer.Option(None, "--config", "-c", help="YAML config (configs/*.yaml)."),
    set_: list[str] = typer.Option([], "--set", help="Dotted override, e.g. --set learner.lr=1e-4 (repeatable)."),
    resume: Optional[Path] = typer.Option(None, "--resume", help="Continue the run in this run directory."),
    metrics_port: Optional[int] = typer.Option(None, "--metrics-port", help="Port of /metrics (default 9464)."),
    run_name: Optional[str] = typer.Option(None, "--run-name", help="runs/<NAME> (default: timestamped)."),
    address: Optional[str] = typer.Option(None, "--address", help="Join this Ray cluster instead of starting one."),
    init_adapter: Optional[Path] = typer.Option(
        None, "--init-adapter", help="Start from this saved LoRA adapter dir whatever the seed."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the resolved config and the receipt, then exit."),
) -> None:
    """Train a LoRA adapter with GRPO against the grader (the step loop of DESIGN.md)."""
    from services.config import ConfigError, load_config
    from services.train import TrainOptions, new_run_dir, resume_config, train

    _setup_logging()
    overrides = list(set_)
    if metrics_port is not None:
        overrides.append(f"trainer.metrics_port={metrics_port}")
    if run_name is not None:
        overrides.append(f"run_name={run_name}")
    if address is not None:
        overrides.append(f"trainer.ray_address={address}")
    try:
        if resume is not None:
            cfg = resume_config(resume, overrides)
            run_dir = resume
        else:
            if config is None:
                raise typer.BadParameter("give --config (or --resume RUN_DIR)")
            cfg = load_config(config, overrides)
            run_dir = new_run_dir(cfg)
    except (ConfigError, FileNotFoundError, FileExistsError) as err:
        typer.echo(f"error: {err}", err=True)
        raise typer.Exit(2) from None
    if init_adapter is not None and not (init_adapter / "adapter_config.json").is_file():
        typer.echo(f"error: --init-adapter {init_adapter} holds no adapter_config.json", err=True)
        raise typer.Exit(2)
    if dry_run:
        from services.config import resolved
        from services.receipt import dry_run_preview

        typer.echo(json.dumps({"run_dir": str(run_dir), "config": resolved(cfg),
                               "receipt": dry_run_preview(cfg)}, indent=2, default=str))
        return
    run = train(TrainOptions(cfg, run_dir, resume=resume is not None, init_adapter=init_adapter))
    typer.echo(f"run directory: {run.root}")
