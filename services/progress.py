"""Step progress: a rich progress bar on a terminal, plain log lines otherwise."""

from __future__ import annotations

import logging
import sys
from typing import Any, Callable

log = logging.getLogger("counterpoint.train")


class StepProgress:
    def __init__(self, total_steps: int, first_step: int, epoch_of: Callable[[int], int],
                 interactive: bool | None = None) -> None:
        self.total, self.epoch_of = total_steps, epoch_of
        self.interactive = sys.stderr.isatty() if interactive is None else interactive
        self._bar: Any = None
        if self.interactive:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self._bar = Progress(TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
                                 TextColumn("{task.fields[stats]}"), TimeElapsedColumn(), transient=False)
            self._task = self._bar.add_task("steps", total=total_steps, completed=first_step - 1, stats="")
            self._bar.start()

    def advance(self, step: int, m: dict[str, float]) -> None:
        stats = (f"step {step}/{self.total}  reward {m.get('reward_mean', float('nan')):.3f}  "
                 f"pass {m.get('pass_rate', float('nan')):.3f}  ppl_ratio {m.get('ppl_ratio', float('nan')):.4f}  "
                 f"{m.get('step_seconds', float('nan')):.1f} s/step")
        if self._bar is not None:
            self._bar.update(self._task, completed=step, stats=stats)
        else:
            log.info(stats)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
