"""Hypothesis fuzzing: the parser and the scorer never raise, and the score's invariants hold."""

from __future__ import annotations

import json

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from graders.voice_leading import (
    CHECKERS,
    STYLES,
    VOCABULARY,
    opening_of,
    parse_completion,
    score,
    signature_of,
)

FUZZ = settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])

FIELDS = ["measure", "m", "bar", "degrees", "voices", "tones", "notes", "bassOctave", "octave",
          "bass_octave", "0", "7", "specs", "x"]
ROOTS = ["C", "D", "Eb", "F#", "G", "Ab", "Bb", "B", "E#", "Cb"]
SYMBOLS = st.one_of(
    st.builds(lambda r, s: r + s, st.sampled_from(ROOTS), st.sampled_from(sorted(VOCABULARY))),
    st.sampled_from(["N/C", "", "Cmaj", "G7/B", " C ", "n/c", "Em9b5", "C6/9"]),
)
KEYS = st.sampled_from(["C major", "A minor", "Bb major", "BB major", "f# MINOR", "C dorian", ""])

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-20, max_value=20),
    st.integers(),
    st.floats(allow_nan=False, allow_infinity=False),
    st.sampled_from(["", "2", " 1 ", "0x3", "Infinity", "two", "1e1", "-0"]),
    st.text(max_size=6),
)
json_values = st.recursive(
    scalars,
    lambda children: st.one_of(
        st.lists(children, max_size=5),
        st.dictionaries(st.sampled_from(FIELDS) | st.text(max_size=4), children, max_size=5),
    ),
    max_leaves=25,
)
entry = st.fixed_dictionaries(
    {"measure": st.one_of(st.integers(0, 9), scalars)},
    optional={
        "degrees": st.lists(st.integers(-5, 9) | scalars, max_size=6) | json_values,
        "voices": json_values,
        "bassOctave": st.one_of(st.integers(-3, 11), scalars),
        "bass_octave": scalars,
    },
)
completions_json = st.one_of(
    json_values.map(json.dumps),
    st.lists(entry, max_size=6).map(json.dumps),
    st.dictionaries(st.sampled_from(FIELDS), st.lists(entry, max_size=6), max_size=3).map(
        json.dumps
    ),
)
wrapped = st.builds(
    lambda pre, body, post, fence: (
        pre + (f"```{fence}\n{body}\n```" if fence is not None else body) + post
    ),
    st.text(max_size=20),
    completions_json,
    st.text(max_size=20),
    st.one_of(st.none(), st.sampled_from(["", "json", "JSON", "js", " json"])),
)
progressions = st.builds(
    lambda key, chords: {"key": key, "chords": chords},
    KEYS,
    st.lists(
        st.fixed_dictionaries({"measure": st.integers(0, 9), "chordSymbol": SYMBOLS}),
        min_size=0,
        max_size=8,
    ),
)
any_completion = st.one_of(st.text(max_size=200), completions_json, wrapped)


def check_invariants(result, progression):
    assert result.reward in (0.0, 1.0)
    assert result.admitted == (result.verdict == "admitted") == (result.reward == 1.0)
    assert list(result.failing_rules) == sorted(result.failing_rules)
    if not result.format_ok:
        assert (result.verdict, result.reward, result.opening) == ("structure", 0.0, "(none)")
    if result.verdict == "structure":
        assert result.failing_rules == ("structure",)
    assert result.sounding_frames <= len(progression["chords"])


@FUZZ
@given(text=any_completion)
def test_parser_never_raises(text):
    specs = parse_completion(text)
    assert all(spec.degrees for spec in specs)
    assert (opening_of(text) == "(none)") == (not specs)
    assert isinstance(signature_of(text), str)


@FUZZ
@given(
    progression=progressions,
    completion=any_completion,
    voices=st.integers(2, 4),
    style=st.sampled_from(STYLES),
)
def test_scorer_never_raises_and_keeps_invariants(progression, completion, voices, style):
    reference = score(progression, completion, voices, style, "reference")
    strict = score(progression, completion, voices, style, "strict")
    check_invariants(reference, progression)
    check_invariants(strict, progression)
    assert strict.reward <= reference.reward  # strict only takes reward away
    assert strict.format_ok == reference.format_ok
    assert strict.opening == reference.opening


@FUZZ
@given(text=st.text(alphabet=st.sampled_from('[]{}",:0123456789 `json\n-.eE'), max_size=120))
def test_bracket_and_fence_soup_never_raises(text):
    for checker in CHECKERS:
        check_invariants(score({"key": "C major", "chords": [{"measure": 1, "chordSymbol": "C"}]},
                               text, 2, "common-practice", checker), {"chords": [1]})


@settings(max_examples=500, deadline=None)
@given(
    text=st.lists(
        st.sampled_from(["`", "```", "json", "JSON", "jSoN", "js", " ", "\n", "\u00a0", "\ufeff",
                         "\x1c", "\u0085", "[1]", "x", "k", "\u212a"]),
        max_size=14,
    ).map("".join)
)
def test_fence_scan_matches_the_reference_pattern(text):
    from graders.voice_leading.parser import FENCE_PATTERN, find_fence

    match = FENCE_PATTERN.search(text)
    assert find_fence(text) == (match.group(1) if match else None)
