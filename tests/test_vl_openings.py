"""Openings, the opening alphabet and forced prefixes (spec §13.1-13.3) and the prompt (§5)."""

from __future__ import annotations

import json
from itertools import product

import pytest

from graders.voice_leading import (
    build_messages,
    forced_prefix,
    named_chord_count,
    opening_alphabet,
    opening_of,
    parse_completion,
    score,
    signature_of,
)


def prog(key: str, *symbols: str, measures=None) -> dict:
    measures = measures or range(1, len(symbols) + 1)
    chords = [{"measure": m, "chordSymbol": s} for m, s in zip(measures, symbols)]
    return {"key": key, "chords": chords}


@pytest.mark.parametrize(
    ("degrees", "opening"),
    [
        ("[0, 1]", "0,1"),
        ("[2, 2]", "2,2"),
        ("[1.5, 3]", "1.5,3"),
        ("[5]", "5"),
        ("[0, 1, 2, 0]", "0,1,2,0"),
        ("[-0, 1.0]", "0,1"),
        ('["2", " 1 "]', "2,1"),
        ("[12345678901234567891]", "12345678901234567000"),
        ("[1e21, 1e-7, 0.000001]", "1e+21,1e-7,0.000001"),
        ("[1e400, 3]", "3"),
    ],
)
def test_opening_formatting(degrees, opening):
    assert opening_of('[{"measure": 7, "degrees": ' + degrees + "}]") == opening


def test_opening_is_the_first_parsed_entry_whatever_its_measure():
    c = '[{"measure": 4, "degrees": [2, 2]}, {"measure": 1, "degrees": [0, 1]}]'
    assert opening_of(c) == "2,2"
    assert opening_of("no json here") == "(none)"
    assert opening_of('[{"measure": 1}, {"m": 2, "tones": [3, 1]}]') == "3,1"


def test_opening_none_exactly_when_format_fails():
    p = prog("C major", "C")
    texts = ["", "[]", "[1, 2]", '[{"measure": 1, "degrees": [0]}]',
             '{"x": [{"bar": null, "notes": [1]}]}']
    for c in texts:
        assert (opening_of(c) == "(none)") == (not score(p, c).format_ok)


def test_signature_collides_by_design():
    a = '[{"measure": 1, "degrees": [1, 12]}, {"measure": 2, "degrees": [0, 1]}]'
    b = '[{"measure": 1, "degrees": [11, 2]}, {"measure": 2, "degrees": [0, 1]}]'
    assert signature_of(a) == signature_of(b) == "112|01"
    assert signature_of("nothing") == ""


@pytest.mark.parametrize(("voices", "size"), [(2, 16), (3, 64), (4, 256)])
def test_alphabet_is_complete_for_an_in_vocabulary_first_chord(voices, size):
    p = prog("A minor", "N/C", "Am", "Dm", "E7", measures=[1, 2, 3, 4])
    alphabet = opening_alphabet(p, voices)
    assert len(alphabet) == size
    assert alphabet == list(product(range(4), repeat=voices))  # first voice varies slowest
    head = [(0,) * (voices - 1) + (d,) for d in range(4)] + [(0,) * (voices - 2) + (1, 0)]
    assert alphabet[:5] == head


def test_alphabet_empty_cases():
    assert opening_alphabet(prog("C major", "N/C", ""), 2) == []
    assert opening_alphabet(prog("C major", "Cmaj", "G"), 2) == []  # first named chord OOV
    # an earlier N/C chord sharing the first named chord's measure: the lookup finds the rest
    assert opening_alphabet(prog("C major", "N/C", "C", measures=[1, 1]), 2) == []


def test_alphabet_max_degree():
    assert len(opening_alphabet(prog("C major", "C"), 2, max_degree=4)) == 25


