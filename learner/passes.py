"""The learner's passes over one worker's shard: old_log_prob, ref, update_actor, and the one
teacher-forced log-prob computation they share (``forward_logprobs``; ``response_logprobs`` runs
it on plain lists for the `rollout logprobs` CLI and the parity tests).

Torch (and torch.distributed, through the DDP-wrapped model) only; no Ray. Tensors of a
micro-batch cover only the positions that can hold response tokens: the model is asked for
``logits_to_keep`` = L - s logits, s = (shortest prompt) - 1, so the output head and the
log-softmax over the 49k vocabulary never run on prompt positions the loss cannot see; and the
tokens every row of a micro-batch shares (a group's prompt) run once (learner.shared_prefix).
The model passed in is a ``SharedPrefixLM`` (or DDP/DeepSpeed around one).

Packed micro-batches (learner.pack_sequences): the rows run as ONE row of their summed length,
without padding, their position ids restarting at 0 at every row and no attention mask, from
which transformers builds a block-diagonal causal mask (masking_utils find_packed_sequence_indices:
sdpa, eager, flex) or flash attention takes the rows' boundaries (varlen). Logits are kept only at
the positions predicting response tokens; their log-probs are then laid out as the padded
micro-batch's [B, W] (``MicroBatch.unpack``), so the losses see the same tensors either way.
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field, replace

import torch
from torch.profiler import record_function

from config.learner import LearnerConfig
from config.rollout import RolloutConfig
from learner.losses import LossInputs, LossNorm, ObjectiveParams, policy_loss
from learner.microbatch import capped_count_bounds, computed_tokens, count_bounds, token_budget_bounds
from learner.rollout_correction import as_floats, merge_sums, rollout_mismatch_sum_tensors
from learner.shared_prefix import shared_prefix_len
from learner.types import TrainBatch

_LEARNER, _ROLLOUT = LearnerConfig(), RolloutConfig()  # the schema's defaults: declared there, read here


@dataclass
class MicroBatch:
    """B sequences right-padded to L tokens; W = L - 1 - s scored positions from position s."""

    input_ids: torch.Tensor  # [B, L] long (packed: [1, T])
    attention_mask: torch.Tensor | None  # [B, L] long (packed: None)
    start: int  # s: first scored position (predicts token s + 1)
    mask: torch.Tensor  # [B, W] float, 1 = response token in the loss
    rollout_logprobs: torch.Tensor  # [B, W] float
    advantages: torch.Tensor  # [B] float
    shared_prefix: int = 0  # c <= s leading tokens every row has; computed once (0 = off)
    tokens: int = 0  # real (unpadded) tokens one forward runs, the shared prefix counted once
    causal_only: bool = False  # run without the attention mask (see make_micro_batches)
    logprob_chunk: int = 0  # token_logprobs' chunk_tokens (learner.logprob_chunk_tokens; 0 = plain)
    padding: bool = False  # runs only to join the ranks' collectives (pad_micro_batches): adds nothing
    # packed (learner.pack_sequences): input_ids is ONE row [1, T] of the B rows end to end, no attention mask
    position_ids: torch.Tensor | None = None  # [1, T] long, 0.. at every row's first token
    keep: torch.Tensor | None = None  # [K + 1] long: positions whose logits are computed (K scored, one spare)
    unpack: torch.Tensor | None = None  # [B, W] long: each scored column's index in the K log-probs; K = none

    @property
    def packed(self) -> bool:
        return self.position_ids is not None


def make_micro_batches(
    batch: TrainBatch,
    size: int,
    device: torch.device | str = "cpu",
    pad_id: int = 0,
    share_prefix: bool = True,
    token_budget: int | None = None,
    pad_multiple: int = 1,
    causal_only: bool = False,
    logprob_chunk: int = 0,
    max_rows: int | None = None,
    pack: bool = False,
) -> list[MicroBatch]:
    """Consecutive rows in micro-batches of ``size``, or, with ``token_budget``, of at most that
    many padded tokens (learner/microbatch.py: groups kept whole where they fit). The
    orchestrator orders rows by group, so a micro-batch of G rows is one group and shares its
    whole prompt.

    ``pad_multiple`` > 1 rounds the width up and the first scored position down to multiples of
    it, so that micro-batches of similar lengths have one shape (a captured CUDA graph per shape,
    learner/graphed.py); the extra positions are masked out of the loss. ``causal_only``: the
    forward gets no attention mask. Exact for right-padded rows: under the causal mask a real
    token only sees the tokens before it, all real; only pad positions' logits (never read)
    differ. It lets attention run its plain causal kernel. ``logprob_chunk``: the micro-batches'
    log-probs are computed in slices of that many tokens (``token_logprobs``). ``max_rows`` with
    ``token_budget``: ``max_rows`` consecutive rows each, as by count, and only a micro-batch that
    would exceed the budget cut further by it (learner/microbatch.py ``capped_count_bounds``).

    ``pack`` (learner.pack_sequences): each micro-batch's rows concatenated into one row
    (``pack_rows``), its length rounded up to ``pad_multiple`` at the end only; the token budget
    counts the rows' real tokens; no shared prefix. mask, rollout_logprobs and advantages are the
    padded micro-batch's, to which the forward's log-probs are unpacked (``forward_logprobs``)."""
    if pad_multiple < 1:
        raise ValueError(f"pad_multiple must be >= 1, got {pad_multiple}")
    if token_budget is None:
        bounds = count_bounds(len(batch), size)
    else:
        lengths = [len(p) + len(r) for p, r in zip(batch.prompt_ids, batch.response_ids)]
        bounds = (token_budget_bounds(lengths, token_budget, batch.group_ids, packed=pack) if max_rows is None
                  else capped_count_bounds(lengths, max_rows, token_budget, batch.group_ids, packed=pack))
    out = []
    for lo, hi in bounds:
        rows = range(lo, hi)
        prompts = [batch.prompt_ids[i] for i in rows]
        resps = [batch.response_ids[i] for i in rows]
        grain = 1 if pack else pad_multiple  # packed: the one row is rounded up instead
        width = -(-max(len(p) + len(r) for p, r in zip(prompts, resps)) // grain) * grain
        start = (min(len(p) for p in prompts) - 1) // grain * grain
        shared = (shared_prefix_len([list(p) + list(r) for p, r in zip(prompts, resps)], start)
                  if share_prefix and not pack else 0)
        ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
        attn = torch.zeros((len(rows), width), dtype=torch.long)
        mask = torch.zeros((len(rows), width - 1 - start))
        rlp = torch.zeros((len(rows), width - 1 - start))
        for b, i in enumerate(rows):
            p, r = batch.prompt_ids[i], batch.response_ids[i]
            ids[b, : len(p) + len(r)] = torch.tensor(list(p) + list(r), dtype=torch.long)
            attn[b, : len(p) + len(r)] = 1
            at = len(p) - 1 - start
            keep = batch.response_mask[i] if batch.response_mask is not None else [1] * len(r)
            mask[b, at : at + len(r)] = torch.tensor(keep, dtype=torch.float32)
            rlp[b, at : at + len(r)] = torch.tensor(batch.rollout_logprobs[i], dtype=torch.float32)
        here = "cpu" if pack else device  # packed: pack_rows moves what it keeps
        mb = MicroBatch(
            input_ids=ids.to(here),
            attention_mask=attn.to(here),
            start=start,
            mask=mask.to(here),
            rollout_logprobs=rlp.to(here),
            advantages=torch.tensor([batch.advantages[i] for i in rows], dtype=torch.float32).to(here),
            shared_prefix=shared,
            tokens=computed_tokens([len(p) + len(r) for p, r in zip(prompts, resps)], shared),
            causal_only=causal_only,
            logprob_chunk=logprob_chunk,
        )
        out.append(pack_rows(mb, prompts, resps, pad_id, pad_multiple, device) if pack else mb)
    return out


def pack_rows(mb: MicroBatch, prompts: list, resps: list, pad_id: int, pad_multiple: int,
              device: torch.device | str) -> MicroBatch:
    """``mb`` (right-padded, no shared prefix) as one packed row: the rows end to end, then pad
    tokens up to a multiple of ``pad_multiple`` (their own block of positions 0..). Row b's
    response token k sits at o_b + len(p_b) + k, predicted by the position before it; its column
    in ``mb.mask`` is len(p_b) - 1 - start + k. ``keep`` lists the predicting positions of every
    response token in row order (K of them), then the last position, whose logits score nothing
    (``token_logprobs`` takes W + 1 logits for W targets); ``unpack`` maps [B, W] to them. The
    position after a row's last token (the next row's first) is never scored."""
    ids, pos, keep = [], [], []
    w = mb.mask.shape[1]
    unpack = torch.full((len(prompts), w), -1, dtype=torch.long)
    offset = 0
    for b, (p, r) in enumerate(zip(prompts, resps)):
        n = len(p) + len(r)
        ids.extend(list(p) + list(r))
        pos.extend(range(n))
        at = len(p) - 1 - mb.start
        unpack[b, at: at + len(r)] = torch.arange(len(keep), len(keep) + len(r))
        keep.extend(range(offset + len(p) - 1, offset + n - 1))
        offset += n
    tail = -(-offset // pad_multiple) * pad_multiple - offset
    ids.extend([pad_id] * tail)
    pos.extend(range(tail))
    keep.append(offset + tail - 1)
    unpack[unpack < 0] = len(keep) - 1  # K: the spare slot, a 0 in the unpacked log-probs
    return replace(mb, input_ids=torch.tensor([ids], dtype=torch.long, device=device), attention_mask=None,
                   mask=mb.mask.to(device), rollout_logprobs=mb.rollout_logprobs.to(device),
                   advantages=mb.advantages.to(device),
                   start=0, causal_only=False, position_ids=torch.tensor([pos], dtype=torch.long, device=device),
                   keep=torch.tensor(keep, dtype=torch.long, device=device), unpack=unpack.to(device))


# attention implementations that take packed rows from position_ids with attention_mask=None:
# transformers' masking_utils builds the block-diagonal causal mask for these (sdpa, eager, flex),
# flash attention runs its varlen kernel from the position ids (modeling_flash_attention_utils)
PACKABLE_ATTENTION = ("sdpa", "eager", "flex_attention", "flash_attention_2", "flash_attention_3",
                      "flash_attention_4")


def packing_refusal(model) -> str | None:
    """Why ``model`` (a transformers causal LM, or peft around one) cannot run packed rows, or
    None. transformers 5 detects packed rows in ``create_causal_mask`` (a restart of the position
    ids, with no attention mask and no cache) only for the attention implementations it has mask
    functions for; any other would attend across the rows' boundaries."""
    config = getattr(model, "config", None)
    impl = getattr(config, "_attn_implementation", None)
    if impl in PACKABLE_ATTENTION:
        return None
    return f"attention implementation {impl!r} is not one of {', '.join(PACKABLE_ATTENTION)}"


