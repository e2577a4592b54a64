"""Openings, the opening alphabet, forced-opening prefixes and signatures (spec §13.1–13.3)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from itertools import product
from typing import Any

from graders.voice_leading.chords import is_named
from graders.voice_leading.jsnum import MISSING, number_to_string
from graders.voice_leading.parser import SpecEntry, parse_completion
from graders.voice_leading.prompt import template_string
from graders.voice_leading.render import render_frames

NO_OPENING = "(none)"


def opening_string(specs: Sequence[SpecEntry]) -> str:
    """The first parsed entry's degrees as parsed (unrounded), JavaScript-formatted, ','-joined."""
    if not specs:
        return NO_OPENING
    return ",".join(number_to_string(d) for d in specs[0].degrees)


def opening_of(completion: str) -> str:
    """§13.1: the opening of a completion under the reference parser, or ``(none)``."""
    return opening_string(parse_completion(completion))


def signature_of(completion: str) -> str:
    """§13.4: every entry's degrees with no separator, entries joined by '|' ('' if none)."""
    return "|".join(
        "".join(number_to_string(d) for d in spec.degrees) for spec in parse_completion(completion)
    )


def first_named_chord(progression: Mapping[str, Any]) -> Mapping[str, Any] | None:
    return next((c for c in progression["chords"] if is_named(c.get("chordSymbol"))), None)


def named_chord_count(progression: Mapping[str, Any]) -> int:
    """Chords whose symbol is a non-empty string other than ``N/C`` (the bridge's ``chords``)."""
    return sum(1 for c in progression["chords"] if is_named(c.get("chordSymbol")))


def opening_alphabet(
    progression: Mapping[str, Any], voices: int, max_degree: int = 3
) -> list[tuple[int, ...]]:
    """§13.2: degree tuples over 0..max_degree (first voice slowest) that render N voices on
    the first frame whose measure equals the first named chord's measure."""
    first = first_named_chord(progression)
    if first is None:
        return []
    measure = first.get("measure")
    if isinstance(measure, bool) or not isinstance(measure, int | float):
        return []
    alphabet = []
    for degrees in product(range(max_degree + 1), repeat=voices):
        entry = SpecEntry(float(measure), tuple(float(d) for d in degrees), None)
        frames = render_frames(progression, [entry], voices)
        frame = next((f for f in frames if f.measure == measure), None)
        if frame is not None and len(frame.voices) == voices:
            alphabet.append(tuple(degrees))
    return alphabet


def forced_prefix(progression: Mapping[str, Any], opening: Sequence[int]) -> str:
    """§13.3: the open partial assistant turn ``[{"measure": M, "degrees": [d0, d1]},``."""
    first = first_named_chord(progression)
    if first is None:
        raise ValueError("progression has no named chord, so it has no opening to force")
    degrees = ", ".join(template_string(d) for d in opening)
    measure = template_string(first.get("measure", MISSING))
    return f'[{{"measure": {measure}, "degrees": [{degrees}]}},'
