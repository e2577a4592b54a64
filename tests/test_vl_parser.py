"""The tolerant completion parser: every verified example of spec §6.5 plus §6.1 fence forms."""

from __future__ import annotations

import json

import pytest

from graders.voice_leading import parse_completion

ARRAY = '[{"measure":1,"degrees":[0,1]}]'
ONE = [(1.0, (0.0, 1.0), None)]


def parsed(text: str) -> list[tuple]:
    return [(e.measure, e.degrees, e.bass_octave) for e in parse_completion(text)]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (ARRAY, ONE),
        ("```json\n" + ARRAY + "\n```", ONE),
        ("```JSON " + ARRAY + "```", ONE),
        ("```Json\n" + ARRAY + "\n```", ONE),
        ("```\n" + ARRAY + "\n```", ONE),
        ("```json" + ARRAY + "```", ONE),
        ("``` json\n" + ARRAY + "\n```", []),
        ("```js\n" + ARRAY + "\n```", []),
        ("```jsonc\n" + ARRAY + "\n```", []),
        ("```json\n" + ARRAY + "\nDone.\n```", []),
        ("```json\n" + ARRAY, ONE),  # no closing fence: bracket search
        ("Here: " + ARRAY + " ok", ONE),
        ("Voicing [bass first]: " + ARRAY, []),
        ("Using [0, 1, 2]: " + ARRAY, []),
        ('{"measure": 2, "degrees": [2, 1]}, {"measure": 3, "degrees": [0, 3]}]', []),
        ('{"voicings":' + ARRAY + "}", ONE),
        ('{"draft":[],"final":' + ARRAY + "}", []),
        ('{"voicing":' + ARRAY + ',"7":[1,2]}', []),
        ('{"result":{"voicings":' + ARRAY + "}}", []),
        (json.dumps(ARRAY), []),  # a JSON string literal holding the array
        ('[{"measure":1,"degrees":[0,1],},]', []),
        ('[{"measure":1,"degrees":[NaN,1]}]', []),
        ("```json\nnot json\n```\n" + ARRAY, []),  # a bad fence disables the bracket fallback
        ("```json\nnope\n```\n```json\n" + ARRAY + "\n```", []),
        ("", []),
        ("   \n\t", []),
        ("null", []),
        ("42", []),
        ("{}", []),
        ('[{"measure":1,"degrees":[0,1],"note":"]"}]', ONE),  # whole text parses first
        ('x [{"measure":1,"degrees":[0,1],"note":"]"}]', []),  # bracket search ends early
        ("\u00a0" + ARRAY, ONE),  # not JSON whitespace -> bracket search
    ],
)
def test_find_value_and_entry_list(text, expected):
    assert parsed(text) == expected


def test_alias_and_coercion_example():
    text = '[{"m":"2","voices":["0"," 1 ",null,true,"x",[2],"0x3",""]}]'
    assert parsed(text) == [(2.0, (0.0, 1.0, 0.0, 1.0, 2.0, 3.0, 0.0), None)]


def test_bar_array_and_non_array_degrees():
    text = '[{"bar":[3],"tones":[1.5,-1]},{"measure":4,"notes":"0 1"}]'
    assert parsed(text) == [(3.0, (1.5, -1.0), None)]


def test_null_falls_through_but_non_null_does_not():
    text = ('[{"measure":null,"m":5,"degrees":null,"voices":[2]},'
            '{"measure":6,"degrees":"x","voices":[1]}]')
    assert parsed(text) == [(5.0, (2.0,), None)]


def test_measure_coercions():
    text = (
        '[{"measure":"","degrees":[0]},{"measure":true,"degrees":[0]},'
        '{"bar":null,"degrees":[0]}]'
    )
    assert [m for m, _, _ in parsed(text)] == [0.0, 1.0, 0.0]


def test_measure_null_without_bar_is_missing():
    assert parsed('[{"measure":null,"degrees":[0]}]') == []
    assert parsed('[{"measure":null,"m":null,"degrees":[0]}]') == []


