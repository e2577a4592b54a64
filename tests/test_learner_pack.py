"""learner.pack_sequences on CPU (fp32, real code): a micro-batch's rows run as ONE unpadded row
with restarting position ids, and give the padded micro-batches' per-token log-probs, entropies,
losses, gradients and, after two optimizer steps, adapter; the token-budget planner counts a
packed micro-batch's real tokens; the config refuses what packing cannot combine with; and
2 gloo ranks (fsdp2, with a padding micro-batch) take the step of one rank.

Tolerance: not bitwise. The packed row's attention reduces over other shapes (one [T, T] masked
softmax against [B, L, L]). Measured here (sdpa, the default; eager gave identical log-probs):
per-token log-probs <= 4.8e-7 absolute (entropies <= 7e-7), the loss <= 2.2e-7 relative, the
gradients <= 4.5e-7 relative (per tensor, by norm), the adapter after two AdamW steps <= 6.0e-6
relative (Adam divides each update by the root of its second moment, so the relative noise of
the smallest gradients shows through). The tests allow 1e-5 relative (loss, gradients, adapter)
and 5e-6 absolute (log-probs).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from config import ConfigError, RunConfig, load_config
from config.learner import LearnerConfig
from learner.losses import ObjectiveParams
from learner.lora import adapter_state_dict
from learner.microbatch import micro_batch_cost, token_budget_bounds
from learner.passes import (forward_logprobs, make_micro_batches, old_log_prob, packing_refusal,
                            ref_log_prob, update_actor)
from learner.policy import PolicyLearner
from learner.shared_prefix import SharedPrefixLM
from learner.types import TrainBatch
from tests.test_learner_gpu_opts import capturing_sync, one_rank_norm
from tests.test_shared_prefix import VOCAB, lora, tiny_llama

REL, ABS = 1e-5, 5e-6
RESPONSES = (5, 40, 9, 33)  # per group: rows that differ a lot in length
# padded, a group costs 4 x 47 and 4 x 52 tokens; packed, 115 and 135: all 8 rows fit packed only
BUDGET = 256


def uneven_groups(seed: int = 0) -> TrainBatch:
    """Two groups of four rows (prompts of 7 and 12 tokens, responses of 5-40 tokens), random
    rollout log-probs, a response mask with one token left out, distinct advantages."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(1, VOCAB, (n,), generator=g).tolist() for n in (7, 12)]
    responses = [torch.randint(1, VOCAB, (n,), generator=g).tolist() for n in RESPONSES * 2]
    keep = [[1] * len(r) for r in responses]
    keep[1][3] = 0
    return TrainBatch([prompts[0]] * 4 + [prompts[1]] * 4, responses,
                      [(torch.rand(len(r), generator=g) * -3).tolist() for r in responses],
                      advantages=[1.0, -1.0, 0.5, -0.5, 0.9, -0.2, 0.4, -1.1], group_ids=[0] * 4 + [1] * 4,
                      response_mask=keep)


def rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).norm() / want.norm().clamp(min=1e-30))


