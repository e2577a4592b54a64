"""Key and chord-symbol parsing and the 28-suffix vocabulary (spec §3, §4)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache
from typing import Final

from graders.voice_leading.jsnum import JS_WS_CLASS, js_trim

# Suffix -> intervals above the root, in the order degree indices count along (§4.2).
VOCABULARY: Final[dict[str, tuple[int, ...]]] = {
    "": (0, 4, 7),
    "m": (0, 3, 7),
    "7": (0, 4, 7, 10),
    "maj7": (0, 4, 7, 11),
    "m7": (0, 3, 7, 10),
    "dim": (0, 3, 6),
    "m7b5": (0, 3, 6, 10),
    "aug": (0, 4, 8),
    "sus4": (0, 5, 7),
    "sus2": (0, 2, 7),
    "add9": (0, 4, 7, 2),
    "madd9": (0, 3, 7, 2),
    "6": (0, 4, 7, 9),
    "m6": (0, 3, 7, 9),
    "dim7": (0, 3, 6, 9),
    "9": (0, 4, 7, 10, 2),
    "maj9": (0, 4, 7, 11, 2),
    "m9": (0, 3, 7, 10, 2),
    "M7": (0, 4, 7, 11),
    "\u00f87": (0, 3, 6, 10),  # ø7
    "\u00f8": (0, 3, 6, 10),  # ø
    "min7": (0, 3, 7, 10),
    "\u0394": (0, 4, 7, 11),  # Δ
    "\u03947": (0, 4, 7, 11),  # Δ7
    "+": (0, 4, 8),
    "\u00b0": (0, 3, 6),  # °
    "\u00b07": (0, 3, 6, 9),  # °7
    "7sus4": (0, 5, 7),  # the reference drops the seventh (§15.4)
}

LETTER_PC: Final = {"C": 0, "D": 2, "E": 4, "F": 5, "G": 7, "A": 9, "B": 11}

# Case-insensitive in JavaScript's non-unicode sense: ASCII letters only (re.ASCII), and the
# separator is JavaScript's \s, not Python's.
_KEY = re.compile(r"([A-G])([#b])?" + JS_WS_CLASS + r"+(major|minor)", re.IGNORECASE | re.ASCII)
# JavaScript '.' stops at line terminators, so a suffix cannot hold one.
_CHORD = re.compile(r"([A-G])([#b])?([^\n\r\u2028\u2029]*)")


@dataclass(frozen=True, slots=True)
class Key:
    """A parsed key. The leading tone is tonic + 11 and the dominant tonic + 7, minor too."""

    tonic: int
    mode: str
    leading_tone: int
    dominant: int


@dataclass(frozen=True, slots=True)
class Chord:
    """A parsed, in-vocabulary chord: tones in vocabulary order (degree indices count along)."""

    root: int
    suffix: str
    tones: tuple[int, ...]
    tone_set: frozenset[int]
    seventh: int | None  # pc of the first of intervals 9, 10, 11 present (the 'seventh', §4.2)


@lru_cache(maxsize=4096)
def parse_key(text: str) -> Key | None:
    """Parse ``'A minor'``-style keys (§3); None when the key is not recognised."""
    if not isinstance(text, str):
        return None
    m = _KEY.fullmatch(js_trim(text))
    if m is None:
        return None
    letter, accidental, mode = m.groups()
    tonic = LETTER_PC[letter.upper()]
    if accidental == "#":
        tonic = (tonic + 1) % 12
    elif accidental == "b":  # an upper-case 'B' matches the pattern but changes nothing
        tonic = (tonic - 1) % 12
    return Key(tonic, mode.lower(), (tonic + 11) % 12, (tonic + 7) % 12)


@lru_cache(maxsize=16384)
def parse_chord_symbol(symbol: str) -> Chord | None:
    """Parse a chord symbol (§4.1); None when out of vocabulary. The slash bass is dropped."""
    if not isinstance(symbol, str):
        return None
    text = js_trim(symbol)
    slash = text.find("/")
    if slash >= 0:
        text = js_trim(text[:slash])
    m = _CHORD.fullmatch(text)
    if m is None:
        return None
    letter, accidental, suffix = m.groups()
    intervals = VOCABULARY.get(suffix)
    if intervals is None:
        return None
    root = LETTER_PC[letter]
    if accidental == "#":
        root = (root + 1) % 12
    elif accidental == "b":
        root = (root - 1) % 12
    tones = tuple((root + i) % 12 for i in intervals)
    seventh = next(((root + i) % 12 for i in (9, 10, 11) if i in intervals), None)
    return Chord(root, suffix, tones, frozenset(tones), seventh)


def is_named(symbol: object) -> bool:
    """A named chord: a non-empty string other than exactly ``N/C`` (§1)."""
    return isinstance(symbol, str) and symbol != "" and symbol != "N/C"
