"""The part-writing verifier (spec §9) and the style presets (§10).

Voices are assigned by pitch rank (bass = lowest). A rule fails if it has at least one violation;
failing rules are reported in canonical order, relaxed ones included (§15.1).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from math import fmod
from typing import Any, Final

from graders.voice_leading.chords import Chord, Key, parse_chord_symbol, parse_key
from graders.voice_leading.render import Frame

RULES: Final = (
    "structure",
    "chordMembership",
    "parallels",
    "hidden",
    "overlap",
    "spacing",
    "crossing",
    "leap",
    "tendencySeventh",
    "tendencyLeadingTone",
)
HARD_FLOOR: Final = frozenset(
    {"structure", "chordMembership", "spacing", "overlap", "crossing", "leap"}
)
# style -> rules demoted to warnings (§10). Only style-gated rules may appear here.
STYLE_RELAXED: Final[dict[str, frozenset[str]]] = {
    "common-practice": frozenset(),
    "lead-sheet": frozenset({"parallels", "tendencySeventh"}),
    "film-ambient": frozenset({"parallels", "hidden", "tendencySeventh", "tendencyLeadingTone"}),
}
STYLES: Final = tuple(STYLE_RELAXED)
MAX_UPPER_SPACING: Final = 12.0
MAX_LEAP: Final = 12.0
_PERFECT: Final = (0.0, 7.0)


@dataclass(frozen=True, slots=True)
class Verdict:
    """The verifier's answer: failing rules in canonical order, and admission under the style."""

    failing: tuple[str, ...]
    admitted: bool


def _sign(x: float) -> int:
    return (x > 0) - (x < 0)


def _interval_class(x: float, y: float) -> float:
    return fmod(abs(x - y), 12.0)


def _frame_failures(
    voices: tuple[float, ...], chord: Chord | None, required: int, clamped: bool, failed: set[str]
) -> None:
    if len(voices) != required:
        failed.add("structure")
    if chord is not None:
        tone_set = chord.tone_set
        if clamped or any(fmod(v, 12.0) not in tone_set for v in voices):
            failed.add("chordMembership")
    for k in range(1, len(voices) - 1):
        if voices[k + 1] - voices[k] > MAX_UPPER_SPACING:
            failed.add("spacing")
            break


def _motion_failures(a: tuple[float, ...], b: tuple[float, ...], failed: set[str]) -> None:
    """leap, parallels, hidden, overlap between two sounding frames of equal voice counts."""
    n = len(a)
    for k in range(1, n):
        if abs(b[k] - a[k]) > MAX_LEAP:
            failed.add("leap")
            break
    if n < 2:
        return
    moves = [_sign(b[i] - a[i]) for i in range(n)]
    for x in range(n - 1):
        if moves[x] == 0:
            continue
        for y in range(x + 1, n):
            if moves[y] != moves[x]:
                continue
            ic = _interval_class(a[x], a[y])
            if ic in _PERFECT and ic == _interval_class(b[x], b[y]):
                failed.add("parallels")
                break
        if "parallels" in failed:
            break
    d_lo, d_hi = b[0] - a[0], b[n - 1] - a[n - 1]
    if (
        _interval_class(b[0], b[n - 1]) in _PERFECT
        and _sign(d_lo) == _sign(d_hi) != 0
        and abs(d_hi) > 2
    ):
        failed.add("hidden")
    for k in range(n - 1):
        if b[k] > a[k + 1] or b[k + 1] < a[k]:
            failed.add("overlap")
            break


def _seventh_resolves(chord_a: Chord, a: tuple[float, ...], chord_b: Chord, b: set[float]) -> bool:
    seventh = chord_a.seventh
    if seventh is None:
        return True
    for p in a:
        if fmod(p, 12.0) != seventh:
            continue
        if (p - 1.0) in b or (p - 2.0) in b:
            continue
        if p in b and fmod(p, 12.0) in chord_b.tone_set:
            continue
        return False
    return True


def _leading_tone_resolves(
    key: Key, chord_a: Chord, a: tuple[float, ...], chord_b: Chord, b: tuple[float, ...]
) -> bool:
    if not a or not b:
        return True
    lt = key.leading_tone
    is_dominant = (chord_a.root == key.dominant or chord_a.root == lt) and lt in chord_a.tone_set
    if not is_dominant or chord_b.root != key.tonic:
        return True
    soprano = max(a)
    if fmod(soprano, 12.0) != lt:
        return True
    return max(b) == soprano + 1.0


