"""Every worked example of spec §14, verified against the reference there."""

from __future__ import annotations

import json

import pytest

from graders.voice_leading import parse_completion, render_frames, score


def prog(key: str, *symbols: str, start: int = 1) -> dict:
    return {
        "key": key,
        "chords": [{"measure": start + i, "chordSymbol": s} for i, s in enumerate(symbols)],
    }


def entries(*degree_lists, bass_octave: dict | None = None) -> str:
    out = []
    for i, degrees in enumerate(degree_lists, start=1):
        obj = {"measure": i, "degrees": list(degrees)}
        if bass_octave and i in bass_octave:
            obj["bassOctave"] = bass_octave[i]
        out.append(obj)
    return json.dumps(out)


def voices_of(progression: dict, completion: str, n: int) -> list[list[float]]:
    return [list(f.voices) for f in render_frames(progression, parse_completion(completion), n)]


CADENCE = prog("C major", "C", "F", "G7", "C")


def test_example_1_clean_four_voice_cadence():
    completion = (
        '[{"measure": 1, "degrees": [0, 1, 2, 0]}, {"measure": 2, "degrees": [2, 0, 1, 0]}, '
        '{"measure": 3, "degrees": [2, 0, 1, 1]}, {"measure": 4, "degrees": [0, 1, 1, 0]}]'
    )
    assert voices_of(CADENCE, completion, 4) == [
        [48, 52, 55, 60], [48, 53, 57, 65], [50, 55, 59, 71], [48, 52, 64, 72]
    ]
    r = score(CADENCE, completion, 4, "common-practice")
    assert (r.reward, r.format_ok, r.admitted, r.verdict) == (1.0, True, True, "admitted")
    assert r.failing_rules == ()
    assert (r.sounding_frames, r.expected_frames) == (4, 4)


EX2 = entries([0, 0], [0, 1], [0, 1], [1, 1])


def test_example_2_frames():
    assert voices_of(CADENCE, EX2, 2) == [[48, 60], [53, 57], [55, 59], [52, 64]]


@pytest.mark.parametrize(
    ("style", "reward", "verdict"),
    [
        ("common-practice", 0.0, "tendencyLeadingTone"),
        ("lead-sheet", 0.0, "tendencyLeadingTone"),
        ("film-ambient", 1.0, "admitted"),
    ],
)
def test_example_2_styles(style, reward, verdict):
    r = score(CADENCE, EX2, 2, style)
    assert (r.reward, r.verdict) == (reward, verdict)
    assert r.failing_rules == ("tendencyLeadingTone",)
    assert r.admitted == (verdict == "admitted")


def test_example_3_lead_sheet_forgives():
    p = prog("G major", "G", "Am7", "D7", "Gmaj7")
    c = entries([0, 0, 0], [0, 0, 0], [0, 0, 3], [0, 0, 2])
    assert voices_of(p, c, 3) == [[55, 67, 79], [57, 69, 81], [50, 62, 72], [55, 67, 74]]
    cp = score(p, c, 3, "common-practice")
    assert (cp.reward, cp.verdict) == (0.0, "parallels,tendencySeventh")
    ls = score(p, c, 3, "lead-sheet")
    assert (ls.reward, ls.verdict) == (1.0, "admitted")
    assert ls.failing_rules == ("parallels", "tendencySeventh")


EX4 = (
    "Sure \u2014 here it is:\n```json\n"
    '{"voicing": [{"bar": 2, "voices": [0, 2], "octave": "3"}, {"m": 3, "tones": [1, 3]}, '
    '{"measure": 4, "notes": [0, 3]}, {"measure": 5, "degrees": [0, 1]}]}\n```\nEnjoy!'
)


def test_example_4_parser_tolerance():
    p = {
        "key": "A minor",
        "chords": [
            {"measure": 1, "chordSymbol": "N/C"},
            {"measure": 2, "chordSymbol": "Am"},
            {"measure": 3, "chordSymbol": "Bm7b5/F"},
            {"measure": 4, "chordSymbol": "E7"},
            {"measure": 5, "chordSymbol": "Am"},
        ],
    }
    specs = parse_completion(EX4)
    assert [(s.measure, s.degrees, s.bass_octave) for s in specs] == [
        (2, (0, 2), 3), (3, (1, 3), None), (4, (0, 3), None), (5, (0, 1), None)
    ]
    assert voices_of(p, EX4, 2) == [[], [57, 64], [50, 57], [52, 62], [57, 60]]
    r = score(p, EX4, 2, "common-practice")
    assert (r.reward, r.format_ok, r.verdict) == (0.0, True, "parallels,hidden,tendencySeventh")
    assert (r.sounding_frames, r.expected_frames) == (4, 4)
    assert r.failing_rules == ("hidden", "parallels", "tendencySeventh")


