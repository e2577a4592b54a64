"""A seeded generator of plausible chord progressions in the `p4-progressions/1` schema.

Why: the reference pool is derived from a song library we cannot ship; the project's default
prompt pools (graders/voice_leading/data/train.json, heldout.json) are generated here instead, reproducibly.

How a progression is made (all choices from one `random.Random(seed)`):
1. a key: 13 major and 12 minor keys, flats and sharps;
2. 4-bar functional phrases (tonic -> predominant -> dominant -> tonic, with half cadences,
   deceptive moves, secondary dominants, leading-tone chords and borrowed chords), joined and
   cut to `bars` bars; the last two bars are always a dominant -> tonic cadence;
3. each roman numeral gets a colour (chord suffix) from its function's table, e.g. a major
   tonic may be `maj7`, `6`, `add9`, `Δ`, a dominant `7`, `9`, `sus4`, `7sus4`;
4. roots are spelled diatonically from the key (letter + degree), falling back to the key's
   accidental family instead of a double accidental (out of vocabulary);
5. now and then a first-inversion/second-inversion slash chord (`C/E`) and, rarely, a pickup
   bar of `N/C`.
A pool is then patched deterministically so that every one of the 28 vocabulary suffixes, a slash
chord and an `N/C` appear at least once, and pools made in one call never share a progression.
One chord per bar; measures are 1..bars. Pure Python, no I/O except `write_pools`.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

SCHEMA = "p4-progressions/1"
GENERATOR = "graders.progressions/1"
# A constant (not today's date) so that regeneration is byte-identical.
EMITTED = "2026-11-29"
DEFAULT_SEED = 20261129
DEFAULT_BARS = 4
DEFAULT_SIZES = {"train": 48, "heldout": 96}
DATA_DIR = Path(__file__).resolve().parent / "data"

# The 28 suffixes of the chord vocabulary (voice-leading-spec.md §4.2), in table order.
SUFFIXES: tuple[str, ...] = (
    "", "m", "7", "maj7", "m7", "dim", "m7b5", "aug", "sus4", "sus2", "add9", "madd9", "6",
    "m6", "dim7", "9", "maj9", "m9", "M7", "ø7", "ø", "min7", "Δ", "Δ7", "+", "°", "°7", "7sus4",
)

LETTERS = "CDEFGAB"
NATURAL_PC = (0, 2, 4, 5, 7, 9, 11)
SHARP_NAMES = ("C", "C#", "D", "D#", "E", "F", "F#", "G", "G#", "A", "A#", "B")
FLAT_NAMES = ("C", "Db", "D", "Eb", "E", "F", "Gb", "G", "Ab", "A", "Bb", "B")

MAJOR_KEYS = ("C", "G", "D", "A", "E", "B", "F#", "F", "Bb", "Eb", "Ab", "Db", "Gb")
MINOR_KEYS = ("A", "E", "B", "F#", "C#", "G#", "D", "G", "C", "F", "Bb", "Eb")


@dataclass(frozen=True)
class Numeral:
    """A chord function: root `semis` above the tonic, spelled `letters` letter-steps above it."""

    semis: int
    letters: int
    colours: tuple[str, ...]  # suffixes this function may take; the first is the plain one


# Colour tables: which suffixes fit which function (the plain triad first).
_N = {
    # major mode
    "I": Numeral(0, 0, ("", "maj7", "6", "add9", "maj9", "M7", "Δ", "Δ7", "sus2")),
    "ii": Numeral(2, 1, ("m", "m7", "m9", "min7", "madd9")),
    "iii": Numeral(4, 2, ("m", "m7")),
    "IV": Numeral(5, 3, ("", "maj7", "add9", "6", "sus2", "maj9")),
    "V": Numeral(7, 4, ("", "7", "9", "sus4", "7sus4", "aug", "+")),
    "vi": Numeral(9, 5, ("m", "m7", "m9")),
    "vii": Numeral(11, 6, ("dim", "m7b5", "ø7", "ø", "°", "dim7", "°7")),
    # borrowed from the parallel minor
    "iv": Numeral(5, 3, ("m", "m6", "m7")),
    "bIII": Numeral(3, 2, ("", "maj7")),
    "bVI": Numeral(8, 5, ("", "maj7")),
    "bVII": Numeral(10, 6, ("", "7")),
    # secondary dominants / leading-tone chords
    "V/V": Numeral(2, 1, ("7", "", "9")),
    "V/vi": Numeral(4, 2, ("7", "")),
    "V/ii": Numeral(9, 5, ("7", "")),
    "V/IV": Numeral(0, 0, ("7",)),
    "vii/V": Numeral(6, 3, ("dim7", "°7", "dim")),
    # minor mode
    "i": Numeral(0, 0, ("m", "m7", "m6", "madd9", "m9", "min7")),
    "iio": Numeral(2, 1, ("dim", "m7b5", "ø7", "ø", "°")),
    "III": Numeral(3, 2, ("", "maj7")),
    "III+": Numeral(3, 2, ("aug", "+")),
    "VI": Numeral(8, 5, ("", "maj7", "add9")),
    "VII": Numeral(10, 6, ("", "7")),
    "V+": Numeral(7, 4, ("aug", "+", "7")),
}

# 4-bar phrases; the last chord decides how the next phrase may follow (any order works).
MAJOR_PHRASES: tuple[tuple[str, ...], ...] = (
    ("I", "IV", "V", "I"), ("I", "vi", "ii", "V"), ("I", "ii", "V", "I"), ("I", "IV", "I", "V"),
    ("I", "vi", "IV", "V"), ("I", "V/vi", "vi", "V"), ("I", "V/V", "V", "I"),
    ("I", "iv", "I", "V"), ("I", "bVI", "bVII", "I"), ("vi", "IV", "I", "V"),
    ("I", "iii", "IV", "V"), ("I", "V", "vi", "IV"), ("I", "IV", "vii", "I"),
    ("I", "ii", "V/V", "V"), ("I", "V/IV", "IV", "V"), ("I", "V/ii", "ii", "V"),
    ("I", "vii/V", "V", "I"), ("I", "bIII", "IV", "V"), ("ii", "V", "I", "vi"),
)
MINOR_PHRASES: tuple[tuple[str, ...], ...] = (
    ("i", "iv", "V", "i"), ("i", "VI", "iio", "V"), ("i", "iv", "V+", "i"),
    ("i", "VII", "III", "VI"), ("i", "III+", "iv", "V"), ("i", "iio", "V", "i"),
    ("i", "VI", "iv", "V"), ("i", "vii", "i", "V"), ("i", "iv", "VII", "III"),
    ("iv", "V", "i", "VI"), ("i", "V/V", "V", "i"),
)

# A secondary dominant must be followed by the chord it tonicizes.
SECONDARY_TARGETS = {"V/V": "V", "V/vi": "vi", "V/ii": "ii", "V/IV": "IV", "vii/V": "V"}
# Chords that may stand before the cadential V (used when patching a pool's coverage).
PREDOMINANTS = ("ii", "IV", "iv", "V/V", "vii/V", "iio", "bVI")
SLASH_P = 0.08  # chance per chord of an inversion written as a slash chord
PICKUP_P = 0.06  # chance per progression of an N/C pickup bar
PLAIN_P = 0.5  # chance of the plain colour; otherwise uniform over the other colours


def _key_letter_pc(tonic: str) -> tuple[int, int]:
    letter = LETTERS.index(tonic[0])
    pc = NATURAL_PC[letter] + (1 if tonic[1:] == "#" else -1 if tonic[1:] == "b" else 0)
    return letter, pc % 12


def spell(tonic: str, semis: int, letters: int) -> str:
    """Spell the note `semis` semitones / `letters` letter-steps above `tonic` (e.g. Bb, 7, 4 -> F)."""
    key_letter, key_pc = _key_letter_pc(tonic)
    letter = (key_letter + letters) % 7
    pc = (key_pc + semis) % 12
    offset = (pc - NATURAL_PC[letter]) % 12
    if offset == 0:
        return LETTERS[letter]
    if offset == 1:
        return LETTERS[letter] + "#"
    if offset == 11:
        return LETTERS[letter] + "b"
    # A double accidental would be out of vocabulary: respell in the key's accidental family.
    return (FLAT_NAMES if "b" in tonic or tonic == "F" else SHARP_NAMES)[pc]


# Intervals of the chord's third and fifth (for slash-chord basses), by suffix family.
_THIRD = {"m": 3, "m7": 3, "min7": 3, "m9": 3, "madd9": 3, "m6": 3, "dim": 3, "°": 3,
          "m7b5": 3, "ø7": 3, "ø": 3, "dim7": 3, "°7": 3}
_FIFTH = {"dim": 6, "°": 6, "m7b5": 6, "ø7": 6, "ø": 6, "dim7": 6, "°7": 6, "aug": 8, "+": 8}


def _slash(tonic: str, numeral: Numeral, suffix: str, rng: random.Random) -> str:
    """The bass of an inversion: the chord's third (letter +2) or fifth (letter +4)."""
    if suffix in ("sus2", "sus4", "7sus4"):
        return ""
    if rng.random() < 0.7:
        return "/" + spell(tonic, numeral.semis + _THIRD.get(suffix, 4), numeral.letters + 2)
    return "/" + spell(tonic, numeral.semis + _FIFTH.get(suffix, 7), numeral.letters + 4)


