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

Numbers: the same loss and gradients up to float rounding. Inductor reorders the reductions
inside the norms and softmax-free element-wise chains; tests/test_learner_compile.py bounds the
float32 difference against the eager learner on CPU.
"""

from __future__ import annotations

from torch import nn


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks of a transformers model (its ``_no_split_modules`` classes), in order;
    [] where the model declares none."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    return [m for m in model.modules() if type(m).__name__ in names]


def compile_layers(model: nn.Module) -> int:
    """Compile each decoder layer of ``model`` (a transformers model, not its peft wrapper) in
    place; returns how many. Compilation happens at each layer's first call."""
    layers = decoder_layers(model)
    for layer in layers:
        layer.compile(dynamic=True)
    return len(layers)
