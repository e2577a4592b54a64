"""A LoRA payload as tensors, and an adapter merged into a model's weights: shared by the
transformers fast engine (rollout/engines/hf_fast.py) and vLLM's merged mode
(rollout/engines/vllm_merge.py). Torch and safetensors only.

Merging: W = W0 + scale * B @ A, computed in float32 from W0 and rounded once to the weights'
dtype; W0 is kept, so every merge starts from the base weights (never an unmerge of the
previous adapter, whose rounding would accumulate step after step). ``MergedWeights`` keeps W0
wherever ``read_base`` puts it (vLLM's merged mode: page-locked host memory by default) and
builds the merged weights on the model's device one layer at a time (``stream_to_device``), so
the merge holds one layer's tensors on the device, not the model's.
"""

from __future__ import annotations

import contextlib
import functools

import warnings
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import torch

from model.adapter_dir import AdapterError, validate_payload
from model.adapter import AdapterPayload

PEFT_PREFIX = "base_model.model."


@dataclass(frozen=True)
class LoraTensors:
    """One adapted linear layer: delta W = scale * B @ A (A [r, in], B [out, r], float32)."""

    a: torch.Tensor
    b: torch.Tensor
    scale: float


def lora_scale(config: dict, r: int) -> float:
    alpha = float(config.get("lora_alpha", r))
    return alpha / (r**0.5) if config.get("use_rslora") else alpha / r


_ST_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64}


