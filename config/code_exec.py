"""The code-exec grader's section (`grader.code_exec` of GraderConfig). Pydantic only: this
module must stay import-light. Read by graders/code_exec/ (sandbox, verifier, the `code-exec`
task); every default of the code-exec grader lives here and nowhere else.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

Isolation = Literal["none", "namespaces"]
Split = Literal["val", "test"]
GradingRules = Literal["mle-bench", "counterpoint"]  # graders/code_exec/grading.py defines both


class CodeExecConfig(BaseModel):
    """How scripts run (sandbox limits, concurrency), how they are rewarded, and which tasks."""

    model_config = ConfigDict(extra="forbid")

    timeout_s: float = Field(
        30.0, gt=0, description="Wall-clock limit of one script, enforced by the parent: SIGINT "
        "to its process group, then `grace_s`, then SIGKILL of the group and the namespace."
    )
    grace_s: float = Field(
        1.0, ge=0, description="Seconds between SIGINT and SIGKILL when a script times out."
    )
    cpu_s: int = Field(
        60, ge=1, description="RLIMIT_CPU of the script (CPU seconds over all its threads); "
        "exceeding it is reported as `timeout`."
    )
    memory_mb: int = Field(
        2048, ge=64, description="Address-space budget (RLIMIT_AS) above the interpreter's "
        "measured baseline (python with numpy, pandas and scikit-learn imported)."
    )
    file_size_mb: int = Field(
        64, ge=1, description="RLIMIT_FSIZE: largest file the script may write."
    )
    open_files: int = Field(256, ge=16, description="RLIMIT_NOFILE of the script.")
    nproc: int = Field(
        32, ge=2, description="RLIMIT_NPROC (processes and threads) of the script; only "
        "enforceable for a non-root uid, i.e. with isolation `namespaces` (a dedicated uid when "
        "the grader runs as root, a user namespace otherwise)."
    )
    tmp_mb: int = Field(
        64, ge=1, description="Size of the private /tmp and /dev/shm tmpfs under `namespaces`."
    )
    workspace_mb: int = Field(
        256, ge=1, description="Total size of the script's workspace (/workspace: the task's "
        "public files, the script and all it writes) under isolation `namespaces`: a tmpfs of this "
        "size, so a write past it fails with ENOSPC (file_size_mb bounds one file, not their sum). "
        "tmpfs is memory: count it, with tmp_mb twice (/tmp, /dev/shm), in "
        "grader.replica_memory_mb. Level `none` isolates no filesystem, so it has no quota either."
    )
    workspace_files: int = Field(
        4096, ge=16, description="Most files and directories in the workspace (its tmpfs's inodes, "
        "the task's files included); creating one more fails with ENOSPC. Empty files cost no "
        "bytes but kernel memory each."
    )
    output_tail_bytes: int = Field(
        4096, ge=256, description="Tail of the script's stdout+stderr kept in a result (term_tail)."
    )
    output_limit_bytes: int = Field(
        8 * 1024 * 1024, ge=1024, description="Total stdout+stderr after which the script is "
        "killed (status `crashed`, exc_type OutputLimitExceeded); the parent never holds more "
        "than the tail."
    )
    max_concurrent: int = Field(
        2, ge=1, description="Simultaneous executions per grader process; more requests queue."
    )
    queue_wait_s: float = Field(
        60.0, ge=0, description="Longest a request waits for a free execution slot before "
        "failing with ResourceExhausted (RESOURCE_EXHAUSTED over gRPC)."
    )
    sentinel: float = Field(
        -0.5, description="Reward of every failed node (no_code, crashed, timeout, "
        "invalid_submission), whatever the task."
    )
    reward_split: Split = Field(
        "val", description="Which held-out split the reward (and a search's selection) uses: "
        "`val` keeps the reported `test` metric out of training; `test` is the reference's "
        "original behaviour. Tasks without a validation split fall back to `test`."
    )
    min_isolation: Isolation = Field(
        "namespaces", description="Refuse to start when the host offers less: `namespaces` = "
        "user/mount/net/pid namespaces + chroot onto the workspace (no network, no task files "
        "visible); `none` = process group, rlimits and a scrubbed environment only."
    )
    isolation: Isolation | None = Field(
        None, description="Force an isolation level (None = the best the host offers). "
        "`none` is for benchmarking the bare subprocess."
    )
    uid_base: int = Field(
        61000, ge=1000, description="When the grader runs as root, scripts run as a dedicated "
        "unprivileged uid from [uid_base, uid_base + uid_count), locked per execution across "
        "processes so RLIMIT_NPROC counts one script only. The range must belong to no real "
        "account: every process of a leased uid is killed before and after each run."
    )
    uid_count: int = Field(256, ge=1, description="Size of the dedicated uid range.")
    work_root: str | None = Field(
        None, description="Absolute directory for per-execution workspaces (None = the system "
        "temp directory)."
    )
    tasks_dir: str | None = Field(
        None, description="Absolute directory of tasks in the MLE-bench layout (one folder per "
        "task with task.json, public/, private/). None = the bundled tasks, built once into "
        "$COUNTERPOINT_CACHE (or ~/.cache/counterpoint)/code-exec/tasks-seed<seed>."
    )
    seed: int = Field(0, ge=0, description="Seed of the bundled tasks' data and splits.")
    grading_rules: GradingRules = Field(
        "mle-bench", description="Rule set grading a task whose task.json names none (a task's "
        "own `grading_rules` key wins): `mle-bench` = the verdict and metric of MLE-bench's "
        "grade.py for that metric (pizza AUC, spooky log loss, nomad2018 RMSLE), so a task "
        "prepared the MLE-bench way grades as MLE-bench grades it; `counterpoint` = the same "
        "metrics with the documented differences (rows matched by id, ...: "
        "graders/code_exec/grading.py COUNTERPOINT_DIFFERENCES). The bundled tasks name "
        "`counterpoint`. Health's `checker` says which rule set grades."
    )

    @field_validator("work_root", "tasks_dir")
    @classmethod
    def _absolute(cls, value: str | None, info) -> str | None:
        # Serve replicas and the sandbox run in other directories: a relative path would move.
        if value is not None and not value.startswith("/"):
            raise ValueError(f"code_exec.{info.field_name} must be an absolute path, got {value!r}")
        return value