def test_forced_prefix_string():
    p = prog("A minor", "N/C", "Am", "E7", measures=[1, 2, 3])
    prefix = forced_prefix(p, (0, 2))
    assert prefix == '[{"measure": 2, "degrees": [0, 2]},'
    assert forced_prefix(prog("C major", "C", measures=[2.5]), (1, 0, 3)) == (
        '[{"measure": 2.5, "degrees": [1, 0, 3]},'
    )
    # a model continuing the prefix produces a parseable answer
    assert parse_completion(prefix + ' {"measure": 3, "degrees": [1, 1]}]')[0].degrees == (0.0, 2.0)


def test_forced_prefix_needs_a_named_chord():
    with pytest.raises(ValueError, match="named chord"):
        forced_prefix(prog("C major", "N/C"), (0, 1))


def test_named_chord_count():
    p = prog("C major", "N/C", "", "n/c", " N/C", " ", "Cmaj", "C")
    assert named_chord_count(p) == 5


# ---- prompt (§5) ------------------------------------------------------------------------------

@pytest.mark.parametrize("voices", [2, 3, 4])
def test_system_message_layout(voices):
    system = build_messages(prog("C major", "C"), voices)[0]
    assert system["role"] == "system"
    lines = system["content"].split("\n")
    assert len(lines) == 18
    assert [i + 1 for i, line in enumerate(lines) if line == ""] == [5, 12, 16]
    assert f"exactly {voices} voices" in lines[1]
    assert f"array of {voices} such numbers" in lines[7]
    assert "\u2014" in lines[2] and "\u2026" in lines[8]
    assert [line[:2] for line in lines[8:11]] == ["- ", "- ", "- "]
    example = json.loads(lines[17])  # always the 4-voice example
    assert example == [{"measure": 1, "degrees": [0, 1, 2, 0], "bassOctave": 3},
                       {"measure": 2, "degrees": [2, 0, 1, 2]}]
    assert '", "' not in lines[17] and '": ' in lines[17] and ", " in lines[17]
    assert not system["content"].endswith("\n")


def test_user_message_matches_the_rendered_example():
    p = {"key": "A minor", "chords": [
        {"measure": 1, "chordSymbol": "N/C"}, {"measure": 2, "chordSymbol": "Am"},
        {"measure": 3, "chordSymbol": "Bm7b5/F"}, {"measure": 4, "chordSymbol": "E7"},
        {"measure": 5, "chordSymbol": "Am"},
    ]}
    user = build_messages(p, 3)[1]
    assert user["role"] == "user"
    lines = user["content"].split("\n")
    assert lines[0] == (
        "# Voice this progression in A minor \u2014 3 voices per chord, bass to soprano."
    )
    assert lines[1:4] == ["", "| Measure | Chord |", "|---------|-------|"]
    assert lines[4:9] == [
        "| 1 | N/C |", "| 2 | Am |", "| 3 | Bm7b5/F |", "| 4 | E7 |", "| 5 | Am |"
    ]
    assert lines[9] == ""
    assert lines[10] == (
        'Return one JSON object per measure above with its "degrees" '
        "(3 chord-note numbers, low\u2192high)."
    )
    assert len(lines) == 11


def test_user_message_is_verbatim():
    p = {"key": " weird | key ", "chords": [{"measure": 2.5, "chordSymbol": " C|x "},
                                             {"measure": 3.0, "chordSymbol": ""}]}
    lines = build_messages(p, 2)[1]["content"].split("\n")
    assert lines[0].startswith("# Voice this progression in  weird | key  \u2014 2 voices")
    assert lines[4:6] == ["| 2.5 |  C|x  |", "| 3 |  |"]


def test_user_message_prints_missing_and_null_like_javascript():
    p = {"chords": [{"measure": None, "chordSymbol": ["A", "m"]}, {}]}
    lines = build_messages(p, 2)[1]["content"].split("\n")
    assert lines[0].startswith("# Voice this progression in undefined \u2014 2 voices")
    assert lines[4:6] == ["| null | A,m |", "| undefined | undefined |"]
