"""The learner's GPU options, checked on CPU: micro-batches by token budget (learner/microbatch.py)
give the same loss and gradients as one batch; gradient checkpointing gives the same update;
the step reports tokens/s and MFU from the tokens it actually ran; fused AdamW only on CUDA."""

from __future__ import annotations

import pytest
import torch

from config import RunConfig
from config.learner import LearnerConfig
from learner.losses import LossNorm, ObjectiveParams
from learner.lora import adapter_state_dict
from learner.microbatch import computed_tokens, count_bounds, mfu, model_flops, token_budget_bounds
from learner.optim import use_fused
from learner.passes import (GradSync, make_micro_batches, old_log_prob, pad_micro_batches, ref_log_prob,
                            update_actor)
from learner.policy import PolicyLearner
from learner.shared_prefix import SharedPrefixLM
from learner.types import TrainBatch
from tests.test_shared_prefix import VOCAB, lora, tiny_llama


# ------------------------------------------------------------------ pure functions
def test_token_budget_keeps_groups_whole_where_they_fit():
    lengths = [10, 12, 11, 9, 20, 21, 22, 20]
    groups = [0, 0, 0, 0, 1, 1, 1, 1]
    # group 0 costs 4 x 12 = 48, group 1 costs 4 x 22 = 88: together 8 x 22 = 176
    assert token_budget_bounds(lengths, 176, groups) == [(0, 8)]
    assert token_budget_bounds(lengths, 100, groups) == [(0, 4), (4, 8)]
    # group 1 does not fit in 60: cut by rows, two rows of <= 22 per micro-batch
    assert token_budget_bounds(lengths, 60, groups) == [(0, 4), (4, 6), (6, 8)]


def test_token_budget_without_groups_and_long_rows():
    assert token_budget_bounds([5, 5, 5, 5, 5], 10) == [(0, 2), (2, 4), (4, 5)]
    # a row longer than the budget goes alone, never dropped; neighbours still pack
    assert token_budget_bounds([3, 50, 3, 3], 10) == [(0, 1), (1, 2), (2, 4)]
    # the padded size counts: a long row raises the cost of the rows beside it
    assert token_budget_bounds([2, 2, 9], 12) == [(0, 2), (2, 3)]


@pytest.mark.parametrize("seed", range(20))
def test_token_budget_bounds_cover_rows_in_order_within_budget(seed):
    g = torch.Generator().manual_seed(seed)
    n = int(torch.randint(1, 40, (1,), generator=g))
    lengths = torch.randint(1, 60, (n,), generator=g).tolist()
    groups = sorted(torch.randint(0, 6, (n,), generator=g).tolist())
    budget = int(torch.randint(1, 300, (1,), generator=g))
    bounds = token_budget_bounds(lengths, budget, groups)
    assert [lo for lo, _ in bounds] == [0] + [hi for _, hi in bounds[:-1]]
    assert bounds[-1][1] == n
    for lo, hi in bounds:
        assert hi > lo
        assert hi - lo == 1 or (hi - lo) * max(lengths[lo:hi]) <= budget


def test_token_budget_refuses_nonsense():
    with pytest.raises(ValueError, match="budget"):
        token_budget_bounds([1, 2], 0)
    with pytest.raises(ValueError, match="group ids"):
        token_budget_bounds([1, 2], 10, [0])
    assert count_bounds(5, 2) == [(0, 2), (2, 4), (4, 5)]


def test_computed_tokens_and_mfu():
    assert computed_tokens([10, 12, 11], 0) == 33
    assert computed_tokens([10, 12, 11], 8) == 8 + 2 + 4 + 3
    assert computed_tokens([10], 8) == 10  # one row shares nothing
    assert model_flops(1_000, train_tokens=3, forward_tokens=2) == 6 * 1_000 * 3 + 2 * 1_000 * 2
    assert mfu(989e12, 2.0, 989e12) == pytest.approx(0.5)
    assert mfu(989e12, 1.0, 989e12, devices=4) == pytest.approx(0.25)
    assert mfu(1.0, 0.0, 989e12) == 0.0


def test_fused_adamw_only_for_cuda_parameters():
    cpu = [torch.nn.Parameter(torch.zeros(3))]
    assert not use_fused(cpu, True)
    assert not use_fused(cpu, False)


def test_new_fields_are_in_the_schema_with_descriptions():
    fields = RunConfig.model_json_schema()["$defs"]["LearnerConfig"]["properties"]
    for name in ("micro_batch_tokens", "gradient_checkpointing", "autocast", "fused_optimizer", "peak_flops"):
        assert fields[name].get("description"), name
    with pytest.raises(ValueError, match="micro_batch_tokens"):
        RunConfig.model_validate({"learner": {"micro_batch_tokens": 0}})


