"""Prompt pools: the p4-progressions/1 loader, the shipped generated pools and their generator."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from graders.voice_leading import progressions
from graders.voice_leading.pool import (
    DEFAULT_FIXTURES,
    FixtureError,
    PoolError,
    PoolTooSmall,
    UnknownCase,
    UnknownSplit,
    load_cases,
    load_pool,
    read_fixture,
    require_pool,
)
from graders.metrics import Counters
from graders.tasks import task_profile
from graders.voice_leading import VOCABULARY, named_chord_count, parse_chord_symbol
from tests.test_vl_fixture import FIXTURE as SHARED_FIXTURE  # ../shared's copy, its bytes pinned there



def _suffix(symbol: str) -> str:
    base = symbol.split("/")[0]
    return base[2:] if base[1:2] in ("#", "b") else base[1:]


# --- the shared reference fixture -------------------------------------------------------------


def test_shared_fixture_gives_32_cases_in_file_order():
    document = json.loads(SHARED_FIXTURE.read_text("utf-8"))
    cases = load_cases(SHARED_FIXTURE, "train", voices=2, style="common-practice")
    assert len(cases) == 32
    assert [c.id for c in cases] == [row["songId"] for row in document["progressions"]]
    first = cases[0]
    assert first.progression == document["progressions"][0]["progression"]
    assert [m["role"] for m in first.messages] == ["system", "user"]
    assert "E minor" in first.messages[1]["content"]
    assert first.chords == named_chord_count(first.progression) == 7  # measure 1 is N/C
    assert len(first.openings) == 16 and first.openings[0] == (0, 0)
    # The first named chord of "fallin" sits in measure 2 (after an N/C bar).
    assert first.prefixes[5] == '[{"measure": 2, "degrees": [1, 1]},'
    assert first.split == "train" and first.voices == 2 and first.style == "common-practice"


def test_shared_fixture_as_user_pool_counts_as_fixture():
    pool = load_pool(fixture=SHARED_FIXTURE)
    assert (pool.size("train"), pool.source) == (32, "fixture")
    assert pool.size("heldout") == progressions.DEFAULT_SIZES["heldout"]


def _write(tmp_path: Path, document) -> Path:
    path = tmp_path / "pool.json"
    path.write_text(json.dumps(document), "utf-8")
    return path


def test_other_schema_is_refused_naming_file_and_schema(tmp_path):
    document = json.loads(SHARED_FIXTURE.read_text("utf-8"))
    document["schema"] = "p4-progressions/2"
    path = _write(tmp_path, document)
    with pytest.raises(FixtureError) as err:
        read_fixture(path)
    assert str(path) in str(err.value)
    assert "not p4-progressions/1" in str(err.value) and "p4-progressions/2" in str(err.value)


def test_missing_file_is_refused(tmp_path):
    with pytest.raises(FixtureError, match="not found"):
        read_fixture(tmp_path / "absent.json")


def test_invalid_json_is_refused(tmp_path):
    path = tmp_path / "broken.json"
    path.write_text('{"schema": "p4-progressions/1", ', "utf-8")
    with pytest.raises(FixtureError, match="not valid JSON"):
        read_fixture(path)


def _doc(rows, **extra):
    return {"schema": "p4-progressions/1", "progressions": rows, **extra}


GOOD = {"key": "C major", "chords": [{"measure": 1, "chordSymbol": "C"}]}


@pytest.mark.parametrize(
    ("document", "problem"),
    [
        (_doc([]), "non-empty list"),
        (_doc([{"progression": GOOD}]), "songId"),
        (_doc([{"songId": "a", "progression": GOOD}, {"songId": "a", "progression": GOOD}]),
         "duplicate songId 'a'"),
        (_doc([{"songId": "a", "progression": {"key": 3, "chords": []}}]), "progression.key"),
        (_doc([{"songId": "a", "progression": {"key": "C major", "chords": []}}]), "chords"),
        (_doc([{"songId": "a", "progression": {"key": "C major",
                                                "chords": [{"measure": "1", "chordSymbol": "C"}]}}]),
         r"chords\[0\].measure"),
        (_doc([{"songId": "a", "progression": {"key": "C major",
                                                "chords": [{"measure": 1, "chordSymbol": None}]}}]),
         r"chords\[0\].chordSymbol"),
        (_doc([{"songId": "a", "progression": GOOD}], n=2), "n is 2"),
        ([1, 2], "not a JSON object"),
    ],
)
def test_malformed_rows_are_refused(tmp_path, document, problem):
    with pytest.raises(FixtureError, match=problem):
        read_fixture(_write(tmp_path, document))


# --- pools ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pool():
    return load_pool()


def test_take_is_pool_order_and_never_truncates(pool):
    train = pool.take(0)
    assert len(train) == 48 and pool.source == "generated"
    assert pool.take(5) == train[:5]
    with pytest.raises(PoolTooSmall, match="asked for 49 cases but the train pool holds 48"):
        pool.take(49)
    with pytest.raises(UnknownSplit, match="'dev'"):
        pool.take(1, "dev")
    with pytest.raises(PoolError, match="limit must be >= 0"):
        pool.take(-1)
    assert pool.take(0, "heldout")[0].split == "heldout"


def test_get_by_id_across_splits(pool):
    assert pool.get("heldout-000").split == "heldout"
    assert pool.get("train-047").id == "train-047"
    with pytest.raises(UnknownCase, match="'nope'"):
        pool.get("nope")
    with pytest.raises(PoolError, match="required") as err:
        pool.get("")
    assert err.value.code == "INVALID_ARGUMENT"


def test_require_pool_names_both_numbers(pool):
    require_pool(pool, 48)
    require_pool(pool, None)
    with pytest.raises(PoolTooSmall, match="--require-pool 49.*holds only 48"):
        require_pool(pool, 49)


def test_same_id_in_two_splits_is_refused():
    with pytest.raises(FixtureError, match="appears in both"):
        load_pool(fixture=SHARED_FIXTURE, heldout_fixture=SHARED_FIXTURE)


def test_bad_options_are_refused():
    with pytest.raises(ValueError, match="voices"):
        load_pool(voices=5)
    with pytest.raises(ValueError, match="style"):
        load_pool(style="baroque")


# --- the shipped generated pools --------------------------------------------------------------


def test_regeneration_is_byte_identical(tmp_path):
    written = progressions.write_pools(tmp_path)
    assert sorted(p.name for p in written) == ["heldout.json", "train.json"]
    for split, shipped in DEFAULT_FIXTURES.items():
        assert (tmp_path / f"{split}.json").read_bytes() == shipped.read_bytes(), split


def test_shipped_pools_are_disjoint_and_sized():
    pools = {s: read_fixture(p) for s, p in DEFAULT_FIXTURES.items()}
    assert len(pools["train"]) >= 32 and len(pools["heldout"]) >= 64
    canon = {s: {json.dumps(r.progression, sort_keys=True) for r in rows} for s, rows in pools.items()}
    assert len(canon["train"]) == len(pools["train"])  # no duplicate inside a pool either
    assert len(canon["heldout"]) == len(pools["heldout"])
    assert not canon["train"] & canon["heldout"]


@pytest.mark.parametrize("split", ["train", "heldout"])
def test_each_shipped_pool_covers_the_vocabulary(split):
    rows = read_fixture(DEFAULT_FIXTURES[split])
    symbols = [c["chordSymbol"] for r in rows for c in r.progression["chords"]]
    named = [s for s in symbols if s != "N/C"]
    assert all(parse_chord_symbol(s) is not None for s in named), "every named chord in vocabulary"
    assert {_suffix(s) for s in named} == set(VOCABULARY) == set(progressions.SUFFIXES)
    assert "N/C" in symbols
    assert any("/" in s for s in named)
    keys = {r.progression["key"] for r in rows}
    assert any("b " in k for k in keys) and any("# " in k for k in keys)
    assert {k.split()[1] for k in keys} == {"major", "minor"}
    for r in rows:  # 4 bars, measures 1..4, ending on a dominant -> tonic cadence
        measures = [c["measure"] for c in r.progression["chords"]]
        assert measures == [1, 2, 3, 4]


def test_generator_is_seeded_and_takes_bars():
    a = progressions.generate_pools({"x": 12}, seed=7, bars=8)
    assert a == progressions.generate_pools({"x": 12}, seed=7, bars=8)
    assert a != progressions.generate_pools({"x": 12}, seed=8, bars=8)
    assert all(len(p["chords"]) == 8 for p in a["x"])
    with pytest.raises(ValueError, match="bars"):
        progressions.generate_pools({"x": 12}, bars=1)
    with pytest.raises(ValueError, match="cannot cover"):
        progressions.generate_pools({"x": 3}, bars=4)


def test_generated_cadence_and_secondary_dominants():
    pools = progressions.generate_pools({"x": 40}, seed=11, bars=4)
    for prog in pools["x"]:
        tonic = prog["key"].split()[0]
        last = parse_chord_symbol(prog["chords"][-1]["chordSymbol"])
        penult = parse_chord_symbol(prog["chords"][-2]["chordSymbol"])
        tonic_pc = parse_chord_symbol(tonic).root
        assert last.root == tonic_pc
        assert penult.root == (tonic_pc + 7) % 12


@pytest.mark.parametrize(
    ("tonic", "semis", "letters", "name"),
    [("Bb", 7, 4, "F"), ("E", 11, 6, "D#"), ("Ab", 6, 3, "D"), ("Gb", 11, 6, "F"),
     ("C#", 8, 5, "A"), ("F#", 6, 3, "B#"), ("Db", 10, 6, "Cb")],
)
def test_spelling(tonic, semis, letters, name):
    assert progressions.spell(tonic, semis, letters) == name


# --- counters ---------------------------------------------------------------------------------


def test_counters_and_verdict_classes():
    counters = Counters()
    counters.add(format_ok=True, admitted=True, first_measure_ok=True)
    counters.add(format_ok=False, admitted=False, first_measure_ok=False)
    assert counters.snapshot() == {
        "scored": 2, "unparsed": 1, "admitted": 1, "first_measure_wrong": 1,
    }
    voice = task_profile("voice-leading")
    assert [voice.verdict_label(v) for v in ("admitted", "structure", "parallels,hidden")] == [
        "admitted", "structure", "rule_failure",
    ] == list(voice.verdict_labels)


def test_every_task_bounds_its_verdict_label():
    """counterpoint_grader_requests_total's `verdict` is the task's bounded label: code-exec's
    script status (and nothing else), vowel-share's admitted | share, and admitted | rejected for
    a task without a profile (a test task, a module:factory)."""
    from records.exec_result import EXEC_STATUSES

    code = task_profile("code-exec")
    assert [code.verdict_label(s) for s in EXEC_STATUSES] == list(EXEC_STATUSES) == list(code.verdict_labels)
    with pytest.raises(ValueError, match="not a script status"):
        code.verdict_label("parallels")
    vowel = task_profile("vowel-share")
    assert {vowel.verdict_label(v) for v in ("admitted", "share", "anything")} == set(vowel.verdict_labels)
    bare = task_profile("no-such-task")
    assert [bare.verdict_label(v) for v in ("admitted", "share", "parallels,hidden")] == [
        "admitted", "rejected", "rejected"] and bare.verdict_labels == ("admitted", "rejected")


def test_bars_cuts_every_progression_and_its_prompt():
    from graders.voice_leading.pool import load_pool

    whole = load_pool(voices=2, style="common-practice")
    cut = load_pool(voices=2, style="common-practice", bars=2)
    assert cut.size("train") == whole.size("train")
    for a, b in zip(whole.take(0, "train"), cut.take(0, "train")):
        assert a.id == b.id
        assert b.progression["chords"] == a.progression["chords"][:2]
        assert b.progression["key"] == a.progression["key"]
        rows = [line for line in b.messages[1]["content"].splitlines() if line.startswith("| ") and "Measure" not in line]
        assert len(rows) == 2
        assert b.prefixes == a.prefixes  # the opening is the first chord's either way
