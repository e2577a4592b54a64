"""learner.compile_layers: each decoder layer of the policy compiled by torch.compile.

Why: once the LoRA linears are fused (learner/fused_lora.py), what is left of the update's gap to
its GEMM floor is element-wise work between the GEMMs: the RMS norms (four per Qwen3 layer, each
a float32 round trip), RoPE's multiplies and halves, the SiLU and its gate multiply, the
residual adds, and each of their backwards, every one a separate pass over [tokens, hidden] or
[tokens, intermediate] in HBM. Inductor fuses each run of them into one kernel. Under CUDA MPS
those passes also compete with the replica's decode for memory bandwidth (config/gpu_sharing.py).

How: regional compilation, as accelerate's ``compile_regions`` does it. The decoder layer class
(the model's ``_no_split_modules``, which transformers declares for every architecture) is
compiled module by module with ``nn.Module.compile``: parameter names, the state dict, peft's
modules and saving stay as they are. All layers share one compiled graph, because torch.compile
inlines built-in modules and takes their parameters as graph inputs. ``dynamic=True``: the
micro-batches' rows and lengths change every step, and one symbolic-shape graph serves them
all instead of a compile per shape. The first layer gets a second graph, since its input (the
frozen embedding's output) carries no gradient.

Under strategy=fsdp2 the layers are compiled after fully_shard, which swaps each layer's class
for a subclass and gathers its weights in forward hooks; dynamo leaves FSDP's hooks out of the
graph (``torch._dynamo.config.skip_fsdp_hooks``), so the all-gathers run as they do eagerly
around the compiled layer. Under DDP the gradient all-reduce hooks on the parameters, outside
any graph. Both over 2 gloo ranks: tests/test_learner_compile.py.

Over peft's own LoRA layers, not learner/fused_lora.py's (refused together): the fused layers look their cast copies
up by parameter, so dynamo guards on each layer's parameters and compiles a graph per layer
until its cache limit (measured: 1.70 s a 4x8 step against 0.95 s over peft's layers), and
inductor fuses peft's scale and add itself.

Numbers: the same loss and gradients up to float rounding. Inductor reorders the sums inside
the norms and fused element-wise chains; tests/test_learner_compile.py bounds the float32
difference against the eager learner on CPU.
"""

from __future__ import annotations

import logging
from typing import Any

from torch import nn

log = logging.getLogger(__name__)


def compile_decision(cfg: Any, *, on_cuda: bool, world_size: int, mapped_base: bool) -> tuple[bool, str]:
    """(whether the learner compiles its layers, why): ``cfg.compile_layers`` where set, else
    (auto) where it was measured to pay: one CUDA worker under strategy ddp, with none of the
    paths whose shapes or hooks it was not tried with on a GPU (CUDA graphs, packed rows, a shared
    prompt prefix, a base mapped from a replica, whose correction runs in forward hooks). Packed
    rows, several DDP workers, fsdp2 (tests/test_learner_compile.py) and a mapped base
    (tests/test_shared_base.py; its hooks add no graph, tests/test_learner_compile.py) are tested
    on CPU and not yet timed: true compiles there. The
    reason goes to run.json (``learner_layers``): a learner left eager runs slower than the
    compiled one the bench timed, and the run says why. ``cfg``: a LearnerConfig."""
    if cfg.compile_layers != "auto":
        return bool(cfg.compile_layers), f"learner.compile_layers={str(cfg.compile_layers).lower()}"
    auto = "learner.compile_layers=auto"
    blockers = (
        (not on_cuda, "the worker is on the CPU"),
        (world_size > 1, f"{world_size} learner workers (timed for one)"),
        (cfg.strategy != "ddp", f"strategy={cfg.strategy}"),
        (cfg.cuda_graphs, "learner.cuda_graphs=true"),
        (cfg.pack_sequences, "learner.pack_sequences=true"),
        (cfg.share_prompt_prefix is True, "learner.share_prompt_prefix=true"),
        (mapped_base, "the base is mapped from the replica (share_base_weights), whose merged-adapter "
                      "correction runs in forward hooks; never timed compiled on a GPU: "
                      "learner.compile_layers=true compiles it, share_base_weights=false gives the "
                      "learner its own copy, which auto compiles"),
    )
    for blocked, why in blockers:
        if blocked:
            return False, f"{auto} leaves the layers eager: {why}"
    return True, f"{auto}: one CUDA worker under ddp, where compiling was measured to pay"


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks of a transformers model or its peft wrapper (the classes that any of
    its modules names in ``_no_split_modules``: LlamaDecoderLayer, ...), in order; [] where none
    is declared. learner/fsdp.py shards these, and compile_layers compiles them."""
    names = set()
    for m in model.modules():
        names.update(getattr(m, "_no_split_modules", None) or ())
    # by the class or a base: fully_shard swaps each sharded layer's class for a subclass
    # (FSDP<Name>) that carries its hooks
    return [m for m in model.modules() if any(c.__name__ in names for c in type(m).__mro__)]


def compile_layers(model: nn.Module) -> int:
    """Compile each decoder layer of ``model`` (a transformers model, not its peft wrapper) in
    place; returns how many (0, said once, where torch.compile is disabled in this process, as
    TORCH_COMPILE_DISABLE or a vLLM CPU engine created here does). Compilation happens at each
    layer's first call."""
    import torch._dynamo

    if torch._dynamo.config.disable:
        log.warning("learner.compile_layers: torch.compile is disabled in this process "
                    "(TORCH_COMPILE_DISABLE or torch._dynamo.config.disable); the layers run eagerly")
        return 0
    layers = decoder_layers(model)
    for layer in layers:
        layer.compile(dynamic=True)
    return len(layers)
