"""Grader section of the run config. Pydantic only: this module must stay import-light."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from config.code_exec import CodeExecConfig
from config.placement import check_label_selector, check_resources, label_selector_field, resources_field
from config.vowel_share import VowelShareConfig

Style = Literal["common-practice", "lead-sheet", "film-ambient"]
Checker = Literal["reference", "strict"]


class GraderConfig(BaseModel):
    """Which verifier scores completions, over which prompt pool, and where it runs."""

    model_config = ConfigDict(extra="forbid")

    task: str = Field(
        "voice-leading", min_length=1,
        description="Verifier task: a registered name (graders/tasks.py: 'voice-leading', 'code-exec', "
        "'vowel-share') or "
        "'module:factory' for an unregistered one the grader process can import.",
    )
    fixture: str | None = Field(
        None,
        description="Path to a p4-progressions/1 training pool; None = the shipped default "
        "fixture (graders/voice_leading/data/train.json).",
    )
    heldout_fixture: str | None = Field(
        None, description="Path to the held-out pool; None = the shipped graders/voice_leading/data/heldout.json."
    )
    require_pool: int | None = Field(
        None, ge=1, description="Refuse to start when the pool holds fewer progressions."
    )
    bars: int | None = Field(
        None, ge=1,
        description="Cut every progression to its first `bars` chords (None = as in the pool). "
        "Shorter progressions are the main lever on a small model's base pass rate.",
    )
    voices: int = Field(2, ge=2, le=4, description="Voices per chord (N).")
    style: Style = Field("common-practice", description="Style preset relaxing rules.")
    checker: Checker = Field(
        "reference",
        description="'reference' reproduces the reference verifier, quirks included; 'strict' "
        "closes the reward holes listed in the README.",
    )
    address: str | None = Field(
        None,
        description="host:port of a running grader; None = the trainer starts one as a Ray "
        "Serve app.",
    )
    replicas: int = Field(1, ge=1, description="Serve replicas when the trainer starts the grader.")
    min_replicas: int | None = Field(None, ge=1, description="Autoscaling lower bound (Serve).")
    max_replicas: int | None = Field(None, ge=1, description="Autoscaling upper bound (Serve).")
    score_chunk: int | None = Field(
        None, ge=1,
        description="Completions per ScoreBatch the trainer sends; the chunks go out concurrently "
        "because Serve routes each request whole to ONE replica, so a single batch would never use "
        "a second replica. None = the task section's max_concurrent where it has one (code-exec: "
        "code_exec.max_concurrent, the scripts one replica runs at once), else the step's batch split "
        "evenly over max_replicas (or replicas).",
    )
    target_ongoing_requests: float = Field(
        8.0, gt=0, description="Serve autoscaling target of in-flight requests per replica."
    )
    # Serve's own defaults (ray.serve.config.AutoscalingConfig, Ray 2.60), stated here so a run's
    # receipt says what it scaled with.
    upscale_delay_s: float = Field(
        30.0, ge=0,
        description="Serve autoscaling: how long the load must ask for more replicas before they "
        "are added (autoscaling_config.upscale_delay_s).",
    )
    downscale_delay_s: float = Field(
        600.0, ge=0,
        description="Serve autoscaling: how long the load must ask for fewer replicas before they "
        "are removed (autoscaling_config.downscale_delay_s). A training run's grader load comes in "
        "bursts (the score phase of each step) between longer gen and update phases: a delay "
        "shorter than a step would drop replicas between steps and start them again under the "
        "next burst.",
    )
    look_back_period_s: float = Field(
        30.0, gt=0,
        description="Serve autoscaling: the window over which in-flight requests are averaged "
        "(autoscaling_config.look_back_period_s). Serve warns when it is not longer than "
        "metrics_interval_s.",
    )
    metrics_interval_s: float = Field(
        10.0, gt=0,
        description="Serve autoscaling: how often replicas and handles push their in-flight counts "
        "to Serve's controller (autoscaling_config.metrics_interval_s). A scale step waits for "
        "a push, so it takes one to two intervals. Ray marks the field deprecated in favour of "
        "RAY_SERVE_*_AUTOSCALING_METRIC_PUSH_INTERVAL_S, which Ray 2.60 does not read yet.",
    )
    replica_liveness_s: float = Field(
        10.0, gt=0,
        description="A grader replica that answered the driver's pings before and then leaves one "
        "unanswered this long is frozen (alive to the OS and to Ray, as a SIGSTOPped process is): the "
        "driver kills it and Serve starts another (graders/autoscale.py ReplicaPinger; "
        "rollout.replica_liveness_s is the rollout's). The ping is Serve's own health-check call on the "
        "replica's event loop, which scoring does not hold (Serve runs the sync RPC methods in a "
        "thread pool); it is sent every grader.replica_poll_s. Serve's own health check would stop "
        "such a replica only after 3 failed checks and a graceful wait, about a minute.",
    )
    replica_poll_s: float = Field(
        1.0, gt=0,
        description="How often the process that started the grader app (the trainer's driver, "
        "`grader serve --ray`) reads the replica count from Serve's controller "
        "(graders/autoscale.py): counterpoint_grader_replicas and "
        "counterpoint_grader_scale_events_total come from these reads, so a change shorter than "
        "this may go unseen.",
    )
    num_cpus: float = Field(
        0.1, gt=0, description="CPUs reserved per grader replica (Ray Serve). For code-exec, "
        "about code_exec.max_concurrent: each running script is one single-threaded interpreter.",
    )
    replica_memory_mb: int | None = Field(
        None, ge=1,
        description="Memory reserved per grader replica (Ray's `memory` resource, MiB; None = "
        "none reserved). For code-exec, about code_exec.max_concurrent x (interpreter baseline "
        "+ code_exec.memory_mb + code_exec.workspace_mb + 2 x code_exec.tmp_mb, the tmpfs): Ray then places no more replicas on a node than it can hold.",
    )
    access_log: bool = Field(
        False, description="Ray Serve's access log of the grader replicas (one line per request, "
        "to the console and the replicas' log files): off, since a training run sends thousands "
        "(\"CALL ... repeated 712x\"); counts and latencies are in the counterpoint_grader_* metrics.",
    )
    shutdown_poll_s: float = Field(
        0.2, gt=0, description="How often a stopping grader replica checks that its calls are done "
        "(Serve's graceful_shutdown_wait_loop_s, 2 s by default; see rollout.shutdown_poll_s).",
    )
    host: str = Field("127.0.0.1", description="Bind address of a grader server.")
    port: int = Field(50051, ge=0, le=65535, description="gRPC port (0 = pick a free one).")
    max_retries: int = Field(4, ge=0, description="Retries of a failed grader call (backoff).")
    retry_backoff_s: float = Field(0.5, gt=0, description="First retry delay; doubles each time.")
    timeout_s: float = Field(
        60.0, gt=0, description="Deadline of one grader call attempt (before a retry)."
    )
    app_name: str = Field(
        "grader",
        min_length=1,
        description="Ray Serve application name; gRPC callers send it as `application` metadata.",
    )
    metrics_port: int | None = Field(
        None, ge=0, le=65535, description="Prometheus /metrics port of a grader server (None = off)."
    )
    native_log_lines_per_s: int = Field(
        20, ge=1,
        description="Lines per second of grpc-core's own (C++) log that `grader serve` passes to "
        "its stderr; the rest are dropped and counted in one line per second "
        "(graders/native_log.py). A client that makes grpc-core log per frame (an HTTP/2 "
        "CONTINUATION flood: 117,749 lines from 8 MB) then cannot fill the log or stall the "
        "server on a full stderr. Python's own log lines are never limited.",
    )
    max_message_bytes: int = Field(
        4 * 1024 * 1024,
        ge=1024,
        description="Largest gRPC message a grader server takes in (the plain server and Serve's "
        "gRPC proxy); a bigger request gets RESOURCE_EXHAUSTED before it is read into memory.",
    )
    token_env: str | None = Field(
        None,
        min_length=1,
        description="Name of an environment variable holding a shared token. When set (or "
        "token_file), servers refuse Grader calls without it as `x-counterpoint-token` metadata "
        "(UNAUTHENTICATED) and clients send it. The token itself is never logged.",
    )
    token_file: str | None = Field(
        None,
        min_length=1,
        description="Path of a file holding the shared token (surrounding whitespace stripped); "
        "the alternative to token_env. Serve replicas read it on their node: give an absolute "
        "path.",
    )
    serve_ingress: Literal["front", "proxy"] = Field(
        "front",
        description="How a grader started as a Serve app is reached over gRPC: 'front' = a "
        "grpcio server in the starting process on host:port that calls the replicas through a "
        "DeploymentHandle (binds `host`, caps messages, checks the token); 'proxy' = Ray "
        "Serve's own gRPC proxy on [::]:port (all interfaces: Ray 2.60 has no host option), "
        "as the cluster manifests use.",
    )

    resources: dict[str, float] = resources_field("grader replica (a Serve app the trainer starts)",
                                                  '{"grader_slot": 1}')
    label_selector: dict[str, str] = label_selector_field("grader replica (a Serve app the trainer starts)",
                                                          '{"counterpoint-role": "grader"}')

    code_exec: CodeExecConfig = Field(
        default_factory=CodeExecConfig,
        description="The code-exec task's settings (task: code-exec): sandbox limits, isolation, "
        "concurrency per replica, reward sentinel and split, which tasks (config/code_exec.py).",
    )
    vowel_share: VowelShareConfig = Field(
        default_factory=VowelShareConfig,
        description="The vowel-share task's settings (task: vowel-share, a synthetic reward for speed "
        "benchmarks): prompt length and pool sizes (config/vowel_share.py).",
    )

    @model_validator(mode="after")
    def _placement(self) -> GraderConfig:
        check_resources("grader.resources", self.resources)
        check_label_selector("grader.label_selector", self.label_selector)
        return self

    @model_validator(mode="after")
    def _one_token_source(self) -> GraderConfig:
        if self.token_env is not None and self.token_file is not None:
            raise ValueError("set grader.token_env or grader.token_file, not both")
        return self

    def task_section(self) -> BaseModel | None:
        """The configured task's own settings: the section named after the task (task
        "code-exec" -> grader.code_exec), None for a task without one. Read by name so that
        this schema branches on no task."""
        section = getattr(self, self.task.replace("-", "_"), None)
        return section if isinstance(section, BaseModel) else None

    def chunk_for(self, n: int) -> int:
        """ScoreBatch size for a batch of n completions (see score_chunk)."""
        if self.score_chunk is not None:
            return self.score_chunk
        # A task section that says how much work one replica runs at once (code_exec's
        # max_concurrent scripts) makes that the chunk, so every replica is kept busy.
        per_replica = getattr(self.task_section(), "max_concurrent", None)
        if per_replica is not None:
            return per_replica
        replicas = max(self.replicas, self.max_replicas or 0)
        return max(1, -(-n // replicas))
