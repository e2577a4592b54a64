"""Grader section of the run config. Pydantic only: this module must stay import-light."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

Style = Literal["common-practice", "lead-sheet", "film-ambient"]
Checker = Literal["reference", "strict"]


class GraderConfig(BaseModel):
    """Which verifier scores completions, over which prompt pool, and where it runs."""

    model_config = ConfigDict(extra="forbid")

    task: Literal["voice-leading"] = Field("voice-leading", description="Verifier task name.")
    fixture: str | None = Field(
        None,
        description="Path to a p4-progressions/1 training pool; None = the shipped default "
        "fixture (graders/data/train.json).",
    )
    heldout_fixture: str | None = Field(
        None, description="Path to the held-out pool; None = the shipped graders/data/heldout.json."
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
    target_ongoing_requests: float = Field(
        8.0, gt=0, description="Serve autoscaling target of in-flight requests per replica."
    )
    num_cpus: float = Field(0.1, gt=0, description="CPUs reserved per grader replica.")
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