# ------------------------------------------------------------------ the same gradients
def two_groups(g: torch.Generator) -> TrainBatch:
    """Two groups of four rows (test_shared_prefix's), random rollout log-probs, distinct advantages per group."""
    from test_shared_prefix import batch_of_two_groups

    return batch_of_two_groups(g, logprobs=lambda r: (torch.rand(len(r), generator=g) * -3).tolist(),
                               group_shift=0.1, vocab=VOCAB)


def capturing_sync(peft_model) -> tuple[GradSync, list[dict[str, torch.Tensor]]]:
    """A GradSync whose optimizer step only records the LoRA gradients (one dict per step)."""
    trainable = {n: p for n, p in peft_model.named_parameters() if p.requires_grad}
    grads: list[dict[str, torch.Tensor]] = []

    def step() -> float:
        grads.append({n: p.grad.detach().clone() for n, p in trainable.items()})
        for p in trainable.values():
            p.grad = None
        return 0.0

    return GradSync(backward=lambda loss, last: loss.backward(), step=step), grads


def one_rank_norm(batch: TrainBatch, loss_type: str, max_completion_length: int) -> LossNorm:
    """The loss normalisation of one rank holding the whole batch."""
    tokens = float(batch.num_response_tokens())
    return LossNorm(loss_type=loss_type, global_tokens=tokens, global_sequences=len(batch), local_tokens=tokens,
                    max_completion_length=max_completion_length, dp_size=1)


def gradients(peft_model, batch: TrainBatch, loss_type: str, **cut) -> tuple[int, float, dict[str, torch.Tensor]]:
    """Micro-batch count, loss and LoRA gradients of one update_actor pass (no optimizer step)."""
    lm = SharedPrefixLM(peft_model)
    mbs = make_micro_batches(batch, cut.pop("size", len(batch)), **cut)
    sync, grads = capturing_sync(peft_model)
    res = update_actor(lm, mbs, sync, one_rank_norm(batch, loss_type, 8), ObjectiveParams.from_config(LearnerConfig()),
                       temperature=0.7, epochs=1, old=None, ref=None, entropy_bonus=False)
    return len(mbs), res.loss, grads[0]


@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "dr_grpo"])
@pytest.mark.parametrize("budget", [30, 50, 90])
def test_token_budget_micro_batches_give_the_gradients_of_one_batch(loss_type, budget):
    peft_model = lora(tiny_llama())
    batch = two_groups(torch.Generator().manual_seed(7))
    one_n, one_loss, one = gradients(peft_model, batch, loss_type)
    cut_n, cut_loss, cut = gradients(peft_model, batch, loss_type, token_budget=budget)
    assert one_n == 1 and cut_n > 1  # the budget really cut the batch
    assert cut_loss == pytest.approx(one_loss, rel=1e-5, abs=1e-7)
    assert any(g.abs().max() > 0 for g in one.values())
    for name, want in one.items():
        torch.testing.assert_close(cut[name], want, rtol=1e-4, atol=1e-7, msg=name)


def all_passes(peft_model, batch: TrainBatch, loss_type: str, pad_to: int | None) -> dict:
    """old_log_prob, ref and two update_actor epochs (beta > 0, entropy bonus on) over the batch's
    micro-batches of 3 rows, padded to ``pad_to`` micro-batches (None: as cut); then one folded
    epoch. Every output, the losses and the LoRA gradients of each optimizer step."""
    lm = SharedPrefixLM(peft_model)
    mbs = make_micro_batches(batch, 3)
    if pad_to is not None:
        mbs = pad_micro_batches(mbs, pad_to)
    sync, grads = capturing_sync(peft_model)
    norm = one_rank_norm(batch, loss_type, 8)
    params = ObjectiveParams.from_config(LearnerConfig(beta=0.05, entropy_coef=0.01))
    olds, rollout, ent = old_log_prob(lm, mbs, 0.7, True)
    refs = ref_log_prob(lm, peft_model, mbs, 0.7)
    two = update_actor(lm, mbs, sync, norm, params, temperature=0.7, epochs=2, old=olds, ref=refs, entropy_bonus=True)
    folded = update_actor(lm, mbs, sync, norm, params, temperature=0.7, epochs=1, old=None, ref=refs,
                          entropy_bonus=False)
    real = len(make_micro_batches(batch, 3))
    return {"n": len(mbs), "olds": olds[:real], "refs": refs[:real], "rollout": rollout, "ent": ent,
            "two": (two.loss, two.sums, two.rollout_sums), "folded": (folded.loss, folded.sums, folded.rollout_sums),
            "grads": grads}


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
def test_padding_micro_batches_change_no_number(loss_type):
    """learner.strategy=fsdp2 pads a rank's micro-batches to the most any rank has: the padding
    adds exactly 0 to every loss, gradient and metric sum (bit for bit, fp32 on CPU)."""
    peft_model = lora(tiny_llama())
    batch = two_groups(torch.Generator().manual_seed(11))
    want = all_passes(peft_model, batch, loss_type, None)
    got = all_passes(peft_model, batch, loss_type, want["n"] + 2)
    assert (want["n"], got["n"]) == (3, 5)
    for key in ("rollout", "ent", "two", "folded"):
        assert got[key] == want[key], key
    for key in ("olds", "refs"):
        assert all(torch.equal(a, e) for a, e in zip(got[key], want[key])), key
    assert len(got["grads"]) == len(want["grads"]) == 3
    assert any(g.abs().max() > 0 for g in want["grads"][0].values())
    for got_step, want_step in zip(got["grads"], want["grads"]):
        for name, g in want_step.items():
            assert torch.equal(got_step[name], g), name


