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

from evals.cli import compare_command, eval_summary_command, prior_shape_command
from services.plot import plot_command



def _setup_logging() -> None:
    """Log lines of the command itself (before a run's logs exist: services/console.py)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")


def _train_logged(opts, verbose: bool):
    """Run train(opts) with the console of services/console.py: people see stages, steps, the
    table and the run directory; Ray/Serve/vLLM/Train output goes to runs/<run>/logs/. A failure
    shows its first lines and the log paths, then exits 1."""
    import traceback

    from services.console import failure_lines, run_logs
    from services.receipt import as_terminated, install_sigterm_handler
    from services.train import train

    logs_dir = opts.run_dir / "logs"
    # SIGTERM (a scheduler, `kill`, KubeRay) is an interruption like Ctrl-C: from here on it raises
    # Terminated (train() installs it again after ray.init, which may set its own), so the
    # receipt says "interrupted" and the console says how to resume, instead of exit 143 in silence.
    install_sigterm_handler()
    with run_logs(logs_dir, verbose) as logs:
        logs.echo(f"run directory: {opts.run_dir}  (logs: {logs_dir}{'' if verbose else '; --verbose shows them'})")
        try:
            run = train(opts)
        except (KeyboardInterrupt, SystemExit) as err:
            term = as_terminated(err)  # Ray may have re-raised our SIGTERM as its own SystemExit(1)
            if term is None and isinstance(err, SystemExit):
                raise
            logs.to_file(traceback.format_exc())
            how = "terminated (SIGTERM)" if term is not None else "interrupted"
            logs.echo(f"{how}; resume with: counterpoint train --resume {opts.run_dir}")
            raise typer.Exit(term.code if term is not None else 130) from None
        except Exception as err:
            logs.to_file(traceback.format_exc())
            for line in failure_lines(err, logs_dir):
                logs.echo(line)
            raise typer.Exit(1) from None
        logs.echo(f"run directory: {run.root}")
    return run


def _say_run_state(run_dir: Path) -> None:
    """A run read while it is still training, or one that died without recording its end."""
    from services.receipt import liveness

    receipt = run_dir / "run.json"
    if not receipt.is_file():
        return
    data = json.loads(receipt.read_text())
    state = liveness(data)
    if state == "alive":
        typer.echo(f"note: run {run_dir} is still training (pid {data.get('pid')}); its last saved adapter is used",
                   err=True)
    elif state == "dead":
        typer.echo(f"note: run {run_dir} died without recording its end (pid {data.get('pid')} is gone); "
                   f"resume it with: counterpoint train --resume {run_dir}", err=True)


def train_command(
    config: Optional[Path] = typer.Option(None, "--config", "-c", help="YAML config (configs/*.yaml). With "
                                          "--resume: checked against the run's recorded config."),
    set_: list[str] = typer.Option([], "--set", help="Dotted override, e.g. --set learner.lr=1e-4 (repeatable)."),
    resume: Optional[Path] = typer.Option(None, "--resume", help="Continue the run in this run directory (with "
                                          "its recorded config; only trainer.steps and where the driver "
                                          "connects or listens may change)."),
    metrics_port: Optional[int] = typer.Option(None, "--metrics-port", help="Port of /metrics (default 9464)."),
    run_name: Optional[str] = typer.Option(None, "--run-name", help="runs/<NAME> (default: timestamped)."),
    address: Optional[str] = typer.Option(None, "--address", help="Join this Ray cluster instead of starting one."),
    init_adapter: Optional[Path] = typer.Option(
        None, "--init-adapter", help="Start from this saved LoRA adapter dir whatever the seed."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the resolved config and the receipt, then exit."),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Print Ray, Serve, vLLM and Train output too "
                                 "(it always goes to runs/<run>/logs/)."),
) -> None:
    """Train a LoRA adapter with GRPO against the grader (the step loop of DESIGN.md)."""
    from config import ConfigError, load_config
    from services.train import TrainOptions, new_run_dir, resume_config

    _setup_logging()
    overrides = list(set_)
    if metrics_port is not None:
        overrides.append(f"trainer.metrics_port={metrics_port}")
    if run_name is not None:
        overrides.append(f"run_name={run_name}")
    if address is not None:
        overrides.append(f"trainer.ray_address={address}")
    from services import runlock
    from services.preflight import PreflightError, apply_memory_budget, check_adapter_dir, preflight
    from services.train import RunInUse

    try:
        if resume is not None:
            run_dir = resume.resolve()
            if not dry_run:
                runlock.probe(run_dir)
            cfg, resume_changes = resume_config(run_dir, overrides, config)
        else:
            if config is None:
                raise typer.BadParameter("give --config (or --resume RUN_DIR)")
            cfg, resume_changes = load_config(config, overrides), None
            run_dir = new_run_dir(cfg, check_lock=not dry_run)
        # gpu_memory_gib -> rollout.gpu_memory_gib and learner.memory_budget_gib (dry runs too)
        cfg, memory_split = apply_memory_budget(cfg)
        if init_adapter is not None:
            init_adapter = init_adapter.resolve()
            check_adapter_dir(init_adapter, "--init-adapter")
        if not dry_run:
            preflight(cfg)
            # The one live driver of run_dir from here to the process's end: taken before Ray or
            # any service starts, and after the checks above so a refused input leaves no directory.
            lock = runlock.acquire(run_dir)
            if resume is None and (run_dir / "run.json").exists():  # a twin that ran and ended meanwhile
                lock.release()
                raise FileExistsError(f"run directory {run_dir} already holds a run; use --resume {run_dir} "
                                      "or another --run-name")
    except (ConfigError, FileNotFoundError, FileExistsError, PreflightError, RunInUse) as err:
        typer.echo(f"error: {err}", err=True)
        raise typer.Exit(2) from None
    if dry_run:
        from config import resolved
        from services.receipt import dry_run_preview

        shown = {"run_dir": str(run_dir), "config": resolved(cfg), "receipt": dry_run_preview(cfg)}
        if memory_split is not None:
            shown["memory_split"] = memory_split.as_dict()
        if resume_changes is not None:
            shown["resume_changes"] = resume_changes
        typer.echo(json.dumps(shown, indent=2, default=str))
        return
    try:
        _train_logged(TrainOptions(cfg, run_dir, resume=resume is not None, init_adapter=init_adapter,
                                   resume_changes=resume_changes), verbose)
    finally:
        lock.release()


def eval_command(
    config: Path = typer.Option(..., "--config", "-c", help="YAML config (model, grader, rollout, eval sections)."),
    set_: list[str] = typer.Option([], "--set", help="Dotted config override (repeatable)."),
    adapter: Optional[Path] = typer.Option(None, "--adapter", help="A peft adapter dir; none = the base model."),
    run: Optional[Path] = typer.Option(None, "--run", help="A run directory: evaluate its last adapter."),
    split: Optional[str] = typer.Option(None, "--split", help="Grader split: heldout or train [eval.split]."),
    generations: Optional[int] = typer.Option(None, "--generations", "-g", min=1,
                                              help="Completions per prompt (G) [eval.generations]."),
    max_new_tokens: Optional[int] = typer.Option(None, "--max-new-tokens", min=1,
                                                 help="Completion token limit [eval.max_tokens, else rollout's]."),
    temperature: Optional[float] = typer.Option(None, "--temperature",
                                                help="Sampling temperature [eval.temperature, else rollout's]."),
    top_p: Optional[float] = typer.Option(None, "--top-p", help="Nucleus mass [eval.top_p, else rollout's]."),
    top_k: Optional[int] = typer.Option(None, "--top-k", help="Top-k, -1 = off [eval.top_k, else rollout's]."),
    seed: Optional[int] = typer.Option(None, "--seed", help="Sampling seed [eval.seed]."),
    limit: Optional[int] = typer.Option(None, "--limit", min=1, help="Only the first N prompts [eval.limit]."),
    eos_token_ids: Optional[str] = typer.Option(None, "--eos-token-ids", help="Extra stop ids, comma-separated."),
    out: Path = typer.Option(..., "--out", "-o", help="EVAL.jsonl to write."),
) -> None:
    """Held-out evaluation: pass rate, coverage, unparseable share, mean length (EVAL.jsonl).
    Sampling settings come from the config's eval section (unset ones from its rollout section);
    options given here override them, and the receipt says where each value came from."""
    from rich.console import Console

    from evals.cli import eval_summary_table
    from config import ConfigError, load_config
    from services.eval_run import EvalOptions, last_adapter_of, run_eval
    from services.preflight import check_adapter_dir, preflight

    _setup_logging()
    if adapter is not None and run is not None:
        typer.echo("error: give --adapter or --run, not both", err=True)
        raise typer.Exit(2)
    given = {"split": split, "generations": generations, "max_tokens": max_new_tokens, "temperature": temperature,
             "top_p": top_p, "top_k": top_k, "seed": seed, "limit": limit}
    from_cli = frozenset(k for k, v in given.items() if v is not None)
    try:
        cfg = load_config(config, [*set_, *(f"eval.{k}={given[k]}" for k in sorted(from_cli))])
        eos = [int(t) for t in eos_token_ids.split(",") if t.strip()] if eos_token_ids else None
        adapter, run, out = (p.resolve() if p is not None else None for p in (adapter, run, out))
        if run is not None:
            check_adapter_dir(last_adapter_of(run), "--run")
            _say_run_state(run)
        if adapter is not None:
            check_adapter_dir(adapter, "--adapter")
        preflight(cfg, ports=False)
    except (ConfigError, ValueError, FileNotFoundError) as err:
        typer.echo(f"error: {err}", err=True)
        raise typer.Exit(2) from None
    summary, path = run_eval(EvalOptions(cfg, out, adapter, run, eos, from_cli))
    Console().print(eval_summary_table(summary, title=f"{cfg.eval.split} evaluation ({path})"))


def replicate_command(
    config: Path = typer.Option(..., "--config", "-c", help="YAML config every arm trains with."),
    seeds: str = typer.Option(..., "--seeds", help="Comma-separated seeds, one arm each, e.g. 7,8,9."),
    out: Path = typer.Option(Path("runs/replicate"), "--out", help="Directory for the arms' runs, evals, logs."),
    set_: list[str] = typer.Option([], "--set", help="Dotted override applied to every arm (repeatable)."),
    pin_init: bool = typer.Option(False, "--pin-init", help="All arms share the first arm's saved init adapter."),
    address: Optional[str] = typer.Option(None, "--address", help="Ray cluster every arm joins."),
    parallel: int = typer.Option(1, "--parallel", min=1, help="Arms at a time (use >1 only on a cluster)."),
    generations: Optional[int] = typer.Option(None, "--generations", "-g", min=1,
                                              help="Eval completions per held-out prompt [eval.generations]."),
    max_new_tokens: Optional[int] = typer.Option(None, "--max-new-tokens", min=1,
                                                 help="Eval completion token limit [eval.max_tokens, else rollout's]."),
    grid: list[str] = typer.Option([], "--grid", help="KEY=v1,v2: one grid axis over a config key (repeatable); "
                                   "every cell of the cartesian product is run for every seed and aggregated "
                                   "(grid.json, grid.png)."),
    last_k: Optional[int] = typer.Option(None, "--last-k", min=1, help="With --grid: tree figures averaged over "
                                         "the last K rounds (default: evals.grid.LAST_K)."),
) -> None:
    """Train N runs that differ only in seed, each evaluated on the same held-out prompts before
    and after training (inside the run); with --grid, every cell of a grid over config keys, each
    cell's figures across seeds."""
    from rich.console import Console

    from config import ConfigError, load_config, resolved
    from services.receipt import Receipt
    from services.replicate import ReplicatePlan, arms_table, as_records, check_grid, grid_report, replicate

    try:
        seed_list = [int(s) for s in seeds.split(",") if s.strip()]
        cfg = load_config(config, set_)
    except (ValueError, ConfigError) as err:
        typer.echo(f"error: {err}", err=True)
        raise typer.Exit(2) from None
    if len(seed_list) < 1 or len(set(seed_list)) != len(seed_list):
        typer.echo(f"error: --seeds must list distinct seeds, got {seeds!r}", err=True)
        raise typer.Exit(2)
    eval_sets = [*([f"eval.generations={generations}"] if generations else []),
                 *([f"eval.max_tokens={max_new_tokens}"] if max_new_tokens else [])]
    try:  # every cell's config, for every seed, as its arms will run it, before anything runs
        cells, modes = check_grid(config, set_, grid, seed_list, eval_sets)
    except (ValueError, ConfigError) as err:
        typer.echo(f"error: {err}", err=True)
        raise typer.Exit(2) from None
    out.mkdir(parents=True, exist_ok=True)
    receipt = Receipt(out / "replicate.json", kind="replicate", run_name=out.name)
    receipt.start(config=resolved(cfg), seeds={"seeds": seed_list},
                  notes={"pin_init": pin_init, "parallel": parallel, "overrides": set_, "eval": eval_sets,
                         **({"grid": {"options": grid, "cells": [
                             {"cell": c.name, "overrides": list(c.overrides), "rollout_mode": modes[c.name]}
                             for c in cells]}} if grid else {})})
    with receipt.guard():
        plan = ReplicatePlan(config, seed_list, out, list(set_), pin_init, address, parallel, eval_sets, cells, modes)
        arms = replicate(plan)
        receipt.update(artifacts={"arms": as_records(arms)})
        if grid:
            artifacts = grid_report(out, cells, arms, last_k)
            receipt.update(artifacts={"arms": as_records(arms), **artifacts})
    Console().print(arms_table(arms))
    if grid:
        import sys

        from evals.grid import failed_lines, grid_table, read_grid_json

        report = read_grid_json(out / "grid.json")
        # Piped to a file or a log, the table keeps its rows whole rather than folding at 80 columns.
        Console(width=None if sys.stdout.isatty() else 200).print(grid_table(report))
        for line in failed_lines(report):
            typer.echo(f"note: {line}", err=True)
        typer.echo(f"grid: {out / 'grid.json'}, {out / 'grid.png'}")
    failed = [a.name if a.cell else a.seed for a in arms if a.status != "completed"]
    if failed:
        which = f"arms {', '.join(failed)}" if grid else f"seeds {failed}"
        typer.echo(f"{len(failed)} of {len(arms)} arms failed ({which}); see the table and logs", err=True)
    if failed:
        raise typer.Exit(1)