def _numerals(mode: str, bars: int, rng: random.Random) -> list[str]:
    phrases = MAJOR_PHRASES if mode == "major" else MINOR_PHRASES
    seq: list[str] = []
    while len(seq) < bars:
        seq.extend(rng.choice(phrases))
    seq = seq[:bars]
    if bars >= 2:  # authentic cadence at the end
        seq[-2:] = ["V", "I" if mode == "major" else "i"]
    # Cutting and the forced cadence can strand a secondary dominant or double the V:
    # such a chord becomes a plain predominant.
    predominant = "ii" if mode == "major" else "iv"
    for i in range(len(seq) - 2):
        target = SECONDARY_TARGETS.get(seq[i])
        if (target and seq[i + 1] != target) or (i == len(seq) - 3 and seq[i] in ("V", "V+")):
            seq[i] = predominant
    return seq


def _colour(numeral: Numeral, rng: random.Random) -> str:
    if len(numeral.colours) == 1 or rng.random() < PLAIN_P:
        return numeral.colours[0]
    return rng.choice(numeral.colours[1:])


@dataclass
class _Slot:
    """One generated chord, kept with its function so that a pool can be recoloured."""

    numeral: str
    suffix: str
    bass: str  # "" or "/E"

    def symbol(self, tonic: str) -> str:
        n = _N[self.numeral]
        return spell(tonic, n.semis, n.letters) + self.suffix + self.bass


