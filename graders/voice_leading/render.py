"""Matching spec entries to chords and rendering MIDI voices (spec §7, §8).

All arithmetic is in doubles in exactly the reference's order, because chordMembership and
spacing compare the results exactly (fractional bassOctave values leave rounding noise).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from functools import partial
from math import fmod
from typing import Any, NamedTuple

from graders.voice_leading.chords import Chord, is_named, parse_chord_symbol
from graders.voice_leading.jsnum import js_round
from graders.voice_leading.parser import SpecEntry

DEFAULT_BASS_OCTAVE = 3.0


class Frame(NamedTuple):
    """One rendered chord; ``voices == ()`` is a rest.

    ``named``: the symbol is a named chord (counts toward expected frames); ``clamped``: a
    pitch was moved by the 0..127 clamp (the strict checker counts that as a non-member).
    """

    measure: Any
    chord_symbol: Any
    voices: tuple[float, ...]
    clamped: bool = False
    named: bool = False


_new_frame = partial(tuple.__new__, Frame)  # NamedTuple's own __new__ is Python-level


def _clamp(x: float) -> float:
    return 127.0 if x > 127.0 else (0.0 if x < 0.0 else x)


def render_voicing(
    chord: Chord, degrees: Sequence[float], bass_octave: float | None, voices: int
) -> tuple[tuple[float, ...], bool]:
    """§8: (MIDI voices low to high, whether clamping moved any pitch)."""
    tones = chord.tones
    size = len(tones)
    indices = [int(fmod(fmod(js_round(d), size) + size, size)) for d in degrees[:voices]]
    for position in range(len(indices), voices):
        indices.append(position % size)  # padding depends on the position (§8.2)
    octave = DEFAULT_BASS_OCTAVE if bass_octave is None else bass_octave
    raw = (octave + 1.0) * 12.0 + tones[indices[0]]
    prev = _clamp(raw)
    clamped = prev != raw
    out = [prev]
    for index in indices[1:]:
        pc = tones[index]
        m = prev + 1.0
        m = m + fmod(fmod(pc - m, 12.0) + 12.0, 12.0)
        prev = _clamp(m)
        clamped = clamped or prev != m
        out.append(prev)
    return tuple(out), clamped


def entries_by_measure(specs: Iterable[SpecEntry]) -> dict[float, SpecEntry]:
    """§7.1: measure -> entry, a later entry for the same measure replacing an earlier one."""
    by_measure: dict[float, SpecEntry] = {}
    for spec in specs:
        by_measure[spec.measure] = spec  # -0.0 and 0.0 are one key, as in a JavaScript Map
    return by_measure


def _measure_key(measure: Any) -> Any:
    # Progression measures are numbers; bool is not a measure (True would equal 1 in Python),
    # and an unhashable value can match no entry.
    if isinstance(measure, bool) or not isinstance(measure, int | float):
        return None
    return measure


_VOICING_CACHE: dict[tuple[Any, ...], tuple[tuple[float, ...], bool]] = {}
_VOICING_CACHE_MAX = 1 << 14  # entries; a few MB at most
_REST: tuple[tuple[float, ...], bool] = ((), False)


def voice_chord(
    symbol: str, degrees: tuple[float, ...], bass_octave: float | None, voices: int
) -> tuple[tuple[float, ...], bool]:
    """Render a named chord symbol (a rest when out of vocabulary), memoised.

    GRPO groups repeat the same voicings many times. The key holds values that compare equal
    only when they render identically (0.0 == -0.0 both give index 0; degrees beyond N are cut).
    """
    key = (symbol, degrees[:voices], bass_octave, voices)
    hit = _VOICING_CACHE.get(key)
    if hit is None:
        chord = parse_chord_symbol(symbol)
        hit = _REST if chord is None else render_voicing(chord, degrees, bass_octave, voices)
        if len(_VOICING_CACHE) >= _VOICING_CACHE_MAX:
            _VOICING_CACHE.clear()
        _VOICING_CACHE[key] = hit
    return hit


def render_frames(
    progression: Mapping[str, Any], specs: Iterable[SpecEntry], voices: int
) -> list[Frame]:
    """One frame per progression chord, in list order (§7.2)."""
    by_measure = entries_by_measure(specs)
    frames = []
    append = frames.append
    for chord in progression["chords"]:
        symbol = chord.get("chordSymbol")
        measure = chord.get("measure")
        # is_named(symbol), inlined for plain strings: this runs for every chord of every call
        if (symbol == "" or symbol == "N/C") if type(symbol) is str else not is_named(symbol):
            append(_new_frame((measure, symbol, (), False, False)))
            continue
        key = measure if type(measure) is int or type(measure) is float else _measure_key(measure)
        spec = by_measure.get(key)
        if spec is None:
            append(_new_frame((measure, symbol, (), False, True)))
        else:
            voiced, clamped = voice_chord(symbol, spec.degrees, spec.bass_octave, voices)
            append(_new_frame((measure, symbol, voiced, clamped, True)))
    return frames
