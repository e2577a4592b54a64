"""`counterpoint grader ...`: serve the grader over gRPC, score JSONL, regenerate the pools.

Defaults come from `config.grader.GraderConfig` (options left unset take its values).
Heavy imports (grpc, ray, the verifier) stay inside the commands so that --help is instant.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from graders.voice_leading import progressions  # light: the generator's defaults

app = typer.Typer(no_args_is_help=True, help="Verifiers: serve over gRPC, score JSONL.", rich_markup_mode=None)

TaskOpt = Annotated[Optional[str], typer.Option(help="Verifier task: voice-leading | code-exec (graders/tasks.py).")]
VoicesOpt = Annotated[Optional[int], typer.Option(help="Voices per chord (2-4).")]
StyleOpt = Annotated[
    Optional[str], typer.Option(help="common-practice | lead-sheet | film-ambient.")
]
CheckerOpt = Annotated[Optional[str], typer.Option(help="reference | strict.")]
SetOpt = Annotated[
    Optional[list[str]],
    typer.Option("--set", help="A grader setting as dotted KEY=VALUE (repeatable; GraderConfig "
                 "fields), e.g. code_exec.max_concurrent=4, code_exec.tasks_dir=/abs/dir."),
]


def _config(sets: list[str] | None = None, **given):
    """A GraderConfig from the options that were given plus ``--set`` overrides (applied last);
    exits 2 naming a bad value."""
    from pydantic import ValidationError

    from config.grader import GraderConfig
    from config.run import ConfigError, apply_override

    tree = {k: v for k, v in given.items() if v is not None}
    try:
        for assignment in sets or ():
            apply_override(tree, assignment)
        return GraderConfig(**tree)
    except ConfigError as exc:
        typer.echo(f"error: --set: {exc}", err=True)
        raise typer.Exit(2) from None
    except ValidationError as exc:
        typer.echo(f"error: invalid grader options: {exc}", err=True)
        raise typer.Exit(2) from None


@app.command()
def serve(
    task: TaskOpt = None,
    host: Annotated[Optional[str], typer.Option(help="Bind address.")] = None,
    port: Annotated[Optional[int], typer.Option(help="gRPC port (0 = a free one).")] = None,
    fixture: Annotated[
        Optional[Path], typer.Option(help="p4-progressions/1 train pool (default: shipped).")
    ] = None,
    heldout_fixture: Annotated[
        Optional[Path], typer.Option(help="p4-progressions/1 held-out pool (default: shipped).")
    ] = None,
    require_pool: Annotated[
        Optional[int], typer.Option(help="Refuse to start if the train pool is smaller.")
    ] = None,
    voices: VoicesOpt = None,
    style: StyleOpt = None,
    checker: CheckerOpt = None,
    bars: Annotated[
        Optional[int], typer.Option(help="Cut every progression to its first N chords.")
    ] = None,
    metrics_port: Annotated[
        Optional[int], typer.Option(help="Expose Prometheus /metrics on 127.0.0.1:PORT (plain server: "
                                    "its scores; --ray: the replica count and scale events).")
    ] = None,
    ray: Annotated[bool, typer.Option("--ray", help="Run as a Ray Serve app.")] = False,
    replicas: Annotated[Optional[int], typer.Option(help="Serve replicas (with --ray).")] = None,
    app_name: Annotated[
        Optional[str], typer.Option(help="Serve application name (with --ray).")
    ] = None,
    ingress: Annotated[
        Optional[str],
        typer.Option(help="With --ray: front (grpcio on --host, default) | proxy (Serve's, [::])."),
    ] = None,
    max_message_bytes: Annotated[
        Optional[int], typer.Option(help="Largest request accepted (bytes).")
    ] = None,
    token_env: Annotated[
        Optional[str], typer.Option(help="Require the shared token held by this env variable.")
    ] = None,
    token_file: Annotated[
        Optional[Path], typer.Option(help="Require the shared token held by this file.")
    ] = None,
    sets: SetOpt = None,
) -> None:
    """Serve the grader over gRPC (plain grpcio server, or --ray for a Ray Serve app)."""
    import signal
    import threading

    from graders.auth import TokenError, resolve_token
    from graders.voice_leading.pool import FixtureError, PoolTooSmall
    from graders.tasks import make_task
    from graders.ports import port_taken

    cfg = _config(
        # Absolute: with --ray the pool is loaded by Serve replicas in other directories.
        task=task, host=host, port=port, fixture=str(fixture.resolve()) if fixture else None,
        heldout_fixture=str(heldout_fixture.resolve()) if heldout_fixture else None,
        require_pool=require_pool, voices=voices, style=style, checker=checker, bars=bars,
        replicas=replicas, app_name=app_name, metrics_port=metrics_port, serve_ingress=ingress,
        max_message_bytes=max_message_bytes, token_env=token_env,
        token_file=str(token_file.resolve()) if token_file else None, sets=sets,
    )
    try:
        task_ = make_task(cfg)  # the pool loads (and --require-pool holds) before anything starts
        token = resolve_token(cfg.token_env, cfg.token_file)
    except (FixtureError, PoolTooSmall, TokenError, ValueError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    # Before anything starts (Ray above all): a second server on a held port would share it.
    proxy = ray and cfg.serve_ingress == "proxy"
    if cfg.port and port_taken("::" if proxy else cfg.host, cfg.port):
        where = f"[::]:{cfg.port} (Serve's gRPC proxy binds every interface)" if proxy else (
            f"{cfg.host}:{cfg.port}")
        typer.echo(f"error: --port {cfg.port}: {where} is in use (another grader?); "
                   "pick another, or 0 for a free one", err=True)
        raise typer.Exit(2)
    if cfg.metrics_port is not None:
        from graders.metrics import start_metrics_server

        bound = start_metrics_server(cfg.metrics_port)
        typer.echo(f"metrics on http://127.0.0.1:{bound}/metrics")
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    if ray:
        _serve_ray(cfg, stop)
        return
    from graders.native_log import route_native_stderr
    from graders.service import GraderCore, start_server

    route_native_stderr(cfg.native_log_lines_per_s)

    core = GraderCore(task_)
    try:
        server = start_server(core, cfg.host, cfg.port, max_message_bytes=cfg.max_message_bytes,
                              token=token)
    except OSError as exc:  # PortInUse: taken between the check above and now
        typer.echo(f"error: --port {cfg.port}: {exc}", err=True)
        raise typer.Exit(2) from None
    typer.echo(
        f"grader {cfg.task} serving on {server.address} "
        f"({_describe(core.health_record())})",
    )
    sys.stdout.flush()
    try:
        while not stop.wait(0.5):  # a timed wait: the SIGTERM handler always gets to run
            pass
    except KeyboardInterrupt:
        pass
    server.stop(grace=2)


def _describe(health) -> str:
    """One line on what is served: the pool, and the task's settings."""
    settings = (f", voices {health.voices}, {health.style}, {health.checker}" if health.voices
                else "".join(f", {k} {v}" for k, v in sorted(health.details.items())))
    return f"pool {health.pool_size} {health.pool_source}{settings}"