_CACHE_MAX = 1 << 14  # entries per cache; a few MB at most
_FRAME_CACHE: dict[tuple[Any, ...], frozenset[str]] = {}
_PAIR_CACHE: dict[tuple[Any, ...], frozenset[str]] = {}


_INTERNED: dict[frozenset[str], frozenset[str]] = {}


def _remember(
    cache: dict[tuple[Any, ...], frozenset[str]], key: tuple[Any, ...], value: set[str]
) -> frozenset[str]:
    if len(cache) >= _CACHE_MAX:
        cache.clear()
    result = frozenset(value)
    result = _INTERNED.setdefault(result, result)  # few distinct rule sets: share them
    cache[key] = result
    return result


def frame_rules(
    symbol: Any, voices: tuple[float, ...], required: int, clamped: bool
) -> frozenset[str]:
    """Per-frame rules of one sounding frame: structure, chordMembership, spacing (§9.3)."""
    key = (symbol, voices, required, clamped)
    hit = _FRAME_CACHE.get(key)
    if hit is not None:
        return hit
    failed: set[str] = set()
    _frame_failures(tuple(sorted(voices)), parse_chord_symbol(symbol), required, clamped, failed)
    return _remember(_FRAME_CACHE, key, failed)


def pair_rules(
    symbol_a: Any,
    voices_a: tuple[float, ...],
    symbol_b: Any,
    voices_b: tuple[float, ...],
    key: str | None,
) -> frozenset[str]:
    """Between-frame rules for consecutive sounding frames A -> B (§9.4)."""
    cache_key = (symbol_a, voices_a, symbol_b, voices_b, key)
    hit = _PAIR_CACHE.get(cache_key)
    if hit is not None:
        return hit
    failed: set[str] = set()
    a, b = tuple(sorted(voices_a)), tuple(sorted(voices_b))
    if len(a) == len(b):
        _motion_failures(a, b, failed)
    chord_a, chord_b = parse_chord_symbol(symbol_a), parse_chord_symbol(symbol_b)
    # Tendencies only across a change of raw symbol string (§15.8).
    if chord_a is not None and chord_b is not None and symbol_a != symbol_b:
        if not _seventh_resolves(chord_a, a, chord_b, set(b)):
            failed.add("tendencySeventh")
        parsed_key = parse_key(key) if key is not None else None
        if parsed_key is not None and not _leading_tone_resolves(
            parsed_key, chord_a, a, chord_b, b
        ):
            failed.add("tendencyLeadingTone")
    return _remember(_PAIR_CACHE, cache_key, failed)


def failing_rules(
    frames: Sequence[Frame], key: Any, voices: int, *, strict: bool = False
) -> tuple[str, ...]:
    """Every rule with at least one violation, in canonical order (relaxation not applied).

    Rests are skipped, so the sounding frames on either side of a rest are compared directly.
    ``strict``: a pitch moved by clamping (``frame.clamped``) is a chordMembership violation.
    'crossing' is only checked when voices are not rank-assigned, i.e. never here (§9.3).
    """
    key = key if isinstance(key, str) else None
    failed: set[str] = set()
    previous = None
    for frame in frames:
        if not frame.voices:
            continue
        failed |= frame_rules(frame.chord_symbol, frame.voices, voices, strict and frame.clamped)
        if previous is not None:
            failed |= pair_rules(
                previous.chord_symbol, previous.voices, frame.chord_symbol, frame.voices, key
            )
        previous = frame
    return tuple(rule for rule in RULES if rule in failed)


def verify(
    frames: Sequence[Frame], key: str, style: str, voices: int, *, strict: bool = False
) -> Verdict:
    """Run every rule; admitted when no failing rule is left gating under ``style``."""
    if style not in STYLE_RELAXED:
        raise ValueError(f"unknown style {style!r}; expected one of {STYLES}")
    failing = failing_rules(frames, key, voices, strict=strict)
    relaxed = STYLE_RELAXED[style]
    return Verdict(failing, all(rule in relaxed for rule in failing))
