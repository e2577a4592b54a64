"""The vowel-share task (graders/vowel_share/task.py), the GPU benches' synthetic reward, served over a
real loopback gRPC server: long distinct prompts, the reward TRL's side of bench/gpu_vs_trl.py
gets, different within a group of completions, and bad requests with their status codes."""

from __future__ import annotations

import pytest

from config.grader import GraderConfig
from graders.client import GraderClient, GraderRequestError
from graders.service import GraderCore, start_server
from graders.tasks import make_task
from graders.vowel_share.task import vowel_share


@pytest.fixture(scope="module")
def client():
    cfg = GraderConfig(task="vowel-share", vowel_share={"prompt_words": 50, "train_cases": 6, "heldout_cases": 2})
    server = start_server(GraderCore(make_task(cfg)), "127.0.0.1", 0)
    with GraderClient(server.address, max_retries=0) as c:
        yield c
    server.stop(None)


def test_vowel_share_is_the_share_of_vowels_among_letters():
    assert vowel_share("aeiou") == 1.0
    assert vowel_share("b-c d!") == 0.0
    assert vowel_share("Ab 12") == pytest.approx(0.5)
    assert vowel_share("") == 0.0 and vowel_share("123 !?") == 0.0


def test_served_over_grpc_with_distinct_long_prompts(client):
    health = client.health()
    assert (health.task, health.pool_size, health.heldout_pool_size, health.checker) == ("vowel-share", 6, 2,
                                                                                         "vowel-share")
    assert health.details["prompt_words"] == 50
    cases = client.cases(limit=0)
    assert [c.id for c in cases] == [f"vs-train-{i}" for i in range(6)]
    texts = [c.messages[0]["content"] for c in cases]
    assert len(set(texts)) == 6 and all(len(t.split()) == 52 for t in texts)  # "Task i:" + 50 words
    assert [c.id for c in client.cases(limit=0, split="heldout")] == ["vs-heldout-0", "vs-heldout-1"]
    group = client.score_batch([("vs-train-0", "aaa"), ("vs-train-0", "abc"), ("vs-train-0", "xyz")])
    assert [s.reward for s in group] == pytest.approx([1.0, 1 / 3, 0.0])
    assert [s.admitted for s in group] == [True, False, False] and all(s.format_ok for s in group)


def test_bad_requests_keep_their_status(client):
    for case_id in ("vs-train-6", "vs-nosplit-0", "train-0", "vs-train-x"):
        with pytest.raises(GraderRequestError) as info:
            client.score(case_id, "a")
        assert info.value.code.name == "NOT_FOUND", case_id
    with pytest.raises(GraderRequestError) as info:
        client.cases(limit=7)
    assert info.value.code.name == "FAILED_PRECONDITION"