def probe_options_command(
    config: Path = typer.Option(..., "--config", "-c", help="YAML config (model, grader, rollout)."),
    set_: list[str] = typer.Option([], "--set", help="Dotted config override (repeatable)."),
    split: str = typer.Option("heldout", "--split", help="Grader split."),
    adapter: Optional[Path] = typer.Option(None, "--adapter", help="A peft adapter dir; none = the base model."),
    eval_file: Optional[Path] = typer.Option(None, "--eval", help="An EVAL.jsonl of the same items: compare with "
                                             "the openings single-sample decoding showed."),
    limit: Optional[int] = typer.Option(None, "--limit", min=1, help="Only the first N prompts."),
    max_new_tokens: int = typer.Option(192, "--max-new-tokens", min=1, help="Token limit of the probe answer."),
    seed: int = typer.Option(0, "--seed", help="Sampling seed."),
    out: Optional[Path] = typer.Option(None, "--out", help="Write the per-item options and the summary as JSON."),
) -> None:
    """Ask for five openings with probabilities; how many distinct admissible ones the model knows."""
    from contextlib import ExitStack

    from rich.console import Console
    from rich.table import Table

    from rollout.types import Prompt, SamplingParams
    from config import ConfigError, load_config
    from evals.eval_file import read_eval
    from services.launch import serve_adapter, start_grader, start_ray, start_rollout
    from evals.probe import ProbeItem, summarize
    from graders.tasks import task_profile

    _setup_logging()
    try:
        cfg = load_config(config, set_)
    except ConfigError as err:
        typer.echo(f"error: {err}", err=True)
        raise typer.Exit(2) from None
    task = task_profile(cfg.grader.task)  # the probe's prompt and parsing are the task's
    if not task.has_probe:
        typer.echo(f"error: grader.task {cfg.grader.task!r} has no five-options probe", err=True)
        raise typer.Exit(2)
    with ExitStack() as stack:
        start_ray(cfg, stack)
        grader = start_grader(cfg, stack)
        rollout = start_rollout(cfg, stack)
        version = serve_adapter(rollout, adapter)
        cases = grader.cases(limit=limit or 0, split=split)
        prompts = [Prompt(tuple(task.probe_messages(c))) for c in cases]
        params = SamplingParams.from_rollout(cfg.rollout, max_tokens=max_new_tokens, seed=seed)
        samples = sorted(rollout.generate(prompts, params, version), key=lambda s: s.prompt_index)
    items = [ProbeItem(c.id, task.probe_options(s.text), frozenset(c.openings)) for c, s in zip(cases, samples)]
    decoded = None
    if eval_file is not None:
        decoded = {i.item_id: len({o for o in i.openings if o != "(none)"}) for i in read_eval(eval_file).items}
    summary = summarize(items, decoded)
    table = Table(title=f"five-options probe ({split}, {len(items)} items)")
    table.add_column("per item")
    for col in ("mean", "median", "min", "max"):
        table.add_column(col, justify="right")
    for key in ("probe_distinct_admissible", "decoded_support", "probe_minus_decoded"):
        if key in summary:
            table.add_row(key, *(f"{summary[key][c]:.2f}" for c in ("mean", "median", "min", "max")))
    Console().print(table)
    typer.echo(f"probe answers parsed: {summary['probe_parsed_share']:.1%}")
    if out is not None:
        out.write_text(json.dumps({"summary": summary, "items": [
            {"item_id": i.item_id, "options": [vars(o) for o in i.options], "distinct_admissible": i.distinct_admissible,
             "raw": s.text} for i, s in zip(items, samples)]}, indent=2, default=str))


def register(app: typer.Typer) -> None:
    """Put the top-level commands on the `counterpoint` app (services/cli.py builds it)."""
    app.command("train")(train_command)
    app.command("eval")(eval_command)
    app.command("replicate")(replicate_command)
    app.command("probe-options")(probe_options_command)
    app.command("plot", help="Regenerate a run's reward / pass-rate / ppl_ratio curves (curves.png).")(plot_command)
    app.command("prior-shape")(prior_shape_command)
    app.command("compare")(compare_command)
    app.command("eval-summary")(eval_summary_command)
