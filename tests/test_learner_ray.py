"""The learner through Ray Train (gloo on CPU): 1 worker and 2 workers take the same update;
the job's lifecycle (init adapter, steps, checkpoint, a worker error, a refused nan step) works end to end.
One test, two fit() runs: each Ray Train start costs ~20 s."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from safetensors.torch import load

from learner.job import LearnerJob
from learner.types import TrainBatch
from model.adapter import FIRST_ADAPTER_VERSION, adapter_version
from config import RunConfig
from rayharness import local_ray

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def ray_cluster(request):
    with local_ray(request, num_cpus=2):
        yield


def cfg(workers: int) -> RunConfig:
    return RunConfig.model_validate({
        "seed": 11,
        "model": {"name_or_path": "tiny-random"},
        "learner": {
            "workers": workers, "num_cpus_per_worker": 1, "lr": 1e-3, "micro_batch_size": 2,
            "loss_type": "dapo", "beta": 0.05, "epochs_per_step": 2,
        },
        "rollout": {"max_tokens": 6},
        "trainer": {"steps": 5},
    })


def batch(k: int) -> TrainBatch:
    """7 sequences (uneven shards 4 + 3), ragged prompts and responses."""
    g = torch.Generator().manual_seed(k)
    prompts = [torch.randint(1, 500, (2 + i % 3,), generator=g).tolist() for i in range(7)]
    responses = [torch.randint(1, 500, (1 + (i * 2) % 5,), generator=g).tolist() for i in range(7)]
    return TrainBatch(
        prompts, responses, [[-10.5] * len(r) for r in responses],
        advantages=[1.5, -0.5, 0.25, -1.0, 0.75, -1.25, 0.25],
        rewards=[1, 0, 1, 0, 1, 0, 1], group_ids=[0, 0, 0, 0, 1, 1, 1],
    )


def run(workers: int, tmp_path, then_fail: bool = False, then_nan: bool = False) -> tuple[list, dict]:
    job = LearnerJob(cfg(workers), tmp_path / f"w{workers}")
    try:
        info = job.start()
        assert info.step == 0 and info.init_payload.version == FIRST_ADAPTER_VERSION and info.init_is_identity
        assert (tmp_path / f"w{workers}" / "adapters" / "init" / "adapter_model.safetensors").is_file()
        # The adapters come back as refs to objects rank 0 owns: fetched while it lives.
        results = [job.step(batch(k)) for k in range(2)]
        results = [dataclasses.replace(r, adapter=r.adapter.fetch()) for r in results]
        info = dataclasses.replace(info, init_payload=info.init_payload.fetch())
        # What a replica's ray.get gives: the payload's bytes as a read-only view into the object
        # store, not a copy deserialised out of it (126 MiB a step for a 4B r=32 adapter).
        assert all(not r.adapter.safetensors.flags.writeable for r in results)
        ckpt = job.save_checkpoint(2, data_position={"cursor": 14})
        assert ckpt == tmp_path / f"w{workers}" / "checkpoints" / "step_2"
        assert (tmp_path / f"w{workers}" / "adapters" / "step_2" / "adapter_model.safetensors").is_file()
        assert (ckpt / "rng_rank0.pt").is_file() and (ckpt / f"rng_rank{workers - 1}.pt").is_file()
        if then_fail:  # a worker's error reaches the driver with its traceback, no hang
            bad = batch(9)
            bad.prompt_ids[0] = [10**9]  # an id past the vocabulary: rank 0's forward fails
            with pytest.raises(RuntimeError, match="learner command 'step' failed in learner rank 0"):
                job.step(bad)
        if then_nan:  # a replica's nan log-probs make the gradients nan: refused, said, nothing published
            bad = batch(8)
            bad.rollout_logprobs[3][0] = float("nan")
            with pytest.raises(RuntimeError, match=r"(?s)learner command 'step' failed in learner rank 0.*"
                                                   r"NonFiniteGradients: the learner's gradient norm is nan"):
                job.step(bad)
            assert sorted(p.name for p in (tmp_path / f"w{workers}" / "adapters").iterdir()) == ["init", "step_2"]
        return results, info
    finally:
        job.stop()


def test_one_worker_and_two_workers_take_the_same_update(ray_cluster, tmp_path):
    one, info1 = run(1, tmp_path, then_nan=True)
    two, info2 = run(2, tmp_path, then_fail=True)
    assert info1.adapter_sha256 == info2.adapter_sha256  # same seed, same init
    init = load(info1.init_payload.data())
    lr = 1e-3
    for r1, r2 in zip(one, two):
        assert r1.adapter.version == r2.adapter.version
        a1, a2 = load(r1.adapter.data()), load(r2.adapter.data())
        assert set(a1) == set(a2) == set(init)
        # Adam moves every weight by ~lr whatever its gradient's size, so float-rounding noise
        # in a near-zero gradient (summed in another order by the all-reduce) becomes a visible
        # difference; 1% of one Adam move bounds it (measured: 0.23%).
        for key in a1:
            assert (a1[key] - a2[key]).abs().max() < 0.01 * lr, key
        moved = max(float((a1[k] - init[k]).abs().max()) for k in a1)
        assert moved > 0.5 * lr
        # Adam is blind to a uniformly scaled gradient (a lost dp_size factor): loss and
        # grad_norm are not, so they must agree too.
        for name in ("loss", "kl", "entropy", "ppl_ratio", "rollout_kl", "clip_frac", "grad_norm"):
            assert r1.metrics[name] == pytest.approx(r2.metrics[name], rel=1e-5, abs=1e-7), name
        assert r1.metrics["response_tokens"] == r2.metrics["response_tokens"] == 1 + 3 + 5 + 2 + 4 + 1 + 3
        assert "frac_reward_zero_std" not in r1.metrics  # one owner: the driver (services/orchestrator.py)
        assert set(r1.phases_s) == {"old_log_prob", "ref", "update_actor"}
        assert r1.phases_s["ref"] > 0 and r1.phases_s["old_log_prob"] > 0  # beta > 0, 2 epochs
    assert [r.adapter.version for r in one] == [adapter_version(1), adapter_version(2)] == [2, 3]
    trained = load(one[-1].adapter.data())
    assert any(v.abs().sum() > 0 for k, v in trained.items() if "lora_B" in k)  # it moved
    assert one[1].metrics["kl"] > 0  # the leash sees the adapter
    # The learner hands Ray Train no dataset: none of Ray Data's actors start (learner/job.py
    # _trainer_class drops the DatasetsCallback that starts a DatasetManager per worker group).
    from ray._private.state import state

    started = {a["ActorClassName"] for a in state.actor_table(None).values()}
    assert "RayTrainWorker" in started and "TrainController" in started, started
    assert not any("DatasetManager" in name for name in started), started

