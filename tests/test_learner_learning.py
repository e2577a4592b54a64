"""The learner in-process (no Ray) on a tiny small-vocabulary model: log-prob alignment and a
bandit it must learn. The Ray path is covered by tests/test_learner_ray.py."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from learner.advantages import compute_advantages, group_ids_for
from learner.passes import response_logprobs
from learner.types import TrainBatch
from learner.policy import PolicyLearner
from config import RunConfig

pytestmark = pytest.mark.slow

VOCAB, TARGET, G = 8, 5, 8


@pytest.fixture(scope="module")
def small_vocab_model(tmp_path_factory):
    """A 2-layer random Llama with an 8-token vocabulary. initializer_range 0.1 (not 0.02): with
    0.02 the output head's weights cap every logit gap near 1.3, so no policy could put more than
    ~30% on one token. Here the target starts at p ~ 0.02-0.13."""
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64,
        initializer_range=0.1,
    )
    path = tmp_path_factory.mktemp("small_vocab")
    LlamaForCausalLM(cfg).save_pretrained(path)
    return path


def run_cfg(model_dir, **learner):
    base = {"lr": 2e-2, "micro_batch_size": 16, "lora": {"r": 8, "alpha": 16}}
    base.update(learner)
    return RunConfig.model_validate({
        "seed": 0,
        "model": {"name_or_path": str(model_dir)},
        "learner": base,
        "rollout": {"max_tokens": 3, "temperature": 1.0},
        "trainer": {"steps": 40},
    })


@torch.no_grad()
def sample(model, prompts: list[list[int]], n: int, length: int, gen: torch.Generator):
    """Plain ancestral sampling, returning token ids and their log-probs (the rollout side)."""
    ids, lps = [], []
    for p in prompts:
        for _ in range(n):
            seq, lp = list(p), []
            for _ in range(length):
                logits = model(input_ids=torch.tensor([seq])).logits[0, -1].float()
                logp = torch.log_softmax(logits, -1)
                tok = int(torch.multinomial(logp.exp(), 1, generator=gen))
                seq.append(tok)
                lp.append(float(logp[tok]))
            ids.append(seq[len(p):])
            lps.append(lp)
    return ids, lps


@torch.no_grad()
def plain_forward_logprobs(model, prompts, responses) -> list[list[float]]:
    """One sequence at a time, no padding, every logit: the reference the learner must match."""
    out = []
    for p, r in zip(prompts, responses):
        logits = model(input_ids=torch.tensor([list(p) + list(r)])).logits[0, len(p) - 1 : -1].float()
        out.append(torch.log_softmax(logits, -1).gather(-1, torch.tensor(r).unsqueeze(-1)).squeeze(-1).tolist())
    return out


def test_learner_logprobs_match_a_plain_forward(small_vocab_model):
    """Varying prompt lengths, micro-batches and logits_to_keep: the trainer's log-probs of the
    sampled tokens equal a plain one-sequence forward's (ppl_ratio 1), and so do those of
    learner.passes.response_logprobs (what `rollout logprobs` reports)."""
    learner = PolicyLearner.for_run(run_cfg(small_vocab_model, micro_batch_size=3, fold_old_logprobs=False))
    prompts = [[1, 2], [3, 4, 5, 6], [7], [2, 3, 4], [1, 1, 1, 1, 1]]
    responses = [[3, 4, 5], [6], [1, 2, 3, 4], [5, 5], [0, 1]]
    ref = plain_forward_logprobs(learner.peft_model, prompts, responses)
    listed = response_logprobs(learner.peft_model, prompts, responses, pad_id=0, micro_batch_size=2)
    assert [len(x) for x in listed] == [len(r) for r in responses]
    for got, want in zip(listed, ref):
        assert got == pytest.approx(want, abs=1e-5)
    batch = TrainBatch(prompts, responses, ref, advantages=[0.0] * 5)
    metrics, phases = learner.step(batch)
    assert metrics["ppl_ratio"] == pytest.approx(1.0, abs=1e-5)
    assert abs(metrics["rollout_kl"]) < 1e-5 and metrics["rollout_k3_kl"] < 1e-6
    assert metrics["response_tokens"] == 12 and metrics["total_tokens"] == 15 + 12
    assert phases["old_log_prob"] > 0 and phases["ref"] == 0.0  # beta = 0: no ref pass


def test_grpo_learns_a_bandit(small_vocab_model):
    """Reward 1 when the completion starts with TARGET; GRPO must raise the mean reward."""
    learner = PolicyLearner.for_run(run_cfg(small_vocab_model))
    gen = torch.Generator().manual_seed(0)
    prompts = [[1, 2, 3], [2, 3], [4, 1, 6, 7]]
    rewards_per_step = []
    for _ in range(20):
        learner.peft_model.eval()
        responses, logprobs = sample(learner.peft_model, prompts, G, 3, gen)
        rewards = [1.0 if r[0] == TARGET else 0.0 for r in responses]
        groups = group_ids_for(len(rewards), G)
        adv = compute_advantages(torch.tensor(rewards), groups, "grpo", "group").tolist()
        batch = TrainBatch(
            [p for p in prompts for _ in range(G)], responses, logprobs, adv,
            rewards=rewards, group_ids=groups.tolist(),
        )
        metrics, _ = learner.step(batch)
        assert metrics["ppl_ratio"] == pytest.approx(1.0, abs=1e-4)  # sampler and trainer agree
        rewards_per_step.append(sum(rewards) / len(rewards))
    first, last = sum(rewards_per_step[:5]) / 5, sum(rewards_per_step[-5:]) / 5
    assert first < 0.35, rewards_per_step
    assert last > 0.7 and last > first + 0.4, rewards_per_step