def test_pad_micro_batches_appends_masked_rows_only():
    batch = two_groups(torch.Generator().manual_seed(2))
    mbs = make_micro_batches(batch, 4, causal_only=True, logprob_chunk=5)
    padded = pad_micro_batches(mbs, 4)
    assert padded[:2] == mbs and all(mb.padding for mb in padded[2:]) and not any(mb.padding for mb in mbs)
    pad = padded[-1]
    assert pad.input_ids.shape == (1, 2) and pad.attention_mask.all() and not pad.mask.any()
    assert (pad.causal_only, pad.logprob_chunk, pad.tokens, pad.shared_prefix) == (True, 5, 0, 0)
    assert pad_micro_batches(mbs, 2) == mbs
    assert [mb.padding for mb in pad_micro_batches([], 2)] == [True, True]  # a rank without rows joins too
    with pytest.raises(ValueError, match="cannot pad 2 micro-batches down to 1"):
        pad_micro_batches(mbs, 1)


def test_token_budget_micro_batches_keep_each_groups_shared_prompt():
    batch = two_groups(torch.Generator().manual_seed(2))
    mbs = make_micro_batches(batch, 1, token_budget=4 * 25)  # a whole group fits, two do not
    assert [mb.input_ids.shape[0] for mb in mbs] == [4, 4]
    assert [mb.shared_prefix for mb in mbs] == [14, 17]
    lengths = [len(p) + len(r) for p, r in zip(batch.prompt_ids, batch.response_ids)]
    assert [mb.tokens for mb in mbs] == [computed_tokens(lengths[:4], 14), computed_tokens(lengths[4:], 17)]


# ------------------------------------------------------------------ the policy, wired from the config
def policy_step(model_dir, **learner):
    cfg = RunConfig.model_validate({
        "seed": 0, "model": {"name_or_path": str(model_dir)},
        "learner": {"lr": 1e-2, "micro_batch_size": 4, "lora": {"r": 4, "alpha": 8}, **learner},
        "rollout": {"temperature": 0.7}, "trainer": {"steps": 2},
    })
    learner_ = PolicyLearner.for_run(cfg)
    batch = two_groups(torch.Generator().manual_seed(3))
    metrics, phases = learner_.step(batch)
    return learner_, metrics, phases, adapter_state_dict(learner_.peft_model)


def test_policy_token_budget_and_checkpointing_give_the_same_update(tmp_path):
    tiny_llama(tmp_path)
    _, base_m, _, base_a = policy_step(tmp_path)
    _, budget_m, _, budget_a = policy_step(tmp_path, micro_batch_tokens=50)
    ckpt_learner, ckpt_m, _, ckpt_a = policy_step(tmp_path, gradient_checkpointing=True)
    assert ckpt_learner.peft_model.is_gradient_checkpointing
    for metrics in (budget_m, ckpt_m):
        for key in ("loss", "grad_norm", "ppl_ratio"):
            assert metrics[key] == pytest.approx(base_m[key], rel=1e-4, abs=1e-6), key
    moved = 0
    for name, want in base_a.items():
        torch.testing.assert_close(budget_a[name], want, atol=1e-6, rtol=1e-4, msg=name)
        torch.testing.assert_close(ckpt_a[name], want, atol=1e-6, rtol=1e-4, msg=name)
        moved += int("lora_B" in name and want.abs().max() > 0)
    assert moved > 0


