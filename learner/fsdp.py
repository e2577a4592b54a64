"""FSDP2 (learner.strategy=fsdp2): the base weights sharded over the workers, LoRA trained.

The problem: under DDP every worker holds the whole base model (and, while loading, a whole
copy in host RAM). Here each worker holds 1/world of every weight (torch's ``fully_shard`` per
decoder layer, then the root), and a layer's weights are all-gathered only while it runs.

How the model is built, so that no worker ever holds the whole model:
1. the transformers model is built from its config.json with every PARAMETER on the meta device
   (``params_on_meta``: each is created, then moved to meta before the next one exists) and
   every BUFFER real on the CPU: non-persistent buffers (rotary ``inv_freq``) are in no
   checkpoint, so they must be computed at construction;
2. LoRA is attached as on the plain path (``attach_lora``: seed, then get_peft_model): peft
   draws each adapter on the CPU, with the same RNG calls in the same order as on a loaded
   base, then moves it to its base layer's device (meta); ``lora_values_kept`` keeps each
   adapter's values just before that move, cast to the base dtype as the move casts them, so
   the same seed gives the same adapter (tests/test_learner_fsdp.py compares them);
3. ``fully_shard`` per decoder layer and the root; ``to_empty`` allocates this rank's shards;
4. every rank reads ONLY ITS SLICE of each base weight from the safetensors files (memory-mapped:
   ``safe_open(...).get_slice``), one tensor at a time, and the LoRA values and buffers kept
   from steps 1-2 are copied in (the LoRA its slice). Why each rank reads its own slice rather
   than rank 0 broadcasting: every worker already resolves the model from its own node's cache
   (as the DDP path does), so no bytes need to cross the network, no rank holds more than one
   slice at a time, and no collective is needed to load.

Shards: FSDP2 shards dim 0 as torch.chunk does (``local_rows``). The adapter and the optimizer
state leave as FULL tensors (``full_state``: DTensor.full_tensor(), a collective: every rank
calls it, in the same order), so checkpoints and published adapters have the plain learner's
layout, whatever the world size (learner/checkpoint.py).

Torch, transformers, peft and safetensors only: no Ray.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from learner.compiled_layers import decoder_layers
from learner.passes import GradSync, refuse_nonfinite

SAFETENSORS_INDEX = "model.safetensors.index.json"


@contextlib.contextmanager
def params_on_meta() -> Iterator[None]:
    """Modules built inside get their parameters on the meta device, buffers where they are
    made (the CPU). A parameter is created, then replaced by its meta twin at registration, so
    its initialisation (which runs after) costs nothing and one tensor exists at a time."""
    register = nn.Module.register_parameter

    def register_on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        register(module, name, param)
        if param is not None and param.device.type != "meta":
            module._parameters[name] = type(param)(param.to("meta"), requires_grad=param.requires_grad)

    nn.Module.register_parameter = register_on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


@contextlib.contextmanager
def lora_values_kept(kept: dict[int, dict[str, torch.Tensor]]) -> Iterator[None]:
    """peft draws each new adapter on the CPU, then moves (and casts) it to its base layer's
    device and dtype: on a meta base its values would be gone. Inside, each adapter's values
    are kept, as that move leaves them (cast to the base dtype), in ``kept`` under the id of
    its module (lora_A / lora_B), before peft moves it."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    move = BaseTunerLayer._move_adapter_to_device_of_base_layer

    def keep_then_move(self, adapter_name: str, device: torch.device | None = None) -> None:
        weight = getattr(self.get_base_layer(), "weight", None)
        for layer_name in self.adapter_layer_names:
            modules = getattr(self, layer_name, None)
            if isinstance(modules, nn.ModuleDict) and adapter_name in modules and weight is not None:
                cast = weight.dtype if weight.dtype.is_floating_point else None
                kept[id(modules[adapter_name])] = {n: t.detach().to(dtype=cast or t.dtype, copy=True)
                                                   for n, t in modules[adapter_name].state_dict().items()}
        move(self, adapter_name, device=device)

    BaseTunerLayer._move_adapter_to_device_of_base_layer = keep_then_move
    try:
        yield
    finally:
        BaseTunerLayer._move_adapter_to_device_of_base_layer = move


