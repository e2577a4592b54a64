"""What the driver and evals may ask of the code-exec task (graders/tasks.py TaskProfile): a
task's reference ladder and a held-out test metric as a reward. Light on purpose: the driver
imports it, and neither the sandbox nor the verifier's metrics may come along."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from graders.tasks import TaskProfile, register_profile
from records.exec_result import EXEC_STATUSES

NAME = "code-exec"  # graders/code_exec/service.py registers the task under the same name
log = logging.getLogger("counterpoint.grader")


@register_profile
class CodeExecProfile(TaskProfile):
    name = NAME
    verdict_labels = EXEC_STATUSES  # a script's verdict is its status

    def verdict_label(self, verdict: str) -> str:
        if verdict not in EXEC_STATUSES:
            raise ValueError(f"code-exec verdict {verdict!r} is not a script status {EXEC_STATUSES}")
        return verdict

    def ladder(self, cfg: Any, case_id: str) -> dict[str, Any]:
        """The case's entry of the tasks' reference ladder (ladder.json beside the tasks, written
        by `grader ladder`), read where this process can see it: code_exec.tasks_dir, or the
        bundled tasks' build in the cache. {} when there is none here (a remote grader's tasks):
        the round diagnostics then have no best_vs_<rung> values."""
        from graders.code_exec.ladder import LADDER_FILE
        from graders.code_exec.task import bundled_tasks_dir

        ce = cfg.code_exec
        root = Path(ce.tasks_dir) if ce.tasks_dir else bundled_tasks_dir(ce.seed)
        try:
            return dict(json.loads((root / LADDER_FILE).read_text()).get(case_id) or {})
        except (OSError, ValueError) as err:
            log.debug("no ladder for %s under %s: %s", case_id, root, err)
            return {}

    def test_reward(self, metric: str, value: float) -> float:
        """The task's reward map of ``metric`` (graders/code_exec/grading.py reward_of)."""
        from graders.code_exec.grading import reward_of

        return reward_of(metric, value)
