"""The voice-leading task: the shipped (or a user's) progression pool plus the verifier of
graders/voice_leading/score.py, as a registered grader task (graders/tasks.py)."""

from __future__ import annotations

from collections.abc import Sequence

from graders.types import CaseInfo, PoolError, Score, TaskInfo
from graders.tasks import register_task
from graders.voice_leading.pool import Case, Pool, load_pool, require_pool
from graders.voice_leading.score import ScoreResult, check_options, score

NAME = "voice-leading"


def case_info(case: Case) -> CaseInfo:
    return CaseInfo(
        id=case.id, split=case.split, task=NAME, messages=[dict(m) for m in case.messages],
        prefixes=list(case.prefixes), voices=case.voices, style=case.style, chords=case.chords,
        openings=[",".join(str(d) for d in o) for o in case.openings], progression=case.progression,
    )


def score_record(case_id: str, result: ScoreResult) -> Score:
    return Score(
        case_id=case_id, reward=result.reward, format_ok=result.format_ok, admitted=result.admitted,
        verdict=result.verdict, status="ok", failing_rules=tuple(result.failing_rules),
        sounding_frames=result.sounding_frames, expected_frames=result.expected_frames, opening=result.opening,
        first_measure_ok=result.first_measure_ok,
        details={"first_measure": result.first_measure, "voice_count": result.voice_count},
    )


class VoiceLeadingTask:
    """A pool and the verifier's options (voices, style, checker)."""

    name = NAME

    def __init__(self, pool: Pool, voices: int, style: str, checker: str) -> None:
        check_options(voices, style, checker)
        self.pool, self.voices, self.style, self.checker = pool, voices, style, checker

    def info(self) -> TaskInfo:
        return TaskInfo(
            pool_size=self.pool.size("train"),
            heldout_pool_size=self.pool.size("heldout") if "heldout" in self.pool.splits else 0,
            pool_source=self.pool.source, voices=self.voices, style=self.style, checker=self.checker,
            openings_histogram=self.pool.openings_histogram("train"),
        )

    def cases(self, limit: int, split: str) -> list[CaseInfo]:
        return [case_info(c) for c in self.pool.take(limit, split)]

    def score(self, pairs: Sequence[tuple[str, str]]) -> list[Score]:
        cases = []
        for i, (case_id, _) in enumerate(pairs):  # every id checked before any scoring
            try:
                cases.append(self.pool.get(case_id))
            except PoolError as exc:
                raise type(exc)(f"requests[{i}]: {exc}" if len(pairs) > 1 else str(exc)) from None
        return [score_record(case_id, score(case.progression, completion, case.voices, case.style, self.checker))
                for case, (case_id, completion) in zip(cases, pairs, strict=True)]


@register_task(NAME)
def voice_leading_task(cfg) -> VoiceLeadingTask:
    """From a GraderConfig: its fixtures (None = the shipped pools), voices, style, bars, checker."""
    pool = load_pool(cfg.fixture, cfg.heldout_fixture, cfg.voices, cfg.style, cfg.bars)
    require_pool(pool, cfg.require_pool)
    return VoiceLeadingTask(pool, cfg.voices, cfg.style, cfg.checker)
