"""The update's forward and backward replayed as CUDA graphs, one capture per micro-batch shape.

Why: on the H200 the learner's update was bound by the host, not the GPU. The profile of
bench/results/gpu-vs-trl.md (4B, 1x8x384) had the device busy 0.4 s of a 1.15 s update;
at 0.6B it was idle most of the time. peft's LoRA layers (7 per decoder layer) and
transformers' decoder launch some ten thousand small kernels per forward and backward, each
from Python. ``torch.cuda.make_graphed_callables`` captures the forward and its backward once.
After that each is one graph launch, and the host runs free at once.

What is captured: ``ScoredTokens``, from input_ids to the log-probs of the scored tokens (and
their entropies), through the peft model, under autocast with its cast cache off (CUDA graphs
need that). Not captured:
- the loss: a few dozen element-wise ops on [B, W];
- the old_log_prob and ref passes: they have no backward, and ref toggles the adapter, which a
  captured graph would not see;
- DDP, DeepSpeed and gradient checkpointing: their hooks run during the backward;
- LoRA dropout: random numbers.
``learner.cuda_graphs`` switches capture on. policy.py captures only where none of the above
applies. A capture that fails is reported once, and the step runs eagerly from then on (the
``learner_cuda_graphs`` metric says which way each step ran).

Shapes: a graph holds fixed shapes. Micro-batches are padded to multiples of
``learner.graph_pad_tokens`` (learner/passes.py make_micro_batches), and the padding is masked
out of the loss. Steps of similar lengths then share one graph. At most ``learner.max_graphs``
graphs are kept, least recently used first out: each holds its own memory pool of activations.
There is no attention mask: rows are right-padded, so under the causal mask a real token never
sees a pad (``MicroBatch.causal_only``).

Gradients accumulate in place. A graphed backward returns views of its static gradient buffers.
Where a parameter has no .grad yet, autograd would install that view as its .grad, and the next
replay would overwrite it. So the trainer keeps its .grad tensors allocated
(learner/passes.py ``ddp_grad_sync(keep_grads=True)``).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch

from learner.passes import MicroBatch, forward_logprobs, token_logprobs

log = logging.getLogger(__name__)


class ScoredTokens(torch.nn.Module):
    """``input_ids`` [B, L] -> (log-probs [B, W],) or (log-probs, entropies [B, W]) of the tokens
    at positions start + 1 .. L - 1 (W = L - 1 - start), without an attention mask."""

    def __init__(self, lm: torch.nn.Module, start: int, temperature: float, entropy: str, logprob_chunk: int = 0):
        super().__init__()
        self.lm, self.start, self.temperature, self.entropy = lm, start, temperature, entropy
        self.logprob_chunk = logprob_chunk

    def forward(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, ...]:
        keep = input_ids.shape[1] - self.start
        logits = self.lm(input_ids=input_ids, logits_to_keep=keep, use_cache=False).logits
        logp, ent = token_logprobs(logits, input_ids[:, self.start + 1 :], self.temperature, self.entropy,
                                   self.logprob_chunk)
        return (logp,) if ent is None else (logp, ent)


Capture = Callable[[torch.nn.Module, torch.Tensor], Callable[[torch.Tensor], tuple[torch.Tensor, ...]]]


def cuda_capture(module: torch.nn.Module, sample: torch.Tensor) -> Callable[[torch.Tensor], tuple[torch.Tensor, ...]]:
    """The module's forward and backward captured on CUDA (three warm-up passes first, on a side
    stream, as make_graphed_callables does); replays copy their input into the static one."""
    return torch.cuda.make_graphed_callables(module, (sample,), num_warmup_iters=3)


class GraphedScorer:
    """A ``learner.passes.Scorer`` that replays a captured graph per micro-batch shape, and runs
    eagerly what cannot be captured (see the module docstring)."""

    def __init__(self, peft_model: torch.nn.Module, max_graphs: int, capture: Capture = cuda_capture):
        if max_graphs < 1:
            raise ValueError(f"max_graphs must be >= 1, got {max_graphs}")
        self.peft_model, self.max_graphs, self.capture = peft_model, max_graphs, capture
        self.graphs: OrderedDict[tuple, Callable] = OrderedDict()
        self.disabled: str | None = None  # why capture was given up, once it failed
        self.captures, self.capture_s, self.replays, self.eager = 0, 0.0, 0, 0

    def __call__(self, model, mb: MicroBatch, temperature: float, entropy: str,
                 amp_dtype: torch.dtype | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        fn = None
        if self.disabled is None and mb.causal_only and not mb.shared_prefix:
            key = (tuple(mb.input_ids.shape), mb.start, float(temperature), entropy, amp_dtype, mb.logprob_chunk)
            fn = self.graphs.get(key)
            if fn is None:
                fn = self._capture(key, mb, temperature, entropy, amp_dtype)
            else:
                self.graphs.move_to_end(key)
        if fn is None:
            self.eager += 1
            return forward_logprobs(model, mb, temperature, entropy, amp_dtype)
        outs = fn(mb.input_ids)
        self.replays += 1
        return outs[0], (outs[1] if len(outs) > 1 else None)

    def _capture(self, key: tuple, mb: MicroBatch, temperature: float, entropy: str,
                 amp_dtype: torch.dtype | None) -> Callable | None:
        while len(self.graphs) >= self.max_graphs:
            self.graphs.popitem(last=False)  # frees that graph and its memory pool
        t = time.perf_counter()
        amp = (torch.autocast(device_type="cuda", dtype=amp_dtype, cache_enabled=False)
               if amp_dtype is not None else contextlib.nullcontext())
        try:
            with amp:
                fn = self.capture(ScoredTokens(self.peft_model, mb.start, temperature, entropy, mb.logprob_chunk),
                                  mb.input_ids)
        except Exception as err:  # noqa: BLE001 - any capture failure: say so once, run eagerly
            self.disabled = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"[:300]
            log.warning("learner: capturing the update as a CUDA graph failed (%s); the update runs eagerly "
                        "from now on (learner.cuda_graphs=false avoids the attempt)", self.disabled)
            return None
        if torch.cuda.is_available():
            torch.cuda.empty_cache()  # the warm-up passes' blocks: the graph's own pool holds what replays use
        self.capture_s += time.perf_counter() - t
        self.captures += 1
        self.graphs[key] = fn
        return fn

    def stats(self) -> dict[str, Any]:
        return {"captures": self.captures, "capture_s": round(self.capture_s, 3), "replays": self.replays,
                "eager": self.eager, "graphs_held": len(self.graphs), "disabled": self.disabled}
