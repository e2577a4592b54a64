"""A run directory (DESIGN.md "Run directory"): where each record lives and how it is written.

```
runs/<run>/run.json            receipt (services/receipt.py)
runs/<run>/timing.jsonl        one line per TRAINED step: {"step", "total_s", "phases_s"}
runs/<run>/metrics.jsonl       one line per trained step: {"step", <every scalar metric>}
runs/<run>/round_<step>/       <task>__<epoch>.jsonl             one row per completion/node
                               <task>__<epoch>__transcript.md    readable prompts + completions
                               <task>__<epoch>__tree.txt         group -> node tree with rewards
                               <task>__summary_<epoch>.json      counts, rates, histograms
                               tree.json                         the search tree (tree mode)
runs/<run>/heldout_before.jsonl, heldout_after.jsonl   EVAL.jsonl of the held-out eval before and
                               after training (evals/eval_file.py), with per-item results
runs/<run>/adapters/init/, adapters/step_<N>/, checkpoints/step_<N>/
runs/<run>/superseded/attempt_<n>/   what a resume re-runs, as the dead attempt left it
```

Commit order of a step: write its round as soon as it is generated and scored (before the
learner trains on it), then ``append_metrics``, then ``append_timing`` last. The timing line is
the commit point: a step is trained iff timing.jsonl has its line, so a round written for a step
that never finished shows up in ``untrained_rounds()``. Nothing a run produced is deleted; what a
resume does with an attempt's records is the driver's policy (services/archive.py).
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

from records.jsonl import RecordError, append_jsonl, atomic_write_text, jsonl_text, read_jsonl
from records.render import render_transcript, render_tree, rows_summary
from records.rows import check_node_rows

# DESIGN.md's phase names in the order a step runs them: the one definition (the step timer,
# timing.jsonl and the metrics use it). adv is a pure function of the rewards, so it runs before
# the learner's passes.
PHASES = ("gen", "score", "adv", "old_log_prob", "ref", "update_actor", "update_weights", "save_checkpoint")


class _InRun:
    """A path at a fixed place under the run directory, read as an attribute of a RunDir."""

    def __init__(self, *parts: str) -> None:
        self.parts = parts

    def __get__(self, run: RunDir | None, owner: type | None = None) -> Any:
        return self if run is None else run.root.joinpath(*self.parts)


class RunDir:
    """Paths and records of one run directory ``runs/<run_name>/``."""

    receipt_path = _InRun("run.json")
    timing_path = _InRun("timing.jsonl")
    metrics_path = _InRun("metrics.jsonl")
    curves_path = _InRun("curves.png")
    init_adapter_dir = _InRun("adapters", "init")
    # where a resume keeps what a dead attempt recorded past its resume point
    superseded_root = _InRun("superseded")

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)

    def adapter_dir(self, step: int) -> Path:
        return self.root / "adapters" / f"step_{step}"

    def checkpoint_dir(self, step: int) -> Path:
        return self.root / "checkpoints" / f"step_{step}"

    def heldout_path(self, when: Literal["before", "after"]) -> Path:
        """EVAL.jsonl of the held-out eval ``before`` or ``after`` training."""
        if when not in ("before", "after"):
            raise RecordError(f"held-out eval is 'before' or 'after', got {when!r}")
        return self.root / f"heldout_{when}.jsonl"

    def round_dir(self, step: int) -> Path:
        return self.root / f"round_{step}"

    def tree_path(self, step: int) -> Path:
        """The search tree after step ``step``'s round (tree mode; what search.carry_tree continues)."""
        return self.round_dir(step) / "tree.json"

    def round_paths(self, step: int, task: str, epoch: int) -> dict[str, Path]:
        base = self.round_dir(step)
        return {
            "rows": base / f"{task}__{epoch}.jsonl",
            "transcript": base / f"{task}__{epoch}__transcript.md",
            "tree": base / f"{task}__{epoch}__tree.txt",
            "summary": base / f"{task}__summary_{epoch}.json",
        }

    def create(self) -> RunDir:
        self.root.mkdir(parents=True, exist_ok=True)
        return self

    # step records
    def append_timing(self, step: int, total_s: float, phases_s: Mapping[str, float]) -> None:
        """Commit step ``step`` as trained (write this last for the step)."""
        unknown = sorted(set(phases_s) - set(PHASES))
        if unknown:
            raise RecordError(
                f"unknown phase names {unknown}; DESIGN.md phases are {list(PHASES)}"
            )
        last = self.last_trained_step()
        if step <= last:
            raise RecordError(f"step {step} is not after the last trained step {last}")
        record = {
            "step": step,
            "total_s": float(total_s),
            "phases_s": {k: float(v) for k, v in phases_s.items()},
        }
        append_jsonl(self.timing_path, record)

    def append_metrics(self, step: int, metrics: Mapping[str, float | int | bool | None]) -> None:
        """Record every scalar metric of step ``step`` (before its timing line)."""
        bad = sorted(
            k for k, v in metrics.items() if v is not None and not isinstance(v, (int, float))
        )
        if bad:
            raise RecordError(f"metrics must be scalars; not scalar: {bad}")
        if "step" in metrics:
            raise RecordError("'step' is the record key, not a metric name")
        append_jsonl(self.metrics_path, {"step": step, **metrics})

    def timing(self) -> list[dict[str, Any]]:
        return read_jsonl(self.timing_path)

    def metrics(self) -> list[dict[str, Any]]:
        return read_jsonl(self.metrics_path)

    def trained_steps(self) -> list[int]:
        return sorted({int(r["step"]) for r in self.timing()})

    def last_trained_step(self) -> int:
        """0 when no step was trained; the next step to run is this + 1."""
        steps = self.trained_steps()
        return steps[-1] if steps else 0

    def metric_series(self) -> dict[str, int]:
        """Metric name -> number of points in metrics.jsonl (the receipt's ``metric_series``)."""
        counts: Counter[str] = Counter()
        for record in self.metrics():
            counts.update(k for k, v in record.items() if k != "step" and v is not None)
        return dict(sorted(counts.items()))

    # rounds
    def round_steps(self) -> list[int]:
        steps = []
        for path in self.root.glob("round_*"):
            suffix = path.name.removeprefix("round_")
            if path.is_dir() and suffix.isdigit():
                steps.append(int(suffix))
        return sorted(steps)

    def untrained_rounds(self) -> list[int]:
        """Steps with a round directory but no timing line (generated, never trained)."""
        trained = set(self.trained_steps())
        return [s for s in self.round_steps() if s not in trained]

    def write_round(
        self,
        step: int,
        task: str,
        epoch: int,
        rows: Sequence[Mapping[str, Any]],
        pass_verdicts: Collection[str] = ("admitted",),
        search_summary: Mapping[str, Any] | None = None,
        tree_json: str | None = None,
    ) -> dict[str, Path]:
        """Write the rollouts of one step: rows, transcript, tree and summary. Files are written
        whole (atomic replace), so re-running a step after a resume overwrites cleanly.
        Tree mode adds the search round's summary (its keys merged in; its ``task``, the case,
        as ``case``) and the tree itself as round_<step>/tree.json."""
        if not rows:
            raise RecordError(f"round {step}: no rows to write")
        check_node_rows(rows)
        wrong_step = sorted({r["step"] for r in rows if r["step"] != step})
        if wrong_step:
            raise RecordError(f"round {step}: rows carry other step numbers {wrong_step}")
        paths = self.round_paths(step, task, epoch)
        body = jsonl_text(rows)
        atomic_write_text(paths["rows"], body)
        atomic_write_text(paths["transcript"], render_transcript(step, task, epoch, rows))
        atomic_write_text(paths["tree"], render_tree(step, task, epoch, rows))
        summary = {"step": step, "task": task, "epoch": epoch, **rows_summary(rows, pass_verdicts)}
        if search_summary is not None:
            summary["case"] = search_summary.get("task")
            summary.update({k: v for k, v in search_summary.items() if k not in summary})
        atomic_write_text(paths["summary"], json.dumps(summary, indent=2) + "\n")
        if tree_json is not None:
            paths["tree_json"] = self.tree_path(step)
            atomic_write_text(paths["tree_json"], tree_json if tree_json.endswith("\n") else tree_json + "\n")
        return paths

    def read_round(self, step: int, task: str, epoch: int) -> list[dict[str, Any]]:
        return read_jsonl(self.round_paths(step, task, epoch)["rows"])
