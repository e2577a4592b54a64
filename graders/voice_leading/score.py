"""Bridge scoring (spec §11): structure gate + verifier -> reward, verdict, failing rules.

Two checkers share every function here; ``strict`` flips small switches (README, "Checker
variants"): typed numbers in the parser, no free reward without named chords, exactly N degrees
per entry, one entry per measure, and clamped pitches counting as non-members.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

from config.grader import GraderConfig
from graders.voice_leading.jsnum import value_to_string
from graders.voice_leading.openings import opening_string
from graders.voice_leading.parser import parse_completion
from graders.voice_leading.render import entries_by_measure, render_frames
from graders.voice_leading.rules import STYLES, verify

CHECKERS: Final = ("reference", "strict")
STRUCTURE: Final = "structure"
_DEFAULTS = GraderConfig()  # the schema is the one place the verifier's defaults live


@dataclass(frozen=True, slots=True)
class ScoreResult:
    """What one completion earned. ``failing_rules`` is sorted alphabetically (§11.10)."""

    reward: float
    format_ok: bool
    admitted: bool
    verdict: str
    failing_rules: tuple[str, ...]
    sounding_frames: int
    expected_frames: int
    first_measure: float | None
    first_measure_ok: bool
    voice_count: int | None
    opening: str


def completion_from_messages(messages: Any) -> str:
    """The completion the bridge scores (§2.3), like the reference's ``lastAssistantText``.

    The content of the last assistant message that has a string or list content; a list is
    concatenated from its parts (a string part counts as itself, a mapping part as its
    ``text`` written like JavaScript's ``String()``, anything else as nothing). A bare string
    instead of a message list is used as-is; otherwise the empty string.
    """
    if isinstance(messages, list | tuple):
        for message in reversed(messages):
            if not isinstance(message, Mapping) or message.get("role") != "assistant":
                continue
            content = message.get("content")
            if isinstance(content, str):
                return content
            if isinstance(content, list | tuple):
                return "".join(
                    part if isinstance(part, str)
                    else value_to_string(part.get("text")) if isinstance(part, Mapping)
                    else ""
                    for part in content
                )
    return messages if isinstance(messages, str) else ""


def check_options(voices: Any, style: Any, checker: Any) -> None:
    """Raise ValueError naming the bad option (voices 2..4, a known style and checker)."""
    if isinstance(voices, bool) or not isinstance(voices, int) or not 2 <= voices <= 4:
        raise ValueError(f"voices must be an integer in 2..4, got {voices!r}")
    if style not in STYLES:
        raise ValueError(f"unknown style {style!r}; expected one of {STYLES}")
    if checker not in CHECKERS:
        raise ValueError(f"unknown checker {checker!r}; expected one of {CHECKERS}")


def check_progression(progression: Any) -> None:
    """Raise ValueError unless ``progression`` is ``{key, chords: [{measure, chordSymbol}]}``."""
    if type(progression) is not dict and not isinstance(progression, Mapping):
        raise ValueError(f"progression must be a mapping, got {type(progression).__name__}")
    chords = progression.get("chords")
    if type(chords) is not list and not isinstance(chords, tuple):
        raise ValueError("progression['chords'] must be a list of {measure, chordSymbol}")
    for i, chord in enumerate(chords):
        if type(chord) is not dict and not isinstance(chord, Mapping):
            raise ValueError(f"progression['chords'][{i}] must be a mapping, got {chord!r}")


def score(
    progression: Mapping[str, Any],
    completion: str,
    voices: int = _DEFAULTS.voices,
    style: str = _DEFAULTS.style,
    checker: str = _DEFAULTS.checker,
) -> ScoreResult:
    """Score one completion against one progression. Never raises on the completion."""
    check_options(voices, style, checker)
    check_progression(progression)
    strict = checker == "strict"
    specs = parse_completion(completion)
    format_ok = bool(specs)
    frames = render_frames(progression, specs, voices)
    named = [f.measure for f in frames if f.named]
    expected = len(named)
    sounding_counts = [len(f.voices) for f in frames if f.voices]
    sounding = len(sounding_counts)
    structure_ok = format_ok and sounding == expected
    if strict and structure_ok:
        structure_ok = (
            expected > 0  # no free reward for an all-N/C progression (§15.2)
            and all(s.typed for s in specs)  # no JavaScript number coercion (§15.13)
            and all(len(s.degrees) == voices for s in specs)  # no padding / truncation
            and len(entries_by_measure(specs)) == len(specs)  # one entry per measure
        )
    if structure_ok:
        verdict = verify(frames, progression.get("key"), style, voices, strict=strict)
        admitted = verdict.admitted
        failing = tuple(sorted(verdict.failing))
        verdict_text = "admitted" if admitted else ",".join(verdict.failing) or "rejected"
    else:
        admitted, failing, verdict_text = False, (STRUCTURE,), STRUCTURE
    first_measure = specs[0].measure if specs else None
    first_named_measure = named[0] if named else None
    distinct_counts = set(sounding_counts)
    return ScoreResult(
        reward=1.0 if admitted else 0.0,
        format_ok=format_ok,
        admitted=admitted,
        verdict=verdict_text,
        failing_rules=failing,
        sounding_frames=sounding,
        expected_frames=expected,
        first_measure=first_measure,
        first_measure_ok=(
            first_measure is not None
            and first_named_measure is not None
            and not isinstance(first_named_measure, bool)
            and first_measure == first_named_measure
        ),
        voice_count=distinct_counts.pop() if len(distinct_counts) == 1 else None,
        opening=opening_string(specs),
    )
