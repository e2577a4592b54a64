"""A test-only grader task over the real Grader contract (protos/grader.proto), for the
end-to-end runs that need a reward a tiny random model can earn and learn.

Task "char-share": the reward of a completion is the share of its characters (after the case's
forced prefix, when it starts with one) that are in ``CHARS``. The reward is dense, so the G
completions of a group differ and GRPO has something to learn from; the voice-leading grader gives
the tiny random model of configs/smoke.yaml reward 0 everywhere (every loss 0, the adapter never
moves).

The server is a real grpcio server on 127.0.0.1 (``graders.service.start_server``: the Grader
service plus grpc.health.v1 and reflection, bad requests mapped to INVALID_ARGUMENT / NOT_FOUND /
FAILED_PRECONDITION); a run is pointed at it with ``--set grader.address=127.0.0.1:PORT``. Every
scored completion is recorded, so a test can check what the driver actually sent.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from graders.voice_leading.pool import PoolTooSmall, UnknownCase, UnknownSplit
from graders.proto import grader_pb2 as pb
from graders.service import RunningServer, start_server

TASK = "char-share"
CHARS = "aeiou"
PASS_SHARE = 0.4  # a completion "passes" (admitted) when at least this share of it is in CHARS
OPENINGS = ("a", "b", "c")  # three forced openings per case: G = 4 gives prefixes 0, 1, 2, 0
NO_OPENING = "(none)"


def prefixes_of(case_id: str) -> list[str]:
    """The forced-opening prefixes of a case, distinct per case and per opening."""
    return [f"[{case_id}:{o}] " for o in OPENINGS]


def char_share(text: str, chars: str = CHARS) -> float:
    return sum(c in chars for c in text) / len(text) if text else 0.0


@dataclass(frozen=True)
class Scored:
    case_id: str
    completion: str
    reward: float


class CharShareCore:
    """Answers the four Grader RPCs (``handle(rpc, request)``, as graders.service.GraderCore);
    bad requests raise graders.voice_leading.pool.PoolError subclasses, which the servicer maps to status
    codes."""

    def __init__(self, n_train: int = 8, n_heldout: int = 4, chars: str = CHARS) -> None:
        self.chars = chars
        self.splits = {
            "train": [f"cs-train-{i}" for i in range(n_train)],
            "heldout": [f"cs-heldout-{i}" for i in range(n_heldout)],
        }
        self.scored: list[Scored] = []
        self._lock = threading.Lock()

    # -------------------------------------------------------------- the contract
    def case(self, case_id: str, split: str) -> pb.Case:
        n = int(case_id.rsplit("-", 1)[1])
        return pb.Case(
            id=case_id, split=split, task=TASK, voices=2, style="test", chords=0,
            messages=[pb.ChatMessage(role="system", content="You write short English text."),
                      pb.ChatMessage(role="user", content=f"Prompt {n} ({split}): write a few words.")],
            openings=list(OPENINGS), prefixes=prefixes_of(case_id),
            progression=pb.Progression(key="", chords=[]),
        )

    def split_of(self, case_id: str) -> str:
        for split, ids in self.splits.items():
            if case_id in ids:
                return split
        raise UnknownCase(f"unknown case_id {case_id!r}")

    def score_one(self, case_id: str, completion: str) -> pb.ScoreReply:
        opening, body = "free", completion
        for label, prefix in zip(OPENINGS, prefixes_of(case_id)):
            if completion.startswith(prefix):
                opening, body = label, completion[len(prefix):]
                break
        share = char_share(body, self.chars)
        format_ok = bool(body.strip())
        admitted = format_ok and share >= PASS_SHARE
        verdict = "admitted" if admitted else ("structure" if not format_ok else "share")
        return pb.ScoreReply(
            case_id=case_id, reward=share, format_ok=format_ok, admitted=admitted, verdict=verdict,
            failing_rules=[] if admitted else [verdict], status="ok", test_metric=share,
            details_json=json.dumps({"share": share, "chars": self.chars}),
            opening=opening if format_ok else NO_OPENING, first_measure_ok=format_ok,
        )

    def health(self, request: pb.HealthRequest) -> pb.HealthReply:
        with self._lock:
            scored = list(self.scored)
        return pb.HealthReply(
            task=TASK, pool_size=len(self.splits["train"]), pool_source="test", voices=2, style="test",
            checker="char-share", heldout_pool_size=len(self.splits["heldout"]),
            counters=pb.Counters(scored=len(scored), admitted=sum(s.reward >= PASS_SHARE for s in scored)),
            openings_histogram={len(OPENINGS): len(self.splits["train"])}, version="test",
        )

    def cases(self, request: pb.CasesRequest) -> pb.CasesReply:
        split = request.split or "train"
        if split not in self.splits:
            raise UnknownSplit(f"unknown split {split!r}; one of {sorted(self.splits)}")
        ids = self.splits[split]
        if request.limit < 0:
            raise UnknownSplit(f"limit must be >= 0, got {request.limit}")
        if request.limit > len(ids):
            raise PoolTooSmall(f"asked for {request.limit} {split} cases, the pool holds {len(ids)}")
        take = ids[: request.limit or len(ids)]
        return pb.CasesReply(cases=[self.case(c, split) for c in take], pool_size=len(ids))

    def score_batch(self, request: pb.ScoreBatchRequest) -> pb.ScoreBatchReply:
        for i, r in enumerate(request.requests):
            try:
                self.split_of(r.case_id)
            except UnknownCase as err:
                raise UnknownCase(f"requests[{i}]: {err}") from None
        replies = [self.score_one(r.case_id, r.completion) for r in request.requests]
        with self._lock:
            self.scored.extend(Scored(r.case_id, r.completion, s.reward) for r, s in zip(request.requests, replies))
        return pb.ScoreBatchReply(replies=replies)

    def score(self, request: pb.ScoreRequest) -> pb.ScoreReply:
        batch = pb.ScoreBatchRequest(requests=[request])
        return self.score_batch(batch).replies[0]

    def handle(self, rpc: str, request):
        return {"Health": self.health, "Cases": self.cases, "Score": self.score,
                "ScoreBatch": self.score_batch}[rpc](request)


@contextmanager
def char_share_grader(**kwargs) -> Iterator[tuple[RunningServer, CharShareCore]]:
    """A char-share grader on a free 127.0.0.1 port for the duration of the block."""
    core = CharShareCore(**kwargs)
    server = start_server(core, host="127.0.0.1", port=0)
    try:
        yield server, core
    finally:
        server.stop(grace=None)


# ------------------------------------------------------------------ runs against it
# Settings under which the tiny random model of configs/smoke.yaml learns this task in a few
# steps (measured: tests/test_train_e2e.py, RISE). At temperature 1 its output head caps
# every logit gap near 1.3 over a 49k vocabulary (no policy can favour anything); sampling (and
# the learner's log-softmax) at T = 0.1 widens the gaps tenfold, the model then repeats one word
# per completion, and GRPO moves it toward words with more vowels.
LEARNS = (
    "rollout.temperature=0.1", "rollout.max_tokens=16", "trainer.group_size=8", "trainer.prompts_per_step=2",
    "learner.lr=3e-3", "learner.beta=0", "learner.micro_batch_size=8",
)


def case_of_row(row: dict) -> str:
    """The case id of an archived node row (its user message names the prompt number)."""
    user = row["prompt_messages"][1]["content"]
    number, split = user.split(" ", 2)[1], user.split("(", 1)[1].split(")", 1)[0]
    return f"cs-{split}-{number}"


def train_args(runs_dir, run_name: str, address: str, *sets: str) -> list[str]:
    """`counterpoint train` on configs/smoke.yaml against a char-share grader at ``address``."""
    args = ["train", "--config", "configs/smoke.yaml", "--run-name", run_name,
            "--set", f"trainer.runs_dir={runs_dir}", "--set", f"grader.address={address}",
            "--set", f"grader.task={TASK}"]  # the run checks the grader serves the task it names
    for s in (*LEARNS, *sets):
        args += ["--set", s]
    return args
