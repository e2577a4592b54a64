"""peft's LoRA linear layers run as one autograd function each (learner.fused_lora).

The problem: peft computes an adapted linear as ``base(x) + lora_B(lora_A(dropout(x))) * s``.
Besides the three GEMMs that is an element-wise multiply by s and an add over the whole
[tokens, out] output, each with its own backward, and, under autocast, a cast of the float32
A and B to bf16 on every forward of every micro-batch (and of their gradients back). On an H200
about 0.5 s of the 4B 4x8 update was that element-wise work.

The fused layer: y = x W0ᵀ (+ b), then ``addmm_(y, x Aᵀ, Bᵀ, alpha=s)``: the scale rides in
the GEMM's alpha and the add in its beta. The backward by hand, with g the output's gradient:

    grad_x = g W0 + s (g B) A      (one GEMM, then an addmm_ into it)
    grad_A = s (g B)ᵀ x            grad_B = s gᵀ (x Aᵀ)

It saves x, x Aᵀ and the (frozen) W0. Where the base layer is not a plain nn.Linear or has hooks
on it (model/shared_base.py ``ServedCorrection`` subtracts the replica's adapter in one), the base
layer's own forward runs and only the LoRA term is fused into its output, so the hooks still run.

Casts: under autocast the float32 master A and B are cast to the compute dtype ONCE per optimizer
step into persistent buffers (``CastCache``): ``FusedLora.refresh`` after every optimizer step
(learner/policy.py wraps the step). The copies are made in place, so a captured CUDA graph
(learner/graphed.py) reads the new values. The gradients come back to the float32 masters, as
the bf16 gradient cast up (what autocast's own cast gives peft's path). Note that a fused
optimizer (torch's fused AdamW) does not bump the parameters' version counters, so the explicit
refresh is what keeps the copies current; the version check here only catches other writes.

Everything else is peft's: the modules, their parameters and names (save, load, export, the
state dict), and the layer's forward wherever the fused one does not apply: adapters disabled
(the reference policy of the KL leash) or merged, several or no active adapters, dropout, DoRA
and other variants, LoRA bias, fan_in_fan_out, extra forward arguments, mixed dtypes without
autocast.

Numbers: float32 without autocast, the same values as peft's path up to the order of the scale
multiply (exact where s is a power of two, as for the default alpha = 2 r; tests/test_fused_lora.py).
Under bf16 autocast the LoRA term and the add are rounded once (inside the GEMM) instead of
three times, so the two paths differ by bf16 rounding.
"""

from __future__ import annotations

import types
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules import module as nn_module

_AUTOCAST_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