@pytest.mark.parametrize(
    ("fields", "octave"),
    [
        ('"bassOctave": null', None),
        ('"bassOctave": null, "bass_octave": null', 0.0),
        ('"octave": "4"', 4.0),
        ('"bassOctave": ""', 0.0),
        ('"bassOctave": "high"', None),
        ('"bassOctave": 2.5', 2.5),
        ('"bassOctave": 1e400', None),
        ('"bassOctave": [5]', 5.0),
        ('"bassOctave": "x", "octave": 4', None),  # first non-null alias wins even if NaN
    ],
)
def test_bass_octave_forms(fields, octave):
    assert parsed('[{"measure": 1, "degrees": [0], ' + fields + "}]") == [(1.0, (0.0,), octave)]


def test_invalid_entries_dropped():
    text = ('[{"measure":1,"degrees":[]},{"measure":2},[1,2],7,null,'
            '{"measure":"Infinity","degrees":[0]},{"measure":1e400,"degrees":[0]}]')
    assert parsed(text) == []


def test_big_and_negative_zero_degrees():
    (entry,) = parse_completion('[{"measure":1,"degrees":[12345678901234567891, 1e400, -0]}]')
    assert entry.degrees == (12345678901234567168.0, 0.0)
    assert entry.measure == 1.0


def test_duplicates_kept_in_order():
    text = '[{"measure":1,"degrees":[0,1]},{"measure":1,"degrees":[2,2]}]'
    assert parsed(text) == [(1.0, (0.0, 1.0), None), (1.0, (2.0, 2.0), None)]


def test_non_finite_degrees_filtered():
    assert parsed('[{"measure":1,"degrees":["Infinity", "nan", 2]}]') == [(1.0, (2.0,), None)]


def test_non_string_completion_is_unparseable():
    assert parse_completion(None) == ()  # type: ignore[arg-type]


# ---- the typed flag behind the strict checker ------------------------------------------------

@pytest.mark.parametrize(
    "entry",
    [
        '{"measure":"1","degrees":[0,1]}',
        '{"measure":true,"degrees":[0,1]}',
        '{"bar":null,"degrees":[0,1]}',
        '{"measure":[1],"degrees":[0,1]}',
        '{"measure":1,"degrees":["0",1]}',
        '{"measure":1,"degrees":[0,null]}',
        '{"measure":1,"degrees":[0,false]}',
        '{"measure":1,"degrees":[0,1.5]}',
        '{"measure":1,"degrees":[0,[1]]}',
        '{"measure":1,"degrees":[0,1e400]}',
        '{"measure":1,"degrees":[0,"x"]}',
        '{"measure":1,"degrees":[0,1],"bassOctave":3.1}',
        '{"measure":1,"degrees":[0,1],"bassOctave":"3"}',
        '{"measure":1,"degrees":[0,1],"bassOctave":1e400}',
        '{"measure":1,"degrees":[0,1],"bassOctave":"high"}',
        '{"measure":1,"degrees":[0,1],"bass_octave":null}',
        '{"measure":1,"degrees":[0,1],"bass_octave":false}',
    ],
)
def test_coerced_entries_are_untyped(entry):
    (parsed_entry,) = parse_completion("[" + entry + "]")
    assert parsed_entry.typed is False


@pytest.mark.parametrize(
    "entry",
    [
        '{"measure":1,"degrees":[0,1]}',
        '{"measure":2.5,"degrees":[0,1.0,-1,12345678901234567891]}',
        '{"bar":2,"voices":[0,1],"octave":4}',
        '{"measure":3,"degrees":[2,0],"bassOctave":null}',
        '{"measure":3,"degrees":[2,0],"bassOctave":-1.0,"junk":"x"}',
    ],
)
def test_plain_entries_are_typed(entry):
    (parsed_entry,) = parse_completion("[" + entry + "]")
    assert parsed_entry.typed is True


def test_unclosed_fence_with_a_long_whitespace_run():
    # A backtracking regex is quadratic here (minutes for this input); the scan is linear.
    text = "```json" + " " * 300_000 + ARRAY
    assert parsed(text) == ONE  # no closing fence: the bracket search finds the array
    assert parsed("```json" + " " * 300_000 + ARRAY + "```") == ONE
