"""EVAL.jsonl format and the prior-shape statistics, on hand-made eval files."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import pytest

from evals.eval_file import (
    NO_OPENING,
    EvalFileError,
    GenerationSettings,
    header_for,
    ids_sha256,
    item_record,
    prompts_sha256,
    read_eval,
    summarize,
    write_eval,
)
from evals.prior_shape import (
    distribution,
    in_alphabet,
    item_shape,
    prior_shape,
    write_prior_shape_json,
    write_prior_shape_png,
)


@dataclass
class Score:  # the fields item_record reads from a grader ScoreResult
    admitted: bool
    verdict: str
    reward: float


def completion_for(opening: str, k: int) -> str:
    if opening == NO_OPENING:
        return f"I think the answer is a C chord ({k})"
    return f'[{{"measure": 1, "degrees": [{opening}]}}, {{"measure": {k + 2}, "degrees": [0, 1]}}]'


def make_item(item_id, openings, admitted, lengths=None, completions=None, alphabet_size=16):
    completions = completions or [completion_for(o, k) for k, o in enumerate(openings)]
    scores = [
        Score(a, "admitted" if a else ("structure" if o == NO_OPENING else "parallels"), float(a))
        for o, a in zip(openings, admitted)
    ]
    return item_record(
        item_id, completions, lengths or [10] * len(openings), scores, alphabet_size,
        openings=openings,
    )


GEN = GenerationSettings(
    generations=6, max_new_tokens=64, temperature=1.0, top_p=1.0, top_k=-1, seed=0,
    eos_token_ids=[2],
)


def write_items(path: Path, items, generation=GEN, **kw) -> Path:
    header = header_for(items, generation=generation, model="tiny", voices=2, **kw)
    return write_eval(path, header, items)


MIXED = ["0,1", "0,1", "2,2", NO_OPENING, "2,2", "1.5,3"]
MIXED_ADMITTED = [True, False, True, False, False, False]


# ---------------------------------------------------------------- format


def test_round_trip_and_record_fields(tmp_path):
    item = make_item("a", MIXED, MIXED_ADMITTED, lengths=[1, 2, 3, 4, 5, 6])
    assert item.pass_count == 2
    assert item.rewards == [1.0, 0.0, 1.0, 0.0, 0.0, 0.0]
    assert item.verdicts[3] == "structure"
    assert item.distinct_exact == 6
    path = write_items(tmp_path / "e.jsonl", [item, make_item("b", ["0,0"] * 6, [False] * 6)])
    ev = read_eval(path)
    assert ev.header.prompt_set.n_items == 2
    assert ev.header.prompt_set.ids_sha256 == ids_sha256(["b", "a"])
    assert ev.header.alphabet_size == 16
    assert ev.items[0] == item
    first = json.loads(path.read_text().splitlines()[0])
    assert first["kind"] == "eval_header"
    assert first["generation"]["eos_token_ids"] == [2]


def test_generation_settings_from_sampling_params_and_prompt_hash():
    from rollout.types import SamplingParams
    from config.rollout import RolloutConfig

    params = SamplingParams.from_rollout(RolloutConfig(), n=8, temperature=0.7, top_p=0.9, top_k=20, max_tokens=96,
                            stop_token_ids=(5, 2), seed=3)
    g = GenerationSettings.from_sampling_params(params, eos_token_ids=[2])
    assert g.model_dump() == {"generations": 8, "max_new_tokens": 96, "temperature": 0.7,
                              "top_p": 0.9, "top_k": 20, "seed": 3, "eos_token_ids": [2, 5]}
    assert "seed" not in g.comparable_fields()
    a = prompts_sha256({"x": [{"role": "user", "content": "C"}], "y": "p"})
    assert a == prompts_sha256({"y": "p", "x": [{"role": "user", "content": "C"}]})
    assert a != prompts_sha256({"x": [{"role": "user", "content": "D"}], "y": "p"})


def test_distinct_stripped_ignores_whitespace():
    completions = ["[0, 1]", "[0,1]", " [0,1]\n", "[1,0]"]
    item = make_item("w", ["0,1"] * 3 + ["1,0"], [False] * 4, completions=completions)
    assert (item.distinct_exact, item.distinct_stripped) == (4, 2)


def _lines(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


def _rewrite(path: Path, lines: list[dict | str]) -> None:
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))


@pytest.mark.parametrize(
    "corrupt, message",
    [
        (lambda ls: [ls[0], "{not json", ls[2]], r":2: not JSON"),
        (lambda ls: ls[1:], r":1: the first line must be the header"),
        (lambda ls: [ls[0], {**ls[1], "pass_count": 5}, ls[2]], r":2: bad item: .*pass_count 5"),
        (lambda ls: [ls[0], ls[1], {**ls[2], "lengths": [1]}], r":3: bad item: .*lengths has 1"),
        (lambda ls: [ls[0], ls[1], {**ls[2], "colour": 1}], r":3: bad item: colour"),
        (lambda ls: [ls[0], ls[1], {**ls[2], "item_id": "a"}], r":3: item_id 'a' repeats line 2"),
        (lambda ls: [ls[0], ls[1]], r"n_items=2, found 1"),
        (
            lambda ls: [{**ls[0], "generation": {**ls[0]["generation"], "top_p": 2}}, ls[1], ls[2]],
            r":1: bad header: generation.top_p",
        ),
        (
            lambda ls: [ls[0], {**ls[1], "admitted": [True] * 6, "pass_count": 6}, ls[2]],
            r":2: bad item: .*completion 3 is unparseable",
        ),
    ],
)
def test_read_eval_names_the_bad_line(tmp_path, corrupt, message):
    path = write_items(
        tmp_path / "e.jsonl",
        [make_item("a", MIXED, MIXED_ADMITTED), make_item("b", ["0,0"] * 6, [True] * 6)],
    )
    _rewrite(path, corrupt(_lines(path)))
    with pytest.raises(EvalFileError, match=message):
        read_eval(path)


def test_read_eval_rejects_items_outside_the_prompt_set_and_wrong_g(tmp_path):
    path = write_items(tmp_path / "e.jsonl", [make_item("a", MIXED, MIXED_ADMITTED)])
    lines = _lines(path)
    _rewrite(path, [lines[0], {**lines[1], "item_id": "z"}])
    with pytest.raises(EvalFileError, match="ids_sha256"):
        read_eval(path)
    short = make_item("a", MIXED[:4], MIXED_ADMITTED[:4]).model_dump()
    _rewrite(path, [lines[0], short])
    with pytest.raises(EvalFileError, match=r":2: item 'a' has 4 completions.*generations=6"):
        read_eval(path)
    with pytest.raises(EvalFileError, match="no such eval file"):
        read_eval(tmp_path / "missing.jsonl")
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(EvalFileError, match="empty file"):
        read_eval(tmp_path / "empty.jsonl")


# ---------------------------------------------------------------- the code-exec shape
STATUSES = ["ok", "no_code", "crashed", "ok", "timeout", "no_code"]


def code_exec_item(item_id="tabular-binary", statuses=STATUSES):
    scores = [Score(admitted=st == "ok", verdict=st, reward=0.4 if st == "ok" else -0.5) for st in statuses]
    return item_record(item_id, [f"script {k}" for k in range(len(statuses))], [7] * len(statuses), scores, 0,
                       statuses=statuses)


def test_a_code_exec_item_has_statuses_not_openings(tmp_path):
    from evals.eval_file import CODE_EXEC_STYLE, ScoringSettings

    item = code_exec_item()
    assert item.openings is None and item.statuses == STATUSES and item.pass_count == 2
    assert item.unparseable == 2  # no script found: nothing to judge
    scoring = ScoringSettings(style=CODE_EXEC_STYLE, checker="counterpoint")
    path = write_items(tmp_path / "e.jsonl", [item], scoring=scoring)
    line = _lines(path)[1]
    assert line["statuses"] == STATUSES and "openings" not in line
    ev = read_eval(path)
    assert ev.items == (item,)
    assert summarize(ev.items).unparseable_share == pytest.approx(2 / 6)
    vl = _lines(write_items(tmp_path / "v.jsonl", [make_item("a", MIXED, MIXED_ADMITTED)]))[1]
    assert "statuses" not in vl and vl["openings"] == MIXED  # voice-leading lines as they always were
    with pytest.raises(EvalFileError, match="code-exec eval"):
        prior_shape(ev)


def test_a_code_exec_eval_written_before_statuses_is_read(tmp_path):
    """Before statuses, a code-exec item kept each status in `openings`: read as statuses."""
    from evals.eval_file import CODE_EXEC_STYLE, ScoringSettings

    path = write_items(tmp_path / "e.jsonl", [code_exec_item()],
                       scoring=ScoringSettings(style=CODE_EXEC_STYLE, checker="counterpoint"))
    header, line = _lines(path)
    _rewrite(path, [header, {**{k: v for k, v in line.items() if k != "statuses"}, "openings": STATUSES}])
    assert read_eval(path).items == (code_exec_item(),)
    _rewrite(path, [{**header, "scoring": None}, {**{k: v for k, v in line.items() if k != "statuses"},
                                                   "openings": STATUSES}])
    assert read_eval(path).items[0].openings == STATUSES  # a voice-leading file keeps its openings


@pytest.mark.parametrize("change, message", [
    (lambda line: {**line, "openings": ["0,1"] * 6}, "openings .*or statuses .*exactly one"),
    (lambda line: {k: v for k, v in line.items() if k != "statuses"}, "exactly one"),
    (lambda line: {**line, "statuses": line["statuses"][:5]}, "statuses has 5 entries"),
    (lambda line: {**line, "statuses": ["crashed"] + line["statuses"][1:]}, "completion 0 is admitted with status 'crashed'"),
])
def test_a_bad_code_exec_item_is_refused_naming_why(tmp_path, change, message):
    path = write_items(tmp_path / "e.jsonl", [code_exec_item()])
    header, line = _lines(path)
    _rewrite(path, [header, change(line)])
    with pytest.raises(EvalFileError, match=message):
        read_eval(path)


def test_write_eval_refuses_a_header_for_other_items(tmp_path):
    items = [make_item("a", MIXED, MIXED_ADMITTED)]
    other = [make_item("b", MIXED, MIXED_ADMITTED)]
    header = header_for(other, generation=GEN, model="m", voices=2)
    with pytest.raises(EvalFileError, match="ids_sha256"):
        write_eval(tmp_path / "e.jsonl", header, items)


def test_item_record_from_the_real_grader():
    from graders.voice_leading import opening_alphabet, opening_of, score

    # spec §14 example 2: the 2-voice cadence fails tendencyLeadingTone under common-practice
    progression = {"key": "C major", "chords": [
        {"measure": 1, "chordSymbol": "C"}, {"measure": 2, "chordSymbol": "F"},
        {"measure": 3, "chordSymbol": "G7"}, {"measure": 4, "chordSymbol": "C"},
    ]}
    example2 = ('[{"measure": 1, "degrees": [0, 0]}, {"measure": 2, "degrees": [0, 1]}, '
                '{"measure": 3, "degrees": [0, 1]}, {"measure": 4, "degrees": [1, 1]}]')
    completions = [example2, "Sure! Here is Python code.", example2]
    scores = [score(progression, c, voices=2, style=style) for c, style in
              zip(completions, ["film-ambient", "common-practice", "common-practice"])]
    item = item_record("cadence", completions, [30, 8, 30], scores,
                       len(opening_alphabet(progression, 2)))
    assert item.openings == ["0,0", NO_OPENING, "0,0"]
    assert item.openings == [opening_of(c) for c in completions]
    assert item.admitted == [True, False, False]
    assert item.verdicts == ["admitted", "structure", "tendencyLeadingTone"]
    assert item.rewards == [1.0, 0.0, 0.0]
    assert (item.pass_count, item.distinct_exact, item.alphabet_size) == (1, 2, 16)
    with pytest.raises(ValueError, match="2 scores for 3 completions"):
        item_record("x", completions, [1, 1, 1], scores[:2], 16)


# ---------------------------------------------------------------- summary


def test_summary_by_hand():
    items = [
        make_item("a", MIXED, MIXED_ADMITTED, lengths=[1, 2, 3, 4, 5, 6]),  # 2 pass, 1 unparseable
        make_item("b", [NO_OPENING] * 6, [False] * 6, lengths=[7] * 6),  # 0 pass, 6 unparseable
    ]
    s = summarize(items)
    assert (s.n_items, s.n_completions) == (2, 12)
    assert s.pass_rate == pytest.approx(2 / 12)
    assert s.coverage == pytest.approx(1 / 2)
    assert s.unparseable_share == pytest.approx(7 / 12)
    assert s.mean_length == pytest.approx((21 + 42) / 12)
    assert math.isnan(summarize([]).pass_rate)


# ---------------------------------------------------------------- prior shape per item


def test_item_shape_mixed_by_hand():
    s = item_shape(make_item("a", MIXED, MIXED_ADMITTED), voices=2)
    assert s.parseable == 5
    assert s.unparseable_share == pytest.approx(1 / 6)
    assert s.histogram == {"0,1": 2, "2,2": 2, "1.5,3": 1}  # (none) is not an opening
    assert s.support == 3
    assert s.mode == "0,1"  # tie with 2,2: first seen wins
    assert s.modal_share == pytest.approx(2 / 5)
    assert s.mode_admissible == 1
    assert s.distinct_passing == 2
    assert s.off_mode_pass_rate == pytest.approx(1 / 3)  # one admitted 2,2 out of 3 off-mode
    assert s.alphabet_support == 2  # 1.5,3 is an opening but not in the alphabet
    assert s.alphabet_share == pytest.approx(2 / 16)
    # all completions, (none) a bucket: counts 2, 2, 1, 1 of 6
    assert s.top_share == pytest.approx(2 / 6)
    h = 2 * (1 / 3) * math.log2(3) + 2 * (1 / 6) * math.log2(6)
    assert s.entropy_bits == pytest.approx(h)
    assert s.effective_openings == pytest.approx(2**h)
    assert s.normalized_entropy == pytest.approx(h / math.log2(6))


def test_mode_tie_goes_to_the_first_seen_and_inadmissible_mode():
    s = item_shape(make_item("t", ["2,2", "0,1", "0,1", "2,2"], [False, True, True, False]), 2)
    assert s.mode == "2,2"
    assert s.mode_admissible == 0
    assert s.off_mode_pass_rate == pytest.approx(1.0)


def test_all_unparseable_item():
    s = item_shape(make_item("u", [NO_OPENING] * 6, [False] * 6), voices=2)
    assert (s.parseable, s.support, s.mode, s.mode_admissible) == (0, 0, None, 0)
    assert math.isnan(s.modal_share)  # reference behaviour
    assert s.distinct_passing is None and s.off_mode_pass_rate is None
    assert s.unparseable_share == 1.0
    assert (s.top_share, s.entropy_bits, s.effective_openings, s.normalized_entropy) == (
        1.0, 0.0, 1.0, 0.0,
    )
    assert s.alphabet_share == 0.0


def test_all_identical_item():
    s = item_shape(make_item("i", ["0,1"] * 6, [True] * 6), voices=2)
    assert (s.support, s.mode, s.modal_share, s.mode_admissible, s.distinct_passing) == (
        1, "0,1", 1.0, 1, 1,
    )
    assert s.off_mode_pass_rate is None  # denominator 0: does not contribute
    assert (s.top_share, s.entropy_bits, s.normalized_entropy) == (1.0, 0.0, 0.0)
    assert s.alphabet_share == pytest.approx(1 / 16)


def test_normalized_entropy_stays_within_one_outside_the_alphabet():
    # G = 8 distinct openings, none in a 2-entry alphabet: entropy 3 bits over 8 possible buckets
    openings = [f"{k}.5,0" for k in range(8)]
    s = item_shape(make_item("x", openings, [False] * 8, alphabet_size=2), voices=2)
    assert s.entropy_bits == pytest.approx(3.0)
    assert s.normalized_entropy == pytest.approx(1.0)
    assert s.alphabet_support == 0 and s.support == 8


def test_in_alphabet():
    assert in_alphabet("0,3", 2) and in_alphabet("3,3,0", 3)
    assert not any(in_alphabet(o, 2) for o in ["4,0", "0,1,2,0", "5", "1.5,3", "-1,0", NO_OPENING])


def test_empty_alphabet_item_has_no_share():
    s = item_shape(make_item("o", ["0,1"] * 6, [False] * 6, alphabet_size=0), voices=2)
    assert s.alphabet_share is None and s.alphabet_support == 0


# ---------------------------------------------------------------- aggregates


def test_distribution_median_is_the_upper_element():
    d = distribution([4, 1, 3, 2, None])
    assert (d.n, d.mean, d.median, d.min, d.max) == (4, 2.5, 3.0, 1.0, 4.0)
    assert distribution([None]).n == 0 and math.isnan(distribution([]).mean)


def test_aggregates_reference_nan_and_nan_free_variant(tmp_path):
    items = [
        make_item("a", MIXED, MIXED_ADMITTED),
        make_item("b", ["0,1"] * 6, [True] * 6),
        make_item("c", [NO_OPENING] * 6, [False] * 6),
    ]
    shape = prior_shape(read_eval(write_items(tmp_path / "e.jsonl", items)))
    assert math.isnan(shape.modal_share_mean_reference)
    nan_free = shape.stats["modal_share_parseable_items"]
    assert (nan_free.n, nan_free.mean) == (2, pytest.approx((0.4 + 1.0) / 2))
    support = shape.stats["support"]
    assert (support.n, support.mean, support.median, support.min, support.max) == (
        3, pytest.approx(4 / 3), 1.0, 0.0, 3.0,
    )
    assert shape.stats["mode_admissible"].mean == pytest.approx(2 / 3)
    assert shape.stats["distinct_passing"].n == 2  # item c contributes nothing
    assert shape.stats["distinct_passing"].mean == pytest.approx(1.5)
    assert shape.stats["off_mode_pass_rate"].n == 1  # only item a has off-mode completions
    assert shape.stats["unparseable_share"].mean == pytest.approx((1 / 6 + 0 + 1) / 3)
    assert shape.stats["alphabet_share"].max == pytest.approx(2 / 16)
    pooled = shape.pooled
    assert pooled["admitted_completions"] == 8 and pooled["completions"] == 18
    assert pooled["top_first_measure_share"] == pytest.approx(7 / 8)  # 0,1 admitted 1 + 6 times
    assert pooled["top_share_all_completions"] == pytest.approx(8 / 18)  # 0,1: 2 + 6
    assert pooled["distinct_openings_all_completions"] == 4


def test_all_parseable_reference_mean_equals_nan_free(tmp_path):
    items = [make_item("a", MIXED, MIXED_ADMITTED), make_item("b", ["0,1"] * 6, [True] * 6)]
    shape = prior_shape(read_eval(write_items(tmp_path / "e.jsonl", items)))
    assert shape.modal_share_mean_reference == pytest.approx(0.7)
    assert shape.stats["modal_share_parseable_items"].mean == pytest.approx(0.7)


def _reject(name):
    raise ValueError(f"non-standard JSON constant {name}")


def test_json_is_strict_and_png_is_written(tmp_path):
    items = [make_item("c", [NO_OPENING] * 6, [False] * 6)]  # the all-unparseable file
    shape = prior_shape(read_eval(write_items(tmp_path / "e.jsonl", items)))
    out = write_prior_shape_json(shape, tmp_path / "ps.json")
    data = json.loads(out.read_text(), parse_constant=_reject)
    assert data["kind"] == "prior_shape"
    assert data["modal_share_mean_reference"] is None
    assert data["modal_share_mean_reference_is_nan"] is True
    assert data["stats"]["modal_share_parseable_items"]["n"] == 0
    assert data["stats"]["support"]["max"] == 0.0
    assert data["pooled"]["top_first_measure_share"] is None
    assert data["items"][0]["modal_share"] is None
    png = write_prior_shape_png(shape, tmp_path / "ps.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