def test_policy_reports_tokens_per_second_and_mfu_of_the_tokens_it_ran(tmp_path):
    tiny_llama(tmp_path)
    batch = two_groups(torch.Generator().manual_seed(3))
    lengths = [len(p) + len(r) for p, r in zip(batch.prompt_ids, batch.response_ids)]
    for extra, forward_passes, shared in (({}, 0, (14, 17)), ({"fold_old_logprobs": False, "beta": 0.05}, 2, (14, 17)),
                                          ({"gradient_checkpointing": True}, 0, (0, 0))):
        learner, metrics, phases, _ = policy_step(tmp_path, **extra)
        assert learner.amp_dtype is None  # CPU: no autocast
        seconds = phases["old_log_prob"] + phases["ref"] + phases["update_actor"]
        trained = computed_tokens(lengths[:4], shared[0]) + computed_tokens(lengths[4:], shared[1])
        tokens = trained * (1 + forward_passes)
        assert metrics["learner_tokens_per_s"] * seconds == pytest.approx(tokens, rel=1e-6), extra
        want = model_flops(learner.num_params, trained, trained * forward_passes) / seconds / 989e12
        assert metrics["learner_mfu"] == pytest.approx(want, rel=1e-6), extra


# ------------------------------------------------------------------ bench/gpu_vs_trl.py's CPU pieces
def test_gpu_bench_config_and_results_follow_their_schemas(tmp_path):
    import json

    from bench import gpu_vs_trl as bench

    cfg = bench.bench_config(tmp_path / "model", prompts=4, steps=6, runs_dir=tmp_path)
    assert (cfg.learner.lora.r, cfg.learner.lora.alpha, cfg.learner.lora.target_modules) == (32, 64.0, "all-linear")
    assert (cfg.trainer.prompts_per_step, cfg.trainer.group_size, cfg.rollout.max_tokens) == (4, 8, 384)
    assert cfg.model.dtype == "bfloat16" and cfg.rollout.engine == "hf" and cfg.learner.use_gpu
    assert cfg.rollout.num_gpus + cfg.learner.gpus_per_worker <= 1  # replica and learner share one GPU
    # sides measured or skipped: a row per shape stays, with nulls where nothing was measured
    cp = {"versions": {"torch": "x"}, "shapes": [
        {"model": "qwen3-4b", "prompts": 1, "s_per_step": 4.0, "gen_tokens": [3072, 3070, 3072],
         "phases_s": {"gen": 2.5, "update_actor": 1.3}, "peak_gib": 52.5, "mfu": 0.04, "params": 4_000_000_000,
         "prompt_tokens": 200.0},
        {"model": "qwen3-0.6b", "prompts": 4, "skipped": "deadline"}]}
    trl = {"versions": {"trl": "1.16.0"}, "shapes": [{"model": "qwen3-4b", "prompts": 1, "s_per_step": 40.0},
                                                       {"model": "qwen3-4b", "prompts": 4, "skipped": "deadline"}]}
    trl_vllm = {"versions": {"vllm": "0.26.0"}, "shapes": [{"model": "qwen3-4b", "prompts": 1, "s_per_step": 2.5}]}
    train = {"versions": {}, "shapes": [
        {"model": "qwen3-4b", "prompts": 1, "mode": "sync", "s_per_step": 2.25, "gen_tokens": [3072, 3072],
         "phases_s": {"gen": 1.5}, "peak_gpu_mib": 61440},
        {"model": "qwen3-4b", "prompts": 1, "mode": "one_step_off", "s_per_step": 2.0, "gen_tokens": [3072, 3072],
         "phases_s": {"gen": 0.1}, "peak_gpu_mib": 71680},
        {"model": "qwen3-4b", "prompts": 4, "mode": "sync", "skipped": "deadline"}]}
    doc = bench.merge(trl, cp, "python3 bench/gpu_vs_trl.py ...", trl_vllm, train)
    bench.validate_results(doc)
    rows = {(r["model"], r["prompts"]): r for r in doc["shapes"]}
    assert [(r["model"], r["prompts"]) for r in doc["shapes"]] == [("qwen3-4b", 1), ("qwen3-4b", 4), ("qwen3-0.6b", 4)]
    four = rows[("qwen3-4b", 1)]
    assert four["tokens"] == 3072 and four["trl_s_per_step"] == 40.0 and four["trl_vllm_s_per_step"] == 2.5
    # the headline takes the faster mode, its phases and its memory; both modes are kept
    assert four["counterpoint_train_s_per_step"] == 2.0 and four["counterpoint_train_modes"] == {"sync": 2.25,
                                                                                                "one_step_off": 2.0}
    assert four["counterpoint_train_variant"] == "one_step_off"
    assert four["phases_s"] == {"gen": 0.1} and four["peak_gib"] == 70.0 and four["counterpoint_s_per_step"] == 4.0
    assert four["mfu"] == pytest.approx(bench.step_model_flops(4_000_000_000, 8, 200.0, 384) / 2.0 / 989e12)
    assert rows[("qwen3-4b", 4)]["counterpoint_s_per_step"] is None and rows[("qwen3-4b", 4)]["tokens"] == 4 * 8 * 384
    assert rows[("qwen3-4b", 4)]["counterpoint_train_s_per_step"] is None
    assert rows[("qwen3-4b", 4)]["counterpoint_train_modes"] == {}
    assert rows[("qwen3-0.6b", 4)]["trl_s_per_step"] is None and rows[("qwen3-0.6b", 4)]["mfu"] is None
    md = bench.markdown(doc, trl, cp, trl_vllm_res=trl_vllm, train_res=train)
    assert "| qwen3-4b | 1x8 | 2.50 | 2.00 | 0.800 | one_step_off | one_step_off 2.00 (0.800); sync 2.25 (0.900) |" in md
    # variants: MPS (run.json's gpu_sharing, else the command's --set) and fp8 rollouts, which are
    # reported beside but never taken as the headline (another policy samples)
    mps = {"model": "qwen3-4b", "prompts": 1, "mode": "one_step_off", "s_per_step": 1.9, "phases_s": {"gen": 0.0},
           "command": "counterpoint train --set gpu_sharing.mode=mps", "rollout_quantization": {"mode": "none"}}
    fp8 = {**mps, "s_per_step": 1.5, "command": "", "gpu_sharing": {"mode": "mps", "requested": "auto"},
           "rollout_quantization": {"mode": "fp8"}}
    fp8_merged = {**fp8, "s_per_step": 1.2, "command": "counterpoint train --set rollout.quantization=fp8 "
                                                       "--set rollout.vllm_lora=merged"}
    # run.json's record says it where the command does not
    recorded = {**fp8, "s_per_step": 1.3, "mode": "sync",
                "rollout_quantization": {"mode": "fp8", "rollout_weights": "fp8 (...; LoRA merged in bfloat16 ...)"}}
    doc2 = bench.merge(None, None, "cmd", trl_vllm, {"shapes": train["shapes"] + [mps, fp8, fp8_merged, recorded]})
    four2 = {(r["model"], r["prompts"]): r for r in doc2["shapes"]}[("qwen3-4b", 1)]
    assert four2["counterpoint_train_s_per_step"] == 1.9 and four2["counterpoint_train_variant"] == "one_step_off, MPS"
    assert four2["counterpoint_train_modes"] == {"sync": 2.25, "one_step_off": 2.0, "one_step_off, MPS": 1.9,
                                                 "one_step_off, MPS, fp8 rollouts": 1.5,
                                                 "one_step_off, MPS, fp8 rollouts, LoRA merged": 1.2,
                                                 "sync, MPS, fp8 rollouts, LoRA merged": 1.3}
    # the fastest fp8 row goes beside the headline, against TRL's vLLM at the same fp8 setting
    assert four2["counterpoint_train_fp8_s_per_step"] == 1.2 and four2["trl_vllm_fp8_s_per_step"] is None
    assert four2["counterpoint_train_fp8_variant"] == "one_step_off, MPS, fp8 rollouts, LoRA merged"
    trl_both = {"versions": {"device": "NVIDIA H100 80GB HBM3"}, "shapes": [
        trl_vllm["shapes"][0], {"model": "qwen3-4b", "prompts": 1, "s_per_step": 2.2, "rollout_quantization": "fp8"}]}
    # two runs that differ only in the learner's --sets keep a label each
    compiled = {**train["shapes"][1], "s_per_step": 1.95,
                "command": "counterpoint train --set learner.compile_layers=true --set learner.fused_lora=false"}
    train3 = {"versions": {"device": "NVIDIA H100 80GB HBM3"}, "shapes": train["shapes"] + [compiled, fp8_merged]}
    doc3 = bench.merge(None, None, "cmd", trl_both, train3)
    bench.validate_results(doc3)
    four3 = {(r["model"], r["prompts"]): r for r in doc3["shapes"]}[("qwen3-4b", 1)]
    assert four3["trl_vllm_s_per_step"] == 2.5 and four3["trl_vllm_fp8_s_per_step"] == 2.2  # bf16 stays the peer
    assert four3["counterpoint_train_variant"] == "one_step_off, learner.compile_layers=true, learner.fused_lora=false"
    assert four3["counterpoint_train_modes"]["one_step_off"] == 2.0
    md3 = bench.markdown(doc3, None, None, trl_vllm_res=trl_both, train_res=train3)
    assert md3.startswith("# counterpoint vs TRL on one H100 80GB HBM3: the whole GRPO step")
    # 1.2 against TRL's fp8 2.2, which is also TRL's faster setting here
    assert "| qwen3-4b | 1x8 | 2.20 | 1.20 | one_step_off, MPS, fp8 rollouts, LoRA merged | 0.545 | 0.545 |" in md3
    assert "| qwen3-4b | 1x8 | fp8 | – x – |" in md3 and "| qwen3-4b | 1x8 | bf16 | – x – |" in md3
    # a run whose policy went nan (its ppl_ratio says so) is never a result, however fast its steps
    went_nan = {**compiled, "s_per_step": 1.0, "command": "counterpoint train --set learner.compile_layers=false",
                "ppl_ratio": [float("nan"), float("nan")]}
    doc4 = bench.merge(None, None, "cmd", trl_both, {**train3, "shapes": train3["shapes"] + [went_nan]})
    four4 = {(r["model"], r["prompts"]): r for r in doc4["shapes"]}[("qwen3-4b", 1)]
    assert four4["counterpoint_train_s_per_step"] == 1.95 and four4["counterpoint_train_variant"] == (
        "one_step_off, learner.compile_layers=true, learner.fused_lora=false")
    assert four4["counterpoint_train_modes"][
        "one_step_off, learner.compile_layers=false (went nan: not a result)"] == 1.0
    # the adapter's transport and MPS's share are in the label too
    assert bench.train_variant({"mode": "one_step_off", "gpu_sharing": {"mode": "mps"}, "command": (
        "counterpoint train --set gpu_sharing.mode=mps --set gpu_sharing.learner_sm_percent=75 "
        "--set adapter_transport=device")}) == (
        "one_step_off, MPS, gpu_sharing.learner_sm_percent=75, adapter_transport=device")
    assert bench.trained_finite({"ppl_ratio": [1.0, None]})  # a step that recorded none
    assert not bench.trained_finite({"ppl_ratio": [1.0, float("inf")]})
    # files measured on two machines make no ratio: refused, naming both
    with pytest.raises(ValueError, match="different GPUs .*H100.*H200"):
        bench.merge(None, None, "cmd", trl_both, {**train3, "versions": {"device": "NVIDIA H200"}})
    # the writer refuses anything off the schema
    with pytest.raises(ValueError, match="keys"):
        bench.validate_results({**doc, "extra": 1})
    with pytest.raises(ValueError, match="keys"):
        bench.validate_results({**doc, "shapes": [{**doc["shapes"][0], "engine": "hf"}]})
    with pytest.raises(ValueError, match="number or null"):
        bench.validate_results({**doc, "shapes": [{**doc["shapes"][0], "mfu": "high"}]})
    # the committed results are in that schema too: the H200's, and the H100's beside it
    committed = json.loads((bench.ROOT / "bench" / "results" / "gpu-vs-trl.json").read_text())
    bench.validate_results(committed)
    for h100 in ("gpu-vs-trl-h100.json", "gpu-vs-trl-h100-2.json"):  # two leases, two machines: two reports
        bench.validate_results(json.loads((bench.ROOT / "bench" / "results" / h100).read_text()))
    # one session's shapes, in the bench's order; the two (4B 1x8 and 4x8) always among them
    shapes = [(r["model"], r["prompts"]) for r in committed["shapes"]]
    assert shapes == [k for k in bench.RUNS if k in shapes] and {("qwen3-4b", 1), ("qwen3-4b", 4)} <= set(shapes)