# ------------------------------------------------------------------ the layout
def test_a_packed_micro_batch_is_one_row_with_restarting_positions():
    batch = uneven_groups()
    padded = make_micro_batches(batch, 4, share_prefix=False)
    packed = make_micro_batches(batch, 4, pack=True, pad_multiple=8)
    lengths = [len(p) + len(r) for p, r in zip(batch.prompt_ids, batch.response_ids)]
    for k, (a, b) in enumerate(zip(padded, packed)):
        rows = lengths[4 * k: 4 * k + 4]
        assert a.input_ids.shape == (4, max(rows)) and not a.packed
        assert b.packed and b.attention_mask is None and b.shared_prefix == 0
        assert b.input_ids.shape == (1, -(-sum(rows) // 8) * 8)  # the sum, rounded up at the end only
        starts = [0] + [sum(rows[:i]) for i in range(1, 4)]
        assert (b.position_ids[0] == 0).nonzero().flatten()[:4].tolist() == starts
        for row, at in enumerate(starts):  # each row's tokens, in order, at positions 0..n-1
            assert torch.equal(b.input_ids[0, at: at + rows[row]], a.input_ids[row, : rows[row]])
            assert b.position_ids[0, at: at + rows[row]].tolist() == list(range(rows[row]))
        for name in ("mask", "rollout_logprobs", "advantages"):  # what the losses read: unchanged
            assert torch.equal(getattr(a, name), getattr(b, name)), name
        assert b.keep.numel() == int(sum(len(r) for r in batch.response_ids[4 * k: 4 * k + 4])) + 1
        assert a.tokens == b.tokens == sum(rows)


def test_the_block_diagonal_mask_is_what_separates_the_rows():
    """Without restarting positions the rows would attend to each other: different log-probs."""
    lm = SharedPrefixLM(lora(tiny_llama()))
    batch = uneven_groups()
    mb = make_micro_batches(batch, 4, pack=True)[0]
    with torch.no_grad():
        want, _ = forward_logprobs(lm, make_micro_batches(batch, 4, share_prefix=False)[0], 0.7)
        got, _ = forward_logprobs(lm, mb, 0.7)
        cross = replace(mb, position_ids=torch.arange(mb.input_ids.shape[1])[None])
        leaked, _ = forward_logprobs(lm, cross, 0.7)
    on = mb.mask > 0
    assert (got - want)[on].abs().max() < ABS
    assert (leaked - want)[on].abs().max() > 1e-2


def test_packing_refuses_attention_it_cannot_mask_in_one_line():
    model = tiny_llama()
    assert packing_refusal(model) is None  # sdpa
    model.config._attn_implementation = "eager"
    assert packing_refusal(model) is None
    model.config._attn_implementation = "paged|sdpa"
    why = packing_refusal(model)
    assert "'paged|sdpa'" in why and "\n" not in why


# ------------------------------------------------------------------ the planner
def test_the_planner_counts_a_packed_micro_batch_by_its_real_tokens():
    lengths = [12, 47, 16, 40] * 2  # two groups of rows of very different lengths
    groups = [0] * 4 + [1] * 4
    assert micro_batch_cost(lengths[:4]) == 4 * 47 and micro_batch_cost(lengths[:4], packed=True) == 115
    budget = 240
    padded = token_budget_bounds(lengths, budget, groups)
    packed = token_budget_bounds(lengths, budget, groups, packed=True)
    assert padded == [(0, 4), (4, 8)]  # 4 x 47 = 188 per group; two groups 376 > 240
    assert sum(lengths) == 230 and packed == [(0, 8)]  # both groups, whole, in one micro-batch
    # groups stay whole where they fit: 150 takes one group either way, not 3 + 5 rows
    assert token_budget_bounds(lengths, 150, groups, packed=True) == [(0, 4), (4, 8)]
    assert token_budget_bounds(lengths, 150, groups) == [(0, 3), (3, 6), (6, 8)]
    batch = uneven_groups()
    n_padded = len(make_micro_batches(batch, 1, token_budget=200, share_prefix=False))
    mbs = make_micro_batches(batch, 1, token_budget=200, pack=True)
    assert len(mbs) < n_padded and all(mb.input_ids.numel() <= 200 for mb in mbs if mb.unpack.shape[0] > 1)


# ------------------------------------------------------------------ the same numbers
def passes(peft_model, batch: TrainBatch, loss_type: str, pack: bool) -> dict:
    """old_log_prob, ref (beta > 0) and two update_actor epochs with an entropy bonus, log-probs
    chunked, micro-batches by ``BUDGET`` tokens; no optimizer step (gradients captured)."""
    lm = SharedPrefixLM(peft_model)
    mbs = make_micro_batches(batch, 1, token_budget=BUDGET, share_prefix=False,
                             logprob_chunk=16, pack=pack)
    sync, grads = capturing_sync(peft_model)
    norm = one_rank_norm(batch, loss_type, 40)
    params = ObjectiveParams.from_config(LearnerConfig(beta=0.05, entropy_coef=0.01, loss_type=loss_type))
    olds, rollout, ent = old_log_prob(lm, mbs, 0.7, True)
    refs = ref_log_prob(lm, peft_model, mbs, 0.7)
    two = update_actor(lm, mbs, sync, norm, params, temperature=0.7, epochs=2, old=olds, ref=refs, entropy_bonus=True)
    return {"n": [mb.mask.shape[0] for mb in mbs], "olds": olds, "refs": refs, "rollout": rollout, "ent": ent,
            "loss": two.loss, "sums": two.sums, "grads": grads, "mask": [mb.mask for mb in mbs]}


@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "dr_grpo"])
def test_packed_passes_give_the_padded_log_probs_losses_and_gradients(loss_type):
    peft_model = lora(tiny_llama())
    batch = uneven_groups()
    want = passes(peft_model, batch, loss_type, pack=False)
    got = passes(peft_model, batch, loss_type, pack=True)
    assert want["n"] == [4, 4] and got["n"] == [8]  # packing took both groups in one micro-batch
    cat = lambda xs: torch.cat([x.reshape(-1) for x in xs])  # noqa: E731

    def on(key, res):  # the scored tokens' values, in batch order (the layouts' widths differ)
        return torch.cat([v[m > 0] for v, m in zip(res[key], res["mask"])])

    for key in ("olds", "refs"):
        assert (on(key, got) - on(key, want)).abs().max() < ABS, key
    assert cat(got["mask"]).sum() == cat(want["mask"]).sum()
    assert got["ent"] == pytest.approx(want["ent"], rel=REL)
    for k, v in want["rollout"].items():
        assert got["rollout"][k] == pytest.approx(v, rel=REL, abs=1e-7), k
    assert got["loss"] == pytest.approx(want["loss"], rel=REL, abs=1e-8)
    for k, v in want["sums"].items():
        assert got["sums"][k] == pytest.approx(v, rel=REL, abs=1e-6), k
    assert len(got["grads"]) == len(want["grads"]) == 2
    assert any(g.abs().max() > 0 for g in want["grads"][0].values())
    for got_step, want_step in zip(got["grads"], want["grads"]):
        for name, g in want_step.items():
            if g.abs().max() > 0:
                assert rel(got_step[name], g) < REL, name
            else:
                assert got_step[name].abs().max() == 0, name


