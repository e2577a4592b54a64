"""Bridge scoring (spec §11) and the two checkers (README "Checker variants")."""

from __future__ import annotations

import json

import pytest

from graders.voice_leading import CHECKERS, STYLES, ScoreResult, score


def prog(key: str, *symbols: str) -> dict:
    chords = [{"measure": i + 1, "chordSymbol": s} for i, s in enumerate(symbols)]
    return {"key": key, "chords": chords}


def answer(*degree_lists, **extra_by_measure) -> str:
    out = []
    for i, degrees in enumerate(degree_lists, start=1):
        obj = {"measure": i, "degrees": list(degrees)}
        obj.update(extra_by_measure.get(f"m{i}", {}))
        out.append(obj)
    return json.dumps(out)


CADENCE = prog("C major", "C", "F", "G7", "C")


def test_result_shape_and_sorted_failing_rules():
    c = answer([0, 2], [0, 2], [0, 2], [0, 2])  # parallel fifths, top moves 3, 2, 3
    r = score(prog("C major", "C", "Eb", "F", "Ab"), c)
    assert isinstance(r, ScoreResult)
    assert r.verdict == "parallels,hidden"  # canonical order in the verdict
    assert r.failing_rules == ("hidden", "parallels")  # sorted alphabetically
    assert (r.reward, r.admitted, r.format_ok) == (0.0, False, True)
    assert (r.sounding_frames, r.expected_frames, r.voice_count) == (4, 4, 2)
    assert (r.first_measure, r.first_measure_ok, r.opening) == (1.0, True, "0,2")
    with pytest.raises(AttributeError):
        r.reward = 1.0  # type: ignore[misc]


def test_structure_hides_every_other_failure():
    c = answer([0, 1], [0, 1], [0, 1])  # measure 4 missing
    r = score(CADENCE, c)
    assert (r.verdict, r.failing_rules, r.reward) == ("structure", ("structure",), 0.0)
    assert (r.sounding_frames, r.expected_frames) == (3, 4)


def test_entries_for_missing_measures_still_count_for_format():
    r = score(CADENCE, '[{"measure": 42, "degrees": [0, 1]}]')
    assert (r.format_ok, r.verdict) == (True, "structure")
    assert (r.first_measure, r.first_measure_ok) == (42.0, False)


def test_first_measure_is_first_in_completion_order():
    c = json.dumps([{"measure": m, "degrees": [0, 1]} for m in (3, 1, 2, 4)])
    r = score(CADENCE, c)
    assert (r.first_measure, r.first_measure_ok, r.opening) == (3.0, False, "0,1")


def test_first_measure_ok_follows_the_first_named_chord():
    p = {"key": "C major", "chords": [{"measure": 1, "chordSymbol": "N/C"},
                                      {"measure": 2, "chordSymbol": "C"}]}
    assert score(p, '[{"measure": 2, "degrees": [0, 1]}]').first_measure_ok
    assert not score(p, '[{"measure": 1, "degrees": [0, 1]}]').first_measure_ok


def test_unparseable_is_structure_with_reward_zero():
    r = score(CADENCE, "I cannot do that.")
    assert (r.format_ok, r.verdict, r.reward, r.opening, r.first_measure, r.voice_count) == (
        False, "structure", 0.0, "(none)", None, None
    )


@pytest.mark.parametrize("completion", [None, 7, b"[]", ["x"]])
def test_non_string_completion_never_raises(completion):
    assert score(CADENCE, completion).verdict == "structure"  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kwargs", "bad"),
    [
        ({"voices": 1}, "1"),
        ({"voices": 5}, "5"),
        ({"voices": True}, "True"),
        ({"voices": "2"}, "'2'"),
        ({"style": "jazz"}, "jazz"),
        ({"checker": "lenient"}, "lenient"),
    ],
)
def test_bad_options_raise_value_error_naming_the_value(kwargs, bad):
    with pytest.raises(ValueError, match=bad):
        score(CADENCE, "[]", **kwargs)


def test_bad_progression_raises_value_error():
    with pytest.raises(ValueError, match="chords"):
        score({"key": "C major"}, "[]")


def test_public_constants():
    assert CHECKERS == ("reference", "strict")
    assert len(STYLES) == 3


def test_all_no_chord_reference_is_free_strict_is_not():
    p = prog("C major", "N/C", "")
    assert score(p, '[{"measure": 9, "degrees": [0]}]').reward == 1.0
    r = score(p, '[{"measure": 9, "degrees": [0]}]', checker="strict")
    assert (r.reward, r.verdict) == (0.0, "structure")