def test_train_figures_read_a_run_directory(tmp_path):
    """bench/gpu_vs_trl.py's reading of a finished run: medians after the warm-up steps without
    the last, the sync's share beside the next generation (one_step_off only), versions per row."""
    import json

    from bench import gpu_vs_trl as bench

    def write(name, rows):
        (tmp_path / name).write_text("".join(json.dumps(r) + "\n" for r in rows))

    steps = [(1, 5.0, 1.2), (2, 3.0, 0.9), (3, 3.2, 1.1), (4, 3.1, 1.0), (5, 2.0, 0.0)]
    write("timing.jsonl", [{"step": s, "total_s": t, "phases_s": {"update_weights": w + 0.2}} for s, t, w in steps])
    write("metrics.jsonl", [{"step": s, "generate_s": 2.5, "update_weights_beside_gen_s": w, "ppl_ratio": 1.0,
                             "adapter_staleness": float(s > 1), "learner_gradient_checkpointing": float(s == 3),
                             "learner_micro_batches": 4.0 + (s == 3)} for s, _, w in steps])
    (tmp_path / "round_0001").mkdir()
    write("round_0001/rows.jsonl", [{"step": 1, "adapter_version": 1}, {"step": 2, "adapter_version": 1}])
    got = bench.train_figures(tmp_path, skip=1, mode="one_step_off")
    assert got["s_per_step"] == 3.1 and got["phases_s"]["update_weights"] == pytest.approx(1.2)
    assert got["update_weights_beside_gen_s"] == 1.0  # the median of steps 2-4
    assert (got["samples"], got["samples_behind"], got["max_behind"], got["versions_ok"]) == (2, 1, 1, True)
    # the learner's memory plan per step, and the report's reading of it
    assert got["learner_gradient_checkpointing"] == [0.0, 0.0, 1.0, 0.0, 0.0]
    assert bench._plan_steps(got) == "1/5 steps (4, 5)"
    assert bench._plan_steps({"learner_gradient_checkpointing": [None, None]}) == "–"
    assert bench.train_figures(tmp_path, skip=1, mode="sync")["versions_ok"] is False  # sync allows none behind
    write("metrics.jsonl", [{"step": s, "generate_s": 2.5} for s, _, _ in steps])  # a run from before the figure
    assert bench.train_figures(tmp_path, skip=1, mode="one_step_off")["update_weights_beside_gen_s"] is None


