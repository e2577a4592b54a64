"""Key parsing (spec §3) and chord symbols / the 28-suffix vocabulary (§4)."""

from __future__ import annotations

import pytest

from graders.voice_leading import VOCABULARY, parse_chord_symbol, parse_key


@pytest.mark.parametrize(
    ("text", "tonic", "mode"),
    [
        ("c major", 0, "major"),
        ("A MINOR", 9, "minor"),
        ("F#  major", 6, "major"),
        ("Eb\tmajor", 3, "major"),
        (" G major ", 7, "major"),
        ("Cb major", 11, "major"),
        ("E# minor", 5, "minor"),
        ("B# major", 0, "major"),
        ("Fb major", 4, "major"),
        ("BB major", 11, "major"),  # upper-case B accidental is accepted and ignored
        ("EB minor", 4, "minor"),
        ("bb major", 10, "major"),
        ("Bb major", 10, "major"),
        ("d MiNoR", 2, "minor"),
        ("G\u00a0major", 7, "major"),  # JavaScript \s includes NBSP
        ("\ufeffA minor\u3000", 9, "minor"),
    ],
)
def test_keys_accepted(text, tonic, mode):
    key = parse_key(text)
    assert key is not None
    assert (key.tonic, key.mode) == (tonic, mode)
    assert key.leading_tone == (tonic + 11) % 12
    assert key.dominant == (tonic + 7) % 12


@pytest.mark.parametrize(
    "text",
    ["C maj", "Cmajor", "D dorian", "H minor", "", "C# b major", "C\u001cmajor", "C majorx",
     "Cbb major", "C\u266f major", "C major\nx", "\u212a major"],
)
def test_keys_rejected(text):
    assert parse_key(text) is None


def test_minor_key_uses_raised_seventh():
    key = parse_key("A minor")
    assert (key.leading_tone, key.dominant) == (8, 4)


def test_vocabulary_has_28_suffixes():
    assert len(VOCABULARY) == 28
    assert VOCABULARY["7sus4"] == VOCABULARY["sus4"]
    assert VOCABULARY["add9"] == (0, 4, 7, 2)


@pytest.mark.parametrize(
    ("symbol", "root", "tones", "seventh"),
    [
        ("C", 0, (0, 4, 7), None),
        ("Am", 9, (9, 0, 4), None),
        ("G7", 7, (7, 11, 2, 5), 5),
        ("Bb", 10, (10, 2, 5), None),
        ("Cb", 11, (11, 3, 6), None),
        ("E#", 5, (5, 9, 0), None),
        ("B#m", 0, (0, 3, 7), None),
        ("Fb", 4, (4, 8, 11), None),
        ("C/E", 0, (0, 4, 7), None),
        ("Am7/G", 9, (9, 0, 4, 7), 7),
        ("F/A/C", 5, (5, 9, 0), None),
        ("G/", 7, (7, 11, 2), None),
        ("C6/9", 0, (0, 4, 7, 9), 9),  # everything after the first slash is dropped
        ("C6", 0, (0, 4, 7, 9), 9),  # the sixth counts as the 'seventh'
        ("Am6", 9, (9, 0, 4, 6), 6),
        ("Cmaj7", 0, (0, 4, 7, 11), 11),
        ("CM7", 0, (0, 4, 7, 11), 11),
        ("C\u0394", 0, (0, 4, 7, 11), 11),
        ("C\u03947", 0, (0, 4, 7, 11), 11),
        ("Bm7b5", 11, (11, 2, 5, 9), 9),
        ("B\u00f87", 11, (11, 2, 5, 9), 9),
        ("B\u00f8", 11, (11, 2, 5, 9), 9),
        ("Amin7", 9, (9, 0, 4, 7), 7),
        ("C+", 0, (0, 4, 8), None),
        ("Caug", 0, (0, 4, 8), None),
        ("B\u00b0", 11, (11, 2, 5), None),
        ("Bdim", 11, (11, 2, 5), None),
        ("B\u00b07", 11, (11, 2, 5, 8), 8),
        ("Bdim7", 11, (11, 2, 5, 8), 8),
        ("G7sus4", 7, (7, 0, 2), None),  # the seventh is dropped
        ("Csus2", 0, (0, 2, 7), None),
        ("Cadd9", 0, (0, 4, 7, 2), None),
        ("Cmadd9", 0, (0, 3, 7, 2), None),
        ("G9", 7, (7, 11, 2, 5, 9), 5),
        ("Cmaj9", 0, (0, 4, 7, 11, 2), 11),
        ("Dm9", 2, (2, 5, 9, 0, 4), 0),
        ("  Dm7  ", 2, (2, 5, 9, 0), 0),
        ("\u00a0F#m\u2028", 6, (6, 9, 1), None),
    ],
)
def test_symbols_in_vocabulary(symbol, root, tones, seventh):
    chord = parse_chord_symbol(symbol)
    assert chord is not None
    assert (chord.root, chord.tones, chord.seventh) == (root, tones, seventh)


@pytest.mark.parametrize(
    "symbol",
    [
        "Cmaj", "Cmin", "CM", "C-", "C5", "C11", "C13", "C69", "C7b9", "C7#9", "Csus",
        "Cm(maj7)", "CmMaj7", "Caug7", "C+7", "C\u266f", "B\u266d", "c", "am7", "H", "Cbb", "Fx",
        "/E", "", "N/C", "C m", "C\nm", "Cm\u2028m", "Em9b5",
        "Cconstructor", "CtoString", "C__proto__", "ChasOwnProperty", "CvalueOf",
    ],
)
def test_symbols_out_of_vocabulary(symbol):
    assert parse_chord_symbol(symbol) is None


def test_trailing_space_before_slash_is_trimmed():
    assert parse_chord_symbol("Cm /G").tones == (0, 3, 7)
