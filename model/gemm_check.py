"""Whether this process's GPU computes a LoRA learner's GEMMs right: the check a run makes of every
CUDA MPS client share below 100% before any of its GPU processes exists (services/mps.py).

Why: on an H100 (driver 580.159.04, torch 2.11) an MPS client capped by
CUDA_MPS_ACTIVE_THREAD_PERCENTAGE at 60, 75 or 80% of the SMs got wrong bf16 GEMMs, while 50, 90
and 100% matched the uncapped process (bench/mps_numerics.py, bench/results/gpu-2026-12-05-h100-mps/).
At 60% lora_A's forward gave nan in the first layer; at 75% every output was finite and wrong (a
step's gradient norm 5.9e4 against 0.15); at 80% a plain GEMM of the down projection's shape was
off by 1.35 of its scale. A run trained on such numbers looks like a run. On the next H100 lease
this check flagged 60, 75 and 80 (75 through the base's forward and input gradients at the 4x8
micro-batch's 4672 tokens), and most other shares from 15 to 85; it passed 5, 10, 25, 27, 48, 50 and
90-99, the same each time it was repeated (bench/results/gpu-2026-12-06-h100/). An H200 with the same
driver gave the same map: 5, 10, 25, 50, 90 and 95 right, every other share from 15 to 85 wrong
(bench/results/gpu-2026-12-06-h200/).

The check runs each linear of one adapted layer the way autograd does (forward F.linear, the
input's gradient, the adapter's weight gradient; LoRA's B also as the fused learner's addmm) at
the worker's token counts, in the model's dtype on the device, and compares sampled output rows
(whole outputs where they are small) with fp32 on the CPU from the same inputs. It can miss a
kernel that is wrong only at shapes it does not run; the learner's refusal of a non-finite
gradient (learner/passes.py) stays the backstop.

    python -m model.gemm_check '{"widths": [[2560, 4096], [2560, 9728]], "rank": 32, "tokens": [4672]}'

prints one JSON line and exits 1 when a GEMM is off. No Ray, no gRPC.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass

# bf16 keeps 8 bits of mantissa: its GEMMs land within ~0.3% of the fp32 result's scale (measured
# 0.2-0.31% at these shapes). The wrong kernels were off by far more, or nan.
TOLERANCE = 0.02
SAMPLE_ROWS = 64
# Qwen3-4B's linears (in, out): the widths where the run's model's config.json cannot be read
# (services/mps.py numerics_specs) and bench/mps_numerics.py's
FALLBACK_WIDTHS = ((2560, 4096), (2560, 1024), (4096, 2560), (2560, 9728), (9728, 2560))


@dataclass(frozen=True)
class Gemm:
    """One product as autograd runs it: ``op`` is forward (F.linear(x, W)), dgrad (gy @ W), wgrad
    (gy^T @ x) or addmm (c + alpha * x @ W^T, the fused learner's lora_B)."""

    linear: str  # "base 2560->9728", "lora_A 2560->32", ...
    op: str
    tokens: int
    d_in: int
    d_out: int

    @property
    def name(self) -> str:
        return f"{self.linear} {self.op} at {self.tokens} tokens"


def learner_gemms(widths, rank: int, tokens) -> list[Gemm]:
    """Every product one adapted layer's backward and forward run, per token count."""
    out = []
    for t in tokens:
        for d_in, d_out in widths:
            out += [Gemm(f"base {d_in}->{d_out}", op, t, d_in, d_out) for op in ("forward", "dgrad")]
            out += [Gemm(f"lora_A {d_in}->{rank}", op, t, d_in, rank) for op in ("forward", "dgrad", "wgrad")]
            out += [Gemm(f"lora_B {rank}->{d_out}", op, t, rank, d_out) for op in ("forward", "addmm", "dgrad", "wgrad")]
    return out


def relative_error(got, ref) -> float:
    """max |got - ref| over max |ref|; inf where got holds a nan or an inf."""
    import torch

    if not bool(torch.isfinite(got).all()):
        return float("inf")
    return float((got - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


def run_gemm(g: Gemm, device: str, dtype, generator) -> float:
    """``g`` on ``device`` in ``dtype`` against fp32 on the CPU from the same (rounded) inputs.
    Inputs are drawn on the device; only the rows compared (whole inputs for a weight gradient)
    cross to the CPU."""
    import torch
    import torch.nn.functional as F

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=generator, device=device) * scale).to(dtype)

    def cpu(t):
        return t.float().cpu()

    w = rand(g.d_out, g.d_in, scale=g.d_in ** -0.5)  # a linear's weight, stored (out, in)
    if g.op == "wgrad":  # a reduction over every token into a small output: compared whole
        gy, x = rand(g.tokens, g.d_out), rand(g.tokens, g.d_in)
        return relative_error(cpu(gy.T @ x), cpu(gy).T @ cpu(x))
    rows = torch.randperm(g.tokens, generator=generator, device=device)[:SAMPLE_ROWS]
    if g.op == "dgrad":
        gy = rand(g.tokens, g.d_out)
        return relative_error(cpu((gy @ w)[rows]), cpu(gy[rows]) @ cpu(w))
    x = rand(g.tokens, g.d_in)
    if g.op == "forward":
        return relative_error(cpu(F.linear(x, w)[rows]), cpu(x[rows]) @ cpu(w).T)
    c = rand(g.tokens, g.d_out)  # addmm: the fused learner's c + s * h B^T
    return relative_error(cpu(torch.addmm(c, x, w.T, alpha=2.0)[rows]), cpu(c[rows]) + 2.0 * (cpu(x[rows]) @ cpu(w).T))


def check(gemms, device: str = "cuda", dtype_name: str = "bfloat16", seed: int = 0) -> dict:
    """{"ok", "device", "sm_count", "worst": {"name", "error"}, "off": [names off by > TOLERANCE]}."""
    import torch

    dtype = getattr(torch, dtype_name)
    generator = torch.Generator(device=device).manual_seed(seed)
    errors = {g.name: run_gemm(g, device, dtype, generator) for g in gemms}
    worst = max(errors, key=errors.get)
    sm = torch.cuda.get_device_properties(0).multi_processor_count if device == "cuda" else None
    off = [n for n, e in errors.items() if not e <= TOLERANCE]
    return {"ok": not off, "device": device, "sm_count": sm, "checked": len(errors),
            "worst": {"name": worst, "error": errors[worst]}, "off": off}


def main(argv: list[str]) -> int:
    spec = json.loads(argv[0])
    gemms = learner_gemms([tuple(w) for w in spec["widths"]], spec["rank"], spec["tokens"])
    result = check(gemms, spec.get("device", "cuda"), spec.get("dtype", "bfloat16"))
    print(json.dumps(result), flush=True)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
