"""`counterpoint eval`: sample G completions per held-out prompt on the rollout service, score
them on the grader service, write EVAL.jsonl (evals/eval_file.py) and a receipt beside it."""

from __future__ import annotations

from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rollout.types import SamplingParams
from config import RunConfig, resolved


@dataclass
class EvalOptions:
    """One `counterpoint eval`: the config (its ``eval`` section says what is sampled and how),
    where to write, which adapter. ``from_cli`` names the eval.* fields given as command-line
    options, for the receipt's account of where each sampling setting came from."""

    config: RunConfig
    out: Path
    adapter: Path | None = None  # None = the base model
    run: Path | None = None  # a run directory: its last adapter
    eos_token_ids: list[int] | None = None
    from_cli: frozenset[str] = frozenset()


SAMPLING_FIELDS = ("max_tokens", "temperature", "top_p", "top_k")


def eval_sampling(cfg: RunConfig, from_cli: frozenset[str] = frozenset()) -> dict[str, dict[str, Any]]:
    """Each setting that shapes an eval's samples, its value and where the value came from: the
    command line, the config's eval section, the config's rollout section (eval.X unset), or the
    schema's default."""
    out: dict[str, dict[str, Any]] = {}
    for name in ("generations", "seed", *SAMPLING_FIELDS):
        value = getattr(cfg.eval, name)
        if name in from_cli:
            source = f"command line (eval.{name})"
        elif value is None:
            value = getattr(cfg.rollout, name)
            source = f"config rollout.{name}" if name in cfg.rollout.model_fields_set else f"default rollout.{name}"
        elif name in cfg.eval.model_fields_set:
            source = f"config eval.{name}"
        else:
            source = f"default eval.{name}"
        out[name] = {"value": value, "source": source}
    return out


def eval_params(sampling: dict[str, dict[str, Any]], eos_token_ids: list[int] | None) -> SamplingParams:
    v = {name: entry["value"] for name, entry in sampling.items()}
    return SamplingParams(n=v["generations"], temperature=v["temperature"], top_p=v["top_p"], top_k=v["top_k"],
                          max_tokens=v["max_tokens"], stop_token_ids=tuple(eos_token_ids or ()), seed=v["seed"])


def last_adapter_of(run_dir: Path) -> Path:
    steps = sorted((int(p.name.split("_")[1]), p) for p in (run_dir / "adapters").glob("step_*"))
    if not steps:
        raise FileNotFoundError(f"run {run_dir} has no adapters/step_<N>/ yet")
    return steps[-1][1]


def run_eval(opts: EvalOptions):
    """Returns (EvalSummary, path of EVAL.jsonl)."""
    from evals.eval_file import GenerationSettings, ScoringSettings, header_for, summarize, write_eval
    from evals.heldout import evaluate_heldout
    from services.launch import (check_resources, ray_session, serve_adapter, start_grader, start_ray,
                                 start_rollout, stop_token_report)
    from services.receipt import Receipt

    cfg, ecfg = opts.config, opts.config.eval
    adapter_dir = last_adapter_of(opts.run) if opts.run is not None else opts.adapter
    sampling = eval_sampling(cfg, opts.from_cli)
    params = eval_params(sampling, opts.eos_token_ids)
    receipt = Receipt(opts.out.with_suffix(".receipt.json"), kind="eval", run_name=opts.out.stem)
    receipt.start(config=resolved(cfg), seeds={"seed": ecfg.seed}, sampling=sampling,
                  notes={"adapter": str(adapter_dir) if adapter_dir else "base model", "split": ecfg.split})
    with receipt.guard(), ExitStack() as stack:
        start_ray(cfg, stack)
        receipt.update(ray_session=ray_session())  # a cluster started here: its /tmp session goes at the end
        check_resources(cfg, with_learner=False)
        grader = start_grader(cfg, stack)
        health = grader.health()
        receipt.set_grader_health(task=health.task, pool_size=health.pool_size, pool_source=health.pool_source,
                                  checker=health.checker, voices=health.voices, style=health.style)
        rollout = start_rollout(cfg, stack)
        stops = stop_token_report(rollout)
        receipt.update(rollout_stop_tokens=stops)
        version = serve_adapter(rollout, adapter_dir)
        cases = grader.cases(limit=ecfg.limit or 0, split=ecfg.split)
        result = evaluate_heldout(grader, rollout, cases, params, version, cfg.trainer.prefix_mode)
        items = result.items()
        header = header_for(
            items, generation=GenerationSettings.from_sampling_params(params, stops["ids"]),
            model=cfg.model.name_or_path, voices=health.voices, split=ecfg.split,
            fixture_source=cfg.grader.heldout_fixture or "shipped", prefix_mode=cfg.trainer.prefix_mode,
            adapter=str(adapter_dir) if adapter_dir else None, run=str(opts.run) if opts.run else None,
            scoring=ScoringSettings(style=health.style, checker=health.checker))
        write_eval(opts.out, header, items)
        summary = summarize(items)
        receipt.update(heldout={"summary": summary.as_dict(), "eval_file": str(opts.out)})
    return summary, opts.out