# ---- strict checker switches, each against the reference -------------------------------------

EX1 = [[0, 1, 2, 0], [2, 0, 1, 0], [2, 0, 1, 1], [0, 1, 1, 0]]


def both(progression, completion, voices=2, style="common-practice"):
    return (
        score(progression, completion, voices, style, "reference"),
        score(progression, completion, voices, style, "strict"),
    )


def test_strict_admits_the_clean_answer():
    ref, strict = both(CADENCE, answer(*EX1), 4)
    assert ref.reward == strict.reward == 1.0


@pytest.mark.parametrize(
    "coerced", ['"2"', "true", "null", "[2]", '""', "2.4"],
)
def test_strict_refuses_number_coercion(coerced):
    c = answer(*EX1).replace("[2, 0, 1, 0]", f"[{coerced}, 0, 1, 0]")
    ref, strict = both(CADENCE, c, 4)
    assert strict.verdict == "structure"
    assert ref.format_ok and strict.format_ok  # other entries still parse


def test_strict_refuses_fractional_bass_octave():
    p = prog("A minor", "Am")
    c = '[{"measure": 1, "degrees": [0, 2], "bassOctave": 3.25}]'  # bass 60 = C, a tone of Am
    ref, strict = both(p, c)
    assert (ref.reward, strict.reward, strict.verdict) == (1.0, 0.0, "structure")


def test_strict_counts_clamped_pitches_as_non_members():
    p = prog("C major", "C", "G", "Em", "C")  # every chord holds G = MIDI 127
    c = answer([0, 0], [0, 0], [0, 0], [0, 0], m1={"bassOctave": 10}, m2={"bassOctave": 10},
               m3={"bassOctave": 10}, m4={"bassOctave": 10})
    ref, strict = both(p, c)
    assert (ref.reward, ref.verdict) == (1.0, "admitted")
    assert (strict.reward, strict.verdict) == (0.0, "chordMembership")


def test_strict_requires_exactly_n_degrees():
    # renders exactly like Example 2: [1] pads to [1, 1], [0, 1, 3] is cut to [0, 1]
    c = answer([0, 0], [0, 1], [0, 1, 3], [1])
    ref, strict = both(CADENCE, c, 2, "film-ambient")
    assert (ref.reward, ref.verdict) == (1.0, "admitted")
    assert (strict.reward, strict.verdict) == (0.0, "structure")


def test_strict_requires_one_entry_per_measure():
    entries = json.loads(answer(*EX1))
    entries.insert(0, {"measure": 2, "degrees": [0, 0, 0, 0]})  # overwritten by the later entry
    c = json.dumps(entries)
    ref, strict = both(CADENCE, c, 4)
    assert ref.reward == 1.0
    assert (strict.reward, strict.verdict) == (0.0, "structure")


def test_strict_keeps_musical_quirks():
    # §15.3: the sixth of C6 still counts as a seventh under strict.
    p = prog("C major", "C6", "F")
    ref, strict = both(p, answer([0, 3], [0, 2]))
    assert ref.verdict == strict.verdict == "hidden,tendencySeventh"


# ---- the bridge's completion extraction (§2.3) ------------------------------------------------

def test_completion_from_messages():
    from graders.voice_leading import completion_from_messages

    msgs = [
        {"role": "system", "content": "s"},
        {"role": "assistant", "content": "first"},
        {"role": "user", "content": "u"},
        {"role": "assistant",
         "content": ["[{", {"type": "text", "text": '"measure": 1'}, {"type": "x"}, "}]"]},
        {"role": "user", "content": "later user turn"},
    ]
    assert completion_from_messages(msgs) == '[{"measure": 1}]'
    assert completion_from_messages("[1]") == "[1]"
    assert completion_from_messages([{"role": "user", "content": "x"}]) == ""
    assert completion_from_messages(None) == ""
    assert completion_from_messages([{"role": "assistant"}]) == ""
    # an assistant turn without usable content is skipped, like the reference's loop
    assert completion_from_messages(
        [{"role": "assistant", "content": "a"}, {"role": "assistant", "content": None}]
    ) == "a"
    parts = [{"text": 5.0}, {"text": None}, None, 7, {"text": [1.0, None]}, {"text": True}]
    assert completion_from_messages([{"role": "assistant", "content": parts}]) == "51,true"
