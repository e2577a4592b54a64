"""The tolerant completion parser (spec §6): any string -> ordered spec entries, never raises.

Each entry also carries ``typed`` for the strict checker (README, "Checker variants"), so both
checkers read a completion identically and strict can only take reward away.
"""

from __future__ import annotations

import re
from functools import partial
from math import isfinite
from typing import Any, Final, NamedTuple

from graders.voice_leading.jsnum import (
    JS_WHITESPACE,
    JS_WS_CLASS,
    MISSING,
    JSONParseError,
    int_to_number,
    js_property_order,
    js_trim,
    parse_json,
    to_number,
)

# The reference's fence pattern: ``` + optional 'json' (ASCII, any case) + JS whitespace +
# the shortest run up to the next ```. Kept as the definition `find_fence` is tested against;
# matching it with a backtracking engine is quadratic in a run of whitespace after an
# unclosed fence (about a second for 10 kB of spaces, 100 s for 100 kB), so `find_fence`
# scans instead.
FENCE_PATTERN: Final = re.compile(
    r"```(?:[jJ][sS][oO][nN])?" + JS_WS_CLASS + r"*(.*?)```", re.DOTALL
)
_JSON_TAG: Final = re.compile(r"[jJ][sS][oO][nN]")
_WHITESPACE: Final = frozenset(JS_WHITESPACE)
_BRACKET: Final = re.compile(r"[\[\]]")

_MEASURE_FIELDS: Final = ("measure", "m", "bar")
_DEGREE_FIELDS: Final = ("degrees", "voices", "tones", "notes")
_OCTAVE_FIELDS: Final = ("bassOctave", "octave", "bass_octave")  # inlined in _parse_entry
_JUST_INT: Final = {int}


class SpecEntry(NamedTuple):
    """One parsed ``{measure, degrees, bassOctave?}`` object, degrees as parsed (unrounded).

    ``typed`` is False when reading it needed JavaScript coercion or lost information: a
    non-number measure/degree/octave (string, bool, null, array), a non-finite value dropped,
    a fractional degree or octave. The reference ignores it; the strict checker refuses such
    completions.
    """

    measure: float
    degrees: tuple[float, ...]
    bass_octave: float | None = None
    typed: bool = True


def find_fence(text: str) -> str | None:
    """The capture of ``FENCE_PATTERN.search(text)`` in linear time (None when no match).

    Only the first ``` can start a match: backtracking the optional tag or the whitespace
    cannot help (neither holds a backtick), and a later ``` lies either inside the same
    backtick run (so it has a later start and the same lack of a closing fence) or after the
    start of the content, where the first start would already have found it as its closer.
    """
    start = text.find("```")
    if start < 0:
        return None
    pos = start + 3
    if _JSON_TAG.match(text, pos):
        pos += 4
    end = len(text)
    while pos < end and text[pos] in _WHITESPACE:
        pos += 1
    close = text.find("```", pos)
    return None if close < 0 else text[pos:close]


def _first_balanced_array(text: str) -> str | None:
    """Substring from the first '[' to the ']' closing it; strings are not special (§15.14)."""
    start = text.find("[")
    if start < 0:
        return None
    depth = 0
    for m in _BRACKET.finditer(text, start):
        if m.group() == "[":
            depth += 1
        else:
            depth -= 1
            if depth == 0:
                return text[start : m.end()]
    return None


def find_json_value(completion: str) -> Any:
    """Step 1 (§6.1): the parsed JSON value, or MISSING when nothing parses."""
    if not js_trim(completion):
        return MISSING
    try:
        return parse_json(completion)  # the whole, untrimmed text
    except JSONParseError:
        pass
    fence = find_fence(completion)
    candidate = fence if fence is not None else _first_balanced_array(completion)
    if not candidate:
        return MISSING
    try:
        return parse_json(candidate)
    except JSONParseError:
        return MISSING  # no second fallback (§15.12)


def entry_list(value: Any) -> list[Any]:
    """Step 2 (§6.2): the array itself, or an object's first array-valued property."""
    if isinstance(value, list):
        return value
    if isinstance(value, dict):
        for key in js_property_order(value):
            v = value[key]
            if isinstance(v, list):
                return v
    return []


def _coalesce(obj: dict[str, Any], fields: tuple[str, ...]) -> Any:
    """``obj.a ?? obj.b ?? obj.c``: the last field's raw value when all are missing or null."""
    for name in fields[:-1]:
        v = obj.get(name)
        if v is not None:
            return v
    return obj.get(fields[-1], MISSING)


def _number(v: Any) -> float:
    # Fast path for the common case (a JSON number); to_number handles every other value.
    t = type(v)
    if t is int:
        return int_to_number(v)
    return v if t is float else to_number(v)


def _is_plain_number(v: Any, *, integral: bool) -> bool:
    """A JSON number as written (no coercion), finite, and integral when asked."""
    t = type(v)
    if t is int:
        return isfinite(int_to_number(v))
    if t is float:
        return isfinite(v) and (not integral or v.is_integer())
    return False


# Build entries through tuple.__new__ directly: NamedTuple's generated __new__ is Python-level.
_new_entry = partial(tuple.__new__, SpecEntry)


def _degrees(raw: list[Any]) -> tuple[tuple[float, ...], bool]:
    """(finite degrees after ToNumber, whether every element was an integral JSON number)."""
    if set(map(type, raw)) == _JUST_INT:  # the common case: integer literals
        try:
            return tuple(map(float, raw)), True
        except OverflowError:  # beyond 1.8e308: JavaScript reads Infinity, dropped below
            pass
    degrees = tuple(d for d in map(_number, raw) if isfinite(d))
    typed = len(degrees) == len(raw) and all(_is_plain_number(d, integral=True) for d in raw)
    return degrees, typed


def _parse_entry(obj: dict[str, Any]) -> SpecEntry | None:
    """Step 3 (§6.3) for one object; also records whether it needed no coercion (``typed``)."""
    raw_measure = obj.get("measure")
    if raw_measure is None:
        raw_measure = _coalesce(obj, _MEASURE_FIELDS)
    measure = _number(raw_measure)
    if not isfinite(measure):
        return None
    raw = obj.get("degrees")
    if raw is None:
        raw = _coalesce(obj, _DEGREE_FIELDS)
    if type(raw) is not list:
        return None
    degrees, typed = _degrees(raw)
    if not degrees:
        return None
    typed = typed and _is_plain_number(raw_measure, integral=False)
    raw_octave = obj.get("bassOctave")  # inlined _coalesce(obj, _OCTAVE_FIELDS): hot path
    if raw_octave is None:
        raw_octave = obj.get("octave")
        if raw_octave is None:
            raw_octave = obj.get("bass_octave", MISSING)
    if raw_octave is MISSING:
        return _new_entry((measure, degrees, None, typed))
    octave = _number(raw_octave)  # an explicit "bass_octave": null is 0 here (§15.13)
    typed = typed and _is_plain_number(raw_octave, integral=True)
    return _new_entry((measure, degrees, octave if isfinite(octave) else None, typed))


def parse_completion(completion: str) -> tuple[SpecEntry, ...]:
    """Parse a completion into spec entries in completion order; () means unparseable."""
    if not isinstance(completion, str):
        return ()
    value = find_json_value(completion)
    if value is MISSING:
        return ()
    out = []
    for item in entry_list(value):
        if type(item) is dict:  # arrays and scalars never yield a finite measure
            entry = _parse_entry(item)
            if entry is not None:
                out.append(entry)
    return tuple(out)
