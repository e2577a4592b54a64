"""The process environment: the one place its defaults live.

Every entry point (the `counterpoint` CLI, the test suite's conftest, the benches) calls
``apply_defaults()`` before importing Ray, vLLM, gRPC or torch, and hands the result to Ray
workers and Serve replicas as their runtime_env, so every process of a run sees the same values.
A variable already set wins (``setdefault``): the caller's environment overrides a default.

Two kinds of variables are set elsewhere, on purpose:

- what follows from the resolved rollout config: rollout/engines/vllm_engine.py sets
  VLLM_CPU_KVCACHE_SPACE (rollout.kv_cache_gib), VLLM_ENABLE_V1_MULTIPROCESSING
  (rollout.vllm_multiprocessing, resolved per host) and VLLM_WORKER_MULTIPROC_METHOD in the
  replica that starts the engine, right before vLLM reads them (the defaults below are what a
  process has before a replica overrides them);
- PYTHONUNBUFFERED, which the interpreter reads at start-up: the Makefile exports it for the
  process it starts (and its children inherit it); it exports nothing else.

The cache of built models and tasks is $COUNTERPOINT_CACHE, else CACHE_DEFAULT (``cache_root``).
"""

from __future__ import annotations

import os
from pathlib import Path

DEFAULTS = {
    # No outside network on our machines; never phone home or reach a hub at run time.
    "RAY_USAGE_STATS_ENABLED": "0",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HF_HUB_DISABLE_TELEMETRY": "1",
    "DO_NOT_TRACK": "1",
    # vllm-cpu: in-process engine core (ready in ~14 s, no /dev/shm leak; MEASURED.md).
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    # Ray Train's preemption watcher: one more actor per learner job (a Python process, ~2 s of
    # CPU at start on the 2-core box) whose notices counterpoint does not act on: its learner is
    # restored by services/learner_recovery.py, from its own checkpoints, whatever killed it.
    "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "0",
    # Ray starts idle workers for a driver's first tasks; ours never use them (every actor has
    # its own runtime_env), so they only cost ~1.2 CPU-s a run and then sit idle.
    "RAY_prestart_worker_first_driver": "0",
    # A gRPC server started before ray.init otherwise prints fork warnings.
    "GRPC_ENABLE_FORK_SUPPORT": "false",
    "TOKENIZERS_PARALLELISM": "false",
    # Multi-GPU hosts of our lender: NVLink multicast must stay off in every process.
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}


def apply_defaults() -> dict[str, str]:
    """Set the defaults that are not already set; return them (for Ray runtime_env)."""
    for key, value in DEFAULTS.items():
        os.environ.setdefault(key, value)
    return {key: os.environ[key] for key in DEFAULTS}


# A local cluster (no ray_address): Ray 2.60 binds its GCS, raylet, agents and metrics export to
# the node's IP, found as the address that reaches the outside (and turns an explicit
# _node_ip_address="127.0.0.1" into that same address: services.resolve_ip_for_localhost). Its
# single-node mode, ray_constants.ENABLE_RAY_CLUSTER = False (the RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER
# switch, on by default on Linux), makes the node's IP the loopback one, and every listener of
# the cluster then binds 127.0.0.1 (measured: README "What listens where"). Never for a joined
# cluster: its nodes must reach this driver at a routable address.
LOCAL_CLUSTER_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}


def bind_local_cluster_to_loopback(ray_module) -> None:
    """Before ray.init starts a local cluster: make it listen on 127.0.0.1 only. The variable is
    read once, when ray is imported, so the imported constant is set too; the processes the
    cluster starts inherit the variable."""
    if os.environ.get("RAY_ADDRESS"):  # ray.init() would join that cluster, not start one
        return
    os.environ.update(LOCAL_CLUSTER_ENV)
    ray_module._private.ray_constants.ENABLE_RAY_CLUSTER = False


CACHE_ENV = "COUNTERPOINT_CACHE"
CACHE_DEFAULT = "~/.cache/counterpoint"


def cache_root(configured: str | None = None) -> Path:
    """Where built models (model.cache_dir) and the bundled code-exec tasks are cached: the
    configured directory, else $COUNTERPOINT_CACHE, else ~/.cache/counterpoint."""
    return Path(configured or os.environ.get(CACHE_ENV) or CACHE_DEFAULT).expanduser()
