"""The one conversion between the grader's plain records (graders/types.py) and the
counterpoint.grader.v1 messages. Used by the grpcio servicer, the Serve app and the client: no
other module builds or reads a Case, ScoreReply or HealthReply field by field.

Task-specific fields travel as JSON objects (``details_json`` on Case, ScoreReply and
HealthReply), so a new task adds no field to the proto and voice-leading clients see the
messages they always did.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from graders.proto import grader_pb2 as pb
from graders.types import CaseInfo, Health, Score


def _json(details: Mapping[str, Any]) -> str:
    return json.dumps(dict(details), sort_keys=True) if details else ""


def _details(text: str) -> dict[str, Any]:
    return json.loads(text) if text else {}


def _measure(value: float) -> int | float:
    return int(value) if value.is_integer() else value


def case_to_proto(case: CaseInfo) -> pb.Case:
    progression = case.progression or {}
    return pb.Case(
        id=case.id, split=case.split, task=case.task, voices=case.voices, style=case.style, chords=case.chords,
        messages=[pb.ChatMessage(role=m["role"], content=m["content"]) for m in case.messages],
        openings=list(case.openings), prefixes=list(case.prefixes),
        progression=pb.Progression(
            key=progression.get("key", ""),
            chords=[pb.Chord(measure=c["measure"], chord_symbol=c["chordSymbol"])
                    for c in progression.get("chords", [])],
        ) if progression else None,
        details_json=_json(case.details),
    )


def case_from_proto(c: pb.Case) -> CaseInfo:
    progression = {}
    if c.HasField("progression"):
        progression = {"key": c.progression.key,
                       "chords": [{"measure": _measure(ch.measure), "chordSymbol": ch.chord_symbol}
                                  for ch in c.progression.chords]}
    return CaseInfo(
        id=c.id, split=c.split, task=c.task, messages=[{"role": m.role, "content": m.content} for m in c.messages],
        prefixes=list(c.prefixes), voices=c.voices, style=c.style, chords=c.chords, openings=list(c.openings),
        progression=progression, details=_details(c.details_json),
    )


def score_to_proto(score: Score) -> pb.ScoreReply:
    reply = pb.ScoreReply(
        case_id=score.case_id, reward=score.reward, format_ok=score.format_ok, admitted=score.admitted,
        verdict=score.verdict, failing_rules=list(score.failing_rules), sounding_frames=score.sounding_frames,
        expected_frames=score.expected_frames, status=score.status, details_json=_json(score.details),
        opening=score.opening, first_measure_ok=score.first_measure_ok,
    )
    if score.test_metric is not None:
        reply.test_metric = score.test_metric
    return reply


def score_from_proto(r: pb.ScoreReply) -> Score:
    return Score(
        case_id=r.case_id, reward=r.reward, format_ok=r.format_ok, admitted=r.admitted, verdict=r.verdict,
        status=r.status, test_metric=r.test_metric if r.HasField("test_metric") else None,
        failing_rules=tuple(r.failing_rules), sounding_frames=r.sounding_frames, expected_frames=r.expected_frames,
        opening=r.opening, first_measure_ok=r.first_measure_ok, details=_details(r.details_json),
    )


def health_to_proto(health: Health) -> pb.HealthReply:
    return pb.HealthReply(
        task=health.task, pool_size=health.pool_size, pool_source=health.pool_source, voices=health.voices,
        style=health.style, checker=health.checker, counters=pb.Counters(**health.counters),
        heldout_pool_size=health.heldout_pool_size, openings_histogram=health.openings_histogram,
        version=health.version, replica=health.replica, details_json=_json(health.details),
    )


def health_from_proto(r: pb.HealthReply) -> Health:
    return Health(
        task=r.task, pool_size=r.pool_size, pool_source=r.pool_source,
        counters={"scored": r.counters.scored, "unparsed": r.counters.unparsed, "admitted": r.counters.admitted,
                  "first_measure_wrong": r.counters.first_measure_wrong},
        heldout_pool_size=r.heldout_pool_size, version=r.version, replica=r.replica, voices=r.voices,
        style=r.style, checker=r.checker, openings_histogram=dict(sorted(r.openings_histogram.items())),
        details=_details(r.details_json),
    )
