"""Matching entries to chords (spec §7) and the renderer (§8, table §8.7)."""

from __future__ import annotations

import pytest

from graders.voice_leading import SpecEntry, parse_chord_symbol, render_frames
from graders.voice_leading.render import render_voicing


@pytest.mark.parametrize(
    ("symbol", "degrees", "octave", "n", "voices"),
    [
        ("C", (0, 1, 2, 0), None, 4, (48, 52, 55, 60)),
        ("F", (2, 0, 1, 0), None, 4, (48, 53, 57, 65)),
        ("G7", (2, 0, 1, 1), None, 4, (50, 55, 59, 71)),
        ("Em", (5,), None, 4, (59, 67, 71, 76)),
        ("B7", (-1, 9, 2.5, 0, 1), None, 4, (57, 63, 69, 71)),
        ("Bm7b5/F", (1, 3), 3, 2, (50, 57)),
        ("C", (0, 0), 10, 2, (127, 127)),
        ("C", (0, 2), 3.1, 2, (49.199999999999996, 55)),
        ("G7", (1, 1, 1), -1.9, 3, (0.20000000000000107, 10.999999999999998, 23)),
        ("C", (0,), -1, 2, (0, 4)),  # bassOctave -1 gives MIDI = pc
        ("C", (2,), -2, 2, (0, 4)),  # clamped to 0 (C), the upper voice stacks above it
        ("C", (0, 1, 2, 0), 3.5, 4, (54, 64, 67, 72)),
    ],
)
def test_rendering_table(symbol, degrees, octave, n, voices):
    rendered, _ = render_voicing(parse_chord_symbol(symbol), degrees, octave, n)
    assert rendered == voices


@pytest.mark.parametrize(
    ("symbol", "degrees", "n", "indices"),
    [
        ("C", (0,), 4, (0, 1, 2, 0)),
        ("C", (2,), 4, (2, 1, 2, 0)),
        ("C", (1, 1), 4, (1, 1, 2, 0)),
        ("C7", (3,), 4, (3, 1, 2, 3)),
        ("C", (3, 4, -1), 3, (0, 1, 2)),  # wrapping: 3 -> root, 4 -> third, -1 -> fifth
        ("C", (0.49999999999999994, -0.5, 1.5), 3, (0, 0, 2)),
        ("C", (1e300,), 2, (int(1e300 % 3), 1)),  # huge degrees are already integers
    ],
)
def test_padding_and_wrapping(symbol, degrees, n, indices):
    chord = parse_chord_symbol(symbol)
    rendered, _ = render_voicing(chord, degrees, None, n)
    expected, _ = render_voicing(chord, tuple(float(i) for i in indices), None, n)
    assert rendered == expected


def test_clamp_flag():
    chord = parse_chord_symbol("C")
    assert render_voicing(chord, (0, 0), 10, 2)[1] is True
    assert render_voicing(chord, (0, 0), 3, 2)[1] is False
    assert render_voicing(parse_chord_symbol("D"), (0, 0), -2, 2)[1] is True  # D at -10 -> 0
    assert render_voicing(chord, (0, 2), 9, 2) == ((120, 127), False)  # G9 is exactly 127
    assert render_voicing(parse_chord_symbol("G"), (0, 1), 9, 2) == ((127, 127), True)


def prog(*chords) -> dict:
    return {"key": "C major", "chords": [{"measure": m, "chordSymbol": s} for m, s in chords]}


def entry(measure, *degrees, octave=None) -> SpecEntry:
    return SpecEntry(float(measure), tuple(float(d) for d in degrees), octave)


def test_matching_last_entry_wins_and_order_is_irrelevant():
    p = prog((1, "C"), (2, "F"))
    frames = render_frames(p, [entry(2, 0, 1), entry(1, 0, 1), entry(1, 0, 2)], 2)
    assert [f.voices for f in frames] == [(48, 55), (53, 57)]


def test_no_chord_measures_and_missing_entries_are_rests():
    p = prog((1, "N/C"), (2, ""), (3, "C"), (4, "G"))
    frames = render_frames(p, [entry(1, 0), entry(2, 0), entry(3, 0, 1)], 2)
    assert [f.voices for f in frames] == [(), (), (48, 52), ()]


def test_fractional_measure_never_matches_and_negative_zero_does():
    p = prog((2, "C"), (0, "G"))
    frames = render_frames(p, [entry(2.5, 0, 1), SpecEntry(-0.0, (0.0, 1.0), None)], 2)
    assert [f.voices for f in frames] == [(), (55, 59)]


def test_repeated_measure_renders_both_chords_from_one_entry():
    p = prog((1, "C"), (1, "Am"))
    frames = render_frames(p, [entry(1, 0, 1)], 2)
    assert [f.voices for f in frames] == [(48, 52), (57, 60)]


def test_out_of_vocabulary_chord_is_a_rest():
    p = prog((1, "Cmaj"), (2, "n/c"))
    assert [f.voices for f in render_frames(p, [entry(1, 0), entry(2, 0)], 2)] == [(), ()]


def test_measures_may_start_anywhere_and_be_out_of_order():
    p = prog((9, "G"), (3, "C"))
    frames = render_frames(p, [entry(3, 0, 1), entry(9, 1, 2)], 2)
    assert [(f.measure, f.voices) for f in frames] == [(9, (59, 62)), (3, (48, 52))]
