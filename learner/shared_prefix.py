"""Run the tokens every row of a micro-batch shares once, not once per row.

A GRPO group is G completions of ONE prompt, and the prompt is most of each sequence: in the
default run ~460 prompt tokens against ~35 completion tokens per row. Recomputing that prompt
for every row made the learner's forward/backward ~8x longer than it needs to be.

``SharedPrefixLM`` runs the common prefix (length c) once with batch 1, repeats its KV cache
over the B rows, and runs the B suffixes against it. Gradients flow back through the repeated
cache into the single prefix pass, so the result is the same function of the weights as B full
passes (equal up to float summation order; tests/test_shared_prefix.py checks logits and LoRA
gradients against the plain forward). Exactness needs c <= s, the first scored position, so
every logit the loss reads comes from the suffix pass; ``shared_prefix_len`` enforces that.

It is a module (not a function) so DDP and DeepSpeed wrap it whole: both passes then sit
inside ONE forward of the wrapped model, which is what their gradient hooks expect.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def shared_prefix_len(rows: Sequence[Sequence[int]], cap: int) -> int:
    """Length of the prefix all ``rows`` share, at most ``cap``; 0 for fewer than two rows
    (nothing to share) or when they share nothing."""
    if len(rows) < 2 or cap <= 0:
        return 0
    first = rows[0]
    n = min(cap, *(len(r) for r in rows))
    for i in range(n):
        token = first[i]
        if any(r[i] != token for r in rows[1:]):
            return i
    return n


class SharedPrefixLM(torch.nn.Module):
    """A causal LM whose forward can compute a shared prefix once.

    ``forward(input_ids, attention_mask, logits_to_keep, shared_prefix=c)`` returns the logits
    of the last ``logits_to_keep`` positions, like the wrapped model's output ``.logits``.
    ``shared_prefix=0`` is the plain forward (``position_ids``: of packed rows, passed on;
    ``logits_to_keep`` may then be a tensor of positions, as transformers allows). Rows must be
    right-padded (the learner's micro-batches are), so every row's first c tokens are real and
    at the same positions;
    ``attention_mask=None`` is then exact too (learner.passes.make_micro_batches).
    """

    def __init__(self, lm: torch.nn.Module):
        super().__init__()
        self.lm = lm

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        logits_to_keep: int | torch.Tensor,
        shared_prefix: int = 0,
        position_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        c = int(shared_prefix)
        width = input_ids.shape[1]
        if c <= 0:  # position_ids: packed rows (learner/passes.py pack_rows), or None
            return self.lm(
                input_ids=input_ids, attention_mask=attention_mask, logits_to_keep=logits_to_keep, use_cache=False,
                position_ids=position_ids,
            ).logits
        if position_ids is not None:
            raise ValueError("a shared prefix and packed rows (position_ids) are two layouts of a micro-batch")
        if not 0 < logits_to_keep <= width - c:
            raise ValueError(f"a shared prefix of {c} tokens needs logits_to_keep in (0, {width - c}], got {logits_to_keep}")
        if bool((input_ids[1:, :c] != input_ids[:1, :c]).any()) or (
                attention_mask is not None and not bool(attention_mask[:, :c].all())):
            raise ValueError(f"rows do not share their first {c} tokens")
        head = self.lm(
            input_ids=input_ids[:1, :c], attention_mask=None if attention_mask is None else attention_mask[:1, :c],
            use_cache=True, logits_to_keep=1,
        )
        cache = head.past_key_values
        cache.batch_repeat_interleave(input_ids.shape[0])
        return self.lm(
            input_ids=input_ids[:, c:],
            attention_mask=attention_mask,
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=logits_to_keep,
        ).logits