@dataclass
class _Draft:
    tonic: str
    mode: str
    pickup: bool
    slots: list[_Slot]

    def progression(self) -> dict:
        chords = [{"measure": 1, "chordSymbol": "N/C"}] if self.pickup else []
        for slot in self.slots:
            chords.append({"measure": len(chords) + 1, "chordSymbol": slot.symbol(self.tonic)})
        return {"key": f"{self.tonic} {self.mode}", "chords": chords}


def _draft(bars: int, rng: random.Random) -> _Draft:
    mode = "major" if rng.random() < 0.6 else "minor"
    tonic = rng.choice(MAJOR_KEYS if mode == "major" else MINOR_KEYS)
    pickup = bars >= 3 and rng.random() < PICKUP_P
    slots = []
    for name in _numerals(mode, bars - 1 if pickup else bars, rng):
        suffix = _colour(_N[name], rng)
        bass = _slash(tonic, _N[name], suffix, rng) if rng.random() < SLASH_P else ""
        slots.append(_Slot(name, suffix, bass))
    return _Draft(tonic, mode, pickup, slots)


def _ensure_coverage(drafts: list[_Draft]) -> None:
    """Recolour chords so that every suffix, a slash chord and an N/C pickup occur in the pool.

    Deterministic: walks drafts in order and only takes a chord whose current suffix occurs more
    than once, so covering one suffix never uncovers another.
    """
    counts = {s: 0 for s in SUFFIXES}
    for d in drafts:
        for slot in d.slots:
            counts[slot.suffix] += 1
    for suffix in SUFFIXES:
        if counts[suffix]:
            continue
        # First choice: a chord whose own function takes this colour; then a predominant
        # (the chord before the final V) swapped for one that does.
        options = [(s, s.numeral) for d in drafts for s in d.slots]
        options += [(d.slots[-3], name) for d in drafts if len(d.slots) >= 3
                    for name in PREDOMINANTS]
        for slot, name in options:
            if suffix in _N[name].colours and counts[slot.suffix] > 1:
                counts[slot.suffix] -= 1
                slot.numeral, slot.suffix, slot.bass = name, suffix, ""
                counts[suffix] += 1
                break
        else:
            raise ValueError(f"cannot place suffix {suffix!r}: pool too small")
    if not any(s.bass for d in drafts for s in d.slots):
        d, slot = next((d, s) for d in drafts for s in d.slots if s.suffix in ("", "m"))
        n = _N[slot.numeral]
        slot.bass = "/" + spell(d.tonic, n.semis + _THIRD.get(slot.suffix, 4), n.letters + 2)
    if not any(d.pickup for d in drafts) and len(drafts[-1].slots) >= 3:
        drafts[-1].pickup = True
        drafts[-1].slots.pop(0)