def policy(model_dir, loss_type: str, **learner) -> PolicyLearner:
    cfg = RunConfig.model_validate({
        "seed": 0, "model": {"name_or_path": str(model_dir)},
        "learner": {"lr": 1e-2, "micro_batch_size": 8, "micro_batch_tokens": BUDGET, "lora": {"r": 4, "alpha": 8},
                    "beta": 0.05, "loss_type": loss_type, "logprob_chunk_tokens": 16, "fold_old_logprobs": False,
                    "entropy_coef": 0.01, **learner},
        "rollout": {"temperature": 0.7, "max_tokens": 40}, "trainer": {"steps": 4},
    })
    return PolicyLearner.for_run(cfg)


def two_steps(learner: PolicyLearner) -> tuple[list[dict], dict[str, torch.Tensor]]:
    metrics = [learner.step(uneven_groups(seed))[0] for seed in (1, 2)]
    return metrics, {k: v.clone() for k, v in adapter_state_dict(learner.peft_model).items()}


@pytest.mark.parametrize("loss_type", ["dapo", "grpo"])
def test_two_packed_policy_steps_give_the_padded_adapter(tmp_path, loss_type):
    """The whole step through PolicyLearner (planner, ref pass, chunked log-probs, AdamW): packed
    against padded, and packed with gradient checkpointing and fused LoRA layers."""
    tiny_llama(tmp_path)
    base_learner = policy(tmp_path, loss_type, share_prompt_prefix=False)
    base_m, base_a = two_steps(base_learner)
    for extra in ({}, {"gradient_checkpointing": True, "fused_lora": True}):
        learner = policy(tmp_path, loss_type, pack_sequences=True, **extra)
        assert learner.pack and not learner.share_prefix and learner.stats()["pack_sequences"] is True
        got_m, got_a = two_steps(learner)
        for got, want in zip(got_m, base_m):
            for key in ("loss", "grad_norm", "kl", "entropy", "ppl_ratio", "clip_frac", "pg_loss"):
                assert got[key] == pytest.approx(want[key], rel=REL, abs=1e-7), (extra, key)
            assert got["learner_tokens_per_s"] > 0
        moved = 0
        for name, want in base_a.items():
            assert rel(got_a[name], want) < REL, (extra, name)
            moved += int("lora_B" in name and want.abs().max() > 0)
        assert moved > 0
    assert base_m[1]["kl"] > 0  # the ref pass ran against an adapter that moved


