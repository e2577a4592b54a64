"""The learner's passes over one worker's shard: old_log_prob, ref, update_actor, and the one
teacher-forced log-prob computation they share (``forward_logprobs``; ``response_logprobs`` runs
it on plain lists for the `rollout logprobs` CLI and the parity tests).

Torch (and torch.distributed, through the DDP-wrapped model) only; no Ray. Tensors of a
micro-batch cover only the positions that can hold response tokens: the model is asked for
``logits_to_keep`` = L - s logits, s = (shortest prompt) - 1, so the output head and the
log-softmax over the 49k vocabulary never run on prompt positions the loss cannot see; and the
tokens every row of a micro-batch shares (a group's prompt) run once (learner.shared_prefix).
The model passed in is a ``SharedPrefixLM`` (or DDP/DeepSpeed around one).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import torch

from learner.losses import LossInputs, LossNorm, ObjectiveParams, policy_loss
from learner.microbatch import computed_tokens, count_bounds, token_budget_bounds
from learner.rollout_correction import merge_sums, rollout_mismatch_sums
from learner.shared_prefix import shared_prefix_len
from learner.types import TrainBatch


@dataclass
class MicroBatch:
    """B sequences right-padded to L tokens; W = L - 1 - s scored positions from position s."""

    input_ids: torch.Tensor  # [B, L] long
    attention_mask: torch.Tensor  # [B, L] long
    start: int  # s: first scored position (predicts token s + 1)
    mask: torch.Tensor  # [B, W] float, 1 = response token in the loss
    rollout_logprobs: torch.Tensor  # [B, W] float
    advantages: torch.Tensor  # [B] float
    shared_prefix: int = 0  # c <= s leading tokens every row has; computed once (0 = off)
    tokens: int = 0  # real (unpadded) tokens one forward runs, the shared prefix counted once


def make_micro_batches(
    batch: TrainBatch,
    size: int,
    device: torch.device | str = "cpu",
    pad_id: int = 0,
    share_prefix: bool = True,
    token_budget: int | None = None,
) -> list[MicroBatch]:
    """Consecutive rows in micro-batches of ``size``, or, with ``token_budget``, of at most that
    many padded tokens (learner/microbatch.py: groups kept whole where they fit). The
    orchestrator orders rows by group, so a micro-batch of G rows is one group and shares its
    whole prompt."""
    if token_budget is None:
        bounds = count_bounds(len(batch), size)
    else:
        lengths = [len(p) + len(r) for p, r in zip(batch.prompt_ids, batch.response_ids)]
        bounds = token_budget_bounds(lengths, token_budget, batch.group_ids)
    out = []
    for lo, hi in bounds:
        rows = range(lo, hi)
        prompts = [batch.prompt_ids[i] for i in rows]
        resps = [batch.response_ids[i] for i in rows]
        width = max(len(p) + len(r) for p, r in zip(prompts, resps))
        start = min(len(p) for p in prompts) - 1
        shared = shared_prefix_len([list(p) + list(r) for p, r in zip(prompts, resps)], start) if share_prefix else 0
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
        out.append(
            MicroBatch(
                input_ids=ids.to(device),
                attention_mask=attn.to(device),
                start=start,
                mask=mask.to(device),
                rollout_logprobs=rlp.to(device),
                advantages=torch.tensor([batch.advantages[i] for i in rows], dtype=torch.float32).to(device),
                shared_prefix=shared,
                tokens=computed_tokens([len(p) + len(r) for p, r in zip(prompts, resps)], shared),
            )
        )
    return out


def amp_context(amp_dtype: torch.dtype | None):
    """torch.autocast on CUDA in ``amp_dtype`` (the base dtype), or nothing."""
    if amp_dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type="cuda", dtype=amp_dtype)


def forward_logprobs(
    model, mb: MicroBatch, temperature: float, entropy: str = "none", amp_dtype: torch.dtype | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs [B, W] of the scored tokens, and entropies [B, W]: ``entropy`` = "none" (not
    computed), "detached" (for the metric only) or "grad" (the bonus is in the loss).
    ``amp_dtype``: the model's forward runs under CUDA autocast in that dtype (learner.autocast).

    log_softmax(logits / T) at the positions that produced each scored token; one log-softmax
    over the [B, W, V] logits serves log-probs and entropy, and T = 1 skips the division: each
    full pass over a 49k vocabulary costs as much as a transformer layer here.
    """
    keep = mb.input_ids.shape[1] - mb.start
    with amp_context(amp_dtype):
        logits = model(
            input_ids=mb.input_ids, attention_mask=mb.attention_mask, logits_to_keep=keep,
            shared_prefix=mb.shared_prefix,
        )
    logits = logits[:, :-1, :].float()
    if temperature != 1.0:
        logits = logits / temperature
    logp_all = torch.log_softmax(logits, dim=-1)
    logp = logp_all.gather(-1, mb.input_ids[:, mb.start + 1 :].unsqueeze(-1)).squeeze(-1)
    if entropy == "none":
        return logp, None
    if entropy == "grad":
        return logp, -(logp_all.exp() * logp_all).sum(-1)
    with torch.no_grad():
        detached = logp_all.detach()
        return logp, -(detached.exp() * detached).sum(-1)


