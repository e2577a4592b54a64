"""The voice-leading task's prompt pools: load `p4-progressions/1` files into cases
(voice-leading-spec.md §2.2, §2.3). The shipped pools are data/train.json and data/heldout.json
beside this module (made by progressions.py).

A fixture is served in FILE ORDER (it is already a frozen draw; never reshuffled). Anything
other than a well-formed `p4-progressions/1` file is refused with an error naming the file and
the problem. Pure Python: no gRPC, no Ray.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from config.grader import GraderConfig
# Request errors are every task's (graders/types.py); imported here for the pool's callers.
from graders.types import PoolError, PoolTooSmall, UnknownCase, UnknownSplit  # noqa: F401
from graders.voice_leading.openings import forced_prefix, named_chord_count, opening_alphabet
from graders.voice_leading.prompt import build_messages
from graders.voice_leading.score import check_options

SCHEMA = "p4-progressions/1"
SPLITS = ("train", "heldout")
DATA_DIR = Path(__file__).resolve().parent / "data"
DEFAULT_FIXTURES = {"train": DATA_DIR / "train.json", "heldout": DATA_DIR / "heldout.json"}


class FixtureError(ValueError):
    """A fixture file that cannot be served (missing, wrong schema, malformed rows)."""


_DEFAULTS = GraderConfig()  # the schema is the one place the verifier's defaults live


@dataclass(frozen=True)
class FixtureRow:
    song_id: str
    genre: str
    progression: dict


@dataclass(frozen=True)
class Case:
    """One prompt of the pool, as served by `Cases` (spec §2.3)."""

    id: str
    split: str
    progression: dict
    voices: int
    style: str
    messages: tuple[dict[str, str], ...]  # system, user
    chords: int  # named chords
    openings: tuple[tuple[int, ...], ...]  # opening alphabet (§13.2)
    prefixes: tuple[str, ...]  # forced-opening prefixes, one per opening (§13.3)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _check_progression(progression: Any, where: str) -> dict:
    if not isinstance(progression, Mapping):
        raise FixtureError(f"{where}: 'progression' must be an object, got {progression!r:.80}")
    if not isinstance(progression.get("key"), str):
        raise FixtureError(f"{where}: progression.key must be a string")
    chords = progression.get("chords")
    if not isinstance(chords, list) or not chords:
        raise FixtureError(f"{where}: progression.chords must be a non-empty list")
    for j, chord in enumerate(chords):
        if not isinstance(chord, Mapping):
            raise FixtureError(f"{where}: chords[{j}] must be an object")
        if not _is_number(chord.get("measure")):
            raise FixtureError(f"{where}: chords[{j}].measure must be a finite number")
        if not isinstance(chord.get("chordSymbol"), str):
            raise FixtureError(f"{where}: chords[{j}].chordSymbol must be a string")
    return dict(progression)


def parse_fixture(document: Any, source: str) -> list[FixtureRow]:
    """Validate a decoded fixture document; rows in file order."""
    if not isinstance(document, Mapping):
        raise FixtureError(f"{source}: not a JSON object")
    schema = document.get("schema")
    if schema != SCHEMA:
        raise FixtureError(f"{source}: not {SCHEMA} (schema is {schema!r})")
    rows = document.get("progressions")
    if not isinstance(rows, list) or not rows:
        raise FixtureError(f"{source}: 'progressions' must be a non-empty list")
    n = document.get("n")
    if n is not None and n != len(rows):
        raise FixtureError(f"{source}: n is {n} but 'progressions' holds {len(rows)} rows")
    out: list[FixtureRow] = []
    seen: set[str] = set()
    for i, row in enumerate(rows):
        where = f"{source}: progressions[{i}]"
        if not isinstance(row, Mapping):
            raise FixtureError(f"{where} must be an object")
        song_id = row.get("songId")
        if not isinstance(song_id, str) or not song_id:
            raise FixtureError(f"{where}: songId must be a non-empty string")
        if song_id in seen:
            raise FixtureError(f"{where}: duplicate songId {song_id!r}")
        seen.add(song_id)
        progression = _check_progression(row.get("progression"), f"{where} ({song_id})")
        genre = row.get("genre", "")
        out.append(FixtureRow(song_id, genre if isinstance(genre, str) else str(genre), progression))
    return out


def read_fixture(path: str | Path) -> list[FixtureRow]:
    """Read and validate a `p4-progressions/1` file."""
    path = Path(path)
    if not path.is_file():
        raise FixtureError(f"{path}: fixture file not found")
    try:
        document = json.loads(path.read_text("utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise FixtureError(f"{path}: not valid JSON ({exc})") from exc
    return parse_fixture(document, str(path))


def first_bars(progression: dict, bars: int | None) -> dict:
    """The progression cut to its first `bars` chords (None = whole). A cut keeps the key and
    the chords' own measure numbers, so a cut case is scored exactly like a short fixture row."""
    if bars is None:
        return progression
    return {**progression, "chords": list(progression["chords"][:bars])}