def unpack_scores(values: torch.Tensor, unpack: torch.Tensor) -> torch.Tensor:
    """[1, K] per-token values of a packed row laid out as [B, W] (``MicroBatch.unpack``), 0
    where no response token is; differentiable (a gather)."""
    flat = torch.cat([values[0], values.new_zeros(1)])
    return flat[unpack]


def padding_micro_batch(device: torch.device | str = "cpu", causal_only: bool = False,
                        logprob_chunk: int = 0) -> MicroBatch:
    """One row of two pad tokens, attended (an all-masked row would give NaN attention) and
    scored at one position whose loss mask is 0: its loss is exactly 0 under every loss_type
    (losses.py multiplies each token by the mask, and the denominators are the step's counts,
    which it does not enter), so is its gradient, and its metric sums are never merged."""
    return MicroBatch(
        input_ids=torch.zeros((1, 2), dtype=torch.long, device=device),
        attention_mask=torch.ones((1, 2), dtype=torch.long, device=device),
        start=0,
        mask=torch.zeros((1, 1), device=device),
        rollout_logprobs=torch.zeros((1, 1), device=device),
        advantages=torch.zeros((1,), device=device),
        causal_only=causal_only,
        logprob_chunk=logprob_chunk,
        padding=True,
    )


def pad_micro_batches(mbs: list[MicroBatch], count: int, device: torch.device | str = "cpu") -> list[MicroBatch]:
    """``mbs`` followed by padding micro-batches up to ``count``: over 2+ ranks every rank runs
    the same number, the largest any has (fsdp2: every forward and backward is a collective;
    ddp: buffer broadcasts in the forward, the pass's last backward all-reduces; deepspeed:
    ZeRO-2 reduces in every backward). ``device`` only where ``mbs`` is empty; else that of its
    micro-batches."""
    if count < len(mbs):
        raise ValueError(f"cannot pad {len(mbs)} micro-batches down to {count}")
    if mbs:
        like = mbs[0]
        device, causal_only, chunk = like.input_ids.device, like.causal_only, like.logprob_chunk
    else:
        causal_only, chunk = False, 0
    return list(mbs) + [padding_micro_batch(device, causal_only, chunk) for _ in range(count - len(mbs))]