@torch.no_grad()
def response_logprobs(
    model: torch.nn.Module,
    prompts: list[list[int]],
    responses: list[list[int]],
    pad_id: int,
    temperature: float = 1.0,
    micro_batch_size: int = 8,
) -> list[list[float]]:
    """Per-token log-probs of each response given its prompt, as plain lists (the trainer's side
    of ppl_ratio for anyone holding sampled rows). ``model``: a causal LM or a SharedPrefixLM."""
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


@torch.no_grad()
def old_log_prob(
    model, mbs: list[MicroBatch], temperature: float, with_entropy: bool, amp_dtype: torch.dtype | None = None
) -> tuple[list[torch.Tensor], dict[str, float], float]:
    """Pre-update log-probs per micro-batch, rollout-agreement sums, and the entropy token sum."""
    olds, sums, ent_sum = [], {}, 0.0
    for mb in mbs:
        logp, ent = forward_logprobs(model, mb, temperature, "detached" if with_entropy else "none", amp_dtype)
        olds.append(logp)
        sums = merge_sums(sums, rollout_mismatch_sums(mb.rollout_logprobs, logp, mb.mask))
        if ent is not None:
            ent_sum += float((ent * mb.mask).sum())
    return olds, sums, ent_sum


@torch.no_grad()
def ref_log_prob(
    lm, peft_model, mbs: list[MicroBatch], temperature: float, amp_dtype: torch.dtype | None = None
) -> list[torch.Tensor]:
    """Reference log-probs: the same model (``lm`` wraps ``peft_model``) with the adapter off."""
    with peft_model.disable_adapter():
        return [forward_logprobs(lm, mb, temperature, amp_dtype=amp_dtype)[0] for mb in mbs]


@dataclass
class UpdateResult:
    sums: dict[str, float]  # policy_loss sums over every micro-batch and epoch (this worker)
    loss: float  # this worker's share of the step loss, averaged over epochs
    grad_norm: float  # global grad norm before clipping (last epoch)
    rollout_sums: dict[str, float]  # filled when old log-probs were folded into the update


@dataclass
class GradSync:
    """How gradients are produced and applied: plain/DDP here, DeepSpeed in learner.worker."""

    backward: Callable[[torch.Tensor, bool], None]  # (loss, is_last_micro_batch_of_the_pass)
    step: Callable[[], float]  # clip, optimizer step, zero grads; returns the pre-clip grad norm


def ddp_grad_sync(model, optimizer: torch.optim.Optimizer, max_grad_norm: float) -> GradSync:
    """Gradient accumulation over micro-batches; a DDP model all-reduces on the last one only."""
    no_sync = getattr(model, "no_sync", None)
    trainable = [p for g in optimizer.param_groups for p in g["params"]]

    def backward(loss: torch.Tensor, last: bool) -> None:
        with no_sync() if (no_sync is not None and not last) else contextlib.nullcontext():
            loss.backward()

    def step() -> float:
        norm = float(torch.nn.utils.clip_grad_norm_(trainable, max_grad_norm))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return norm

    return GradSync(backward=backward, step=step)


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
) -> UpdateResult:
    """``epochs`` optimizer steps over the shard, gradients accumulated over micro-batches.

    ``old=None`` folds old_log_prob into the update: with one epoch, every micro-batch's forward
    runs before the only optimizer step, so its detached log-probs ARE the pre-update policy.
    """
    if old is None and epochs != 1:
        raise ValueError("old log-probs can only be folded into the update with epochs_per_step=1")
    sums: dict[str, float] = {}
    rollout_sums: dict[str, float] = {}
    losses, grad_norm = [], 0.0
    for _ in range(epochs):
        epoch_loss = 0.0
        for i, mb in enumerate(mbs):
            logp, ent = forward_logprobs(model, mb, temperature, "grad" if entropy_bonus else "detached", amp_dtype)
            if old is None:
                old_mb = logp.detach()
                rollout_sums = merge_sums(rollout_sums, rollout_mismatch_sums(mb.rollout_logprobs, old_mb, mb.mask))
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
            out = policy_loss(inp, norm, params, entropy_bonus=entropy_bonus)
            sync.backward(out.loss, i == len(mbs) - 1)
            epoch_loss += float(out.loss.detach())
            sums = merge_sums(sums, out.sums)
        grad_norm = sync.step()
        losses.append(epoch_loss)
    return UpdateResult(sums=sums, loss=sum(losses) / len(losses), grad_norm=grad_norm, rollout_sums=rollout_sums)