def meta_lora_model(model_dir: Path, model_cfg, lora_cfg, seed: int, init_adapter: Path | None):
    """(the peft model with every parameter on the meta device and its buffers real on the CPU,
    the adapter's values by parameter name): the same adapter ``attach_lora`` makes on a loaded
    base (seeded init, or ``init_adapter``'s weights)."""
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    from learner.lora import attach_lora
    from model.adapter_dir import WEIGHTS_FILE
    from model.base import torch_dtype

    with params_on_meta():
        base = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(model_dir)),
                                                dtype=torch_dtype(model_cfg.dtype))
    base.eval()  # as from_pretrained leaves it
    base.config.use_cache = False
    for p in base.parameters():
        p.requires_grad_(False)
    by_module: dict[int, dict[str, torch.Tensor]] = {}
    with lora_values_kept(by_module):
        peft_model = attach_lora(base, lora_cfg, seed, init_adapter)
    lora = {f"{m_name}.{n}": v for m_name, m in peft_model.named_modules() if id(m) in by_module
            for n, v in by_module[id(m)].items()}
    trainable = {n for n, p in peft_model.named_parameters() if p.requires_grad}
    if set(lora) != trainable:
        raise RuntimeError(f"kept adapter values for {len(lora)} tensors, but {len(trainable)} are trainable")
    if init_adapter is not None:  # peft loaded the file into meta tensors: read it again
        saved = load_file(str(Path(init_adapter) / WEIGHTS_FILE))
        name = peft_model.active_adapter
        lora = {n: saved[n.replace(f".{name}.", ".")] for n in lora}
    return peft_model, lora


def mixed_precision(base_dtype: torch.dtype, device: torch.device):
    """Compute in the base dtype on CUDA with a 16-bit base (LoRA kept float32 for the optimizer,
    gradients reduced in float32); everything as stored otherwise (float32 on CPU: the plain
    path's numbers)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    low = device.type == "cuda" and base_dtype in (torch.bfloat16, torch.float16)
    return MixedPrecisionPolicy(param_dtype=base_dtype if low else None,
                                reduce_dtype=torch.float32 if low else None)


def local_rows(full_rows: int, world: int, rank: int) -> tuple[int, int]:
    """The dim-0 rows [lo, hi) of rank ``rank``'s FSDP2 shard: torch.chunk's split (the last
    ranks may get fewer rows, or none)."""
    per = -(-full_rows // world)
    lo = min(rank * per, full_rows)
    return lo, min(lo + per, full_rows)


def copy_slice_into(param: torch.Tensor, read_rows) -> None:
    """Fill this rank's shard of ``param`` (a DTensor sharded on dim 0, or a replicated plain
    tensor) from ``read_rows(lo, hi)``, which returns those rows of the full tensor."""
    with torch.no_grad():
        if isinstance(param, DTensor):
            local = param.to_local()
            mesh = param.device_mesh
            lo, hi = local_rows(param.shape[0], mesh.size(), mesh.get_local_rank())
            if hi > lo:
                local.copy_(read_rows(lo, hi))
        else:
            param.copy_(read_rows(0, param.shape[0]))


def safetensors_files(model_dir: Path) -> list[Path]:
    index = model_dir / SAFETENSORS_INDEX
    if index.is_file():
        return sorted({model_dir / f for f in json.loads(index.read_text())["weight_map"].values()})
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"learner.strategy=fsdp2 loads safetensors checkpoints slice by slice; {model_dir} has none")
    return files


def checkpoint_name(param_name: str, prefix: str) -> str:
    """The name a base parameter of the peft model has in the model's own checkpoint."""
    name = param_name.removeprefix(prefix)
    return name.replace(".base_layer.", ".")


