"""Hypothesis fuzzing: the parser and the scorer never raise, and the score's invariants hold."""

from __future__ import annotations

import json

import pytest
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


# --- Python's own limits (issue 11): every one of them must stay inside score() ---------------
# Int-string conversion (4300 digits), float overflow, the recursion limit, long strings and
# arrays, JSON \u escapes of lone surrogates and raw surrogates in the str itself.

CADENCE = {"key": "C major", "chords": [{"measure": m, "chordSymbol": s}
                                        for m, s in enumerate(["C", "F", "G7", "C"], start=1)]}
HUGE_DIGITS = st.integers(4290, 6000).map(lambda n: "7" * n)
huge_numbers = st.one_of(
    HUGE_DIGITS,  # an integer literal over the int-string limit
    HUGE_DIGITS.map(lambda d: "-" + d),
    HUGE_DIGITS.map(lambda d: "0." + d),
    HUGE_DIGITS.map(lambda d: d + ".5e-" + d),
    st.sampled_from(["1e999999999999999999999", "-1e-999999999999999999", "1e308", "-1.8e308",
                     "4e-324", "2.5e-320", "9007199254740993", "-0", "1E+400"]),
)
number_strings = st.one_of(  # JSON strings that Number() coerces
    HUGE_DIGITS.map(lambda d: json.dumps(d)),
    HUGE_DIGITS.map(lambda d: json.dumps("0x" + d)),
    HUGE_DIGITS.map(lambda d: json.dumps("0b" + "1" * len(d))),
    st.sampled_from(['"1e400"', '"-Infinity"', '" 0o7 "', '"\\u00a01\\ufeff"']),
)
escapes = st.one_of(  # \u escapes, surrogates (paired, lone, reversed) included
    st.integers(0, 0xFFFF).map(lambda c: f"\\u{c:04x}"),
    st.sampled_from(["\\ud800", "\\udfff", "\\udc00\\ud800", "\\ud83c\\udfb5", "\\u0000"]),
)
raw_chars = st.characters(blacklist_categories=())  # surrogates included
scalar_text = st.one_of(huge_numbers, number_strings,
                        st.lists(escapes, max_size=4).map(lambda e: '"' + "".join(e) + '"'))


def _entry(measure: str, degrees: list[str], octave: str | None, key: str | None) -> str:
    fields = [f'"measure": {measure}', f'"degrees": [{", ".join(degrees)}]']
    if octave is not None:
        fields.append(f'"bassOctave": {octave}')
    if key is not None:
        fields.append(f'"{key}": 1')
    return "{" + ", ".join(fields) + "}"


extreme_entries = st.builds(
    _entry,
    st.one_of(st.integers(1, 4).map(str), scalar_text),
    st.lists(st.one_of(st.integers(-3, 9).map(str), scalar_text), min_size=1, max_size=5),
    st.one_of(st.none(), st.integers(-2, 9).map(str), scalar_text),
    st.one_of(st.none(), HUGE_DIGITS, st.lists(escapes, max_size=3).map("".join)),
)
extreme_json = st.one_of(
    st.lists(extreme_entries, min_size=1, max_size=6).map(lambda es: "[" + ", ".join(es) + "]"),
    st.builds(lambda key, es: f'{{"{key}": [{", ".join(es)}]}}',  # the issue's own shape
              st.one_of(HUGE_DIGITS, st.lists(escapes, max_size=3).map("".join)),
              st.lists(extreme_entries, min_size=1, max_size=4)),
)
nesting = st.builds(  # at and far past the recursion limit, also inside an entry
    lambda depth, opener, inner, where: where.format(
        opener * depth + inner + {"[": "]", '{"a": ': "}"}[opener] * depth),
    st.sampled_from([500, 990, 1000, 1010, 5000, 100_000]),
    st.sampled_from(["[", '{"a": ']),
    st.sampled_from(["", "1", '{"measure": 1, "degrees": [0, 1]}']),
    st.sampled_from(["{}", '[{{"measure": 1, "degrees": {}}}]',
                     '[{{"measure": {}, "degrees": [0, 1]}}]', "```json\n{}\n```"]),
)
bulk = st.builds(  # long strings and arrays
    lambda n, unit, where: where.format(unit * n),
    st.sampled_from([10_000, 200_000]),
    st.sampled_from(["a", "\\ud800", "\U0001f3b5", "0,", '{"measure": 1, "degrees": [0, 1]},']),
    st.sampled_from(['"{}"', "[{}1]", '[{{"measure": 1, "degrees": [{}1]}}]', "```{}", "{}"]),
)
any_str = st.one_of(
    extreme_json, nesting, bulk,
    st.text(alphabet=raw_chars, max_size=200),
    st.builds(lambda pre, body: pre + body, st.text(alphabet=raw_chars, max_size=8), extreme_json),
)


@settings(max_examples=300, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(text=any_str, voices=st.integers(2, 4))
def test_score_never_raises_past_pythons_limits(text, voices):
    reference = score(CADENCE, text, voices, "common-practice", "reference")
    strict = score(CADENCE, text, voices, "common-practice", "strict")
    check_invariants(reference, CADENCE)
    check_invariants(strict, CADENCE)
    assert strict.reward <= reference.reward
    assert isinstance(signature_of(text), str)


@pytest.mark.parametrize("text", [
    '{"' + "1" * 5000 + '": [{"measure": 1, "degrees": [0, 2]}]}',  # issue 11's completion
    '[{"measure": 1, "degrees": [0, 2], "' + "9" * 4301 + '": 0}]',
    "[" * 100_000 + "]" * 100_000,
    '[{"measure": 1, "degrees": ' + "[" * 100_000 + "]" * 100_000 + "}]",
    '[{"measure": "\\ud800", "degrees": ["\\udc00", 2]}]',
    '\ud800[{"measure": 1, "degrees": [0, 2]}]',
])
def test_score_never_raises_on_the_known_limits(text):
    for checker in CHECKERS:
        check_invariants(score(CADENCE, text, 2, "common-practice", checker), CADENCE)


def test_a_key_past_the_int_string_limit_is_an_ordinary_key():
    entries = [{"measure": m, "degrees": d} for m, d in [(1, [0, 0]), (2, [0, 1]), (3, [0, 1]),
                                                          (4, [1, 1])]]
    plain = score(CADENCE, json.dumps({"voicing": entries}), 2, "film-ambient")
    keyed = score(CADENCE, json.dumps({"1" * 5000: entries}), 2, "film-ambient")
    assert plain.verdict == keyed.verdict == "admitted"
