"""`counterpoint rollout ...`: sample completions, serve replicas. (`rollout logprobs`, which
recomputes them with the learner's code, is services/logprobs.py's: rollout/ does not import
learner/.)

Defaults come from `config.rollout` (ModelConfig, RolloutConfig): options left unset take their
values, or those of `--config FILE` (a run config YAML) when given. Heavy imports (torch, vLLM,
Ray) stay inside the commands so that --help is instant.

    counterpoint rollout generate --model tiny-random --prompts p.jsonl --n 4 --out s.jsonl
    counterpoint rollout logprobs --model tiny-random --in s.jsonl --out scored.jsonl
    counterpoint rollout serve --replicas 2 --metrics-port 9400
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

app = typer.Typer(no_args_is_help=True, help="Generation engines and the Serve deployment.",
                  rich_markup_mode=None)

ModelOpt = Annotated[
    Optional[str],
    typer.Option("--model", help="smollm2-135m-instruct | tiny-random | a local dir | a hub id."),
]
DtypeOpt = Annotated[Optional[str], typer.Option(help="float32 | bfloat16 | float16 (base weights).")]
EngineOpt = Annotated[Optional[str], typer.Option("--engine", help="auto | vllm | hf.")]
AdapterOpt = Annotated[
    Optional[Path], typer.Option(help="A peft LoRA adapter dir, served as adapter version 1.")
]
ConfigOpt = Annotated[Optional[Path], typer.Option("--config", help="Run config YAML for defaults.")]
EosOpt = Annotated[
    Optional[str],
    typer.Option(help="Comma-separated stop token ids replacing the model's eos (end-of-turn stays)."),
]


def fail(message: str) -> None:
    """End the command with exit status 2 and one line saying why (services/logprobs.py too)."""
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(2)


def model_and_rollout_configs(config: Path | None, model: dict, rollout: dict):
    """(ModelConfig, RolloutConfig) from the config file (if any) plus the options given."""
    from pydantic import ValidationError

    from config.rollout import ModelConfig, RolloutConfig

    base_model, base_rollout = {}, {}
    name = model.get("name_or_path")
    if name and Path(name).expanduser().exists():  # a local dir: replicas run in other directories
        model = {**model, "name_or_path": str(Path(name).expanduser().resolve())}
    if config is not None:
        from config import load_config

        try:
            run = load_config(config)
        except Exception as err:  # ConfigError, YAML or file errors: say which file
            fail(f"{config}: {err}")
        base_model, base_rollout = run.model.model_dump(), run.rollout.model_dump()
    try:
        return (
            ModelConfig(**{**base_model, **{k: v for k, v in model.items() if v is not None}}),
            RolloutConfig(**{**base_rollout, **{k: v for k, v in rollout.items() if v is not None}}),
        )
    except ValidationError as err:
        fail(f"invalid options: {err}")


def _eos(value: str | None) -> list[int] | None:
    if value is None:
        return None
    try:
        return [int(v) for v in value.split(",") if v.strip()]
    except ValueError:
        fail(f"--eos-token-ids must be comma-separated integers, got {value!r}")


def numbered_json_lines(path: Path, what: str) -> list[tuple[int, object]]:
    """(line number, value) of each non-empty line of a JSONL input file; a missing file or a
    line that is not JSON ends the command naming it (services/logprobs.py reads with it too)."""
    if not path.is_file():
        fail(f"{what} file {path} does not exist")
    out = []
    for lineno, line in enumerate(path.read_text().splitlines(), 1):
        if line.strip():
            try:
                out.append((lineno, json.loads(line)))
            except json.JSONDecodeError as err:
                fail(f"{path}:{lineno}: not JSON ({err.msg})")
    return out


def read_prompts(path: Path) -> list:
    """Prompts JSONL: one object per line with `messages` ([{role, content}, ...]) and an
    optional `assistant_prefix`."""
    from rollout.types import Prompt

    prompts = []
    for lineno, row in numbered_json_lines(path, "prompts"):
        messages = row.get("messages") if isinstance(row, dict) else None
        if not isinstance(messages, list) or not messages or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages
        ):
            fail(f"{path}:{lineno}: needs 'messages': a non-empty list of {{role, content}} strings")
        prefix = row.get("assistant_prefix", "")
        if not isinstance(prefix, str):
            fail(f"{path}:{lineno}: 'assistant_prefix' must be a string")
        prompts.append(Prompt(messages=tuple(messages), assistant_prefix=prefix))
    if not prompts:
        fail(f"{path} holds no prompts")
    return prompts


def progress_bar():
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    return Progress(
        TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
        disable=not sys.stderr.isatty(), transient=True,
    )


@app.command()
def generate(
    prompts: Annotated[Path, typer.Option("--prompts", help="Prompts JSONL (lines with `messages`).")],
    out: Annotated[Path, typer.Option("--out", help="Samples JSONL to write (one line per sample).")],
    model: ModelOpt = None,
    dtype: DtypeOpt = None,
    engine: EngineOpt = None,
    adapter: AdapterOpt = None,
    n: Annotated[int, typer.Option("--n", min=1, help="Samples per prompt.")] = 1,
    max_tokens: Annotated[Optional[int], typer.Option(help="Max completion tokens.")] = None,
    temperature: Annotated[Optional[float], typer.Option(help="Sampling temperature.")] = None,
    top_p: Annotated[Optional[float], typer.Option(help="Nucleus mass.")] = None,
    top_k: Annotated[Optional[int], typer.Option(help="Top-k (-1 = off).")] = None,
    seed: Annotated[Optional[int], typer.Option(help="Sampling seed (reproducible runs).")] = None,
    eos_token_ids: EosOpt = None,
    max_model_len: Annotated[Optional[int], typer.Option(help="Context length for vLLM.")] = None,
    replicas: Annotated[
        Optional[int], typer.Option(help="Run on a Ray Serve deployment of this many replicas.")
    ] = None,
    batch_size: Annotated[int, typer.Option(min=1, help="Prompts per engine call (in-process).")] = 8,
    config: ConfigOpt = None,
) -> None:
    """Sample N completions per prompt; write text, token ids and sampling log-probs."""
    from model.adapter import BASE_MODEL_VERSION, FIRST_ADAPTER_VERSION
    from rollout.types import SamplingParams

    model_cfg, rollout_cfg = model_and_rollout_configs(
        config,
        {"name_or_path": model, "dtype": dtype, "eos_token_ids": _eos(eos_token_ids)},
        {"engine": engine, "max_tokens": max_tokens, "temperature": temperature, "top_p": top_p,
         "top_k": top_k, "max_model_len": max_model_len, "replicas": replicas},
    )
    prompt_list = read_prompts(prompts)
    payload = None
    if adapter is not None:
        from model.adapter_dir import AdapterError, payload_from_dir

        try:
            payload = payload_from_dir(adapter, version=FIRST_ADAPTER_VERSION)
        except AdapterError as err:
            fail(str(err))
    params = SamplingParams(
        n=n, temperature=rollout_cfg.temperature, top_p=rollout_cfg.top_p, top_k=rollout_cfg.top_k,
        max_tokens=rollout_cfg.max_tokens, seed=seed,
    )
    version = payload.version if payload is not None else BASE_MODEL_VERSION
    if replicas is not None:
        samples = _generate_on_serve(model_cfg, rollout_cfg, prompt_list, params, payload, seed or 0)
    else:
        samples = _generate_in_process(model_cfg, rollout_cfg, prompt_list, params, payload, batch_size, seed or 0)
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w") as fh:
        for s in samples:
            fh.write(json.dumps({
                "prompt_index": s.prompt_index, "sample_index": s.sample_index, "text": s.text,
                "prompt_token_ids": s.prompt_token_ids, "token_ids": s.token_ids,
                "logprobs": s.logprobs, "finish_reason": s.finish_reason,
                "adapter_version": s.adapter_version, "temperature": params.temperature,
            }) + "\n")
    stops = sum(s.finish_reason == "stop" for s in samples)
    tokens = sum(len(s.token_ids) for s in samples)
    typer.echo(
        f"wrote {len(samples)} samples ({tokens} tokens, {stops} stopped, adapter v{version}) to {out}"
    )


def _generate_in_process(model_cfg, rollout_cfg, prompts, params, payload, batch_size, seed):
    from dataclasses import replace

    from rollout.engines import make_engine

    engine = make_engine(model_cfg, rollout_cfg, seed=seed)
    if engine.stop.warning:
        typer.echo(f"warning: {engine.stop.warning}", err=True)
    version = 0
    if payload is not None:
        engine.load_adapter(payload)
        version = payload.version
    samples = []
    with progress_bar() as progress:
        task = progress.add_task(f"{engine.kind} generate", total=len(prompts))
        for start in range(0, len(prompts), batch_size):
            batch_params = params if params.seed is None else replace(params, seed=params.seed + start * params.n)
            for s in engine.generate(prompts[start : start + batch_size], batch_params, version):
                s.prompt_index += start
                samples.append(s)
            progress.advance(task, min(batch_size, len(prompts) - start))
    return samples


def _generate_on_serve(model_cfg, rollout_cfg, prompts, params, payload, seed):
    import ray

    from rollout.deployment import deploy_rollout, stop_rollout

    ray.init(num_cpus=max(2, int(rollout_cfg.num_cpus * rollout_cfg.replicas + 0.999)), include_dashboard=False)
    try:
        client = deploy_rollout(model_cfg, rollout_cfg, seed=seed)
        version = 0
        if payload is not None:
            client.publish(payload)
            seconds = client.sync(payload.version)
            typer.echo(f"adapter v{payload.version} live on {rollout_cfg.replicas} replicas in {seconds:.2f} s", err=True)
            version = payload.version
        samples = client.generate(prompts, params, version)
        stop_rollout()
        return samples
    finally:
        ray.shutdown()


@app.command()
def serve(
    model: ModelOpt = None,
    dtype: DtypeOpt = None,
    engine: EngineOpt = None,
    replicas: Annotated[Optional[int], typer.Option(help="Engine replicas.")] = None,
    num_cpus: Annotated[Optional[float], typer.Option(help="CPUs per replica.")] = None,
    num_gpus: Annotated[Optional[float], typer.Option(help="GPUs per replica.")] = None,
    adapter: AdapterOpt = None,
    address: Annotated[
        Optional[str], typer.Option(help="Ray cluster address (default: start a local one).")
    ] = None,
    metrics_port: Annotated[
        Optional[int], typer.Option(help="Expose Prometheus /metrics on 127.0.0.1:PORT.")
    ] = None,
    seed: Annotated[int, typer.Option(help="Engine seed.")] = 0,
    config: ConfigOpt = None,
) -> None:
    """Deploy the rollout replicas on Ray Serve and keep them up until Ctrl-C."""
    import time

    import ray

    from rollout.deployment import APP_NAME, REGISTRY_NAME, deploy_rollout, stop_rollout

    model_cfg, rollout_cfg = model_and_rollout_configs(
        config, {"name_or_path": model, "dtype": dtype},
        {"engine": engine, "replicas": replicas, "num_cpus": num_cpus, "num_gpus": num_gpus},
    )
    if address:
        ray.init(address=address)
    else:
        ray.init(num_cpus=max(2, int(rollout_cfg.num_cpus * rollout_cfg.replicas + 0.999)), include_dashboard=False)
    client = deploy_rollout(model_cfg, rollout_cfg, seed=seed)
    if adapter is not None:
        from model.adapter_dir import payload_from_dir

        client.publish(payload_from_dir(adapter, version=client.snapshot()["latest"] + 1))
        client.sync(client.snapshot()["latest"])
    if metrics_port is not None:
        from prometheus_client import CollectorRegistry, start_http_server

        registry = CollectorRegistry()
        registry.register(client.metrics_collector())
        start_http_server(metrics_port, addr="127.0.0.1", registry=registry)
        typer.echo(f"metrics on http://127.0.0.1:{metrics_port}/metrics")
    typer.echo(
        f"serving app {APP_NAME!r}: {rollout_cfg.replicas} replicas of {model_cfg.name_or_path}; "
        f"registry {REGISTRY_NAME!r} (namespace 'counterpoint'); Ctrl-C to stop"
    )
    try:
        while True:
            time.sleep(5)
    except KeyboardInterrupt:
        pass
    finally:
        stop_rollout()
        ray.shutdown()