def _canonical(progression: dict) -> str:
    return json.dumps(progression, sort_keys=True, ensure_ascii=False)


def generate_pools(
    sizes: dict[str, int], seed: int = DEFAULT_SEED, bars: int = DEFAULT_BARS
) -> dict[str, list[dict]]:
    """Generate disjoint pools (split name -> progressions) from one seeded stream.

    Every pool covers all 28 suffixes, contains a slash chord and an N/C bar; no progression
    appears twice within or across pools.
    """
    if bars < 2:
        raise ValueError(f"bars must be >= 2, got {bars}")
    rng = random.Random(seed)
    seen: set[str] = set()
    pools: dict[str, list[dict]] = {}
    for split, n in sizes.items():
        if n < len(SUFFIXES) // bars + 2:
            raise ValueError(f"pool {split!r} of {n} cannot cover {len(SUFFIXES)} suffixes")
        for _attempt in range(100):
            drafts: list[_Draft] = []
            local: set[str] = set()
            while len(drafts) < n:
                draft = _draft(bars, rng)
                key = _canonical(draft.progression())
                if key not in seen and key not in local:
                    local.add(key)
                    drafts.append(draft)
            _ensure_coverage(drafts)
            progs = [d.progression() for d in drafts]
            keys = {_canonical(p) for p in progs}
            if len(keys) == n and not keys & seen:  # recolouring kept everything unique
                seen |= keys
                pools[split] = progs
                break
        else:
            raise RuntimeError(f"could not make {n} unique progressions for {split!r}")
    return pools


def fixture_document(split: str, progressions: list[dict], seed: int, bars: int) -> dict:
    """Wrap progressions as a `p4-progressions/1` document (rows in generation order)."""
    n = len(progressions)
    return {
        "schema": SCHEMA,
        "provenance": {
            "emitted": EMITTED,
            "why": "counterpoint's default prompt pool: generated functional progressions, so a "
            "fresh clone has a reproducible pool without any song library.",
            "pool_available_at_emit": n,
            "shuffle": f"none (generation order; {GENERATOR}, random.Random({seed}))",
            "slice": f"[0, {n})",
            "bars": bars,
            "split": split,
            "generator": GENERATOR,
            "seed": seed,
            "note": f"{bars}-bar progressions (short on purpose: the training default uses short "
            "progressions). Regenerate: counterpoint grader make-fixtures --seed "
            f"{seed} --bars {bars} --out graders/voice_leading/data",
        },
        "genres": {"generated": n},
        "n": n,
        "progressions": [
            {"songId": f"{split}-{i:03d}", "genre": "generated", "progression": p}
            for i, p in enumerate(progressions)
        ],
    }


def render_document(document: dict) -> str:
    """The exact file text (UTF-8, one chord per line, trailing newline)."""
    return json.dumps(document, ensure_ascii=False, indent=1) + "\n"


def write_pools(
    out_dir: Path,
    seed: int = DEFAULT_SEED,
    bars: int = DEFAULT_BARS,
    sizes: dict[str, int] | None = None,
) -> list[Path]:
    """Generate and write `<split>.json` for each pool; returns the written paths."""
    sizes = sizes or DEFAULT_SIZES
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for split, progs in generate_pools(sizes, seed, bars).items():
        path = out_dir / f"{split}.json"
        path.write_text(render_document(fixture_document(split, progs, seed, bars)), "utf-8")
        written.append(path)
    return written