def build_case(row: FixtureRow, split: str, voices: int, style: str, bars: int | None = None) -> Case:
    progression = first_bars(row.progression, bars)
    openings = tuple(tuple(o) for o in opening_alphabet(progression, voices))
    return Case(
        id=row.song_id,
        split=split,
        progression=progression,
        voices=voices,
        style=style,
        messages=tuple(build_messages(progression, voices)),
        chords=named_chord_count(progression),
        openings=openings,
        prefixes=tuple(forced_prefix(progression, o) for o in openings),
    )


def load_cases(path: str | Path, split: str, voices: int, style: str, bars: int | None = None) -> list[Case]:
    """Cases of one fixture file, in file order."""
    return [build_case(row, split, voices, style, bars) for row in read_fixture(path)]


@dataclass
class Pool:
    """The cases of every split plus an id index. ``source`` is "generated" for the shipped
    generated pools and "fixture" when the train split comes from a user file."""

    splits: dict[str, tuple[Case, ...]]
    source: str
    paths: dict[str, str] = field(default_factory=dict)
    _by_id: dict[str, Case] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._by_id = {}
        for split, cases in self.splits.items():
            for case in cases:
                other = self._by_id.get(case.id)
                if other is not None:
                    raise FixtureError(
                        f"case id {case.id!r} appears in both {other.split} "
                        f"({self.paths.get(other.split)}) and {split} ({self.paths.get(split)})"
                    )
                self._by_id[case.id] = case

    def size(self, split: str = "train") -> int:
        return len(self._split(split))

    def _split(self, split: str) -> tuple[Case, ...]:
        split = split or "train"
        if split not in self.splits:
            raise UnknownSplit(f"unknown split {split!r}; expected one of {tuple(self.splits)}")
        return self.splits[split]

    def take(self, limit: int, split: str = "train") -> tuple[Case, ...]:
        """The first ``limit`` cases in pool order (0 = all); never truncated silently."""
        cases = self._split(split)
        if limit < 0:
            raise PoolError(f"limit must be >= 0, got {limit}")
        if limit > len(cases):
            raise PoolTooSmall(
                f"asked for {limit} cases but the {split or 'train'} pool holds {len(cases)}"
            )
        return cases[: limit or len(cases)]

    def get(self, case_id: str) -> Case:
        if not case_id:
            raise PoolError("case_id is required")
        try:
            return self._by_id[case_id]
        except KeyError:
            raise UnknownCase(f"unknown case_id {case_id!r}") from None

    def openings_histogram(self, split: str = "train") -> dict[int, int]:
        hist: dict[int, int] = {}
        for case in self._split(split):
            hist[len(case.openings)] = hist.get(len(case.openings), 0) + 1
        return dict(sorted(hist.items()))


def load_pool(
    fixture: str | Path | None = None,
    heldout_fixture: str | Path | None = None,
    voices: int = _DEFAULTS.voices,
    style: str = _DEFAULTS.style,
    bars: int | None = None,
) -> Pool:
    """Both splits; None means the shipped generated pool of that split. `bars` cuts every
    progression to its first chords (grader.bars)."""
    check_options(voices, style, "reference")
    paths = {
        "train": Path(fixture) if fixture else DEFAULT_FIXTURES["train"],
        "heldout": Path(heldout_fixture) if heldout_fixture else DEFAULT_FIXTURES["heldout"],
    }
    splits = {s: tuple(load_cases(p, s, voices, style, bars)) for s, p in paths.items()}
    source = "fixture" if fixture else "generated"
    return Pool(splits, source, {s: str(p) for s, p in paths.items()})


def require_pool(pool: Pool, minimum: int | None, split: str = "train") -> None:
    """Refuse a pool smaller than ``minimum`` (spec §2.2 "require-pool")."""
    if minimum is not None and pool.size(split) < minimum:
        raise PoolTooSmall(
            f"--require-pool {minimum}: the {split} pool ({pool.paths.get(split)}) holds only "
            f"{pool.size(split)} progressions"
        )