class LoraLinearFn(torch.autograd.Function):
    """y = base + s (x Aᵀ) Bᵀ with base = x W0ᵀ + b (``weight`` given) or the base layer's own
    output ``base_out``; everything computed in the dtype of ``a_c``/``b_c`` (the compute copies
    of the float32 masters ``lora_a``/``lora_b``, or the masters themselves).

    Shapes: x [..., in], W0 [out, in], A [r, in], B [out, r]; y [..., out]."""

    @staticmethod
    def forward(ctx, x, base_out, weight, bias, lora_a, lora_b, a_c, b_c, scale: float):
        dtype = a_c.dtype
        lead = x.shape[:-1]
        xc = x.reshape(-1, x.shape[-1]).to(dtype)  # [N, in]
        xa = torch.mm(xc, a_c.t())  # [N, r]
        if base_out is None:
            y = F.linear(xc, weight.to(dtype), None if bias is None else bias.to(dtype))  # [N, out], ours
            y.addmm_(xa, b_c.t(), alpha=scale)
        else:
            y = torch.addmm(base_out.reshape(-1, base_out.shape[-1]), xa, b_c.t(), alpha=scale)
        ctx.save_for_backward(xc, xa, weight if base_out is None else None, a_c, b_c)
        ctx.scale, ctx.x_shape, ctx.x_dtype = scale, x.shape, x.dtype
        ctx.base_given = base_out is not None
        ctx.master_dtypes = (lora_a.dtype, lora_b.dtype)
        return y.view(*lead, y.shape[-1])

    @staticmethod
    def backward(ctx, g):
        xc, xa, weight, a_c, b_c = ctx.saved_tensors
        s = ctx.scale
        g2 = g.reshape(-1, g.shape[-1]).to(a_c.dtype)  # [N, out]
        need_x, need_base, _, _, need_a, need_b = ctx.needs_input_grad[:6]
        grad_x = grad_base = grad_a = grad_b = None
        gbs = torch.mm(g2, b_c).mul_(s) if (need_x or need_a) else None  # s (g B): [N, r]
        if need_x:
            if weight is not None:
                grad_x = torch.mm(g2, weight.to(a_c.dtype)).addmm_(gbs, a_c)  # g W0 + s (g B) A
            else:
                grad_x = torch.mm(gbs, a_c)  # the base layer's own backward adds g W0
            grad_x = grad_x.view(ctx.x_shape).to(ctx.x_dtype)
        if need_base:
            grad_base = g
        if need_a:
            grad_a = torch.mm(gbs.t(), xc).to(ctx.master_dtypes[0])  # s (g B)ᵀ x: [r, in]
        if need_b:
            grad_b = torch.mm(g2.t(), xa).mul_(s).to(ctx.master_dtypes[1])  # s gᵀ (x Aᵀ): [out, r]
        return grad_x, grad_base, None, None, grad_a, grad_b, None, None, None


