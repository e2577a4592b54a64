"""What the learner benches share: random training batches in GRPO's grouped layout, and the
relative distance between two adapters.

Imported as ``bench.synthetic`` by the scripts in this folder (each puts the repo root first on
sys.path).
"""

from __future__ import annotations


def grouped_batch(n: int, group: int, prompt_len: int, response_lens: tuple[int, int], vocab: int, seed: int,
                  rollout_logprob: float):
    """`n` rows of random token ids, `group` consecutive rows sharing one prompt (as G samples of
    one prompt do), response lengths drawn from [lo, hi], advantages ~ N(0, 1) with reward 1
    where the advantage is positive. Every rollout log-prob is `rollout_logprob`: near the
    model's own (a random model: about -log(vocab)) it keeps the importance weights sane."""
    import torch

    from learner.types import TrainBatch

    g = torch.Generator().manual_seed(seed)
    lo, hi = response_lens
    prompts, responses = [], []
    for i in range(n):
        if i % group == 0:
            prompt = torch.randint(1, vocab, (prompt_len,), generator=g).tolist()
        prompts.append(prompt)
        length = int(torch.randint(lo, hi + 1, (1,), generator=g))
        responses.append(torch.randint(1, vocab, (length,), generator=g).tolist())
    adv = torch.randn(n, generator=g).tolist()
    return TrainBatch(prompts, responses, [[rollout_logprob] * len(r) for r in responses], adv,
                      rewards=[float(a > 0) for a in adv], group_ids=[i // group for i in range(n)])


def l2(tensors: dict) -> float:
    """Euclidean norm over all tensors of an adapter state (or of its movement)."""
    return sum(float(t.float().pow(2).sum()) for t in tensors.values()) ** 0.5


def relative_gap(a: dict, b: dict, scale: dict) -> float:
    """||a - b|| / ||scale|| over all tensors (inf when scale is zero)."""
    den = l2(scale)
    return l2({k: a[k].float() - b[k].float() for k in b}) / den if den > 0 else float("inf")
