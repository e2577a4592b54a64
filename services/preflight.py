"""Checks that need no service: run before Ray starts, so bad input costs a second and one line.

Each check raises ``PreflightError`` with a message naming the config key (or option) and what
is wrong with it. What can only fail inside a service (a replica running out of memory, a
worker's NCCL set-up) is not guessed at here.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

from config import RunConfig
from graders.ports import port_taken
from graders.tasks import task_profile

log = logging.getLogger("counterpoint.preflight")


class PreflightError(ValueError):
    """Input that would make a run fail after its services started."""


def check_model(cfg: RunConfig) -> None:
    """model.name_or_path is a built-in name, a local model directory, or a hub id this host can
    load (offline hosts: only one already in the local hub cache)."""
    from model.base import EMBEDDED_NAME, QWEN3_SHAPE_NAME, TINY_NAME, gguf_path

    name = cfg.model.name_or_path
    if name in (TINY_NAME, QWEN3_SHAPE_NAME):
        return
    if name == EMBEDDED_NAME:
        try:
            gguf_path()
        except FileNotFoundError as err:
            raise PreflightError(f"model.name_or_path={name}: {err}") from None
        return
    local = Path(name).expanduser()
    if local.exists():
        if not (local / "config.json").is_file():
            raise PreflightError(f"model.name_or_path={name}: the directory holds no config.json")
        return
    looks_local = local.is_absolute() or name.startswith((".", "~")) or name.count("/") != 1
    if looks_local:
        raise PreflightError(f"model.name_or_path={name}: no such directory (built-in names: "
                             f"{EMBEDDED_NAME}, {TINY_NAME}, {QWEN3_SHAPE_NAME})")
    if os.environ.get("HF_HUB_OFFLINE") == "1":
        from huggingface_hub import try_to_load_from_cache

        if not isinstance(try_to_load_from_cache(name, "config.json"), str):
            raise PreflightError(f"model.name_or_path={name}: not a local directory, and this host is offline "
                                 "(HF_HUB_OFFLINE=1) with no cached copy of that hub id")


def model_config_here(cfg: RunConfig) -> dict | None:
    """The model's config.json where this host has it without a download: a built-in model (built
    once here, as the rollout deploy would), a local directory, or a hub id in the local hub cache;
    None for a hub id only the cluster's nodes reach (its replicas then check it)."""
    from model.base import EMBEDDED_NAME, QWEN3_SHAPE_NAME, TINY_NAME, resolve_model

    name = cfg.model.name_or_path
    local = Path(name).expanduser()
    if name in (EMBEDDED_NAME, TINY_NAME, QWEN3_SHAPE_NAME) or local.exists():
        return json.loads((resolve_model(cfg.model) / "config.json").read_text())
    from huggingface_hub import try_to_load_from_cache

    cached = try_to_load_from_cache(name, "config.json")
    return json.loads(Path(cached).read_text()) if isinstance(cached, str) else None


def check_parallel_shape(cfg: RunConfig) -> None:
    """A sharded rollout engine (rollout.tensor_parallel_size > 1) splits the model's heads evenly
    (rollout/engines/vllm_engine.py parallel_shape_problem): refused here rather than in every
    replica's vLLM start-up, minutes later."""
    if cfg.rollout.tensor_parallel_size == 1:
        return
    from rollout.engines.vllm_engine import parallel_shape_problem

    check_model(cfg)
    model_config = model_config_here(cfg)
    problem = model_config and parallel_shape_problem(model_config, cfg.rollout.tensor_parallel_size)
    if problem:
        raise PreflightError(f"{problem} (model.name_or_path={cfg.model.name_or_path})")


def check_grader_pool(cfg: RunConfig) -> None:
    """The pool a grader started by this run would serve loads (for voice-leading: the fixtures
    exist, parse, fit). The task checks its own pool (graders/tasks.py TaskProfile.check_pool):
    a task without a pool to check passes."""
    if cfg.grader.address is not None:
        return  # an external grader validated its own pool when it started
    try:
        task_profile(cfg.grader.task).check_pool(cfg.grader)
    except (OSError, ValueError) as err:
        first = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise PreflightError(f"grader pool: {first}") from None