def build_fsdp_model(model_dir: Path, model_cfg, lora_cfg, seed: int, init_adapter: Path | None,
                     device: torch.device, cpu_offload: bool = False):
    """The peft model, sharded over the default process group and loaded: see the module doc."""
    from safetensors import safe_open
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("learner.strategy=fsdp2 needs torch.distributed initialised (the Ray Train workers do it)")
    peft_model, kept = meta_lora_model(model_dir, model_cfg, lora_cfg, seed, init_adapter)
    buffers = {n: b.detach().clone() for n, b in peft_model.named_buffers()}
    base_dtype = next(p.dtype for n, p in peft_model.named_parameters() if n not in kept)
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    policy = dict(mesh=mesh, mp_policy=mixed_precision(base_dtype, device),
                  offload_policy=CPUOffloadPolicy() if cpu_offload else OffloadPolicy())
    layers = decoder_layers(peft_model)
    if not layers:
        raise ValueError("no decoder layers found to shard: the model names none in _no_split_modules")
    for layer in layers:
        fully_shard(layer, **policy)
    fully_shard(peft_model, **policy)
    peft_model.to_empty(device="cpu" if cpu_offload else device)

    params = dict(peft_model.named_parameters())
    prefix = "base_model.model."
    wanted = {checkpoint_name(n, prefix): n for n in params if n not in kept}
    for path in safetensors_files(Path(model_dir)):
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():
                name = wanted.pop(key, None)
                if name is None:
                    continue  # tied (lm_head.weight is embed_tokens.weight) or not a parameter
                part = f.get_slice(key)
                copy_slice_into(params[name], lambda lo, hi: part[lo:hi].to(base_dtype))
    if wanted:
        raise ValueError(f"{model_dir}: no weights for {sorted(wanted)[:5]} ({len(wanted)} base parameters)")
    for name, value in kept.items():
        copy_slice_into(params[name], lambda lo, hi, v=value: v[lo:hi])
    named_buffers = dict(peft_model.named_buffers())
    for name, value in buffers.items():
        with torch.no_grad():
            named_buffers[name].copy_(value)
    return peft_model


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor (collective for a DTensor: every rank must call it, in the same order)."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def full_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` with every DTensor gathered whole (in key order: the same on every rank)."""
    return {k: full_tensor(v) for k, v in state.items()}


def full_optimizer_state(optimizer: torch.optim.Optimizer) -> dict:
    """``optimizer.state_dict()`` with the sharded state gathered: the plain learner's layout
    (parameter indices, full tensors), so a checkpoint resumes under any world size or strategy."""
    sd = optimizer.state_dict()
    sd["state"] = {i: full_state(s) for i, s in sorted(sd["state"].items())}
    return sd


def load_full_optimizer_state(optimizer: torch.optim.Optimizer, sd: dict) -> None:
    """Load a full (plain-layout) optimizer state dict into an optimizer over DTensor params:
    each state tensor of a parameter's shape becomes this rank's shard of it."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    state = {}
    for i, s in sd["state"].items():
        p = params[int(i)]
        state[i] = {k: (shard_like(p, v) if torch.is_tensor(v) and isinstance(p, DTensor) and v.shape == p.shape else v)
                    for k, v in s.items()}
    optimizer.load_state_dict({**sd, "state": state})


def shard_like(param: DTensor, full: torch.Tensor) -> DTensor:
    """``full`` cut to ``param``'s placement, from this rank's own copy (no communication)."""
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(full.to(param.to_local().device), param.device_mesh, param.placements, src_data_rank=None)


def fsdp_grad_sync(model, optimizer: torch.optim.Optimizer, max_grad_norm: float) -> GradSync:
    """Gradient accumulation over micro-batches for an FSDP2 model: unsharded gradients kept
    locally until the pass's last backward, which reduce-scatters them (like DDP's no_sync);
    clipping by the norm of the sharded gradients (a DTensor, reduced over ranks)."""
    trainable = [p for g in optimizer.param_groups for p in g["params"]]

    def backward(loss: torch.Tensor, last: bool) -> None:
        model.set_requires_gradient_sync(last)
        loss.backward()

    def step() -> float:
        norm = refuse_nonfinite(float(full_tensor(torch.nn.utils.clip_grad_norm_(trainable, max_grad_norm))),
                                optimizer)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return norm

    return GradSync(backward=backward, step=step)
