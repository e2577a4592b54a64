"""One copy of the frozen base model on a GPU that a rollout replica and the learner share.

LoRA training never changes the base weights, yet the replica's engine and the learner each held
a whole copy (two x 7.5 GiB at Qwen3-4B). Here the replica's engine OWNS the base and the learner
MAPS it: the owner hands out handles to its tensors (torch's ``reduce_tensor``: CUDA IPC on a
GPU, a shared-memory file on the CPU), and the learner builds its transformers model around
views of them (``shared_model``), allocating no weights of its own.

Layout. vLLM fuses q/k/v into ``qkv_proj`` and gate/up into ``gate_up_proj``; its model class
says so in ``packed_modules_mapping``. Each part is a block of rows of the fused weight, in the
listed order, as tall as the transformers module's ``out_features``, so the transformers model's
``q_proj.weight`` is a view of rows [0, q) of ``qkv_proj.weight``, ``k_proj`` of [q, q + k), and
so on. The vocabulary may be padded (rows beyond the model's are never read). Anything that does
not line up (a name, a shape, a dtype) refuses to share, in one line (``ShareRefused``).

Merged LoRA. In vLLM's merged mode the replica's weights hold W_v = W0 + s B_v A_v of the
adapter version v it serves (rollout/engines/vllm_merge.py), not W0. The learner wants
W0 x + s B A x for its own adapter (A, B), and gets it exactly from the served weights:

    y = W_v x - s B_v (A_v x) + s B (A x)

The first two terms are the base layer's output (a forward hook subtracts the served delta, so
the reference policy under ``disable_adapter()`` is W0 x as well); the third is peft's own. The
gradient in A and B is that of W0 x + s B A x, and the gradient in x flows through W_v^T -
s A_v^T B_v^T = W0^T. The learner does not keep A_v and B_v itself: the owner keeps the adapter
it merged in one flat float32 buffer (``ServedAdapter``) that the learner maps too, with a
scalar that is 1 while the weights hold that adapter and 0 while they hold W0 (version 0). So
the correction is right whatever version the replica serves, including after a learner restart
that replays steps from a checkpoint while the replica serves a newer adapter.

The fence. The owner rewrites its weights only between steps (the driver syncs the adapter after
the update), but nothing else would notice if a merge ran during the learner's passes: its
forward would mix two versions. Every write goes through ``Fence.writing`` (a seqlock in shared
host memory: odd while writing, +2 per write), and the learner reads it before and after each
step (``Fence.check``), so a write during a step fails the step in one line instead of training
on torn weights. The same shared block carries the announcement of the served adapter's buffer
(its handle and layout, pickled), written when the owner first holds an adapter.

Torch only: no Ray, vLLM or transformers import at module level. The owners are
rollout/engines/vllm_merge.py (vLLM's worker) and rollout/engines/hf.py; the learner is
learner/policy.py.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

FENCE_WORDS = 4  # seq, version in the weights, served-adapter generation, announcement length
ANNOUNCE_BYTES = 1 << 20  # room for the served adapter's handle and layout (252 layers: ~30 KB)


class ShareRefused(RuntimeError):
    """The base cannot be shared here; the message is the one-line reason."""


class FenceMoved(RuntimeError):
    """The owner rewrote the shared weights while the learner was using them."""


class OwnerGone(RuntimeError):
    """The process that owned the shared weights has exited: what the learner maps is no longer
    the model (a restored learner maps the replica that replaced it)."""


def check_owner(pid: int) -> None:
    """OwnerGone when process ``pid`` (on this host: it shares the learner's device) has exited."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        raise OwnerGone(f"the replica that owned the shared base weights (pid {pid}) is gone") from None
    except PermissionError:  # alive, another user's
        pass


# ------------------------------------------------------------------------------ tensor handles


@contextlib.contextmanager
def _file_system_sharing() -> Iterator[None]:
    """CPU storage shared through named shared-memory files: a handle is plain data that any
    process of the host can open (the default, file descriptors, only reaches processes that
    torch.multiprocessing started)."""
    import torch.multiprocessing as tmp

    before = tmp.get_sharing_strategy()
    tmp.set_sharing_strategy("file_system")
    try:
        yield
    finally:
        tmp.set_sharing_strategy(before)


def tensor_handle(tensor: torch.Tensor) -> tuple:
    """A picklable handle to ``tensor``'s memory. CUDA: torch's IPC handle (``reduce_tensor``);
    CPU: the storage is moved into shared memory first (in place: the owner's tensor keeps
    working, its data now lives in a shared file). Any number of processes may open one handle,
    any number of times (``open_handle`` takes a reference of its own per open)."""
    from torch.multiprocessing.reductions import reduce_storage, reduce_tensor

    tensor = tensor.detach()
    if type(tensor) is not torch.Tensor:  # vLLM's parameter classes: the consumer needs none of them
        tensor = tensor.as_subclass(torch.Tensor)
    if tensor.is_cuda:
        rebuild, args = reduce_tensor(tensor)
        return ("cuda", args)
    with _file_system_sharing():
        storage = tensor.untyped_storage()
        if not storage.is_shared():
            tensor.share_memory_()
            storage = tensor.untyped_storage()
        _, storage_args = reduce_storage(storage)
    return ("cpu", storage_args, tensor.dtype, tensor.storage_offset(), tuple(tensor.shape), tuple(tensor.stride()))


def open_handle(handle: tuple, cuda_index: int | None = None) -> torch.Tensor:
    """The tensor behind ``tensor_handle``'s handle, mapped into this process (no copy).
    ``cuda_index``: this process's index of the owner's GPU (Ray gives each process its own
    CUDA_VISIBLE_DEVICES, so the owner's index may name another device here)."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor, rebuild_storage_filename

    if handle[0] == "cuda":
        args = list(handle[1])
        if cuda_index is not None:
            args[6] = cuda_index  # storage_device
        return rebuild_cuda_tensor(*args).detach()
    _, storage_args, dtype, offset, shape, stride = handle
    storage = rebuild_storage_filename(*storage_args)
    # torch's rebuild spends the one reference that reduce_storage gave the handle, so a handle
    # could be opened twice at most: a third open (a replacement replica, a restarted learner,
    # a second learner of a test process) found the file unlinked while its owner still used it.
    # Each open takes its own reference instead; the handle's stays until the owner's
    # torch_shm_manager removes the file once every process of its group has exited.
    storage._shared_incref()
    return torch.empty(0, dtype=dtype).set_(storage, offset, shape, stride)


def device_uuid(device: torch.device | str) -> str | None:
    """The GPU's UUID (the same in every process, whatever its CUDA_VISIBLE_DEVICES); None on CPU."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    return str(torch.cuda.get_device_properties(index).uuid)


def cuda_index_of(uuid: str) -> int | None:
    """This process's index of the GPU with ``uuid``, or None when it cannot see it."""
    if not torch.cuda.is_available():
        return None
    for i in range(torch.cuda.device_count()):
        if str(torch.cuda.get_device_properties(i).uuid) == uuid:
            return i
    return None


# ------------------------------------------------------------------------------ the fence


class Fence:
    """A seqlock over the owner's weights in shared host memory, and the announcement of the
    served adapter's buffer. Words: [seq, version in the weights, announcement generation,
    announcement length]; then the announcement's bytes."""

    def __init__(self, words: torch.Tensor, board: torch.Tensor):
        self.words, self.board = words, board

    @classmethod
    def create(cls) -> "Fence":
        return cls(torch.zeros(FENCE_WORDS, dtype=torch.int64), torch.zeros(ANNOUNCE_BYTES, dtype=torch.uint8))

    def handles(self) -> tuple[tuple, tuple]:
        return tensor_handle(self.words), tensor_handle(self.board)

    @classmethod
    def open(cls, handles: tuple[tuple, tuple]) -> "Fence":
        return cls(open_handle(handles[0]), open_handle(handles[1]))

    def read(self) -> tuple[int, int]:
        """(seq, version in the weights)."""
        seq, version = (int(x) for x in self.words[:2].tolist())
        return seq, version

    @contextlib.contextmanager
    def writing(self, synchronize=None) -> Iterator["Fence"]:
        """Around a write of the weights: seq odd during it, then even again. ``synchronize``
        waits for the device's queued work, so "done" means written, not queued. Call
        ``set_version`` inside."""
        self.words[0] += 1
        try:
            yield self
        finally:
            if synchronize is not None:
                synchronize()
            self.words[0] += 1

    def set_version(self, version: int) -> None:
        self.words[1] = version

    def announce(self, message: Any) -> int:
        """Publish ``message`` (picklable) to the learners; returns its generation."""
        blob = pickle.dumps(message)
        if len(blob) > ANNOUNCE_BYTES:
            raise ShareRefused(f"the served adapter's layout takes {len(blob)} bytes, more than {ANNOUNCE_BYTES}")
        self.board[: len(blob)] = torch.frombuffer(bytearray(blob), dtype=torch.uint8)
        self.words[3] = len(blob)
        self.words[2] += 1
        return int(self.words[2])

    def generation(self) -> int:
        """The announcement's generation; 0 = nothing announced yet."""
        return int(self.words[2])

    def announcement(self) -> tuple[int, Any]:
        """(generation, message); generation 0 = nothing announced yet."""
        generation, size = int(self.words[2]), int(self.words[3])
        if generation == 0:
            return 0, None
        return generation, pickle.loads(self.board[:size].numpy().tobytes())

    def check(self, before: tuple[int, int], what: str) -> None:
        """FenceMoved when the weights were being written at ``before`` or have been since."""
        now = self.read()
        if before[0] % 2 or now[0] != before[0]:
            raise FenceMoved(f"the rollout replica rewrote the shared base weights during {what} "
                             f"(fence {before[0]} -> {now[0]}, version {before[1]} -> {now[1]}): the step "
                             "would mix two versions of the weights")


# ------------------------------------------------------------------------------ what the owner hands out


@dataclass(frozen=True)
class BaseExport:
    """What a learner needs to map an owner's base weights. Picklable; made per learner."""

    owner: str  # the engine that owns the weights ("vllm", "hf")
    owner_pid: int
    device_uuid: str | None  # None: host memory
    dtype: str  # torch dtype name of the weights
    tensors: dict[str, tuple]  # the owner's parameter name -> tensor_handle
    packed: dict[str, tuple[str, ...]] = field(default_factory=dict)  # fused name -> part names, in order
    fence: tuple | None = None  # Fence.handles()
    merges: bool = False  # the owner merges adapters into these weights (ServedCorrection prepares for it)
    elsewhere: dict[str, str] = field(default_factory=dict)  # parameters with no memory to map -> their device

    def describe(self) -> str:
        where = f"GPU {self.device_uuid}" if self.device_uuid else "host memory"
        return f"{self.owner} replica (pid {self.owner_pid}), {len(self.tensors)} tensors in {where}"


def export_base(owner: str, named: Iterable[tuple[str, torch.Tensor]], packed: Mapping[str, Iterable[str]],
                fence: Fence | None, merges: bool = False) -> BaseExport:
    """The owner's side: handles to its parameters (name -> tensor), its fused-module map, its
    fence and whether it merges adapters into the weights. ``named`` should list every name of a
    parameter held under several (``named_parameters(remove_duplicate=False)``): a tied output
    head is then exported under its own name too, and the learner computes with what the owner
    does. A parameter on the meta device holds no memory: it is listed in ``elsewhere``, and
    refused only if a learner needs it."""
    tensors, elsewhere, dtype, uuid = {}, {}, None, None
    for name, tensor in named:
        # vLLM's LoRA wrappers (unmerged LoRA) hold the layer they wrap as `base_layer`: its weight
        # is the module's own, under the module's name
        name = name.replace(".base_layer.", ".")
        if tensor.is_meta:
            elsewhere[name] = "meta"
            continue
        if tensor.numel() == 0:
            raise ShareRefused(f"{owner} holds {name} as an empty tensor (its kernels keep the weights elsewhere)")
        tensors[name] = tensor_handle(tensor)
        if tensor.is_floating_point() and dtype is None:
            dtype, uuid = str(tensor.dtype).removeprefix("torch."), device_uuid(tensor.device)
    return BaseExport(owner=owner, owner_pid=os.getpid(), device_uuid=uuid, dtype=dtype or "float32",
                      tensors=tensors, packed={k: tuple(v) for k, v in packed.items()},
                      fence=fence.handles() if fence is not None else None, merges=merges, elsewhere=elsewhere)


# ------------------------------------------------------------------------------ the learner's model


def owner_source(name: str, packed: Mapping[str, tuple[str, ...]]) -> tuple[str, str | None]:
    """(the owner's tensor name, the part) for one of the transformers model's parameter names:
    ``model.layers.0.self_attn.k_proj.weight`` -> (``...qkv_proj.weight``, ``k_proj``)."""
    parts = name.split(".")
    for fused, members in packed.items():
        for i, piece in enumerate(parts):
            if piece in members:
                return ".".join([*parts[:i], fused, *parts[i + 1:]]), piece
    return name, None


def base_views(expected: Mapping[str, tuple[tuple[int, ...], torch.dtype]], owned: Mapping[str, torch.Tensor],
               packed: Mapping[str, tuple[str, ...]], elsewhere: Mapping[str, str] | None = None
               ) -> dict[str, torch.Tensor]:
    """For each parameter the transformers model expects (name -> (shape, dtype)), a view of the
    owner's tensors with that shape: the tensor itself, its leading rows (a padded vocabulary),
    or its block of rows of a fused weight. ShareRefused, naming the first that does not fit."""
    heights: dict[str, int] = {name: shape[0] for name, (shape, _) in expected.items() if shape}
    views = {}
    for name, (shape, dtype) in expected.items():
        source, part = owner_source(name, packed)
        if source not in owned and source in (elsewhere or {}):
            raise ShareRefused(f"the replica holds {source} on the {elsewhere[source]} device, with no memory for the "
                               f"learner's {name} to map")
        if source not in owned:
            near = [o for o in owned if o.rsplit(".", 2)[-2:] == source.rsplit(".", 2)[-2:]][:3]
            raise ShareRefused(f"the replica's weights have no {source} for the learner's {name}"
                               + (f" (it holds {', '.join(near)})" if near else f" ({len(owned)} tensors, e.g. "
                                                                                f"{', '.join(list(owned)[:3])})"))
        tensor = owned[source]
        if tensor.dtype != dtype:
            raise ShareRefused(f"{source} is {tensor.dtype} in the replica, the learner wants {dtype}")
        if part is not None:
            fused = next(members for f, members in packed.items() if f in source.split("."))
            start = 0
            for member in fused:
                if member == part:
                    break
                start += heights[name.replace(f".{part}.", f".{member}.")]
            tensor = tensor[start: start + shape[0]]
        elif tensor.shape[0] > shape[0] and tuple(tensor.shape[1:]) == tuple(shape[1:]):
            tensor = tensor[: shape[0]]  # a vocabulary padded to a multiple of the kernels' tile
        if tuple(tensor.shape) != tuple(shape):
            raise ShareRefused(f"{source} gives the learner's {name} shape {tuple(tensor.shape)}, it needs {tuple(shape)}")
        views[name] = tensor
    return views


def _set_parameter(model: torch.nn.Module, name: str, tensor: torch.Tensor) -> None:
    owner, _, leaf = name.rpartition(".")
    module = model.get_submodule(owner) if owner else model
    module._parameters[leaf] = torch.nn.Parameter(tensor, requires_grad=False)


def open_export(export: BaseExport, device: torch.device | str) -> dict[str, torch.Tensor]:
    """The owner's tensors mapped into this process, on ``device``; ShareRefused when ``device``
    is not where they live."""
    device = torch.device(device)
    if export.device_uuid is None:
        if device.type != "cpu":
            raise ShareRefused(f"the {export.owner} replica's weights are in host memory, the learner runs on {device}")
        return {name: open_handle(h) for name, h in export.tensors.items()}
    mine = device_uuid(device) if device.type == "cuda" else None
    if mine != export.device_uuid:
        raise ShareRefused(f"the {export.owner} replica's weights are on GPU {export.device_uuid}, the learner "
                           f"on {mine or device}")
    index = cuda_index_of(export.device_uuid)
    return {name: open_handle(h, index) for name, h in export.tensors.items()}


def shared_model(model_dir, dtype: torch.dtype, export: BaseExport, device: torch.device | str):
    """The transformers model of ``model_dir`` whose parameters are views of the owner's
    weights (frozen), its buffers (rotary frequencies) computed here. No weights are read or
    allocated. ShareRefused when the two do not line up."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(model_dir))
    with init_empty_weights(include_buffers=False):  # parameters on "meta", buffers real
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.config.use_cache = False
    tied = dict(getattr(model, "_tied_weights_keys", None) or {}) if getattr(config, "tie_word_embeddings", False) else {}
    expected = {name: (tuple(p.shape), p.dtype) for name, p in model.named_parameters() if name not in tied}
    owned = open_export(export, device)
    for name, view in base_views(expected, owned, export.packed, export.elsewhere).items():
        _set_parameter(model, name, view)
    if tied:
        model.tie_weights()
    left = [name for name, p in model.named_parameters(remove_duplicate=False) if p.is_meta]
    if left:
        raise ShareRefused(f"the replica's weights leave {len(left)} of the learner's parameters unset, e.g. {left[0]}")
    for module in model.modules():  # buffers were built on the CPU
        for key, buf in list(module._buffers.items()):
            if buf is not None:
                module._buffers[key] = buf.to(device)
    return model


# ------------------------------------------------------------------------------ the served adapter


@dataclass(frozen=True)
class ServedLayout:
    """Where each layer's A and B sit in the served adapter's flat float32 buffer. Element 0 is
    the switch: 1.0 while the weights hold this adapter, 0.0 while they hold W0."""

    layers: dict[str, tuple[int, tuple[int, int], int, tuple[int, int], float]]  # name -> (a at, a shape, b at, b shape, scale)
    numel: int

    @classmethod
    def of(cls, lora: Mapping[str, Any]) -> "ServedLayout":
        at, layers = 1, {}
        for name in sorted(lora):
            t = lora[name]
            a_shape, b_shape = tuple(t.a.shape), tuple(t.b.shape)
            layers[name] = (at, a_shape, at + t.a.numel(), b_shape, float(t.scale))
            at += t.a.numel() + t.b.numel()
        return cls(layers, at)

    def fits(self, lora: Mapping[str, Any]) -> bool:
        return set(lora) == set(self.layers) and all(
            (tuple(lora[n].a.shape), tuple(lora[n].b.shape), float(lora[n].scale)) == (a, b, s)
            for n, (_, a, _, b, s) in self.layers.items())

    def views(self, flat: torch.Tensor) -> dict[str, tuple[torch.Tensor, torch.Tensor, float]]:
        out = {}
        for name, (a_at, a_shape, b_at, b_shape, scale) in self.layers.items():
            a = flat[a_at: a_at + a_shape[0] * a_shape[1]].view(a_shape)
            b = flat[b_at: b_at + b_shape[0] * b_shape[1]].view(b_shape)
            out[name] = (a, b, scale)
        return out


class ServedAdapter:
    """The owner's side: the adapter it merged, kept in one flat float32 buffer that learners
    map (announced through the fence), and the switch at element 0."""

    def __init__(self, fence: Fence, device: torch.device):
        self.fence, self.device = fence, device
        self.layout: ServedLayout | None = None
        self.flat: torch.Tensor | None = None

    def store(self, lora: Mapping[str, Any], make) -> dict[str, Any]:
        """Copy ``lora`` (name -> LoraTensors) into the buffer; returns the same adapter as views
        of it (``make(a, b, scale)`` builds one layer's object), which the merge then uses."""
        if self.layout is None or not self.layout.fits(lora):
            self.layout = ServedLayout.of(lora)
            self.flat = torch.zeros(self.layout.numel, dtype=torch.float32, device=self.device)
            self.fence.announce({"flat": tensor_handle(self.flat), "layout": self.layout,
                                 "device_uuid": device_uuid(self.device)})
        views = self.layout.views(self.flat)
        out = {}
        for name, t in lora.items():
            a, b, scale = views[name]
            a.copy_(t.a)
            b.copy_(t.b)
            out[name] = make(a, b, t.scale)
        return out

    def switch(self, on: bool) -> None:
        if self.flat is not None:
            self.flat[0] = 1.0 if on else 0.0


class ServedCorrection:
    """The learner's side: a forward hook on the base layer of each adapted module that
    subtracts the served adapter's delta, s * on * B_v (A_v x), reading A_v, B_v and the switch
    from the owner's buffer (mapped once per announcement). Until the owner has announced one,
    its weights are W0 and nothing is subtracted.

    One hook function for every layer, each layer's term an attribute of its base layer
    (``served_term``): under learner.compile_layers dynamo guards on a hook's closure, so a hook
    per layer closing over the layer's name compiled one graph per decoder layer until its
    recompile limit (8) left the rest eager; one function reading its module shares one graph.

    ``merges``: the owner merges adapters (BaseExport.merges). Each layer then starts with a term
    of zeros shaped like its own LoRA's, switched off, instead of none: compiled layers are traced
    with the correction from the first pass, and the first announcement swaps in tensors of the
    same shapes, where a term that appeared only then recompiled every layer's graph mid-run."""

    def __init__(self, peft_model: torch.nn.Module, fence: Fence, device: torch.device, merges: bool = False):
        from peft.tuners.lora import LoraLayer

        self.fence, self.device = fence, torch.device(device)
        self.generation = 0
        self.layers: dict[str, torch.nn.Module] = {}
        for name, module in peft_model.named_modules():
            if isinstance(module, LoraLayer):
                self.layers[_checkpoint_name(name)] = module
        for module in self.layers.values():
            module.base_layer.served_term = None
        if merges:
            self._set_zero_terms()
        self.handles = [module.base_layer.register_forward_hook(_subtract_served_delta)
                        for module in self.layers.values()]

    def refresh(self) -> bool:
        """Map the owner's served adapter when it has announced a new one; True when it did
        (graphs captured with the old mapping must go)."""
        if self.fence.generation() == self.generation:  # every step asks: no unpickling unless it changed
            return False
        generation, message = self.fence.announcement()
        if message["device_uuid"] != device_uuid(self.device):
            raise ShareRefused("the replica's served adapter is not on the learner's GPU")
        index = cuda_index_of(message["device_uuid"]) if message["device_uuid"] else None
        flat = open_handle(message["flat"], index)
        layout: ServedLayout = message["layout"]
        missing = sorted(set(layout.layers) - set(self.layers))
        if missing:
            raise ShareRefused(f"the replica merged layers the learner does not adapt, e.g. {missing[0]}")
        self._set_terms(flat, layout)
        self.generation = generation
        return True

    def _set_terms(self, flat: torch.Tensor, layout: "ServedLayout") -> None:
        on = flat[0:1]
        for name, (a, b, scale) in layout.views(flat).items():
            self.layers[name].base_layer.served_term = (a, b, scale, on)

    def _set_zero_terms(self) -> None:
        """Zeros shaped like each layer's own LoRA, switched off. One pair per kind of layer (its
        name with the layer number dropped), shared by the decoder layers: a compiled layer's call
        sees only its own linears' terms, and zeros for every layer would hold the whole LoRA in
        float32 beside the update until the first merge (264 MB at 4B, r=32)."""
        on = torch.zeros(1, dtype=torch.float32, device=self.device)
        zeros: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
        for name, module in self.layers.items():
            shapes = (module.lora_A["default"].weight.shape, module.lora_B["default"].weight.shape)
            key = (re.sub(r"\.\d+\.", ".#.", name), *shapes)
            if key not in zeros:
                zeros[key] = tuple(torch.zeros(shape, dtype=torch.float32, device=self.device) for shape in shapes)
            a, b = zeros[key]
            module.base_layer.served_term = (a, b, float(module.scaling["default"]), on)

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        for module in self.layers.values():
            del module.base_layer.served_term


def _subtract_served_delta(module, args, out):
    """ServedCorrection's forward hook: ``out`` less the served delta s * on * B_v (A_v x)."""
    term = module.served_term
    if term is None:
        return out
    a, b, scale, on = term
    x = args[0]
    return out - torch.nn.functional.linear(torch.nn.functional.linear(x, a.to(x.dtype)), b.to(x.dtype)) * (scale * on).to(out.dtype)


def _checkpoint_name(peft_name: str) -> str:
    """A peft module name as the adapter's checkpoint names it (``base_model.model.`` dropped)."""
    prefix = "base_model.model."
    return peft_name[len(prefix):] if peft_name.startswith(prefix) else peft_name