def _serve_ray(cfg, stop) -> None:
    import signal

    import ray
    from ray import serve

    from graders import serve_app

    from config.runtime_env import apply_defaults

    from graders.ports import free_port
    from graders.service import PortInUse

    if cfg.port == 0 and cfg.serve_ingress == "proxy":  # Serve's proxy cannot report a port it
        cfg = cfg.model_copy(update={"port": free_port()})  # picked: choose one here (the front binds 0)
    if not ray.is_initialized():
        from config.runtime_env import bind_local_cluster_to_loopback

        bind_local_cluster_to_loopback(ray)
        ray.init(include_dashboard=False, runtime_env={"env_vars": apply_defaults()})
        # ray.init replaces the SIGTERM handler with sys.exit(15): stop Serve cleanly instead.
        signal.signal(signal.SIGTERM, lambda *_: stop.set())
    if cfg.serve_ingress == "front":  # the front's grpc-core runs here; after ray.init, whose
        from graders.native_log import route_native_stderr  # processes keep the real stderr

        route_native_stderr(cfg.native_log_lines_per_s)
    try:  # Serve's HTTP proxy (proxy ingress only) gets a free port, never a taken 8000
        serve_app.start(cfg, grpc_port=cfg.port, http_port=free_port())
    except PortInUse as exc:  # taken while Ray started
        typer.echo(f"error: --port {cfg.port}: {exc}", err=True)
        serve.shutdown()
        raise typer.Exit(2) from None
    if cfg.serve_ingress == "front":  # the port the front bound (port 0: the one it found)
        cfg = cfg.model_copy(update={"port": serve_app.front_port(cfg.app_name)})
    watch = None
    if cfg.metrics_port is not None:  # replicas export their own series through Ray's agent
        from prometheus_client import REGISTRY

        from graders.autoscale import watch_app

        watch = watch_app(cfg)
        REGISTRY.register(watch.collector())
    where = (f"{cfg.host}:{cfg.port}" if cfg.serve_ingress == "front"
             else f"Ray Serve gRPC proxy [::]:{cfg.port}")
    typer.echo(
        f"grader {cfg.task} serving on {where} "
        f"(application {cfg.app_name!r}, {cfg.replicas} replica(s))"
    )
    sys.stdout.flush()
    try:
        while not stop.wait(0.5):
            pass
    except KeyboardInterrupt:
        pass
    if watch is not None:
        watch.stop()
    serve_app.stop_front(cfg.app_name)
    serve.shutdown()


def _score_line(text: str, voices: int, style: str, checker: str) -> dict:
    from graders.voice_leading import score

    row = json.loads(text)
    if not isinstance(row, dict):
        raise ValueError("each line must be a JSON object")
    if "progression" not in row:
        raise ValueError("missing 'progression'")
    completion = row.get("completion")
    if not isinstance(completion, str):
        raise ValueError("'completion' must be a string")
    result = score(
        row["progression"], completion, row.get("voices", voices), row.get("style", style), checker
    )
    return {
        "reward": result.reward,
        "format_ok": result.format_ok,
        "admitted": result.admitted,
        "verdict": result.verdict,
        "failing_rules": list(result.failing_rules),
        "sounding_frames": result.sounding_frames,
        "expected_frames": result.expected_frames,
    }


