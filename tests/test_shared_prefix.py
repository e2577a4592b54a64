"""learner/shared_prefix.py: a group's prompt computed once gives the same logits, gradients and
update as recomputing it for every row."""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM

from learner.lora import adapter_state_dict
from learner.passes import make_micro_batches
from learner.shared_prefix import SharedPrefixLM, shared_prefix_len
from learner.types import TrainBatch
from learner.policy import PolicyLearner
from config import RunConfig

VOCAB = 32


def test_shared_prefix_len():
    assert shared_prefix_len([[1, 2, 3, 4], [1, 2, 3, 9], [1, 2, 7]], cap=10) == 2
    assert shared_prefix_len([[1, 2, 3, 4], [1, 2, 3, 4]], cap=3) == 3  # capped
    assert shared_prefix_len([[1, 2], [1, 2, 3]], cap=10) == 2  # one row is the prefix
    assert shared_prefix_len([[5, 2], [1, 2]], cap=10) == 0
    assert shared_prefix_len([[1, 2, 3]], cap=10) == 0  # one row: nothing to share
    assert shared_prefix_len([[1, 2, 3], [1, 2, 3]], cap=0) == 0


def tiny_llama(tmp_path=None):
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
    )
    model = LlamaForCausalLM(cfg)
    if tmp_path is not None:
        model.save_pretrained(tmp_path)
    return model


def lora(model):
    peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"]))
    with torch.no_grad():  # B != 0, so the adapter changes the prompt's keys and values too
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.05)
    return peft_model


def padded(rows: list[list[int]]):
    width = max(map(len, rows))
    ids = torch.zeros((len(rows), width), dtype=torch.long)
    attn = torch.zeros((len(rows), width), dtype=torch.long)
    for b, r in enumerate(rows):
        ids[b, : len(r)] = torch.tensor(r)
        attn[b, : len(r)] = 1
    return ids, attn


def test_logits_and_lora_gradients_match_the_plain_forward():
    lm = SharedPrefixLM(lora(tiny_llama()))
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, VOCAB, (20,), generator=g).tolist()
    rows = [prompt + torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (7, 3, 11, 1)]
    ids, attn = padded(rows)
    s = len(prompt) - 1  # first scored position
    keep = ids.shape[1] - s
    c = shared_prefix_len(rows, s)
    assert c == s

    def loss_and_grads(shared: int):
        lm.zero_grad(set_to_none=True)
        logits = lm(ids, attn, logits_to_keep=keep, shared_prefix=shared)[:, :-1].float()
        logp = torch.log_softmax(logits, -1).gather(-1, ids[:, s + 1 :, None]).squeeze(-1)
        real = attn[:, s + 1 :].float()
        loss = -(logp * real).sum()
        loss.backward()
        grads = {n: p.grad.clone() for n, p in lm.named_parameters() if p.requires_grad}
        return logits * real[..., None], loss.detach(), grads

    plain_logits, plain_loss, plain_grads = loss_and_grads(0)
    shared_logits, shared_loss, shared_grads = loss_and_grads(c)
    assert plain_logits.shape == shared_logits.shape
    torch.testing.assert_close(shared_logits, plain_logits, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(shared_loss, plain_loss, atol=1e-4, rtol=1e-5)
    assert plain_grads.keys() == shared_grads.keys() and len(plain_grads) == 12
    for name in plain_grads:
        assert plain_grads[name].abs().max() > 0, name
        torch.testing.assert_close(shared_grads[name], plain_grads[name], atol=1e-5, rtol=1e-4, msg=name)


def test_rows_that_do_not_share_the_prefix_are_refused():
    lm = SharedPrefixLM(tiny_llama())
    ids, attn = padded([[1, 2, 3, 4, 5], [1, 9, 3, 4, 5]])
    with pytest.raises(ValueError, match="do not share their first 3 tokens"):
        lm(ids, attn, logits_to_keep=2, shared_prefix=3)
    with pytest.raises(ValueError, match="logits_to_keep"):
        lm(ids, attn, logits_to_keep=5, shared_prefix=1)


def batch_of_two_groups(g: torch.Generator, logprobs=lambda r: [-3.0] * len(r), group_shift: float = 0.0,
                        vocab: int = VOCAB) -> TrainBatch:
    """Two groups of four rows, prompts of 15 and 18 tokens, responses of 2-7 tokens; each row's
    rollout log-probs from `logprobs(response)`, advantages i - 1.5 + group_shift * group."""
    prompts, responses, lps, adv = [], [], [], []
    for group in range(2):
        prompt = torch.randint(0, vocab, (15 + 3 * group,), generator=g).tolist()
        for i in range(4):
            r = torch.randint(0, vocab, (2 + (3 * i + group) % 6,), generator=g).tolist()
            prompts.append(prompt)
            responses.append(r)
            lps.append(logprobs(r))
            adv.append(float(i) - 1.5 + group_shift * group)
    return TrainBatch(prompts, responses, lps, adv, rewards=[0.0] * 8, group_ids=[0] * 4 + [1] * 4)


def test_micro_batches_share_each_groups_prompt():
    batch = batch_of_two_groups(torch.Generator().manual_seed(2))
    mbs = make_micro_batches(batch, 4)
    assert [mb.shared_prefix for mb in mbs] == [14, 17]  # the whole prompt but its last token
    assert [mb.start for mb in mbs] == [14, 17]
    assert all(mb.shared_prefix == 0 for mb in make_micro_batches(batch, 4, share_prefix=False))
    # a micro-batch spanning both groups shares what their token rows have in common
    (mixed,) = make_micro_batches(batch, 8)
    assert mixed.shared_prefix == shared_prefix_len([p + r for p, r in zip(batch.prompt_ids, batch.response_ids)], 14)


@pytest.mark.parametrize("beta", [0.0, 0.05])
def test_a_learner_step_is_the_same_with_and_without_sharing(tmp_path, beta):
    tiny_llama(tmp_path)
    batch = batch_of_two_groups(torch.Generator().manual_seed(3))

    def step(share: bool):
        cfg = RunConfig.model_validate({
            "seed": 0,
            "model": {"name_or_path": str(tmp_path)},
            "learner": {"lr": 1e-2, "micro_batch_size": 4, "beta": beta, "fold_old_logprobs": beta == 0,
                        "share_prompt_prefix": share, "lora": {"r": 4, "alpha": 8}},
            "trainer": {"steps": 2},
        })
        learner = PolicyLearner.for_run(cfg)
        metrics, _ = learner.step(batch)
        return metrics, adapter_state_dict(learner.peft_model)

    plain_metrics, plain_adapter = step(False)
    shared_metrics, shared_adapter = step(True)
    for key in ("loss", "grad_norm", "ppl_ratio", "entropy", "kl"):
        assert shared_metrics[key] == pytest.approx(plain_metrics[key], rel=1e-4, abs=1e-6), key
    moved = 0
    for name, want in plain_adapter.items():
        torch.testing.assert_close(shared_adapter[name], want, atol=1e-6, rtol=1e-4, msg=name)
        moved += int("lora_B" in name and want.abs().max() > 0)
    assert moved > 0  # the step changed the adapter, so the comparison says something
