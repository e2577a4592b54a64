"""Registry rules (pure), chunking, and the metric families built from a snapshot."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from rollout.metrics import RolloutCollector, metric_families
from rollout.registry import AdapterUnavailableError, RegistryState


def test_versions_only_move_forward_and_old_ones_are_dropped():
    state = RegistryState(keep=2)
    state.publish(1, "ref1")
    state.publish(2, "ref2")
    state.publish(3, "ref3")
    assert state.latest == 3 and state.versions() == [2, 3]
    assert state.get(2) == "ref2"
    with pytest.raises(AdapterUnavailableError, match="v1 is no longer kept"):
        state.get(1)
    with pytest.raises(AdapterUnavailableError, match=r"v4 has not been published \(latest is v3\)"):
        state.get(4)
    with pytest.raises(ValueError, match="not newer"):
        state.publish(3, "again")


def test_a_kept_version_is_re_exported_only_with_the_same_checksum():
    """A restored learner's export of the live version replaces the dead owner's ref when its
    bytes are the published ones (same checksum); other bytes, no checksum, or a version no
    longer kept are refused and change nothing."""
    state = RegistryState(keep=2)
    state.publish(1, "ref1", checksum=11)
    state.publish(2, "ref2", checksum=22)
    state.publish(3, "ref3")  # an in-process payload that came without one
    assert state.reexport(2, "ref2-again", 22) is None and state.get(2) == "ref2-again"
    assert "other bytes" in state.reexport(2, "ref2-other", 23) and state.get(2) == "ref2-again"
    assert "no checksum" in state.reexport(2, "ref2-none", None) and state.get(2) == "ref2-again"
    assert "no checksum" in state.reexport(3, "ref3-again", 33) and state.get(3) == "ref3"
    assert "v1 is not kept" in state.reexport(1, "ref1-again", 11)
    assert state.latest == 3 and state.versions() == [2, 3]  # versions never move


def test_all_hold_needs_expected_live_replicas_all_on_the_version():
    state = RegistryState(liveness_s=5.0)
    state.publish(1, "r")
    state.heartbeat("a", "A", 1, 10, now=0.0)
    assert not state.all_hold(1, expected=2, now=0.0)  # only one replica so far
    state.heartbeat("b", "B", 0, 5, now=1.0)
    assert not state.all_hold(1, expected=2, now=1.0)  # b still on the base model
    state.heartbeat("b", "B", 1, 7, now=2.0)
    assert state.all_hold(1, expected=2, now=2.0)
    assert state.tokens_total() == 17


def test_silent_replicas_are_dropped_but_their_tokens_still_count():
    state = RegistryState(liveness_s=5.0)
    state.heartbeat("a", "A", 0, 10, now=0.0)
    state.heartbeat("b", "B", 0, 20, now=4.0)
    assert [r.replica_id for r in state.live(now=6.0)] == ["b"]
    assert state.tokens_total() == 30
    assert state.snapshot(now=6.0)["replicas"] == {"b": 0}
    assert not state.all_hold(0, expected=2, now=6.0)


def test_even_chunks_cover_every_prompt_once():
    from rollout.deployment import even_chunks

    assert even_chunks(5, 2) == [(0, 3), (3, 5)]
    assert even_chunks(2, 8) == [(0, 1), (1, 2)]
    assert even_chunks(0, 3) == []
    for n in range(1, 20):
        for k in range(1, 6):
            spans = even_chunks(n, k)
            assert [i for a, b in spans for i in range(a, b)] == list(range(n))
            assert max(b - a for a, b in spans) - min(b - a for a, b in spans) <= 1


def test_metric_names_and_labels():
    snapshot = {"replicas": {"r1": 2, "r2": 3}, "tokens_total": 1234}
    families = {f.name: f for f in metric_families(snapshot)}
    assert set(families) == {"counterpoint_rollout_adapter_version", "counterpoint_rollout_tokens"}
    registry = CollectorRegistry()
    registry.register(RolloutCollector(lambda: snapshot))
    text = generate_latest(registry).decode()
    assert 'counterpoint_rollout_adapter_version{replica="r1"} 2.0' in text
    assert 'counterpoint_rollout_adapter_version{replica="r2"} 3.0' in text
    assert "counterpoint_rollout_tokens_total 1234.0" in text


def test_a_failing_snapshot_does_not_break_the_scrape():
    def boom() -> dict:
        raise ConnectionError("cluster gone")

    registry = CollectorRegistry()
    registry.register(RolloutCollector(boom))
    assert "counterpoint_rollout" not in generate_latest(registry).decode()
