"""rollout/engines/vllm_cpu_lora.py computes exactly what vLLM's per-token torch LoRA ops do."""

from __future__ import annotations

import pytest
import torch
import vllm.lora.ops.torch_ops.lora_ops as vllm_ops

from rollout.engines import vllm_cpu_lora as ours

SLOTS, R, HIDDEN, OUT = 3, 8, 48, 40


def case(indices: list[int], seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    tokens = len(indices)
    return {
        "x_hidden": torch.randn(tokens, HIDDEN, generator=g),
        "x_rank": torch.randn(tokens, R, generator=g),
        "a": torch.randn(SLOTS, 1, R, HIDDEN, generator=g),  # [slots, 1, r, in]: vLLM's layout
        "b": torch.randn(SLOTS, 1, OUT, R, generator=g),
        "b3": torch.randn(SLOTS, OUT, R, generator=g),  # 3-D weights are accepted too
        "out_rank": torch.randn(tokens, R, generator=g),
        "out_full": torch.randn(tokens, OUT + 6, generator=g),  # padded wider than the adapter
        "idx": torch.tensor(indices),
    }


INDEX_SETS = {
    "one adapter": [1] * 7,
    "several slots": [0, 2, 2, 1, 0, 1, 2],
    "no-lora tokens (-1)": [-1, 0, -1, 2, 2, 0, 1],
}


@pytest.mark.parametrize("name", INDEX_SETS)
def test_shrink_and_expand_match_vllm(name):
    c = case(INDEX_SETS[name])
    want, got = c["out_rank"].clone(), c["out_rank"].clone()
    vllm_ops.bgmv_shrink(c["x_hidden"], c["a"], want, c["idx"], 0.5)
    ours.bgmv_shrink(c["x_hidden"], c["a"], got, c["idx"], 0.5)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for weights in ("b", "b3"):
        for add in (True, False):
            want, got = c["out_full"].clone(), c["out_full"].clone()
            vllm_ops.bgmv_expand(c["x_rank"], c[weights], want, c["idx"], add)
            ours.bgmv_expand(c["x_rank"], c[weights], got, c["idx"], add)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
            want, got = c["out_full"].clone(), c["out_full"].clone()
            vllm_ops.bgmv_expand_slice(c["x_rank"], c[weights], want, c["idx"], 3, OUT, add)
            ours.bgmv_expand_slice(c["x_rank"], c[weights], got, c["idx"], 3, OUT, add)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_sequence_variants_match_vllm():
    """sgmv_*: per-sequence adapter indices expanded over each sequence's tokens (prefill)."""
    seq_lens, seq_idx = torch.tensor([3, 1, 4]), torch.tensor([2, -1, 0])
    c = case([0] * int(seq_lens.sum()), seed=1)
    start = torch.cumsum(seq_lens, 0) - seq_lens
    meta = (start, seq_lens, seq_idx, 3, 4, int(seq_lens.sum()))
    want, got = c["out_rank"].clone(), c["out_rank"].clone()
    vllm_ops.sgmv_shrink(c["x_hidden"], c["a"], want, *meta, 2.0)
    ours.sgmv_shrink(c["x_hidden"], c["a"], got, *meta, 2.0)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for add in (True, False):
        want, got = c["out_full"].clone(), c["out_full"].clone()
        vllm_ops.sgmv_expand(c["x_rank"], c["b"], want, *meta, add)
        ours.sgmv_expand(c["x_rank"], c["b"], got, *meta, add)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        want, got = c["out_full"].clone(), c["out_full"].clone()
        vllm_ops.sgmv_expand_slice(c["x_rank"], c["b"], want, *meta, 2, OUT, add)
        ours.sgmv_expand_slice(c["x_rank"], c["b"], got, *meta, 2, OUT, add)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_single_row_output_broadcast_matches_vllm():
    """vLLM's expand writes row 0 only when it computed one row for a multi-row output."""
    c = case([1])
    out_w, out_g = torch.zeros(4, OUT), torch.zeros(4, OUT)
    vllm_ops.bgmv_expand(c["x_rank"], c["b"], out_w, c["idx"], True)
    ours.bgmv_expand(c["x_rank"], c["b"], out_g, c["idx"], True)
    torch.testing.assert_close(out_g, out_w)
