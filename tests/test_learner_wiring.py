"""The learner options that were only tested as pure functions, shown wired from the config to
the computation a run performs.

The policy is built the way the Ray Train worker builds it (learner/worker.py:
``PolicyLearner(learner section, model section, PolicySpec.for_run(run config))``), in-process on
the tiny random model, and fed one fixed batch. For every option the loss and metrics it reports
must equal what the pure functions (learner.losses.policy_loss, learner.kl.kl_estimate,
learner.advantages.compute_advantages) give for the option's value, computed here from an
independent plain forward; and changing the option must change them. Advantages are computed by
the driver, not the learner: ``services.orchestrator.advantages`` is checked against
compute_advantages for every estimator and scale.

The init adapter has random non-zero LoRA B, so the policy differs from the reference (the KL
terms are not 0), and the rollout log-probs are perturbed, so truncated importance sampling
weights are neither 1 nor all under the cap.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch

from learner.advantages import ADVANTAGE_ESTIMATORS, compute_advantages
from learner.kl import kl_estimate
from learner.losses import LossInputs, LossNorm, ObjectiveParams, policy_loss
from learner.policy import PolicyLearner, PolicySpec
from learner.rollout_correction import finalize
from learner.types import TrainBatch
from config import RunConfig
from services.orchestrator import advantages as driver_advantages

pytestmark = pytest.mark.slow

TEMPERATURE = 0.7  # not 1: the spec's temperature must reach the learner's log-softmax
MAX_TOKENS = 24  # rollout.max_tokens: dr_grpo's normaliser when learner.max_completion_length is None
REWARDS = [0.1, 0.5, 0.5, 0.9, 0.0, 0.2, 0.7, 0.3]
GROUPS = [0, 0, 0, 0, 1, 1, 1, 1]
VALID = [True, True, False, True, True, False, True, True]


def run_config(**learner) -> RunConfig:
    base = {"lr": 1e-3, "micro_batch_size": 4, "lora": {"r": 4, "alpha": 8}, "beta": 0.0}
    base.update(learner)
    return RunConfig.model_validate({
        "seed": 3, "model": {"name_or_path": "tiny-random", "dtype": "float32"}, "learner": base,
        "rollout": {"temperature": TEMPERATURE, "max_tokens": MAX_TOKENS}, "trainer": {"steps": 4},
    })


def worker_policy(cfg: RunConfig, init_adapter: Path) -> PolicyLearner:
    """As learner/worker.py's train_loop_per_worker builds it from the slices LearnerJob sends."""
    return PolicyLearner(cfg.learner, cfg.model, PolicySpec.for_run(cfg), rank=0, world_size=1,
                         device="cpu", init_adapter=init_adapter)


@pytest.fixture(scope="module")
def init_adapter(tmp_path_factory) -> Path:
    """A LoRA adapter with random non-zero B (a fresh one is the identity: KL 0 everywhere)."""
    learner = PolicyLearner.for_run(run_config())
    gen = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for name, p in learner.peft_model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    out = tmp_path_factory.mktemp("init_adapter")
    learner.save_init_adapter(out)
    return out


@pytest.fixture(scope="module")
def batch() -> TrainBatch:
    """Two groups of four: one shared prompt per group (as the driver orders rows), responses of
    different lengths; rollout log-probs filled in by ``reference`` below."""
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(10, 40000, (n,), generator=gen).tolist() for n in (7, 5)]
    lengths = [3, 6, 4, 5, 6, 2, 5, 4]
    responses = [torch.randint(10, 40000, (n,), generator=gen).tolist() for n in lengths]
    adv = compute_advantages(torch.tensor(REWARDS), torch.tensor(GROUPS), "grpo").tolist()
    return TrainBatch(prompt_ids=[prompts[g] for g in GROUPS], response_ids=responses,
                      rollout_logprobs=[[0.0] * n for n in lengths], advantages=adv, rewards=REWARDS,
                      group_ids=GROUPS)


def padded(rows: list[torch.Tensor]) -> torch.Tensor:
    out = torch.zeros(len(rows), max(len(r) for r in rows))
    for i, r in enumerate(rows):
        out[i, : len(r)] = r
    return out