def test_ray_overhead_compares_sync_runs_with_the_vllm_loop():
    from bench import gpu_vs_trl as bench

    loop = {"shapes": [
        {"model": "qwen3-0.6b", "prompts": 4, "engine": "VllmEngine", "s_per_step": 3.2,
         "phases_s": {"gen": 1.9, "score": 0.004, "update_actor": 1.14, "update_weights": 0.10}},
        {"model": "qwen3-4b", "prompts": 1, "engine": "HfFastEngine", "s_per_step": 3.7, "phases_s": {"gen": 2.4}}]}
    train = {"shapes": [
        {"model": "qwen3-0.6b", "prompts": 4, "mode": "sync", "s_per_step": 3.5,
         "phases_s": {"gen": 1.91, "score": 0.016, "update_actor": 1.44, "update_weights": 0.14}},
        {"model": "qwen3-0.6b", "prompts": 4, "mode": "one_step_off", "s_per_step": 2.4, "phases_s": {"gen": 0.0}},
        {"model": "qwen3-4b", "prompts": 1, "mode": "sync", "s_per_step": 2.2, "phases_s": {"gen": 1.5}}]}
    # only a sync run beside a vLLM loop of its shape: another engine's loop differs in more than Ray
    (row,) = bench.ray_overhead(loop, train)
    assert (row["model"], row["prompts"]) == ("qwen3-0.6b", 4)
    assert row["added_s"] == pytest.approx(0.3) and row["added_share"] == pytest.approx(0.3 / 3.2)
    assert row["phases_added_s"]["update_actor"] == pytest.approx(0.30)
    assert row["phases_added_s"]["gen"] == pytest.approx(0.01)
    doc = bench.merge(None, None, "cmd", None, train)
    md = bench.markdown(doc, None, None, train_res=train, loop_res=loop)
    assert "| qwen3-0.6b | 4x8 | 3.20 | 3.50 | 0.30 | +9.4% | +0.010 | +0.012 | +0.300 | +0.040 |" in md
    assert bench.ray_overhead(None, train) == [] and bench.ray_overhead(loop, None) == []


