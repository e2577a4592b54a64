"""The code-exec verifier: cases (one per task) and score(case, completion) -> ExecResult
(records/exec_result.py: the script it extracted and ran, and what that gave).

A plain object for the grader registry: no Ray, no gRPC. The service layer maps
`ResourceExhausted` to RESOURCE_EXHAUSTED, `KeyError` of an unknown case to NOT_FOUND and
`IsolationUnavailable` to a refusal to start.
"""

from __future__ import annotations

import csv
import math
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict

import pandas as pd

from config.code_exec import CodeExecConfig
from graders.code_exec.extract import extract_code
from graders.code_exec.grading import (InvalidSubmission, grade, oriented, parse_submission,
                                       read_csv_exact, reward_of)
from graders.code_exec.sandbox import ResourceExhausted, Sandbox  # noqa: F401 (re-export)
from graders.code_exec.task import TaskError, TaskSpec, load_tasks, resolve_tasks_dir
from records.exec_result import ExecResult

SYSTEM_PROMPT = (
    "You are an expert machine-learning engineer. Write ONE complete Python script that solves "
    "the task below. It runs with the task's files in its working directory and must write "
    "`submission.csv` there. Available: Python 3 standard library, numpy, pandas, scipy, "
    "scikit-learn. No network, no GPU, one CPU thread, a time limit of {timeout:g} s. Answer "
    "with the script in a single ```python fenced block."
)
PREVIEW_LINES = 5
PREVIEW_CHARS = 240


def _preview(path, lines: int = PREVIEW_LINES) -> str:
    out = []
    with open(path, encoding="utf-8") as f:
        for i, line in enumerate(f):
            if i >= lines:
                break
            line = line.rstrip("\n")
            out.append(line if len(line) <= PREVIEW_CHARS else line[:PREVIEW_CHARS] + " ...")
    return "\n".join(out)


def _wide_lines(data: bytes, min_commas: int, block: int = 8 << 20):
    """(line index, start, end, commas) of every line holding at least `min_commas` commas,
    counted with numpy a block at a time (a few bytes of memory per byte of one block, whatever
    the file's size; a 64 MiB file in about a second)."""
    import numpy as np

    line, line_start, carry = 0, 0, 0  # the line open at the block's start: index, offset, commas
    for a in range(0, len(data), block):
        blk = np.frombuffer(data, dtype=np.uint8, count=min(block, len(data) - a), offset=a)
        commas = np.cumsum(blk == ord(","), dtype=np.int64)
        newlines = np.flatnonzero(blk == ord("\n"))
        if len(newlines):
            per = np.diff(commas[newlines], prepend=0)
            per[0] += carry
            starts = np.concatenate(([line_start], a + newlines[:-1] + 1))
            for i in np.flatnonzero(per >= min_commas).tolist():
                yield line + i, int(starts[i]), a + int(newlines[i]), int(per[i])
            line, line_start = line + len(newlines), a + int(newlines[-1]) + 1
            carry = int(commas[-1] - commas[newlines[-1]])
        else:
            carry += int(commas[-1])
    if line_start < len(data) and carry >= min_commas:
        yield line, line_start, len(data), carry


WIDTH_SLACK = 1024  # fields a line may hold beyond the task's columns (check_width)


def check_width(data: bytes, n_columns: int, slack: int = WIDTH_SLACK) -> None:
    """Refuse a submission with a line of more than `n_columns + slack` fields before pandas
    reads it. pandas turns extra fields into columns (a wide header) or index levels (a wide
    row), slowly and in memory that grows with them (measured: one 8 MB header of a million
    names took 72 s and 3.2 GB; one row of 3 million fields under a 2-column header ran past
    120 s), so one script could stall or kill the grader for every caller. The bound is generous
    because extra columns are not a defect: grade() ignores them where MLE-bench does (an index
    written by to_csv, a note column, a duplicated target read back as `<target>.1`), and a
    64 MiB file 1,024 fields wider than its columns, as a header or as rows, reads in under 3 s
    and about 250 MB (measured on a 2-core box). A line over the bound that holds a quote is re-read with the csv module (quoted
    commas do not separate). Which columns a submission must have, and may have, stays grade()'s."""
    bound = n_columns + slack
    for line, start, end, commas in _wide_lines(data, bound):
        text = data[start:end]
        fields = commas + 1
        if b'"' in text:
            try:
                fields = len(next(csv.reader([text.decode("utf-8", "replace")])))
            except (csv.Error, StopIteration):
                continue
        if fields > bound:
            raise InvalidSubmission(f"line {line + 1} has {fields} fields, over the {bound} read "
                                    f"({n_columns} columns + {slack})")


def _row_count(path) -> int:
    return len(pd.read_csv(path))


def check_workspace_fits(tasks: dict[str, TaskSpec], cfg: CodeExecConfig) -> None:
    """Refuse, before any script runs, a task whose public files alone fill the workspace quota
    (they are copied into it): otherwise every execution of that task would fail its set-up."""
    for tid, t in sorted(tasks.items()):
        files = [p for p in t.public.iterdir() if p.is_file()]
        size = sum(p.stat().st_size for p in files)
        if size >= cfg.workspace_mb * 2**20 or len(files) + 2 > cfg.workspace_files:  # + the script, the root
            raise TaskError(f"task {tid}: its public files ({size / 2**20:.1f} MiB, {len(files)} files) do not fit "
                            f"the workspace (code_exec.workspace_mb={cfg.workspace_mb}, "
                            f"workspace_files={cfg.workspace_files})")