def amp_context(amp_dtype: torch.dtype | None):
    """torch.autocast on CUDA in ``amp_dtype`` (the base dtype), or nothing."""
    if amp_dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type="cuda", dtype=amp_dtype)


def _scores(logits: torch.Tensor, targets: torch.Tensor, temperature: float,
            entropy: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The plain computation on logits [B, n, V] and targets [B, n]: log-probs [B, n] and
    entropies [B, n] of log_softmax(logits / T), in float32. Every op works on one position's
    row, so running it on slices of positions gives the same bits per position as on all."""
    logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    logp_all = torch.log_softmax(logits, dim=-1)
    logp = logp_all.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    if entropy == "none":
        return logp, None
    if entropy == "grad":
        return logp, -(logp_all.exp() * logp_all).sum(-1)
    with torch.no_grad():
        detached = logp_all.detach()
        return logp, -(detached.exp() * detached).sum(-1)


class _ChunkedScores(torch.autograd.Function):
    """``_scores`` over slices of ``rows`` positions, keeping nothing of them for the backward:
    the forward saves only the logits (already alive as the model's output) and the backward
    recomputes each slice's graph and takes its gradient, writing it into the logits' gradient.
    Peak extra memory is a few float32 copies of one slice, [B, rows, V], not of [B, W, V]."""

    @staticmethod
    def forward(ctx, logits, targets, temperature: float, entropy: str, rows: int):
        b, w = targets.shape
        logp = torch.empty((b, w), dtype=torch.float32, device=logits.device)
        ent = torch.empty((b, w) if entropy != "none" else (0,), dtype=torch.float32, device=logits.device)
        for lo in range(0, w, rows):
            hi = min(lo + rows, w)
            lp, en = _scores(logits[:, lo:hi], targets[:, lo:hi], temperature, entropy)
            logp[:, lo:hi] = lp
            if en is not None:
                ent[:, lo:hi] = en
        ctx.save_for_backward(logits, targets)
        ctx.temperature, ctx.entropy, ctx.rows = temperature, entropy, rows
        if entropy != "grad":
            ctx.mark_non_differentiable(ent)
        return logp, ent

    @staticmethod
    def backward(ctx, g_logp, g_ent):
        logits, targets = ctx.saved_tensors
        w = targets.shape[1]
        grad = torch.empty_like(logits)
        grad[:, w:].zero_()  # the positions after the last scored one predict nothing scored
        for lo in range(0, w, ctx.rows):
            hi = min(lo + ctx.rows, w)
            with torch.enable_grad():
                x = logits[:, lo:hi].detach().requires_grad_(True)
                lp, en = _scores(x, targets[:, lo:hi], ctx.temperature, ctx.entropy)
                outs, grads = [lp], [g_logp[:, lo:hi]]
                if ctx.entropy == "grad":
                    outs.append(en)
                    grads.append(g_ent[:, lo:hi])
                (gx,) = torch.autograd.grad(outs, [x], grads)
            grad[:, lo:hi] = gx
        return grad, None, None, None, None


def token_logprobs(
    logits: torch.Tensor, targets: torch.Tensor, temperature: float, entropy: str = "none", chunk_tokens: int = 0,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs [B, W] of ``targets`` [B, W] under the logits [B, W + 1, V] of the positions
    before them (the last position predicts nothing scored), and entropies [B, W]: ``entropy`` =
    "none" (not computed), "detached" (for the metric only) or "grad" (the bonus is in the loss).

    log_softmax(logits / T): one log-softmax over the [B, W, V] logits serves log-probs and
    entropy, and T = 1 skips the division: each full pass over a 49k-152k vocabulary costs as
    much as a transformer layer here.

    ``chunk_tokens`` > 0 (learner.logprob_chunk_tokens): the same ops over slices of
    max(1, chunk_tokens // B) positions (``_ChunkedScores``), so that no float32 copy of the
    whole [B, W, V] logits exists, in the forward or the backward: at Qwen3's 152k vocabulary
    each such copy is 0.6 MB per token (2.8 GB at 8 x 584 tokens), and the plain path holds
    several. Same values and gradients, bit for bit on CPU (tests/test_learner_memory.py); the
    backward recomputes one log-softmax pass. 0 = the plain path.
    """
    if chunk_tokens <= 0:
        return _scores(logits[:, :-1, :], targets, temperature, entropy)
    rows = max(1, chunk_tokens // max(1, targets.shape[0]))
    logp, ent = _ChunkedScores.apply(logits, targets, temperature, entropy, rows)
    return logp, (None if entropy == "none" else ent)


def forward_logprobs(
    model, mb: MicroBatch, temperature: float, entropy: str = "none", amp_dtype: torch.dtype | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs [B, W] of the scored tokens, and entropies [B, W] (``token_logprobs``), of one
    forward of ``model`` over the micro-batch. ``amp_dtype``: the model's forward runs under CUDA
    autocast in that dtype (learner.autocast)."""
    if mb.packed:
        with amp_context(amp_dtype):
            logits = model(input_ids=mb.input_ids, attention_mask=None, logits_to_keep=mb.keep,
                           position_ids=mb.position_ids)
        targets = mb.input_ids[:, mb.keep[:-1] + 1]
        logp, ent = token_logprobs(logits, targets, temperature, entropy, mb.logprob_chunk)
        return unpack_scores(logp, mb.unpack), (None if ent is None else unpack_scores(ent, mb.unpack))
    keep = mb.input_ids.shape[1] - mb.start
    with amp_context(amp_dtype):
        logits = model(
            input_ids=mb.input_ids, attention_mask=None if mb.causal_only else mb.attention_mask,
            logits_to_keep=keep, shared_prefix=mb.shared_prefix,
        )
    return token_logprobs(logits, mb.input_ids[:, mb.start + 1 :], temperature, entropy, mb.logprob_chunk)


@torch.no_grad()
def response_logprobs(
    model: torch.nn.Module,
    prompts: list[list[int]],
    responses: list[list[int]],
    pad_id: int,
    temperature: float = _ROLLOUT.temperature,
    micro_batch_size: int = _LEARNER.micro_batch_size,
) -> list[list[float]]:
    """Per-token log-probs of each response given its prompt, as plain lists (the trainer's side
    of ppl_ratio for anyone holding sampled rows). ``model``: a causal LM or a SharedPrefixLM.
    ``temperature`` and ``micro_batch_size`` default to the config's (rollout.temperature,
    learner.micro_batch_size)."""
    from learner.shared_prefix import SharedPrefixLM

    lm = model if isinstance(model, SharedPrefixLM) else SharedPrefixLM(model)
    device = next(lm.parameters()).device
    batch = TrainBatch(prompt_ids=[list(p) for p in prompts], response_ids=[list(r) for r in responses],
                       rollout_logprobs=[[0.0] * len(r) for r in responses], advantages=[0.0] * len(prompts))
    out: list[list[float]] = []
    for mb in make_micro_batches(batch, micro_batch_size, device, pad_id, share_prefix=False):
        logp, _ = forward_logprobs(lm, mb, temperature)
        for b in range(logp.shape[0]):
            out.append(logp[b][mb.mask[b] > 0].tolist())
    return out


def _no_report() -> None:
    """The default progress report of a pass: nothing (learner/worker.py reports to the driver)."""


@torch.no_grad()
def old_log_prob(
    model, mbs: list[MicroBatch], temperature: float, with_entropy: bool, amp_dtype: torch.dtype | None = None,
    report: Callable[[], None] = _no_report,
) -> tuple[list[torch.Tensor], dict[str, float], float]:
    """Pre-update log-probs per micro-batch, rollout-agreement sums, and the entropy token sum;
    ``report()`` after each micro-batch (progress, config/liveness.py)."""
    olds, sums = [], {}
    for mb in mbs:
        logp, ent = forward_logprobs(model, mb, temperature, "detached" if with_entropy else "none", amp_dtype)
        olds.append(logp)
        if not mb.padding:
            sums = merge_sums(sums, rollout_mismatch_sum_tensors(mb.rollout_logprobs, logp, mb.mask))
            if ent is not None:
                sums = merge_sums(sums, {"entropy": (ent * mb.mask).sum()})
        report()
    floats = as_floats(sums)
    return olds, {k: v for k, v in floats.items() if k != "entropy"}, floats.get("entropy", 0.0)


@torch.no_grad()
def ref_log_prob(
    lm, peft_model, mbs: list[MicroBatch], temperature: float, amp_dtype: torch.dtype | None = None,
    report: Callable[[], None] = _no_report,
) -> list[torch.Tensor]:
    """Reference log-probs: the same model (``lm`` wraps ``peft_model``) with the adapter off."""
    refs = []
    with peft_model.disable_adapter():
        for mb in mbs:
            refs.append(forward_logprobs(lm, mb, temperature, amp_dtype=amp_dtype)[0])
            report()
    return refs


@dataclass
class UpdateResult:
    sums: dict[str, float]  # policy_loss sums over every micro-batch and epoch (this worker)
    loss: float  # this worker's share of the step loss, averaged over epochs
    grad_norm: float  # global grad norm before clipping (last epoch)
    rollout_sums: dict[str, float]  # filled when old log-probs were folded into the update


def _no_context(last: bool) -> AbstractContextManager:
    return contextlib.nullcontext()


@dataclass
class GradSync:
    """How gradients are produced and applied: plain/DDP here, DeepSpeed in learner.policy,
    FSDP2 in learner.fsdp. Wrappers that replace one part keep the others (dataclasses.replace)."""

    backward: Callable[[torch.Tensor, bool], None]  # (loss, is_last_micro_batch_of_the_pass)
    step: Callable[[], float]  # clip, optimizer step, zero grads; returns the pre-clip grad norm
    # entered around a micro-batch's forward AND backward, (is_last_micro_batch_of_the_pass):
    # DDP decides in the forward whether the backward all-reduces (ddp_grad_sync)
    micro_batch: Callable[[bool], AbstractContextManager] = field(default=_no_context)


class NonFiniteGradients(FloatingPointError):
    """A step's gradient norm is nan or inf: its forward, loss or backward produced a non-finite
    value. Raised before the optimizer step (DeepSpeed: after its engine's step, which clips and
    steps in one call), so the worker ends without publishing an adapter from it."""


def refuse_nonfinite(norm: float, optimizer: torch.optim.Optimizer, *, stepped: bool = False,
                     under_mps: bool | None = None) -> float:
    """``norm`` when it is finite; else the gradients are dropped and NonFiniteGradients raised.

    An AdamW step on a nan gradient turns every weight it touches into nan, and an adapter of nans
    still generates (degenerate text that a grader may even score): the run would go on training
    a different experiment, its rewards looking fine. Seen on an H100 under MPS (issue 34: the
    learner's forward gave nan from the first step while ppl_ratio read nan and the run exited 0).
    Every rank sees the same global norm, so every rank raises at the same point and none is left
    waiting in a collective. ``under_mps`` (default: this worker got the run's MPS pipe directory,
    services/mps.py) adds where it was seen."""
    if math.isfinite(norm):
        return norm
    if under_mps is None:
        under_mps = "CUDA_MPS_PIPE_DIRECTORY" in os.environ
    optimizer.zero_grad(set_to_none=True)
    taken = ("its optimizer step was taken (DeepSpeed clips and steps in one call), and the worker stops "
             "before publishing the adapter" if stepped else
             "the optimizer step was not taken, so the adapter and optimizer state are the last step's")
    seen = (" This worker runs under CUDA MPS, where a capped share's GEMMs were seen to come out nan or wrong "
            "(README, MPS section; the run's start-up check, model/gemm_check.py, can miss a shape it does not "
            "run): try another gpu_sharing.learner_sm_percent or gpu_sharing.mode=timeslice." if under_mps else "")
    raise NonFiniteGradients(
        f"the learner's gradient norm is {norm}: this step's forward, loss or backward gave a non-finite value; "
        f"{taken}. The run stops here; --resume continues from the last checkpoint.{seen}")


def ddp_grad_sync(model, optimizer: torch.optim.Optimizer, max_grad_norm: float,
                  keep_grads: bool = False) -> GradSync:
    """Gradient accumulation over micro-batches; a DDP model all-reduces on the last one only.

    DDP's ``no_sync`` has to hold over the forward too: the forward prepares the reducer, whose
    hooks then all-reduce in the backward whatever the flag says by then (torch's no_sync doc).
    So it is the ``micro_batch`` context, not part of ``backward``. Every rank must run as many
    micro-batches (the forward broadcasts buffers after a synced pass, the last backward
    all-reduces): learner/policy.py pads the ranks with fewer (``pad_micro_batches``).

    ``keep_grads``: the parameters' .grad tensors exist before the first backward and are zeroed,
    not freed, after each optimizer step, so every backward ADDS into them in place. A graphed
    backward (learner/graphed.py) returns views of its static buffers, which autograd would
    otherwise install as .grad when none exists: the next replay would overwrite them."""
    no_sync = getattr(model, "no_sync", None)
    trainable = [p for g in optimizer.param_groups for p in g["params"]]

    def micro_batch(last: bool) -> AbstractContextManager:
        return no_sync() if (no_sync is not None and not last) else contextlib.nullcontext()

    def backward(loss: torch.Tensor, last: bool) -> None:
        if keep_grads:
            for p in trainable:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
        loss.backward()

    def step() -> float:
        norm = refuse_nonfinite(float(torch.nn.utils.clip_grad_norm_(trainable, max_grad_norm)), optimizer)
        optimizer.step()
        optimizer.zero_grad(set_to_none=not keep_grads)
        return norm

    return GradSync(backward=backward, step=step, micro_batch=micro_batch)


Scorer = Callable[..., tuple[torch.Tensor, torch.Tensor | None]]


def update_actor(
    model,
    mbs: list[MicroBatch],
    sync: GradSync,
    norm: LossNorm,
    params: ObjectiveParams,
    *,
    temperature: float,
    epochs: int,
    old: list[torch.Tensor] | None,
    ref: list[torch.Tensor] | None,
    entropy_bonus: bool,
    amp_dtype: torch.dtype | None = None,
    scorer: Scorer | None = None,
    report: Callable[[], None] = _no_report,
) -> UpdateResult:
    """``epochs`` optimizer steps over the shard, gradients accumulated over micro-batches.

    ``old=None`` folds old_log_prob into the update: with one epoch, every micro-batch's forward
    runs before the only optimizer step, so its detached log-probs ARE the pre-update policy.
    ``scorer(model, mb, temperature, entropy, amp_dtype)`` computes a micro-batch's log-probs and
    entropies with the gradient path (default ``forward_logprobs``; learner/graphed.py replays
    captured graphs). ``report()`` after each micro-batch's backward (progress). Metric sums stay on the device until the end: one host transfer per step,
    not a few dozen syncs per micro-batch that would keep the host from running ahead.
    """
    if old is None and epochs != 1:
        raise ValueError("old log-probs can only be folded into the update with epochs_per_step=1")
    scorer = scorer or forward_logprobs
    sums: dict = {}
    rollout_sums: dict = {}
    losses, grad_norm = [], 0.0
    for _ in range(epochs):
        epoch_loss = None
        for i, mb in enumerate(mbs):
            last = i == len(mbs) - 1
            with sync.micro_batch(last):  # forward and backward (DDP: no_sync but on the last)
                with record_function("cp.forward"):
                    logp, ent = scorer(model, mb, temperature, "grad" if entropy_bonus else "detached", amp_dtype)
                if old is None:
                    old_mb = logp.detach()
                    if not mb.padding:
                        rollout_sums = merge_sums(rollout_sums,
                                                  rollout_mismatch_sum_tensors(mb.rollout_logprobs, old_mb, mb.mask))
                else:
                    old_mb = old[i]
                inp = LossInputs(
                    logprobs=logp,
                    old_logprobs=old_mb,
                    advantages=mb.advantages,
                    mask=mb.mask,
                    rollout_logprobs=mb.rollout_logprobs,
                    ref_logprobs=ref[i] if ref is not None else None,
                    entropy=ent,
                )
                with record_function("cp.loss"):
                    out = policy_loss(inp, norm, params, entropy_bonus=entropy_bonus)
                with record_function("cp.backward"):
                    sync.backward(out.loss, last)
            epoch_loss = out.loss.detach() if epoch_loss is None else epoch_loss + out.loss.detach()
            if not mb.padding:  # its sums are zeros but for the row it counts under "sequences"
                sums = merge_sums(sums, out.sum_tensors)
            report()
        with record_function("cp.optimizer"):
            grad_norm = sync.step()
        losses.append(epoch_loss)
    with record_function("cp.metrics"):
        floats = as_floats({**{f"p/{k}": v for k, v in sums.items()}, **{f"r/{k}": v for k, v in rollout_sums.items()},
                            **{f"loss/{i}": v for i, v in enumerate(losses)}})
    epoch_losses = [floats[f"loss/{i}"] for i in range(len(losses))]
    return UpdateResult(sums={k[2:]: v for k, v in floats.items() if k.startswith("p/")},
                        loss=sum(epoch_losses) / len(epoch_losses), grad_norm=grad_norm,
                        rollout_sums={k[2:]: v for k, v in floats.items() if k.startswith("r/")})
