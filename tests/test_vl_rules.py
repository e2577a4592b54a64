"""Every verifier rule (spec §9) on hand-worked frames, and every style preset (§10)."""

from __future__ import annotations

import pytest

from graders.voice_leading import RULES, STYLES, Frame, verify
from graders.voice_leading.rules import HARD_FLOOR, STYLE_RELAXED


def frames(*chords) -> list[Frame]:
    """chords: (symbol, voices) pairs; measures numbered from 1."""
    return [
        Frame(i + 1, sym, tuple(float(v) for v in voices)) for i, (sym, voices) in enumerate(chords)
    ]


def failing(*chords, key: str = "C major", n: int = 2) -> tuple[str, ...]:
    return verify(frames(*chords), key, "common-practice", n).failing


def test_canonical_order_and_no_crossing_rule_ever():
    assert RULES[0] == "structure" and RULES[-1] == "tendencyLeadingTone"
    # Voices are ranked by pitch, so written crossings are simply re-sorted.
    assert failing(("C", (60, 48)), ("C", (64, 55))) == ()
    assert "crossing" not in failing(("C", (72, 48, 60)), ("C", (52, 76, 43)), n=3)


# ---- per-frame rules ------------------------------------------------------------------------

def test_structure_counts_voices():
    assert failing(("C", (48, 52, 55))) == ("structure",)
    assert failing(("C", (48, 52))) == ()


def test_chord_membership():
    assert failing(("C", (48, 61))) == ("chordMembership",)
    assert failing(("C", (49.199999999999996, 55))) == ("chordMembership",)  # fractional pitch
    assert failing(("C", (127, 127))) == ()  # 127 is G, a tone of C
    assert failing(("Cmaj", (48, 61))) == ()  # out-of-vocabulary symbols are not checked


def test_spacing_upper_voices_only():
    assert failing(("C", (48, 52, 67)), n=3) == ("spacing",)  # 15 between ranks 1 and 2
    assert failing(("C", (36, 52, 64)), n=3) == ()  # bass gap exempt, exactly 12 allowed
    assert failing(("C", (24, 67))) == ()  # N = 2: nothing to compare
    assert failing(("C", (48, 52, 55, 72)), n=4) == ("spacing",)  # ranks 2-3


# ---- between-frame rules --------------------------------------------------------------------

def test_leap_upper_voices_only():
    assert failing(("C", (48, 64)), ("Am", (45, 81))) == ("leap",)
    assert failing(("C", (48, 64)), ("C7", (48, 76))) == ()  # exactly an octave
    assert failing(("C", (48, 67)), ("Em", (64, 67))) == ()  # the bass is exempt


@pytest.mark.parametrize(
    ("a", "b"),
    [
        ((48, 55), (50, 57)),  # fifth -> fifth
        ((48, 60), (50, 62)),  # octave -> octave
        ((36, 55), (38, 69)),  # twelfth -> nineteenth: compound intervals fold; different amounts
        ((60, 67), (59, 66)),  # both down
    ],
)
def test_parallels_detected(a, b):
    assert "parallels" in failing(("X1", a), ("X2", b))


@pytest.mark.parametrize(
    ("a", "b"),
    [
        ((48, 55), (48, 55)),  # nothing moves
        ((48, 55), (48, 60)),  # oblique
        ((48, 55), (43, 62)),  # contrary motion
        ((48, 55), (50, 58)),  # fifth -> sixth
        ((48, 54), (50, 56)),  # tritone is not perfect
    ],
)
def test_parallels_not_detected(a, b):
    assert "parallels" not in failing(("X1", a), ("X2", b))


def test_parallels_any_pair_including_unison_and_non_adjacent():
    # the unison rises by 2 onto 57, above where the top voice was: overlap too
    assert failing(("C", (48, 55, 55)), ("D", (50, 57, 57)), n=3) == ("parallels", "overlap")
    assert failing(("C", (48, 52, 60)), ("Dm", (50, 53, 62)), n=3) == ("parallels",)


def test_hidden_outer_voices_with_top_leap():
    assert failing(("C", (48, 64)), ("D", (50, 69))) == ("hidden",)
    # a true parallel fifth with a top move of 3+ fails both rules
    assert failing(("C", (48, 55)), ("Eb", (51, 58))) == ("parallels", "hidden")
    # top moves by step (2): never hidden
    assert failing(("C", (48, 67)), ("D", (50, 69))) == ("parallels",)
    # contrary motion into an octave: not hidden
    assert failing(("C", (48, 64)), ("G", (43, 67))) == ()
    # inner voices are ignored: only ranks 0 and n-1
    assert "hidden" not in failing(("C", (36, 48, 64)), ("G", (35, 55, 62)), n=3)


def test_overlap():
    assert failing(("C", (48, 55)), ("Am", (57, 60))) == ("overlap",)  # lower rises above
    assert failing(("C", (48, 55)), ("G", (43, 47))) == ("overlap",)  # upper falls below
    assert failing(("C", (48, 55)), ("G", (55, 59))) == ()  # landing exactly is allowed


def test_rests_are_skipped_between_frames():
    fs = frames(("C", (48, 55)), ("N/C", ()), ("D", (50, 57)))
    assert verify(fs, "C major", "common-practice", 2).failing == ("parallels",)


def test_mixed_voice_counts_skip_motion_rules():
    assert failing(("C", (48, 55)), ("D", (50, 57, 62))) == ("structure",)


