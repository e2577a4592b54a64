"""Teacher-forced log-probs of sampled tokens: the trainer's side of ppl_ratio.

The same function serves `counterpoint rollout logprobs` (a user checking ppl_ratio by hand)
and the learner's `old_log_prob` / `ref` phases, so both describe the same distribution:
log_softmax(logits / T) at the positions that produced each response token.
"""

from __future__ import annotations

import torch


def token_logprobs(
    logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    """Log-prob of each target token.

    logits: [B, T, V] predicting position t+1 at t (already shifted by the caller);
    targets: [B, T] token ids. Returns [B, T] float32.
    """
    scaled = logits.float() / temperature
    return torch.log_softmax(scaled, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def entropy_from_logits(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Entropy of the (tempered) next-token distribution at each position: [B, T]."""
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    return -(logp.exp() * logp).sum(-1)


def pack_sequences(
    prompts: list[list[int]], responses: list[list[int]], pad_id: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-pad prompt+response pairs.

    Returns input_ids [B, L], attention_mask [B, L] and response_mask [B, L-1] where
    response_mask[b, t] = 1 iff input_ids[b, t+1] is a response token (aligned with the
    shifted logits of `sequence_logprobs`).
    """
    lengths = [len(p) + len(r) for p, r in zip(prompts, responses)]
    width = max(lengths)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    attn = torch.zeros((len(prompts), width), dtype=torch.long)
    resp = torch.zeros((len(prompts), width - 1), dtype=torch.float32)
    for b, (p, r) in enumerate(zip(prompts, responses)):
        seq = list(p) + list(r)
        ids[b, : len(seq)] = torch.tensor(seq, dtype=torch.long)
        attn[b, : len(seq)] = 1
        if r:
            resp[b, len(p) - 1 : len(p) - 1 + len(r)] = 1.0
    return ids, attn, resp


def sequence_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    temperature: float = 1.0,
    with_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Forward pass; log-probs [B, L-1] of input_ids[:, 1:] (and entropies if asked)."""
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits[:, :-1, :]
    lp = token_logprobs(logits, input_ids[:, 1:], temperature)
    ent = entropy_from_logits(logits, temperature) if with_entropy else None
    return lp, ent


@torch.no_grad()
def response_logprobs(
    model: torch.nn.Module,
    prompts: list[list[int]],
    responses: list[list[int]],
    pad_id: int,
    temperature: float = 1.0,
    micro_batch_size: int = 8,
) -> list[list[float]]:
    """Per-token log-probs of each response given its prompt, as plain lists."""
    out: list[list[float]] = []
    for start in range(0, len(prompts), micro_batch_size):
        p = prompts[start : start + micro_batch_size]
        r = responses[start : start + micro_batch_size]
        ids, attn, _ = pack_sequences(p, r, pad_id)
        lp, _ = sequence_logprobs(model, ids, attn, temperature)
        for b, (pp, rr) in enumerate(zip(p, r)):
            out.append(lp[b, len(pp) - 1 : len(pp) - 1 + len(rr)].tolist())
    return out