class CodeExecTask:
    """Bundled (or user) ML-engineering tasks graded by running the extracted script."""

    name = "code-exec"

    def __init__(self, cfg: CodeExecConfig | None = None):
        self.cfg = cfg or CodeExecConfig()
        self.tasks_dir = resolve_tasks_dir(self.cfg.tasks_dir, self.cfg.seed)
        self.tasks: dict[str, TaskSpec] = load_tasks(self.tasks_dir)
        check_workspace_fits(self.tasks, self.cfg)
        self.sandbox = Sandbox(self.cfg)
        self._answers = {tid: read_csv_exact(t.answers_path) for tid, t in self.tasks.items()}
        # which rule set grades each task (grading.py): its task.json's, else the config's
        self.grading_rules = {tid: t.rules(self.cfg.grading_rules) for tid, t in self.tasks.items()}

    @property
    def isolation(self) -> str:
        return self.sandbox.isolation

    def cases(self, split: str = "train") -> list[dict]:
        """One case per task (the task is the case; `split` is accepted for the registry's
        signature: every split gets the same tasks, the held-out split lives inside each)."""
        out = []
        for tid, t in sorted(self.tasks.items()):
            pub = t.public
            desc = (pub / t.description).read_text(encoding="utf-8")
            files = []
            for p in sorted(pub.iterdir()):
                if p.suffix == ".csv":
                    files.append(f"- {p.name}: {_row_count(p)} rows; first lines:\n"
                                 f"```\n{_preview(p)}\n```")
            user = f"{desc}\n\n## Data preview\n\n" + "\n".join(files)
            out.append({
                "id": tid,
                "prompt_messages": [
                    {"role": "system", "content": SYSTEM_PROMPT.format(timeout=self.cfg.timeout_s)},
                    {"role": "user", "content": user},
                ],
                "task": {**t.summary(), "grading_rules": self.grading_rules[tid],
                         **({"scaffold": t.scaffold} if t.scaffold else {})},
            })
        return out

    def _failed(self, tid, status, code, message=None, res=None) -> ExecResult:
        return ExecResult(
            task_id=tid, status=status, reward=self.cfg.sentinel, test_metric=None,
            val_metric=None, oriented=None, exec_time=res.exec_time if res else 0.0,
            term_tail=res.tail if res else "", exc_type=res.exc_type if res else None,
            message=message, isolation=self.isolation,
            limits=res.limits if res else asdict(self.sandbox.limits), code=code or "",
            queue_wait=res.queue_wait if res else 0.0,
        )

    def score(self, case_id: str, completion: str) -> ExecResult:
        """Extract, run in the sandbox, check and grade. Raises KeyError for an unknown task
        and ResourceExhausted when no execution slot frees up in time; never for the script."""
        t = self.tasks[case_id]
        code = extract_code(completion)
        if code is None:
            return self._failed(case_id, "no_code", None, "no fenced python block in the completion")
        res, data, why = self.sandbox.run(code, t.public)
        if res.outcome == "timeout":
            return self._failed(case_id, "timeout", code, f"killed: {res.exc_type}", res)
        if res.outcome == "output_limit":
            return self._failed(case_id, "crashed", code, "output limit exceeded", res)
        if res.outcome == "error":
            return self._failed(case_id, "crashed", code, f"exit status {res.returncode}", res)
        try:
            if data is None:
                raise InvalidSubmission(why)
            check_width(data, 1 + len(t.target_columns))  # before pandas reads a million columns
            g = grade(t, parse_submission(data), self._answers[case_id], self.grading_rules[case_id])
        except InvalidSubmission as e:
            return self._failed(case_id, "invalid_submission", code, str(e), res)
        use_val = self.cfg.reward_split == "val" and g.val is not None
        m = g.val if use_val else g.test
        if not math.isfinite(m):
            return self._failed(case_id, "invalid_submission", code, "metric is not finite", res)
        return ExecResult(
            task_id=case_id, status="ok", reward=reward_of(t.metric, m), test_metric=g.test,
            val_metric=g.val, oriented=oriented(t.metric, m), exec_time=res.exec_time,
            term_tail=res.tail, exc_type=None, message=None, isolation=self.isolation,
            limits=res.limits, code=code, queue_wait=res.queue_wait,
        )

    def score_many(self, items: list[tuple[str, str]], score=None) -> list[ExecResult]:
        """Score (case_id, completion) pairs, at most `max_concurrent` at once, in input order.

        ``score(case_id, completion)`` replaces `self.score` (the service wraps it to record
        metrics). The first exception (ResourceExhausted) is raised once the scripts already
        running have finished; those not yet started are cancelled."""
        if not items:
            return []
        score = score or self.score
        pool = ThreadPoolExecutor(max_workers=min(len(items), self.cfg.max_concurrent))
        try:
            return list(pool.map(lambda it: score(*it), items))
        finally:
            pool.shutdown(wait=True, cancel_futures=True)
