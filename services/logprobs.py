"""`counterpoint rollout logprobs`: recompute a samples file's log-probs with the learner's own
teacher-forced pass (learner/passes.py) and print ppl_ratio, rollout_kl and rollout_k3_kl of the
file (DESIGN.md): the engine/learner parity check by hand.

It sits under the `rollout` command group (services/cli.py adds it there) but lives here, above
both packages, because it runs learner code on rollout's output; rollout/ never imports learner/.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer

from config.learner import LearnerConfig
from config.rollout import RolloutConfig
from rollout.cli import (AdapterOpt, ConfigOpt, DtypeOpt, ModelOpt, fail, model_and_rollout_configs,
                         numbered_json_lines, progress_bar)

SamplesOpt = Annotated[Path, typer.Option("--in", help="Samples JSONL from `rollout generate`.")]
ScoredOpt = Annotated[Path, typer.Option("--out", help="JSONL with `trainer_logprobs` added.")]
TemperatureOpt = Annotated[Optional[float], typer.Option(help="Override the temperature stored in each line.")]
MicroBatchOpt = Annotated[int, typer.Option(min=1, help="Sequences per forward.")]
NEEDED = ("prompt_token_ids", "token_ids", "logprobs")  # what a samples line must hold
# The schema's defaults: the learner's micro-batch, and the temperature a line without one was sampled at.
_LEARNER, _ROLLOUT = LearnerConfig(), RolloutConfig()


def logprobs(in_path: SamplesOpt, out: ScoredOpt, model: ModelOpt = None, dtype: DtypeOpt = None,
             adapter: AdapterOpt = None, temperature: TemperatureOpt = None, micro_batch_size: MicroBatchOpt = _LEARNER.micro_batch_size,
             config: ConfigOpt = None) -> None:
    """Recompute the samples' log-probs with transformers (the learner's side) and print
    ppl_ratio, rollout_kl and rollout_k3_kl of the file."""
    model_cfg, _ = model_and_rollout_configs(config, {"name_or_path": model, "dtype": dtype}, {})
    rows = []
    for lineno, row in numbered_json_lines(in_path, "samples"):
        if not isinstance(row, dict) or not all(k in row for k in NEEDED):
            fail(f"{in_path}:{lineno}: needs an object with {', '.join(NEEDED)}")
        rows.append(row)
    if not rows:
        fail(f"{in_path} holds no samples")

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from learner.passes import response_logprobs
    from learner.rollout_correction import parity_stats
    from model.base import resolve_model, torch_dtype

    model_dir = resolve_model(model_cfg)
    net = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch_dtype(model_cfg.dtype))
    if adapter is not None:
        from peft import PeftModel

        net = PeftModel.from_pretrained(net, str(adapter))
    net.eval()
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else 0

    trainer: list[list[float]] = [None] * len(rows)  # type: ignore[list-item]
    by_temp: dict[float, list[int]] = {}
    for i, row in enumerate(rows):
        by_temp.setdefault(float(temperature or row.get("temperature", _ROLLOUT.temperature)), []).append(i)
    with progress_bar() as progress:
        task = progress.add_task("transformers log-probs", total=len(rows))
        for temp, idx in by_temp.items():
            for start in range(0, len(idx), micro_batch_size):
                chunk = idx[start : start + micro_batch_size]
                lps = response_logprobs(
                    net, [rows[i]["prompt_token_ids"] for i in chunk], [rows[i]["token_ids"] for i in chunk],
                    pad_id=pad_id, temperature=temp, micro_batch_size=micro_batch_size,
                )
                for i, lp in zip(chunk, lps):
                    trainer[i] = lp
                progress.advance(task, len(chunk))
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w") as fh:
        for row, lp in zip(rows, trainer):
            fh.write(json.dumps({**row, "trainer_logprobs": lp}) + "\n")
    try:
        stats = parity_stats([r["logprobs"] for r in rows], trainer)
    except ValueError as err:
        fail(f"{in_path}: {err}")
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"{in_path.name}: rollout vs transformers ({model_cfg.dtype})")
    for name in ("ppl_ratio", "rollout_kl", "rollout_k3_kl", "max_abs_diff", "sequences", "tokens"):
        table.add_column(name, justify="right")
    d = stats.as_dict()
    table.add_row(*(f"{d[k]:.6g}" if isinstance(d[k], float) else str(d[k]) for k in d))
    Console().print(table)
    typer.echo(json.dumps(d))
