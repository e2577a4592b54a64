"""A second verifier task needs one module and one registration: the servicer, the Serve app and
the client are untouched. Shown with a tiny test-only task (not shipped) served over a real
loopback gRPC server, its task-specific fields (status, test metric, details) crossing the wire."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from config.grader import GraderConfig
from graders.client import GraderClient, GraderRequestError
from graders.types import CaseInfo, Score, TaskInfo, UnknownCase
from graders.service import GraderCore, start_server
from graders.tasks import make_task, register_task, task_names

WORDS = {"w-0": "apple", "w-1": "kiwi", "w-2": "banana"}


class LetterCountTask:
    """Reward: 1 when the completion is the number of letters of the case's word."""

    name = "test-letter-count"

    def info(self) -> TaskInfo:
        return TaskInfo(pool_size=len(WORDS), heldout_pool_size=0, pool_source="test",
                        details={"alphabet": "latin"})

    def cases(self, limit: int, split: str) -> list[CaseInfo]:
        ids = sorted(WORDS)[: limit or None]
        return [CaseInfo(id=i, split=split, task=self.name,
                         messages=[{"role": "user", "content": f"How many letters in {WORDS[i]}?"}],
                         details={"word": WORDS[i]}) for i in ids]

    def score(self, pairs: Sequence[tuple[str, str]]) -> list[Score]:
        out = []
        for case_id, completion in pairs:
            if case_id not in WORDS:
                raise UnknownCase(f"unknown case_id {case_id!r}")
            text = completion.strip()
            if not text.isdigit():
                out.append(Score(case_id, -0.5, False, False, "no_number", status="no_code"))
                continue
            error = abs(int(text) - len(WORDS[case_id]))
            out.append(Score(case_id, float(error == 0), True, error == 0, "ok" if error == 0 else "wrong",
                             test_metric=float(error), details={"answer": int(text)}))
        return out


@register_task("test-letter-count")
def letter_count_task(cfg) -> LetterCountTask:
    return LetterCountTask()


@pytest.fixture(scope="module")
def client():
    server = start_server(GraderCore(make_task(GraderConfig(task="test-letter-count"))), "127.0.0.1", 0)
    with GraderClient(server.address, max_retries=0) as c:
        yield c
    server.stop(None)


def test_registered_task_is_served_over_grpc(client):
    health = client.health()
    assert (health.task, health.pool_size, health.pool_source) == ("test-letter-count", 3, "test")
    assert health.details == {"alphabet": "latin"} and health.voices == 0
    cases = client.cases(limit=2)
    assert [c.id for c in cases] == ["w-0", "w-1"] and cases[0].details == {"word": "apple"}
    assert cases[1].messages == [{"role": "user", "content": "How many letters in kiwi?"}]
    right, wrong, none = client.score_batch([("w-0", "5"), ("w-1", "7"), ("w-2", "many")])
    assert (right.reward, right.admitted, right.test_metric, right.details) == (1.0, True, 0.0, {"answer": 5})
    assert (wrong.reward, wrong.test_metric, wrong.status) == (0.0, 3.0, "ok")
    assert (none.reward, none.status, none.format_ok, none.test_metric) == (-0.5, "no_code", False, None)
    assert client.health().counters["scored"] == 3


def test_bad_requests_keep_their_status(client):
    with pytest.raises(GraderRequestError) as info:
        client.score("w-9", "3")
    assert info.value.code.name == "NOT_FOUND"


def test_unknown_task_names_the_registered_ones():
    assert "voice-leading" in task_names() and "test-letter-count" in task_names()
    with pytest.raises(ValueError, match="registered: .*voice-leading"):
        make_task(GraderConfig(task="no-such-task"))


def test_module_factory_path_needs_no_registration():
    task = make_task(GraderConfig(task=f"{__name__}:letter_count_task"))
    assert task.cases(0, "train")[2].details == {"word": "banana"}