@torch.no_grad()
def plain_forward(model, batch: TrainBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs and entropies [B, T] of the response tokens at TEMPERATURE, one row at a time
    through the plain HF forward (no micro-batching, no shared prefix: independent of
    learner/passes.py)."""
    logps, ents = [], []
    for p, r in zip(batch.prompt_ids, batch.response_ids):
        logits = model(input_ids=torch.tensor([p + r])).logits[0, len(p) - 1: len(p) + len(r) - 1].float()
        lp_all = torch.log_softmax(logits / TEMPERATURE, -1)
        logps.append(lp_all.gather(-1, torch.tensor(r)[:, None])[:, 0])
        ents.append(-(lp_all.exp() * lp_all).sum(-1))
    return padded(logps), padded(ents)


@pytest.fixture(scope="module")
def reference(init_adapter, batch):
    """Policy, reference (adapter off) and entropy terms of the batch from the plain forward,
    and rollout log-probs = policy log-probs + noise, written into the batch."""
    learner = worker_policy(run_config(), init_adapter)
    learner.peft_model.eval()
    logp, ent = plain_forward(learner.peft_model, batch)
    with learner.peft_model.disable_adapter():
        ref, _ = plain_forward(learner.peft_model, batch)
    mask = padded([torch.ones(len(r)) for r in batch.response_ids])
    gen = torch.Generator().manual_seed(9)
    rollout = (logp + torch.randn(logp.shape, generator=gen) * 0.8) * mask
    batch.rollout_logprobs = [rollout[i, : len(r)].tolist() for i, r in enumerate(batch.response_ids)]
    assert (ref - logp).abs().max() > 1e-2, "the init adapter must move the policy off the reference"
    return {"logp": logp, "ref": ref, "ent": ent, "mask": mask, "rollout": rollout}


def pure(reference, batch: TrainBatch, *, loss_type="dapo", max_completion_length=MAX_TOKENS, beta=0.0,
         kl_estimator="k3", entropy_coef=0.0, tis_cap=2.0, bonus=False, advantages=None) -> dict[str, float]:
    """The step's loss and metrics straight from learner.losses.policy_loss. One optimizer step
    over one epoch: the pre-update policy IS the policy (ratio 1), as in the learner."""
    r = reference
    adv = torch.tensor(advantages if advantages is not None else batch.advantages)
    tokens = float(r["mask"].sum())
    out = policy_loss(
        LossInputs(logprobs=r["logp"], old_logprobs=r["logp"], advantages=adv, mask=r["mask"],
                   rollout_logprobs=r["rollout"], ref_logprobs=r["ref"] if beta > 0 else None, entropy=r["ent"]),
        LossNorm(loss_type=loss_type, global_tokens=tokens, global_sequences=len(batch), local_tokens=tokens,
                 max_completion_length=max_completion_length, dp_size=1),
        ObjectiveParams(epsilon_low=0.2, epsilon_high=0.28, beta=beta, kl_estimator=kl_estimator,
                        entropy_coef=entropy_coef, tis_cap=tis_cap),
        entropy_bonus=bonus,
    )
    return {"loss": float(out.loss), **finalize(out.sums)}


def learner_step(init_adapter, batch: TrainBatch, **learner) -> dict[str, float]:
    metrics, _ = worker_policy(run_config(**learner), init_adapter).step(batch)
    return metrics


def assert_matches(got: dict[str, float], want: dict[str, float], keys=("loss", "kl", "tis_weight", "entropy")):
    for key in keys:
        assert got[key] == pytest.approx(want[key], rel=1e-4, abs=1e-6), (key, got[key], want[key])


def all_distinct(values: list[float], tol: float = 1e-4) -> bool:
    return all(abs(a - b) > tol for a, b in itertools.combinations(values, 2))


def test_kl_estimator_and_beta_reach_the_loss(init_adapter, batch, reference):
    losses = []
    for est in ("k1", "k2", "k3", "low_var_kl"):
        got = learner_step(init_adapter, batch, beta=0.1, kl_estimator=est)
        want = pure(reference, batch, beta=0.1, kl_estimator=est)
        assert_matches(got, want)
        kl_mean = float((kl_estimate(reference["logp"], reference["ref"], est) * reference["mask"]).sum()
                        / reference["mask"].sum())
        assert got["kl"] == pytest.approx(kl_mean, rel=1e-4, abs=1e-6), est
        losses.append(got["loss"])
    # k3 and low_var_kl agree unless a log-ratio exceeds 20; every other pair must differ.
    assert all_distinct(losses[:3]) and all_distinct([losses[0], losses[1], losses[3]]), losses
    off = learner_step(init_adapter, batch, beta=0.0)
    assert_matches(off, pure(reference, batch, beta=0.0), keys=("loss", "tis_weight"))
    assert off["kl"] == 0.0 and abs(off["loss"] - losses[2]) > 1e-4


def test_tis_cap_reaches_the_importance_weights(init_adapter, batch, reference):
    w = torch.exp(reference["logp"] - reference["rollout"])[reference["mask"] > 0]
    assert (w > 2.0).any() and (w < 0.5).any(), "the perturbed rollout log-probs must exercise the caps"
    losses, weights = [], []
    for cap in (None, 2.0, 0.5):
        got = learner_step(init_adapter, batch, tis_cap=cap)
        assert_matches(got, pure(reference, batch, tis_cap=cap))
        expected_w = 1.0 if cap is None else float(w.clamp(max=cap).mean())  # None = TIS off
        assert got["tis_weight"] == pytest.approx(expected_w, rel=1e-4)
        losses.append(got["loss"])
        weights.append(got["tis_weight"])
    assert all_distinct(losses) and all_distinct(weights), (losses, weights)


def test_entropy_coef_and_floor_switch_the_bonus(init_adapter, batch, reference):
    mean_entropy = float((reference["ent"] * reference["mask"]).sum() / reference["mask"].sum())
    plain = learner_step(init_adapter, batch, entropy_coef=0.0)
    assert_matches(plain, pure(reference, batch))
    assert plain["entropy_bonus_active"] == 0.0
    # No floor: the bonus is always on.
    on = learner_step(init_adapter, batch, entropy_coef=0.01)
    assert_matches(on, pure(reference, batch, entropy_coef=0.01, bonus=True))
    assert on["entropy_bonus_active"] == 1.0
    assert on["loss"] == pytest.approx(plain["loss"] - 0.01 * mean_entropy, rel=1e-4)
    # A floor above the step's entropy keeps it on; one below switches it off.
    above = learner_step(init_adapter, batch, entropy_coef=0.01, entropy_floor=mean_entropy + 1.0)
    assert above["entropy_bonus_active"] == 1.0 and above["loss"] == pytest.approx(on["loss"], rel=1e-4)
    below = learner_step(init_adapter, batch, entropy_coef=0.01, entropy_floor=mean_entropy - 1.0)
    assert below["entropy_bonus_active"] == 0.0 and below["loss"] == pytest.approx(plain["loss"], rel=1e-4)
    # The entropy it reports (and rewards) is the sampling distribution's, at the temperature.
    assert on["entropy"] == pytest.approx(mean_entropy, rel=1e-4)


def test_max_completion_length_is_dr_grpo_normaliser(init_adapter, batch, reference):
    default = learner_step(init_adapter, batch, loss_type="dr_grpo")  # None -> rollout.max_tokens
    assert_matches(default, pure(reference, batch, loss_type="dr_grpo", max_completion_length=MAX_TOKENS))
    doubled = learner_step(init_adapter, batch, loss_type="dr_grpo", max_completion_length=2 * MAX_TOKENS)
    assert_matches(doubled, pure(reference, batch, loss_type="dr_grpo", max_completion_length=2 * MAX_TOKENS))
    assert abs(default["loss"]) > 1e-4 and doubled["loss"] == pytest.approx(default["loss"] / 2, rel=1e-4)
    # Other loss types ignore it.
    dapo = learner_step(init_adapter, batch, loss_type="dapo", max_completion_length=2 * MAX_TOKENS)
    assert_matches(dapo, pure(reference, batch, loss_type="dapo"))


def test_driver_advantages_follow_estimator_and_scale(init_adapter, batch, reference):
    seen: dict[tuple[str, str], list[float]] = {}
    for est, scale in itertools.product(ADVANTAGE_ESTIMATORS, ("group", "batch", "none")):
        cfg = run_config(advantage=est, scale_rewards=scale, invalid_advantage=-0.75)
        got = driver_advantages(cfg, REWARDS, GROUPS, VALID)
        want = compute_advantages(torch.tensor(REWARDS), torch.tensor(GROUPS), estimator=est, scale_rewards=scale,
                                  valid=torch.tensor(VALID), invalid_advantage=-0.75)
        assert torch.equal(got, want), (est, scale)
        seen[(est, scale)] = got.tolist()
    # The options change the advantages where the math says they do (advantages.py docstring).
    grpo = [seen[("grpo", s)] for s in ("group", "batch", "none")]
    assert all(a != b for a, b in itertools.combinations(grpo, 2))
    assert seen[("grpo", "none")] == seen[("dr_grpo", "group")]  # unscaled grpo is Dr. GRPO
    for est in ("dr_grpo", "rank", "rloo"):  # never scaled
        assert seen[(est, "group")] == seen[(est, "batch")] == seen[(est, "none")], est
    unique = {tuple(seen[(est, "group")]) for est in ADVANTAGE_ESTIMATORS}
    assert len(unique) == len(ADVANTAGE_ESTIMATORS), seen
    valid_only = seen[("grpo_valid_only", "group")]
    assert [a for a, v in zip(valid_only, VALID) if not v] == [-0.75, -0.75]
    # The learner trains on what it is given: the loss of two estimators' advantages differs and
    # each equals policy_loss of those advantages.
    losses = []
    for est in ("grpo", "rloo"):
        adv = seen[(est, "group")]
        fed = TrainBatch(batch.prompt_ids, batch.response_ids, batch.rollout_logprobs, adv, batch.rewards, batch.group_ids)
        got = learner_step(init_adapter, fed)
        assert_matches(got, pure(reference, batch, advantages=adv))
        losses.append(got["loss"])
    assert abs(losses[0] - losses[1]) > 1e-4