def _code_exec_rows(lines: list[str], cfg) -> list[dict]:
    """`grader score --task code-exec`: the rows of JSONL input, scored concurrently within
    code_exec.max_concurrent, in input order. A malformed line or unknown task id yields
    {"line": k, "error": "..."}."""
    from graders.code_exec.service import code_exec_task, score_row

    task_ = code_exec_task(cfg)
    tasks = task_.verifier.tasks
    rows: list[dict | None] = []
    pairs, where = [], []
    for k, text in lines:
        try:
            row = json.loads(text)
            if not isinstance(row, dict):
                raise ValueError("each line must be a JSON object")
            if not isinstance(row.get("completion"), str):
                raise ValueError("'completion' must be a string")
            if row.get("task_id") not in tasks:
                raise ValueError(f"unknown task_id {row.get('task_id')!r}; one of {', '.join(sorted(tasks))}")
        except (ValueError, KeyError) as exc:  # JSONDecodeError is a ValueError
            rows.append({"line": k, "error": f"{type(exc).__name__}: {exc}"})
            continue
        where.append(len(rows))
        rows.append(None)
        pairs.append((row["task_id"], row["completion"]))
    for i, result in zip(where, task_.verifier.score_many(pairs, score=task_.score_one), strict=True):
        rows[i] = score_row(result)
    return rows  # type: ignore[return-value]


@app.command("list")
def list_(task: TaskOpt = None, sets: SetOpt = None) -> None:
    """One JSON line per case of the task: for code-exec, each task ({"id", "metric",
    "direction", ...}); otherwise each train case's id and split."""
    cfg = _config(task=task, sets=sets)
    try:
        if cfg.task == "code-exec":
            from graders.code_exec.service import list_tasks

            rows = list_tasks(cfg)
        else:
            from graders.tasks import make_task

            rows = [{"id": c.id, "split": c.split, "task": c.task} for c in make_task(cfg).cases(0, "train")]
    except ValueError as exc:  # TaskError, FixtureError, an unknown task
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    for row in rows:
        sys.stdout.write(json.dumps(row, ensure_ascii=False) + "\n")
    sys.stdout.flush()


@app.command()
def score(
    task: TaskOpt = None,
    voices: VoicesOpt = None,
    style: StyleOpt = None,
    checker: CheckerOpt = None,
    sets: SetOpt = None,
) -> None:
    """Score JSONL from stdin; one JSON line out per input line, in order.

    voice-leading lines: {"progression": {key, chords}, "completion": "...", optional "voices",
    optional "style"}. code-exec lines: {"task_id": "...", "completion": "..."} (the script is
    extracted from the completion); out: status, reward, test_metric, val_metric, oriented,
    exec_time, term_tail, exc_type, message, isolation, limits. A malformed line yields
    {"line": k, "error": "..."}; the rest go on.
    """
    cfg = _config(task=task, voices=voices, style=style, checker=checker, sets=sets)
    out = sys.stdout
    if cfg.task == "code-exec":
        lines = [(k, text) for k, text in enumerate(sys.stdin, start=1) if text.strip()]
        try:
            rows = _code_exec_rows(lines, cfg)
        except ValueError as exc:  # IsolationRefused, TaskError
            typer.echo(f"error: {exc}", err=True)
            raise typer.Exit(2) from None
        for row in rows:
            out.write(json.dumps(row, ensure_ascii=False) + "\n")
        out.flush()
        return
    for k, text in enumerate(sys.stdin, start=1):
        if not text.strip():
            continue
        try:
            row = _score_line(text, cfg.voices, cfg.style, cfg.checker)
        except (ValueError, TypeError, KeyError) as exc:  # JSONDecodeError is a ValueError
            row = {"line": k, "error": f"{type(exc).__name__}: {exc}"}
        out.write(json.dumps(row, ensure_ascii=False) + "\n")
    out.flush()


@app.command("make-fixtures")
def make_fixtures(
    seed: Annotated[int, typer.Option(help="Generator seed.")] = progressions.DEFAULT_SEED,
    out: Annotated[Path, typer.Option(help="Output directory.")] = progressions.DATA_DIR,
    bars: Annotated[int, typer.Option(help="Bars per progression.")] = progressions.DEFAULT_BARS,
    train: Annotated[int, typer.Option(help="Train pool size.")] = (
        progressions.DEFAULT_SIZES["train"]
    ),
    heldout: Annotated[int, typer.Option(help="Held-out pool size.")] = (
        progressions.DEFAULT_SIZES["heldout"]
    ),
) -> None:
    """(Re)generate the default pools (train.json, heldout.json) deterministically."""
    try:
        paths = progressions.write_pools(out, seed, bars, {"train": train, "heldout": heldout})
    except ValueError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    for path in paths:
        typer.echo(f"wrote {path}")