def test_packing_is_refused_beside_layouts_it_cannot_share_in_one_line():
    for sets, message in (
        (["learner.pack_sequences=true", "learner.share_prompt_prefix=true"],
         "learner.pack_sequences=true with learner.share_prompt_prefix=true"),
        (["learner.pack_sequences=true", "learner.cuda_graphs=true"],
         "learner.pack_sequences=true with learner.cuda_graphs=true"),
    ):
        with pytest.raises(ConfigError) as err:
            load_config(None, sets)
        assert "\n" not in str(err.value) and message in str(err.value)
    assert load_config(None, []).learner.pack_sequences is False  # off by default
    fields = RunConfig.model_json_schema()["$defs"]["LearnerConfig"]["properties"]
    assert "sdpa with the block-diagonal mask lost" in fields["pack_sequences"]["description"]  # why it is off
    cfg = load_config(None, ["learner.pack_sequences=true", "learner.strategy=fsdp2", "learner.fused_lora=false"])
    assert cfg.learner.pack_sequences and cfg.learner.share_prompt_prefix is None


@pytest.mark.slow
def test_packed_fsdp2_over_two_ranks_takes_the_step_of_one_rank(tmp_path):
    """5 rows over 2 gloo ranks, 2 per packed micro-batch: rank 0 runs 2 and 1 rows, rank 1 runs
    2 rows and a padding micro-batch (unpacked) in every pass; against one DDP rank, packed and
    padded. Tolerance as tests/test_learner_fsdp.py (1e-4: the ranks' reduce-scatter sums in
    another order), and the packed one rank against the padded one to this file's."""
    from tests.test_learner_fsdp import REL as RANKS_REL, rel as rel_dict, run_ranks

    padded = run_ranks("ddp", 1, tmp_path / "ddp1_padded", mode=("packed", "off"), timeout=300)
    packed = run_ranks("ddp", 1, tmp_path / "ddp1_packed", mode=("packed", "on"), timeout=300)
    fsdp = run_ranks("fsdp2", 2, tmp_path / "fsdp2_packed", mode=("packed", "on"), timeout=300)
    assert rel_dict(packed["grads"], padded["grads"]) < REL and rel_dict(packed["step1"], padded["step1"]) < REL
    for want in (packed, padded):
        assert fsdp["metrics"]["loss"] == pytest.approx(want["metrics"]["loss"], rel=2e-6)
        for key in ("grad_norm", "kl", "entropy", "ppl_ratio", "pg_loss"):
            assert fsdp["metrics"][key] == pytest.approx(want["metrics"][key], rel=RANKS_REL, abs=1e-9), key
        assert fsdp["metrics"]["sequences"] == 5.0
        assert rel_dict(fsdp["grads"], want["grads"]) < RANKS_REL
        assert rel_dict(fsdp["step1"], want["step1"]) < RANKS_REL
    assert any(v.abs().sum() > 0 for k, v in fsdp["grads"].items() if "lora_B" in k)


def test_auto_checkpointing_weighs_packed_rows_by_their_mean_length():
    """7 rows, the longest 584 tokens, on 24 GiB (Qwen3-4B, r=32): padded, 3 rows fit a plain
    micro-batch (3 micro-batches), so the plan checkpoints (all 7 in one); packed rows of 250
    tokens on average fit 7 in one plain micro-batch: no checkpointing."""
    from learner.memory_plan import memory_plan
    from tests.test_learner_memory import GIB, QWEN3_4B, QWEN3_4B_LORA32

    args = (QWEN3_4B, 32, QWEN3_4B_LORA32, 24 * GIB, 584, 256)
    padded = memory_plan(*args, rows=7)
    packed = memory_plan(*args, rows=7, row_tokens=250)
    assert padded.gradient_checkpointing and not packed.gradient_checkpointing
    assert packed.micro_batch_tokens >= 7 * 250 and packed.fits
