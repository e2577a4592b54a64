"""`counterpoint eval`: sample G completions per held-out prompt on the rollout service, score
them on the grader service, write EVAL.jsonl (services/evalfile.py) and a receipt beside it."""

from __future__ import annotations

import json
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

from rollout.types import SamplingParams
from services.config import RunConfig, resolved


@dataclass
class EvalOptions:
    config: RunConfig
    out: Path
    split: str = "heldout"
    generations: int = 8
    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int = 0
    adapter: Path | None = None  # None = the base model
    run: Path | None = None  # a run directory: its last adapter
    limit: int | None = None
    eos_token_ids: list[int] | None = None


def last_adapter_of(run_dir: Path) -> Path:
    steps = sorted((int(p.name.split("_")[1]), p) for p in (run_dir / "adapters").glob("step_*"))
    if not steps:
        raise FileNotFoundError(f"run {run_dir} has no adapters/step_<N>/ yet")
    return steps[-1][1]


def run_eval(opts: EvalOptions):
    """Returns (EvalSummary, path of EVAL.jsonl)."""
    from rollout.adapters import payload_from_dir
    from services.evalfile import GenerationSettings, ScoringSettings, header_for, summarize, write_eval
    from services.heldout import evaluate_heldout
    from services.launch import check_resources, start_grader, start_ray, start_rollout, stop_token_report
    from services.receipt import Receipt

    cfg = opts.config
    adapter_dir = last_adapter_of(opts.run) if opts.run is not None else opts.adapter
    receipt = Receipt(opts.out.with_suffix(".receipt.json"), kind="eval", run_name=opts.out.stem)
    receipt.start(config=resolved(cfg), seeds={"seed": opts.seed},
                  notes={"adapter": str(adapter_dir) if adapter_dir else "base model", "split": opts.split})
    with receipt.guard(), ExitStack() as stack:
        start_ray(cfg, stack)
        check_resources(cfg, with_learner=False)
        grader = start_grader(cfg, stack)
        health = grader.health()
        receipt.set_grader_health(task=health.task, pool_size=health.pool_size, pool_source=health.pool_source,
                                  checker=health.checker, voices=health.voices, style=health.style)
        rollout = start_rollout(cfg, stack)
        stops = stop_token_report(cfg)
        receipt.update(rollout_stop_tokens=stops)
        version = 0
        if adapter_dir is not None:
            payload = payload_from_dir(adapter_dir, version=1)
            rollout.publish(payload)
            rollout.sync(1)
            version = 1
        cases = grader.cases(limit=opts.limit or 0, split=opts.split)
        params = SamplingParams(n=opts.generations, temperature=opts.temperature, top_p=opts.top_p,
                                top_k=opts.top_k, max_tokens=opts.max_new_tokens,
                                stop_token_ids=tuple(opts.eos_token_ids or ()), seed=opts.seed)
        result = evaluate_heldout(grader, rollout, cases, params, version, cfg.trainer.prefix_mode)
        items = result.items()
        header = header_for(
            items, generation=GenerationSettings.from_sampling_params(params, stops["ids"]),
            model=cfg.model.name_or_path, voices=health.voices, split=opts.split,
            fixture_source=cfg.grader.heldout_fixture or "shipped", prefix_mode=cfg.trainer.prefix_mode,
            adapter=str(adapter_dir) if adapter_dir else None, run=str(opts.run) if opts.run else None,
            scoring=ScoringSettings(style=health.style, checker=health.checker))
        write_eval(opts.out, header, items)
        summary = summarize(items)
        receipt.update(heldout={"summary": summary.as_dict(), "eval_file": str(opts.out)})
    return summary, opts.out


def summary_json(summary) -> str:
    return json.dumps(summary.as_dict(), indent=2)
