"""Compatibility with the shared p4-progressions/1 fixture (../shared/fixtures, copied to
tests/fixtures so that a clone anywhere runs it)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from graders.voice_leading import (
    build_messages,
    forced_prefix,
    named_chord_count,
    opening_alphabet,
    parse_chord_symbol,
    score,
)

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "progressions-v1.json"
# The reference's bytes (../shared/fixtures/progressions-v1.json): an edit to the copy shows here
FIXTURE_SHA256 = "329225e6cfd9641b2edbbd8d088fff72c18fbfad341e73d504e3fd1b87c6bd36"


def test_fixture_is_the_reference_copy():
    assert hashlib.sha256(FIXTURE.read_bytes()).hexdigest() == FIXTURE_SHA256


@pytest.fixture(scope="module")
def pool() -> list[dict]:
    data = json.loads(FIXTURE.read_text())
    assert data["schema"] == "p4-progressions/1"
    assert data["n"] == len(data["progressions"]) == 32
    return [row["progression"] for row in data["progressions"]]


def test_every_named_symbol_is_in_vocabulary(pool):
    for progression in pool:
        for chord in progression["chords"]:
            assert chord["chordSymbol"] == "N/C" or parse_chord_symbol(chord["chordSymbol"])


@pytest.mark.parametrize("voices", [2, 3, 4])
def test_alphabet_prompt_and_forced_prefixes(pool, voices):
    for progression in pool:
        alphabet = opening_alphabet(progression, voices)
        assert len(alphabet) == 4**voices
        system, user = build_messages(progression, voices)
        assert user["content"].count("\n| ") == len(progression["chords"]) + 1  # + the header
        named = [c for c in progression["chords"] if c["chordSymbol"] != "N/C"]
        assert named_chord_count(progression) == len(named) >= 4
        # a forced opening continued with a root-position answer for every other named chord
        opening = alphabet[len(alphabet) // 3]
        rest = "".join(
            f' {{"measure": {c["measure"]}, "degrees": {list(range(voices))}}},' for c in named[1:]
        )
        completion = forced_prefix(progression, opening) + rest.rstrip(",") + "]"
        result = score(progression, completion, voices, "film-ambient")
        assert result.format_ok and result.first_measure_ok
        assert result.sounding_frames == result.expected_frames == len(named)
        assert result.opening == ",".join(map(str, opening))
        assert result.voice_count == voices