def test_example_5_wrapping_padding_rounding():
    p = prog("E minor", "Em", "B7", "Em")
    c = (
        '[{"measure":1,"degrees":[5]},{"measure":2,"degrees":[-1, 9, 2.5, 0, 1]},'
        '{"measure":3,"degrees":["2"], "bassOctave": null}]'
    )
    assert voices_of(p, c, 4) == [[59, 67, 71, 76], [57, 63, 69, 71], [59, 67, 71, 76]]
    r = score(p, c, 4)
    assert (r.reward, r.verdict) == (0.0, "parallels,tendencySeventh")


def test_example_6_out_of_vocabulary_chord():
    p = prog("D major", "D", "Bm7", "Em9b5", "A7")
    r = score(p, entries([0, 1], [0, 1], [0, 1], [0, 1]), 2)
    assert (r.verdict, r.failing_rules, r.reward) == ("structure", ("structure",), 0.0)
    assert (r.sounding_frames, r.expected_frames) == (3, 4)


def test_example_6_lost_prefix():
    c = (
        '{"measure": 2, "degrees": [2, 1]}, {"measure": 3, "degrees": [0, 3]}, '
        '{"measure": 4, "degrees": [0, 1]}]'
    )
    r = score(CADENCE, c, 2)
    assert (r.format_ok, r.sounding_frames, r.expected_frames) == (False, 0, 4)
    assert (r.verdict, r.reward, r.opening) == ("structure", 0.0, "(none)")


def test_example_6_bracket_in_prose():
    c = "Voicing [bass first]: " + EX2
    assert score(CADENCE, EX2, 2, "film-ambient").reward == 1.0
    r = score(CADENCE, c, 2, "film-ambient")
    assert (r.format_ok, r.verdict, r.reward) == (False, "structure", 0.0)


def test_example_7_fractional_octave():
    p = prog("C major", "G7")
    c = '[{"measure":1,"degrees":[1,1,1],"bassOctave":-1.9}]'
    assert voices_of(p, c, 3) == [[0.20000000000000107, 10.999999999999998, 23]]
    r = score(p, c, 3)
    assert (r.verdict, r.reward) == ("chordMembership,spacing", 0.0)


def test_example_7_extreme_octave():
    c = entries([0, 0], [0, 1], [0, 1], [1, 1], bass_octave={1: 10})
    assert voices_of(CADENCE, c, 2)[0] == [127, 127]
    r = score(CADENCE, c, 2, "film-ambient")
    assert (r.verdict, r.reward) == ("overlap,leap,tendencyLeadingTone", 0.0)


def test_example_8_all_no_chord_is_free_reward():
    p = prog("C major", "N/C", "N/C")
    r = score(p, '[{"measure": 9, "degrees": [0]}]', 2)
    assert (r.format_ok, r.sounding_frames, r.expected_frames) == (True, 0, 0)
    assert (r.reward, r.verdict) == (1.0, "admitted")


def test_example_9_sixth_counted_as_seventh():
    p = prog("C major", "C6", "F")
    c = entries([0, 3], [0, 2])
    assert voices_of(p, c, 2) == [[48, 57], [53, 60]]
    assert score(p, c, 2).verdict == "hidden,tendencySeventh"


@pytest.mark.parametrize(
    ("key", "verdict"),
    [("Bb major", "hidden,overlap,tendencyLeadingTone"), ("BB major", "hidden,overlap")],
)
def test_example_10_key_spelling(key, verdict):
    p = prog(key, "Bb", "F7", "Bb")
    c = entries([0, 1], [2, 1], [0, 2])
    assert voices_of(p, c, 2) == [[58, 62], [48, 57], [58, 65]]
    assert score(p, c, 2).verdict == verdict


def test_example_11_rest_between_chords():
    p = prog("C major", "C", "N/C", "G")
    c = '[{"measure":1,"degrees":[0,2]},{"measure":3,"degrees":[0,1]}]'
    assert voices_of(p, c, 2) == [[48, 55], [], [55, 59]]
    r = score(p, c, 2)
    assert (r.reward, r.verdict, r.sounding_frames, r.expected_frames) == (1.0, "admitted", 2, 2)