def test_tendency_seventh():
    assert failing(("G7", (55, 65)), ("C", (48, 64))) == ()  # F -> E, step down
    assert failing(("G7", (55, 65)), ("C", (48, 67))) == ("tendencySeventh",)  # F -> G, up
    assert failing(("G7", (55, 65)), ("Dm", (50, 65))) == ()  # held into a chord holding F
    assert failing(("G7", (55, 65)), ("C", (48, 65))) == ("chordMembership", "tendencySeventh")
    # F (53) resolves to 52 in another voice; the soprano B does not rise
    assert failing(("G7", (53, 59)), ("C", (48, 52))) == ("overlap", "tendencyLeadingTone")
    assert failing(("C6", (48, 57)), ("G", (43, 55))) == ()  # the sixth A steps down by 2
    assert failing(("G7", (55, 65)), ("C", (48, 76))) == ("tendencySeventh",)  # E up an octave


def test_tendency_rules_need_a_raw_symbol_change():
    assert failing(("G7", (55, 65)), ("G7", (55, 67))) == ()
    assert failing(("G7", (55, 65)), ("G7/B", (55, 67))) == ("tendencySeventh",)
    assert failing(("G7", (55, 65)), (" G7", (55, 67))) == ("tendencySeventh",)


def test_tendency_leading_tone():
    assert failing(("G", (55, 59)), ("C", (48, 60))) == ()
    assert failing(("G", (55, 59)), ("C", (48, 64))) == ("tendencyLeadingTone",)
    assert failing(("G", (55, 59)), ("Cm", (48, 63))) == ("tendencyLeadingTone",)  # quality ignored
    assert failing(("Bdim", (50, 59)), ("C", (52, 55))) == ("tendencyLeadingTone",)  # vii counts
    assert failing(("G", (43, 59, 62)), ("C", (48, 60, 64)), n=3) == ()  # inner LT: warning only
    assert failing(("G", (55, 59)), ("C", (48, 64)), key="C dorian") == ()  # unknown key
    assert failing(("G", (55, 59)), ("F", (53, 57))) == ()  # not going to the tonic


def test_leading_tone_in_minor_uses_raised_seventh():
    assert failing(("E7", (52, 56)), ("Am", (45, 60)), key="A minor") == ("tendencyLeadingTone",)
    assert failing(("E7", (52, 56)), ("Am", (45, 57)), key="A minor") == ()
    assert failing(("Em", (52, 55)), ("Am", (45, 60)), key="A minor") == ()  # no G#: no dominant


# ---- styles -----------------------------------------------------------------------------------

SINGLE_FAILURES = {
    "structure": (("C", (48, 52, 55)),),
    "chordMembership": (("C", (48, 61)),),
    "spacing": None,  # needs N = 3, below
    "parallels": (("C", (48, 55)), ("D", (50, 57))),
    "hidden": (("C", (48, 64)), ("D", (50, 69))),
    "overlap": (("C", (48, 55)), ("Am", (57, 60))),
    "leap": (("C", (48, 64)), ("Am", (45, 81))),
    "tendencySeventh": (("G7", (55, 65)), ("C", (48, 67))),
    "tendencyLeadingTone": (("G", (55, 59)), ("C", (48, 64))),
}


@pytest.mark.parametrize("style", STYLES)
@pytest.mark.parametrize("rule", [r for r in RULES if r != "crossing"])
def test_style_matrix(style, rule):
    if rule == "spacing":
        fs, n = frames(("C", (48, 52, 67))), 3
    else:
        fs, n = frames(*SINGLE_FAILURES[rule]), 2
    verdict = verify(fs, "C major", style, n)
    assert verdict.failing == (rule,)  # relaxed rules are still reported
    assert verdict.admitted == (rule in STYLE_RELAXED[style])


def test_style_presets():
    assert STYLES == ("common-practice", "lead-sheet", "film-ambient")
    assert STYLE_RELAXED["common-practice"] == frozenset()
    assert STYLE_RELAXED["lead-sheet"] == {"parallels", "tendencySeventh"}
    assert STYLE_RELAXED["film-ambient"] == {
        "parallels", "hidden", "tendencySeventh", "tendencyLeadingTone"
    }
    assert all(not (relaxed & HARD_FLOOR) for relaxed in STYLE_RELAXED.values())


def test_unknown_style_is_an_error():
    with pytest.raises(ValueError, match="jazz"):
        verify([], "C major", "jazz", 2)


def test_empty_realization_is_admitted_vacuously():
    assert verify([], "C major", "common-practice", 2).admitted


def test_memoised_results_do_not_leak_between_calls():
    # the same frames judged under different required voice counts, keys and strictness
    fs = frames(("G", (55, 59)), ("C", (48, 64)))
    assert verify(fs, "C major", "common-practice", 2).failing == ("tendencyLeadingTone",)
    assert verify(fs, "C major", "common-practice", 3).failing == (
        "structure", "tendencyLeadingTone"
    )
    assert verify(fs, "F major", "common-practice", 2).failing == ()
    clamped = [Frame(1, "C", (127.0, 127.0), True)]
    assert verify(clamped, "C major", "common-practice", 2).failing == ()
    strict = verify(clamped, "C major", "common-practice", 2, strict=True)
    assert strict.failing == ("chordMembership",)
    assert verify(clamped, "C major", "common-practice", 2).failing == ()