def check_ports(cfg: RunConfig) -> None:
    t = cfg.trainer
    if t.metrics_port and port_taken(t.metrics_host, t.metrics_port):
        raise PreflightError(f"trainer.metrics_port={t.metrics_port}: {t.metrics_host}:{t.metrics_port} is in use "
                             "(another run?); pick another with --metrics-port or 0 for a free one")
    if t.ray_metrics_port and not t.ray_address and port_taken("127.0.0.1", t.ray_metrics_port):
        raise PreflightError(f"trainer.ray_metrics_port={t.ray_metrics_port}: the port is in use")


def apply_memory_budget(cfg: RunConfig):
    """``(cfg, split)``: the run's gpu_memory_gib split between vLLM and the learner
    (services/memory_budget.py) and written into rollout.gpu_memory_gib and
    learner.memory_budget_gib, so the services use it and the receipt's config records it;
    ``(cfg, None)`` unchanged without a budget. Refused in one line (PreflightError) when the
    budget cannot hold the run, or when either field is given otherwise than the split sets it (a
    resumed run's recorded values are the split's)."""
    if cfg.gpu_memory_gib is None:
        return cfg, None
    from model.base import resolve_model
    from services.memory_budget import BudgetTooSmall, split_for_run

    check_model(cfg)
    model_config = json.loads((resolve_model(cfg.model) / "config.json").read_text())
    w0_on_device = cfg.rollout.merged_w0 == "device"  # merged LoRA's W0 kept on the GPU instead of the host
    try:
        split = split_for_run(cfg, model_config, w0_on_device)
    except BudgetTooSmall as err:
        raise PreflightError(str(err)) from None
    for name, given, value in (("rollout.gpu_memory_gib", cfg.rollout.gpu_memory_gib, split.rollout_gib),
                               ("learner.memory_budget_gib", cfg.learner.memory_budget_gib, split.learner_gib)):
        if given is not None and given != value:
            raise PreflightError(f"{name}={given:g} is given with gpu_memory_gib={cfg.gpu_memory_gib:g}, which sets "
                                 f"it ({value:g} here): leave it unset")
    log.info("memory budget: %s", split.summary())
    return cfg.model_copy(update={
        "rollout": cfg.rollout.model_copy(update={"gpu_memory_gib": split.rollout_gib}),
        "learner": cfg.learner.model_copy(update={"memory_budget_gib": split.learner_gib}),
    }), split


def check_adapter_dir(path: Path, option: str) -> None:
    """An adapter directory whose weights are all finite. An adapter of nans (a run that went nan
    before the learner refused non-finite gradients, a broken export) still loads and generates:
    degenerate text that a grader may even score, so training or evaluating from it would run
    another experiment than the one asked for, without an error."""
    if not (path / "adapter_config.json").is_file():
        raise PreflightError(f"{option} {path}: not an adapter directory (no adapter_config.json)")
    weights = path / "adapter_model.safetensors"
    if weights.is_file():
        from safetensors.torch import load_file  # torch only where an adapter is given
        import torch

        counts = {name: int((~torch.isfinite(t)).sum()) for name, t in load_file(weights).items()
                  if t.is_floating_point()}
        bad = {name: n for name, n in counts.items() if n}
        if bad:
            first = next(iter(bad))
            raise PreflightError(f"{option} {path}: {sum(bad.values())} non-finite values (nan or inf) in "
                                 f"{len(bad)} of its tensors, first {first}: a policy that went nan; "
                                 "give an adapter from before that")


def check_gpu_sharing(cfg: RunConfig) -> None:
    """gpu_sharing.mode=mps needs the MPS control binary on this host (it ships with the driver)."""
    from services.mps import CONTROL_BINARY, DRIVER_BIN_DIRS, find_control_binary

    if cfg.gpu_sharing.mode == "mps" and find_control_binary() is None:
        raise PreflightError(f"gpu_sharing.mode=mps, but {CONTROL_BINARY} is neither on PATH nor in "
                             f"{', '.join(DRIVER_BIN_DIRS)} (it ships with the NVIDIA driver); use gpu_sharing.mode=timeslice, or auto, which time-slices without it")


def preflight(cfg: RunConfig, *, ports: bool = True) -> None:
    """Every check that needs no service, cheapest first."""
    check_gpu_sharing(cfg)
    check_model(cfg)
    check_parallel_shape(cfg)
    check_grader_pool(cfg)
    if ports:
        check_ports(cfg)
