"""The driver's archive policy for a resumed run: what happens to the records of an attempt that
died (the run directory's layout and writers are records/run_dir.py's).

JSONL files survive a SIGKILL mid-write: a record is committed once its trailing newline is on
disk. On resume, ``recover(run)`` cuts a torn last line (an incomplete record) and
``supersede_after(run, step)`` moves everything recorded after the checkpoint the run resumes
from (rounds, metrics and timing lines, adapters, checkpoints) into ``superseded/attempt_<n>/``
with a ``superseded.json`` saying what and why: the main tree then holds each step once, and the
dead attempt's rollouts stay readable beside it. Nothing a run produced is deleted.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from records.jsonl import atomic_write_text, jsonl_text, read_jsonl, repair_jsonl
from records.run_dir import RunDir


def recover(run: RunDir) -> dict[str, int]:
    """Make the directory consistent after a crash (call on resume): cut torn last lines.
    Metrics lines of steps without a timing line stay until ``supersede_after`` moves them
    (they are after every trained step). Returns what was cut and what is uncommitted."""
    torn_timing = repair_jsonl(run.timing_path)
    torn_metrics = repair_jsonl(run.metrics_path)
    trained = set(run.trained_steps())
    uncommitted = [m for m in read_jsonl(run.metrics_path) if m.get("step") not in trained]
    return {
        "timing_torn_bytes": torn_timing,
        "metrics_torn_bytes": torn_metrics,
        "metrics_uncommitted_lines": len(uncommitted),
    }


def supersede_after(run: RunDir, step: int, reason: str = "resume") -> tuple[list[int], Path | None]:
    """Move what was recorded after ``step`` (a resume from step's checkpoint re-runs it) out
    of the main tree into ``superseded/attempt_<n>/``: timing and metrics lines of later
    steps, their round directories, adapters/step_* and checkpoints/step_* after ``step``.
    Returns (the trained steps moved, the attempt directory or None when nothing moved)."""
    dropped = [s for s in run.trained_steps() if s > step]
    moved: dict[str, list] = {"timing": [], "metrics": [], "rounds": [], "adapters": [], "checkpoints": []}
    kept_lines: dict[Path, list] = {}
    for name, path in (("timing", run.timing_path), ("metrics", run.metrics_path)):
        records = read_jsonl(path)
        kept_lines[path] = [r for r in records if int(r["step"]) <= step]
        moved[name] = [r for r in records if int(r["step"]) > step]
    later = lambda p: p.is_dir() and p.name.split("_")[-1].isdigit() and int(p.name.split("_")[-1]) > step
    dirs = {"rounds": [run.round_dir(s) for s in run.round_steps() if s > step],
            "adapters": sorted(p for p in (run.root / "adapters").glob("step_*") if later(p)),
            "checkpoints": sorted(p for p in (run.root / "checkpoints").glob("step_*") if later(p))}
    if not any(moved.values()) and not any(dirs.values()):
        return dropped, None
    run.superseded_root.mkdir(exist_ok=True)
    n = 1 + sum(1 for p in run.superseded_root.glob("attempt_*") if p.is_dir())
    attempt = run.superseded_root / f"attempt_{n}"
    attempt.mkdir()
    for name in ("timing", "metrics"):
        if moved[name]:
            atomic_write_text(attempt / f"{name}.jsonl", jsonl_text(moved[name]))
    for kind, paths in dirs.items():
        for path in paths:
            dest = attempt / path.name if kind == "rounds" else attempt / kind / path.name
            dest.parent.mkdir(parents=True, exist_ok=True)
            os.replace(path, dest)
            moved[kind].append(path.name)
    atomic_write_text(attempt / "superseded.json", json.dumps({
        "reason": reason, "resumed_from_step": step, "trained_steps": dropped,
        "uncommitted_steps": sorted({int(r["step"]) for r in moved["metrics"]} - set(dropped)),
        "rounds": moved["rounds"], "adapters": moved["adapters"], "checkpoints": moved["checkpoints"],
    }, indent=2) + "\n")
    # The main tree's lines last: a crash before this point leaves them (and a copy aside).
    for path, kept in kept_lines.items():
        if path.exists():
            atomic_write_text(path, jsonl_text(kept))
    return dropped, attempt