class CastCache:
    """Each LoRA master tensor in a compute dtype, copied from the master only when ``refresh``
    is called (or the master's version counter moved): once per optimizer step, not once per
    forward. The buffers are persistent and rewritten in place."""

    def __init__(self):
        self.entries: dict[tuple[int, torch.dtype], tuple[torch.Tensor, torch.Tensor, list[int]]] = {}

    def get(self, master: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        if master.dtype == dtype:
            return master
        key = (id(master), dtype)
        entry = self.entries.get(key)
        if entry is None:
            with torch.no_grad():
                entry = (master, master.detach().to(dtype), [master._version])
            self.entries[key] = entry
        elif entry[2][0] != master._version:  # written outside an optimizer step (a load, a copy_)
            with torch.no_grad():
                entry[1].copy_(master)
            entry[2][0] = master._version
        return entry[1]

    def refresh(self) -> None:
        """Copy every master into its buffers: one foreach copy per (device, dtype) group."""
        groups: dict[tuple, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
        for master, buf, version in self.entries.values():
            dst, src = groups.setdefault((buf.device, buf.dtype), ([], []))
            dst.append(buf)
            src.append(master.detach())
            version[0] = master._version
        with torch.no_grad():
            for dst, src in groups.values():
                torch._foreach_copy_(dst, src)


def _plain_linear(base: nn.Module) -> bool:
    """Whether ``base`` is an nn.Linear whose forward is F.linear and nothing else: no hooks (on
    it or global) and frozen weights, so that the fused function may run its GEMM itself."""
    return (type(base) is nn.Linear and not base.weight.requires_grad
            and (base.bias is None or not base.bias.requires_grad)
            and not (base._forward_hooks or base._forward_pre_hooks or base._backward_hooks
                     or base._backward_pre_hooks)
            and not (nn_module._global_forward_hooks or nn_module._global_forward_pre_hooks
                     or nn_module._global_backward_hooks or nn_module._global_backward_pre_hooks))


class FusedLora:
    """Every peft ``lora.Linear`` of ``peft_model`` forwarded through ``LoraLinearFn`` where it
    applies (the module docstring says where not); the modules themselves stay peft's.

    ``refresh()`` after each optimizer step (and whenever the masters were written); ``restore()``
    puts peft's forward back. ``compute_dtype``: the autocast dtype the learner runs in, whose
    copies are made at once (so that none is first made inside a CUDA graph capture)."""

    def __init__(self, peft_model: nn.Module, compute_dtype: torch.dtype | None = None):
        from peft.tuners.lora import Linear as LoraLinear  # peft's, imported where it is needed

        self.cache = CastCache()
        self.layers: list[nn.Module] = []
        self.fused_calls = 0  # forwards that ran fused (counted in Python: a graph replay adds none)
        self.peft_calls = 0  # forwards that ran peft's path
        for module in peft_model.modules():
            if type(module) is LoraLinear:
                module.forward = types.MethodType(self._forward_fn(), module)
                self.layers.append(module)
        if compute_dtype is not None:
            for module in self.layers:
                for name in module.lora_A:
                    self.cache.get(module.lora_A[name].weight, compute_dtype)
                    self.cache.get(module.lora_B[name].weight, compute_dtype)

    def refresh(self) -> None:
        self.cache.refresh()

    def restore(self) -> None:
        for module in self.layers:
            del module.forward  # the class's (peft's) forward again
        self.layers = []

    def stats(self) -> dict[str, Any]:
        return {"layers": len(self.layers), "fused_forwards": self.fused_calls, "peft_forwards": self.peft_calls,
                "cast_copies": len(self.cache.entries)}

    def _forward_fn(self):
        fused = self

        def forward(module, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
            out = fused._fused(module, x, args, kwargs)
            if out is None:
                fused.peft_calls += 1
                return type(module).forward(module, x, *args, **kwargs)
            fused.fused_calls += int(out[1])
            fused.peft_calls += int(not out[1])
            return out[0]

        return forward

    def _fused(self, module, x: torch.Tensor, args: tuple, kwargs: dict) -> tuple[torch.Tensor, bool] | None:
        """(the output, whether it ran fused), or None where peft's forward must run."""
        if args or kwargs or module.disable_adapters or module.merged or module.fan_in_fan_out:
            return None
        adapters = module.active_adapters
        if len(adapters) != 1:
            return None
        name = adapters[0]
        if (name not in module.lora_A or name in module.lora_variant
                or not isinstance(module.lora_dropout[name], nn.Identity)):
            return None
        lora_a, lora_b = module.lora_A[name].weight, module.lora_B[name].weight
        if module.lora_B[name].bias is not None:  # peft's lora_bias
            return None
        device_type = x.device.type
        if torch.is_autocast_enabled(device_type) and x.dtype in _AUTOCAST_DTYPES:
            dtype = torch.get_autocast_dtype(device_type)
        elif x.dtype == lora_a.dtype == lora_b.dtype:
            dtype = x.dtype
        else:
            return None  # peft promotes mixed dtypes without autocast: its path, not ours
        base = module.base_layer
        a_c, b_c = self.cache.get(lora_a, dtype), self.cache.get(lora_b, dtype)
        scale = float(module.scaling[name])
        if _plain_linear(base):
            if base.weight.dtype != x.dtype and not torch.is_autocast_enabled(device_type):
                return None
            return LoraLinearFn.apply(x, None, base.weight, base.bias, lora_a, lora_b, a_c, b_c, scale), True
        base_out = base(x)  # its hooks run (ServedCorrection), and its own backward
        if base_out.dtype != dtype:  # an unusual base layer: peft's term on its output, as peft adds it
            return _lora_after(module, x, base_out, name), False
        return LoraLinearFn.apply(x, base_out, None, None, lora_a, lora_b, a_c, b_c, scale), True


def _lora_after(module, x: torch.Tensor, base_out: torch.Tensor, name: str) -> torch.Tensor:
    """peft's LoRA term on an already computed base output (its dtypes as peft has them)."""
    lora_a, lora_b = module.lora_A[name], module.lora_B[name]
    xl = module._cast_input_dtype(x, lora_a.weight.dtype)
    return (base_out + lora_b(lora_a(xl)) * module.scaling[name]).to(base_out.dtype)
