"""Step progress: a rich progress bar on a terminal, one plain line per step otherwise.

Both show reward, pass rate, ppl_ratio, seconds per step and the phase split (DESIGN.md names,
shortened). The console is the run's terminal (services/console.py) when one is set up."""

from __future__ import annotations

import logging
import sys
from typing import Any, Callable

log = logging.getLogger("counterpoint.train")

SHORT = {"old_log_prob": "old_lp", "update_actor": "update", "update_weights": "sync", "save_checkpoint": "ckpt"}


def phase_split(phases: dict[str, float] | None, sync_beside_gen_s: float | None = None) -> str:
    """'gen 1.2 score 0.0 ... s' in the step-loop order; empty without phases. With one_step_off,
    the part of the sync during which the next generation still ran is named beside it
    ('sync 1.1 (0.9 beside gen)'): a replica that merges the adapter waits for that generation, so
    those seconds are not a slow transfer."""
    from services.console import iter_phases

    if not phases:
        return ""

    beside = f" ({sync_beside_gen_s:.1f} beside gen)" if (sync_beside_gen_s or 0.0) >= 0.05 else ""
    return "[" + " ".join(f"{SHORT.get(k, k)} {v:.1f}" + (beside if k == "update_weights" else "")
                          for k, v in iter_phases(phases)) + " s]"


def step_line(step: int, total: int, m: dict[str, float], phases: dict[str, float] | None = None) -> str:
    nan = float("nan")
    line = (f"step {step}/{total}  reward {m.get('reward_mean', nan):.3f}  pass {m.get('pass_rate', nan):.3f}  "
            f"ppl_ratio {m.get('ppl_ratio', nan):.4f}  {m.get('step_seconds', nan):.1f} s/step")
    split = phase_split(phases, m.get("update_weights_beside_gen_s"))
    return f"{line}  {split}" if split else line


class StepProgress:
    def __init__(self, total_steps: int, first_step: int, epoch_of: Callable[[int], int],
                 interactive: bool | None = None) -> None:
        from services.console import current

        self.total, self.epoch_of = total_steps, epoch_of
        self.logs = current()
        stream = self.logs.console if self.logs is not None else sys.stderr
        self.interactive = _isatty(stream) if interactive is None else interactive
        self._bar: Any = None
        if self.interactive:
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self._bar = Progress(TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
                                 TextColumn("{task.fields[stats]}"), TimeElapsedColumn(), transient=False,
                                 console=Console(file=stream), redirect_stdout=False, redirect_stderr=False)
            self._task = self._bar.add_task("steps", total=total_steps, completed=first_step - 1, stats="")
            self._bar.start()
            if self.logs is not None:
                self.logs.live = self._bar  # log lines print above the bar

    def advance(self, step: int, m: dict[str, float], phases: dict[str, float] | None = None) -> None:
        if self._bar is not None:
            stats = step_line(step, self.total, m, phases).split("  ", 1)[1]
            self._bar.update(self._task, completed=step, stats=stats)
            if step >= self.total:
                self.close()  # the held-out table and the last lines print below a finished bar
        else:
            log.info(step_line(step, self.total, m, phases))

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            if self.logs is not None:
                self.logs.live = None
            self._bar = None


def _isatty(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False