def test_decode_bench_step_times_and_overrides():
    from bench import vllm_decode
    from config import ConfigError

    rows = vllm_decode.add_step_ms([
        {"prompts": 1, "variant": "raw", "s": 1.45, "tokens": 384},
        {"prompts": 1, "variant": "raw_1tok", "s": 0.066, "tokens": 1},
        {"prompts": 4, "variant": "raw", "s": 1.67, "tokens": 384}])  # no 1-token call for 4: no figure
    assert rows[0]["ms_per_step"] == pytest.approx(1e3 * (1.45 - 0.066) / 383)
    assert "ms_per_step" not in rows[1] and "ms_per_step" not in rows[2]
    from config.run import config_with_overrides

    cfg = vllm_decode.bench_config("/m", 1, 1, "/r", engine="vllm")
    assert config_with_overrides(cfg.model_dump(), ["rollout.vllm_multiprocessing=false"]).rollout.vllm_multiprocessing is False
    with pytest.raises(ConfigError, match="rollout"):
        config_with_overrides(cfg.model_dump(), ["rollout.no_such_knob=1"])


@pytest.mark.slow
def test_decode_bench_loads_adapters_shaped_from_the_config_as_peft_shapes_them():
    from types import SimpleNamespace

    from safetensors.torch import load

    from bench import vllm_decode
    from bench.synthetic import config_lora_payload, make_lora_payload
    from config.rollout import ModelConfig, RolloutConfig
    from model.base import resolve_model
    from rollout.engines import make_engine

    model = ModelConfig(name_or_path="tiny-random", dtype="float32")
    model_dir = resolve_model(model)
    peft = load(make_lora_payload(model_dir, 1, r=4, alpha=8).data())
    ours = load(config_lora_payload(model_dir, 1, r=4, alpha=8).data())
    assert {k: tuple(v.shape) for k, v in ours.items()} == {k: tuple(v.shape) for k, v in peft.items()}
    assert {v.dtype for v in ours.values()} == {torch.bfloat16}  # as the learner publishes on a GPU
    engine = make_engine(model, RolloutConfig(max_model_len=512, max_lora_rank=8), kind="hf", seed=0)
    result: dict = {}
    cfg = SimpleNamespace(learner=SimpleNamespace(lora=SimpleNamespace(r=4, alpha=8)))
    assert vllm_decode.load_adapters(engine, model_dir, cfg, result) == 3 and engine.loaded_version() == 3
    assert len(result["adapter_load_s"]) == 3 and all(s > 0 for s in result["adapter_load_s"])