def load_safetensors_bytes(data, device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    """A safetensors blob (bytes, or any buffer: a payload's ``view()``, an mmap) as tensors on
    ``device`` with ONE host-to-device copy of its data section (views into it after), instead
    of a copy per tensor: the 4B r=32 adapter is 504 tensors, and per-tensor copies of it took
    ~0.2 s on the H200 host."""
    import json as _json
    import struct

    data = memoryview(data).cast("B")
    if data.nbytes < 8:
        raise AdapterError("adapter safetensors is shorter than its 8-byte header length")
    (n,) = struct.unpack("<Q", data[:8])
    header = _json.loads(bytes(data[8 : 8 + n]))
    header.pop("__metadata__", None)
    with warnings.catch_warnings():  # read-only bytes: the tensor is copied before any write
        warnings.simplefilter("ignore", UserWarning)
        raw = torch.frombuffer(data, dtype=torch.uint8, offset=8 + n)
    blob = raw.to(device) if torch.device(device).type != "cpu" else raw.clone()
    out = {}
    for name, info in header.items():
        if info["dtype"] not in _ST_DTYPES:
            raise AdapterError(f"adapter tensor {name!r} has dtype {info['dtype']}; expected a float type")
        dtype = _ST_DTYPES[info["dtype"]]
        lo, hi = info["data_offsets"]
        raw = blob[lo:hi]
        if lo % dtype.itemsize:  # a view needs an aligned offset; copy the odd one
            raw = raw.clone()
        out[name] = raw.view(dtype).view(info["shape"])
    return out


def parse_adapter(payload: AdapterPayload, device: torch.device | str = "cpu") -> dict[str, LoraTensors]:
    """The payload's LoRA matrices by module name (peft's saved names, prefix stripped), on
    ``device`` in float32. Refuses what a plain merge cannot express, naming it."""
    validate_payload(payload)
    check_mergeable(payload.config, payload.version)
    return lora_from_state(load_safetensors_bytes(payload.view(), device), payload.config, payload.version)


def check_mergeable(cfg: dict, v: int) -> None:
    """Refuse, naming it, an adapter config that a plain W0 + s B A merge cannot express."""
    for key, bad in (("use_dora", True), ("fan_in_fan_out", True)):
        if cfg.get(key) == bad:
            raise AdapterError(f"adapter v{v}: {key}={bad} is not supported by the hf fast engine")
    if cfg.get("bias", "none") != "none":
        raise AdapterError(f"adapter v{v}: bias={cfg.get('bias')!r} is not supported (only 'none')")
    if cfg.get("modules_to_save"):
        raise AdapterError(f"adapter v{v}: modules_to_save {cfg['modules_to_save']} is not supported")
    if cfg.get("rank_pattern") or cfg.get("alpha_pattern"):
        raise AdapterError(f"adapter v{v}: rank_pattern/alpha_pattern are not supported")


def lora_from_state(state: dict[str, torch.Tensor], cfg: dict, v: int) -> dict[str, LoraTensors]:
    """An adapter's tensors (peft's saved names: from a file, or views of a device payload's
    copy, model/adapter_ipc.py) paired per module, in float32 where they lie."""
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in state.items():
        name = key[len(PEFT_PREFIX):] if key.startswith(PEFT_PREFIX) else key
        for part in ("lora_A", "lora_B"):
            tail = f".{part}.weight"
            if name.endswith(tail):
                pairs.setdefault(name[: -len(tail)], {})[part] = tensor
                break
        else:
            raise AdapterError(f"adapter v{v}: tensor {key!r} is not a LoRA A/B weight")
    out = {}
    for name, ab in pairs.items():
        if set(ab) != {"lora_A", "lora_B"}:
            raise AdapterError(f"adapter v{v}: module {name} lacks {({'lora_A', 'lora_B'} - set(ab)).pop()}")
        a, b = ab["lora_A"], ab["lora_B"]
        if a.ndim != 2 or b.ndim != 2 or a.shape[0] != b.shape[1]:
            raise AdapterError(f"adapter v{v}: module {name} has A {tuple(a.shape)} and B {tuple(b.shape)}")
        out[name] = LoraTensors(
            a=a.to(dtype=torch.float32), b=b.to(dtype=torch.float32),
            scale=lora_scale(cfg, a.shape[0]),
        )
    if not out:
        raise AdapterError(f"adapter v{v} holds no LoRA tensors")
    return out


def merged_weight(w0: torch.Tensor, lora: LoraTensors) -> torch.Tensor:
    """W0 + scale * B @ A in float32, rounded once to W0's dtype. One addmm adds the float32
    W0 inside the GEMM: three passes over the layer instead of five (a bf16 addmm would be one
    pass, but on some backends it rounds B @ A before adding W0: two roundings, not one)."""
    return torch.addmm(w0.float(), lora.b.float(), lora.a.float(), alpha=lora.scale).to(w0.dtype)


WeightLoader = Callable[[Iterable[tuple[str, torch.Tensor]]], object]


@functools.lru_cache(maxsize=None)
def side_stream(device: torch.device) -> "torch.cuda.Stream":
    """The one side stream of ``device`` that every merge copies W0 on. torch's caching allocator
    keeps a pool per stream and reuses a block only on the stream it was allocated on, so a new
    stream per merge left each merge's W0 copies cached for good: on an H200 at Qwen3-4B the
    vLLM worker grew by ~2 GiB per adapter version (10.4 -> 25.0 GiB over 6 versions,
    bench/results/memory.md)."""
    return torch.cuda.Stream(device)


def stream_to_device(items: Iterable[tuple[str, torch.Tensor]], device: torch.device | str,
                     copy: Callable[[torch.Tensor], torch.Tensor] | None = None,
                     fence: Callable[[], object] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """``items`` with each tensor on ``device``, copied there only when it is asked for: a tensor
    already there is passed on as it is. Besides what the caller still holds, at most two
    copies exist: the one handed over and the next. On CUDA the next is already on its way (a
    non-blocking copy from page-locked memory on a side stream, which the caller's stream waits
    for), so the transfer of layer i+1 overlaps the work on layer i. Nothing here keeps a tensor
    once it is handed over, so the caller decides when it is freed. ``copy`` replaces the
    transfer (tests).

    On CUDA the host waits, before it starts a copy, until the GPU has finished the caller's
    work on the layer handed over two layers before. A copy made on the side stream is freed
    into a block that torch reuses only once the caller's stream has passed that point
    (``record_stream``); a host that queued every layer at once left each layer's block waiting
    for the GPU, and a merge reserved ~2.7 GiB more than it used at Qwen3-4B
    (bench/results/memory.md, 2026-12-03). The GPU keeps a layer of queued work while the host
    waits, so the copies still overlap the merges. ``fence`` replaces that event (tests): made
    after the caller's turn on each layer, its ``synchronize`` is the wait."""
    device = torch.device(device)
    side = side_stream(device) if copy is None and device.type == "cuda" else None

    def start(name: str, tensor: torch.Tensor):
        if copy is not None:
            return name, copy(tensor), None
        if tensor.device == device:
            return name, tensor, None
        if side is None:
            return name, tensor.to(device), None
        with torch.cuda.stream(side):
            moved = tensor.to(device, non_blocking=True)
        done = torch.cuda.Event()
        done.record(side)
        return name, moved, done

    if fence is None and side is not None:
        def fence():
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(device))
            return event

    items = iter(items)
    queue: deque = deque()
    handed: deque = deque()  # per layer handed over: an event after the caller's work on it (CUDA)
    first = next(items, None)
    if first is not None:
        queue.append(start(*first))
    while queue:
        name, tensor, done = queue.popleft()
        while len(handed) >= 2:
            handed.popleft().synchronize()
        following = next(items, None)
        if following is not None:
            queue.append(start(*following))
        if done is not None:
            current = torch.cuda.current_stream(device)
            current.wait_event(done)
            tensor.record_stream(current)  # its memory is not reused before the caller's work on it ends
        ready = [(name, tensor)]
        del name, tensor, done
        yield ready.pop()  # nothing here holds the tensor while the caller has it
        if fence is not None:  # the caller asked for the next layer: its work on this one is queued
            handed.append(fence())


class WriteScope:
    """Which layers a write of merged weights includes, and what it runs inside. This one: the
    layers that change, in name order, written as they are."""

    def complete(self, names: list[str]) -> list[str]:
        return sorted(set(names))

    def writing(self, names: list[str]) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()


class MergedWeights:
    """An adapter written into a model through the model's own weight loader.

    ``load_weights`` takes (checkpoint name, tensor) pairs, as vLLM's ``model.load_weights`` does
    (it splits q/k/v and gate/up into its fused layers itself); ``read_base`` returns the named
    tensors of the base checkpoint (W0), wherever they are to be kept: on ``device`` (the
    model's), or in host memory, page-locked for fast copies. It is asked once per adapted
    layer. Names are the checkpoint's, e.g. ``model.layers.0.self_attn.q_proj.weight``.

    Each write is one ``load_weights`` call over a lazy sequence of pairs: each layer's W0 is
    copied to ``device`` as the loader reaches it, merged there in float32 (``merged_weight``),
    cast, loaded and freed, so the merge holds about two layers' tensors on the device at a
    time (the next layer's W0 arrives while this one merges). The arithmetic is the same as
    merging every layer at once: the same float32 ops on the same W0 bits, then one cast.

    ``scope`` (``WriteScope``; default: write exactly the layers that change, in name order) says
    which layers a write must include and what it runs inside: a model whose layers are
    re-quantized as they load (vLLM's online fp8, rollout/engines/vllm_merge.py) takes a fused
    layer's shards all together, so a write there includes each touched fused layer's other
    shards (at W0 where the adapter leaves them) and runs inside vLLM's layerwise reload.
    """

    def __init__(self, load_weights: WeightLoader, read_base: Callable[[list[str]], dict[str, torch.Tensor]],
                 device: torch.device | str = "cpu", copy: Callable[[torch.Tensor], torch.Tensor] | None = None,
                 scope: "WriteScope | None" = None):
        self.load_weights, self.read_base = load_weights, read_base
        self.scope = scope or WriteScope()
        device = torch.device(device)
        if device.type == "cuda" and device.index is None and torch.cuda.is_available():
            device = torch.device("cuda", torch.cuda.current_device())  # as the tensors there name it
        self.device, self.copy = device, copy
        self.base: dict[str, torch.Tensor] = {}  # W0 of every layer an adapter has touched
        self.lora: dict[str, LoraTensors] = {}
        self.held = 0  # the version held (its tensors in self.lora)
        self.in_weights = 0  # the version now written into the weights (0 = W0)

    def hold(self, lora: dict[str, LoraTensors], version: int) -> None:
        """Keep ``lora`` as ``version`` and write it into the weights."""
        missing = [f"{name}.weight" for name in self.scope.complete(list(lora)) if name not in self.base]
        if missing:
            found = self.read_base(missing)
            absent = sorted(set(missing) - set(found))
            if absent:
                raise AdapterError(f"adapter v{version} names layers the base checkpoint lacks: {absent[:3]}")
            self.base.update({k[: -len(".weight")]: v for k, v in found.items()})
        stale = [n for n in self.lora if n not in lora]  # layers the new adapter leaves alone
        if stale and self.in_weights:
            self._write(stale, self._base_pairs)
        self.lora, self.held = lora, version
        self.use(version)

    def use(self, version: int) -> None:
        """Make the weights answer for ``version``: 0 = the base model, else the held adapter."""
        if version == self.in_weights:
            return
        if version == 0:
            self._write(list(self.lora), self._base_pairs)
        elif version == self.held:
            self._write(list(self.lora), self._merged_pairs)
        else:
            raise AdapterError(f"merged weights hold adapter v{self.held}, not v{version}")
        self.in_weights = version

    def _write(self, changed: list[str], pairs: Callable[[list[str]], Iterator[tuple[str, torch.Tensor]]]) -> None:
        names = self.scope.complete(changed)
        with self.scope.writing(names):
            self.load_weights(pairs(names))

    def _w0(self, names: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
        """W0 of ``names`` in their order, each on the device only while it is used."""
        return stream_to_device(((n, self.base[n]) for n in names), self.device, self.copy)

    def _base_pairs(self, names: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
        return ((f"{n}.weight", w0) for n, w0 in self._w0(names))

    def _merged_pairs(self, names: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
        """Each layer merged with the held adapter; a layer it leaves alone (a fused layer's
        other shard, ``scope``) at W0."""
        for n, w0 in self._w0(names):
            lora = self.lora.get(n)
            merged = w0 if lora is None else merged_weight(w0, lora)
            del w0  # this layer's W0 copy is free before the loader asks for the next layer
            yield f"{n}.weight", merged

    def extra_bytes(self) -> int:
        """Bytes held on the model's device besides the model: the adapter's matrices, and W0
        where it is kept there (not the transient tensors of a merge)."""
        held = list(self.base.values()) + [x for t in self.lora.values() for x in (t.a, t.b)]
        return sum(x.numel() * x.element_size() for x in held if x.device == self.device)

    def host_bytes(self) -> int:
        """Bytes of W0 kept off the model's device (host memory)."""
        return sum(x.numel() * x.element_size() for x in self.base.values() if x.device != self.device)