def test_trl_fp8_needs_trls_vllm():
    from argparse import Namespace

    from bench import gpu_vs_trl as bench

    with pytest.raises(SystemExit, match="trl --quantization fp8 needs --vllm"):
        bench.trl(Namespace(quantization="fp8", vllm=False))


def test_gpu_bench_flops_and_prompts():
    from bench import gpu_vs_trl as bench

    assert bench.step_model_flops(10, sequences=2, prompt_tokens=3, completion_tokens=5) == 8 * 10 * 2 * 8
    assert set(bench.SHAPES) >= {"qwen3-0.6b", "qwen3-4b"}
    assert bench.SHAPES["qwen3-4b"]["num_hidden_layers"] == 36 and bench.SHAPES["qwen3-0.6b"]["hidden_size"] == 1024


def test_gpu_bench_one_call_plan_and_shards():
    """`gpu_vs_trl.py all`: every (side, shape) placed once, the GPUs' loads balanced longest
    first, TRL before counterpoint on a GPU; the per-GPU result files combine in RUNS order."""
    from bench import gpu_vs_trl as bench

    for gpus in (1, 2, 3, 4):
        plan = bench.plan_jobs(["trl", "counterpoint"], bench.RUNS, gpus)
        placed = [(side, shape) for lane in plan for side, shapes in lane for shape in shapes]
        assert sorted(placed) == sorted((side, shape) for side in ("trl", "counterpoint") for shape in bench.RUNS)
        for lane in plan:
            assert [side for side, _ in lane] == sorted({side for side, _ in lane}, key=["trl", "counterpoint"].index)
        loads = [sum(bench.ESTIMATE_S[(side, *shape)] for side, shapes in lane for shape in shapes) for lane in plan]
        total = sum(bench.ESTIMATE_S.values())
        assert max(loads) <= total / gpus + max(bench.ESTIMATE_S.values())  # the LPT bound
    two = bench.plan_jobs(["trl"], bench.RUNS, 2)
    assert {shape for lane in two for _, shapes in lane for shape in shapes} == set(bench.RUNS)
    assert all(len(lane) == 1 for lane in two)  # one TRL process per GPU
    shards = [{"system": "trl", "versions": {"trl": "1.16.0"},
               "shapes": [{"model": "qwen3-0.6b", "prompts": 4, "s_per_step": 30.0},
                          {"model": "qwen3-4b", "prompts": 1, "s_per_step": 40.0}]},
              {"system": "trl", "versions": {"trl": "1.16.0"},
               "shapes": [{"model": "qwen3-4b", "prompts": 4, "s_per_step": 45.0},
                          {"model": "qwen3-0.6b", "prompts": 1, "s_per_step": 28.0}]}]
    combined = bench.combine(shards)
    assert [(r["model"], r["prompts"]) for r in combined["shapes"]] == bench.RUNS
    assert combined["versions"] == {"trl": "1.16.0"} and bench.combine([]) is None
    line = '[trl] {"model": "qwen3-4b", "prompts": 1, "s_per_step": 40.123456, "params": 4000000000}\n'
    assert bench._summary(line) == '[trl] {"model": "qwen3-4b", "prompts": 1, "s_per_step": 40.123}'
