"""compare: comparability checks, the bootstrap, and the reported difference."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from evals.compare import (
    NotComparableError,
    bootstrap_difference,
    compare,
    run_matrix,
    write_comparison_json,
    write_comparison_png,
)
from evals.eval_file import (
    NO_OPENING,
    GenerationSettings,
    header_for,
    item_record,
    read_eval,
    write_eval,
)


@dataclass
class Score:
    admitted: bool
    verdict: str


G = 4


def gen(seed: int = 0, **changes) -> GenerationSettings:
    base = dict(generations=G, max_new_tokens=64, temperature=1.0, top_p=1.0, top_k=-1,
                seed=seed, eos_token_ids=[2])
    return GenerationSettings(**{**base, **changes})


def write_run(
    path: Path, passes: dict[str, int], generation=None, model="tiny", **header_kw
) -> Path:
    """One eval run: item id -> number of admitted completions out of G."""
    items = []
    for item_id, k in passes.items():
        openings = ["0,1"] * k + ["2,2"] * (G - k - 1) + [NO_OPENING] * (1 if k < G else 0)
        scores = [Score(i < k, "admitted" if i < k else "parallels") for i in range(G)]
        completions = [f"{item_id} completion {i}" for i in range(G)]
        items.append(item_record(item_id, completions, [5] * G, scores, 16, openings=openings))
    header = header_for(items, generation=generation or gen(), model=model, voices=2, **header_kw)
    return write_eval(path, header, items)


IDS = [f"p{i:02d}" for i in range(10)]


def run(tmp_path, name, counts, **kw):
    return read_eval(write_run(tmp_path / f"{name}.jsonl", dict(zip(IDS, counts)), **kw))


# ---------------------------------------------------------------- refusals


def test_refuses_different_prompt_sets(tmp_path):
    base = run(tmp_path, "base", [1] * 10)
    other = read_eval(write_run(tmp_path / "arm.jsonl", {f"q{i}": 1 for i in range(10)}))
    with pytest.raises(NotComparableError, match=r"prompt_set\.ids_sha256") as e:
        compare([base], [other])
    assert "arm.jsonl" in str(e.value) and "base.jsonl" in str(e.value)
    fewer = read_eval(write_run(tmp_path / "few.jsonl", dict(zip(IDS[:5], [1] * 5))))
    with pytest.raises(NotComparableError, match=r"prompt_set\.n_items: 10 vs 5"):
        compare([base], [fewer])
    other_split = run(tmp_path, "split", [1] * 10, split="dev")
    with pytest.raises(NotComparableError, match=r"prompt_set\.split: 'heldout' vs 'dev'"):
        compare([base], [other_split])
    edited = run(tmp_path, "edited", [1] * 10, prompts_sha256="b" * 64)
    base_h = run(tmp_path, "base_h", [1] * 10, prompts_sha256="a" * 64)
    with pytest.raises(NotComparableError, match=r"prompt_set\.prompts_sha256"):
        compare([base_h], [edited])


def test_refuses_different_generation_settings_naming_them(tmp_path):
    base = run(tmp_path, "base", [1] * 10)
    hot = run(tmp_path, "hot", [1] * 10, generation=gen(temperature=0.7, max_new_tokens=32))
    with pytest.raises(NotComparableError) as e:
        compare([base], [run(tmp_path, "ok", [1] * 10, generation=gen(seed=1)), hot])
    assert "generation.temperature: 1.0 vs 0.7" in str(e.value)
    assert "generation.max_new_tokens: 64 vs 32" in str(e.value)
    assert "seed" not in str(e.value)


def test_refuses_different_scoring_and_voices(tmp_path):
    from evals.eval_file import ScoringSettings

    cp = ScoringSettings(style="common-practice", checker="reference")
    film = ScoringSettings(style="film-ambient", checker="reference")
    base = run(tmp_path, "base", [1] * 10, scoring=cp)
    with pytest.raises(NotComparableError, match=r"scoring\.style: 'common-practice' vs 'film"):
        compare([base], [run(tmp_path, "film", [1] * 10, scoring=film)])
    compare([base], [run(tmp_path, "unknown", [1] * 10)], n_boot=10)  # absent: not compared
    lines = (tmp_path / "base.jsonl").read_text().splitlines()
    header = json.loads(lines[0])
    (tmp_path / "n3.jsonl").write_text("\n".join([json.dumps({**header, "voices": 3}), *lines[1:]]))
    with pytest.raises(NotComparableError, match="voices: 2 vs 3"):
        compare([base], [read_eval(tmp_path / "n3.jsonl")])


def test_eos_ids_are_a_set():
    assert gen(eos_token_ids=[5, 2, 5]).eos_token_ids == [2, 5]
    a, b = gen(eos_token_ids=[5, 2]), gen(eos_token_ids=[2, 5])
    assert a.comparable_fields() == b.comparable_fields()


def test_seed_fixture_path_and_model_may_differ_but_warn(tmp_path):
    base = run(tmp_path, "base", [1] * 10, fixture_source="/a/heldout.json")
    arms = [run(tmp_path, f"arm{s}", [2] * 10, generation=gen(seed=s)) for s in (1, 1, 2)]
    arms.append(run(tmp_path, "arm9", [2] * 10, generation=gen(seed=9), model="other",
                    fixture_source="/a/heldout.json"))
    result = compare([base], arms, n_boot=50)
    assert result.metrics["pass_rate"].difference == pytest.approx(25.0)
    assert any("arm runs repeat a generation seed ([1, 1, 2, 9])" in w for w in result.warnings)
    assert sum("fixture_source" in w for w in result.warnings) == 3
    assert [w for w in result.warnings if "model 'other' differs from 'tiny'" in w]
    clean = compare([base], [arms[3]], n_boot=50)
    assert [w for w in clean.warnings if "repeat" in w or "fixture_source" in w] == []


# ---------------------------------------------------------------- bootstrap


def test_bootstrap_is_deterministic_under_a_seed():
    rng = np.random.default_rng(1)
    base, arm = rng.random((2, 30)), rng.random((3, 30))
    for paired in (False, True):
        a = bootstrap_difference(base, arm, paired=paired, n_boot=500, seed=7)
        b = bootstrap_difference(base, arm, paired=paired, n_boot=500, seed=7)
        c = bootstrap_difference(base, arm, paired=paired, n_boot=500, seed=8)
        assert np.array_equal(a, b)
        assert not np.array_equal(a, c)


def test_paired_bootstrap_of_identical_runs_is_exactly_zero_unpaired_is_not():
    x = np.random.default_rng(2).random((1, 40))
    assert np.all(bootstrap_difference(x, x, paired=True, n_boot=300, seed=0) == 0)
    assert np.any(bootstrap_difference(x, x, paired=False, n_boot=300, seed=0) != 0)


def test_paired_bootstrap_of_a_constant_shift_is_the_shift():
    x = np.random.default_rng(3).random((1, 25)) * 0.5
    reps = bootstrap_difference(x, x + 0.1, paired=True, n_boot=200, seed=0)
    assert np.allclose(reps, 0.1)


def test_bootstrap_resamples_runs():
    # item-constant runs: only the run draw matters. Arm runs 0.2 and 0.4, base 0:
    # each replicate is the mean of two draws from {0.2, 0.4}.
    base = np.zeros((1, 10))
    arm = np.stack([np.full(10, 0.2), np.full(10, 0.4)])
    reps = bootstrap_difference(base, arm, paired=False, n_boot=2000, seed=0)
    assert set(np.round(reps, 12)) == {0.2, 0.3, 0.4}
    assert np.mean(np.isclose(reps, 0.3)) == pytest.approx(0.5, abs=0.05)


def test_bootstrap_matches_an_explicit_loop():
    """The weighted (multinomial-count) form equals literally resampling runs and items."""
    rng = np.random.default_rng(4)
    base, arm = rng.random((2, 12)), rng.random((3, 12))
    n_boot, seed = 50, 11
    fast = bootstrap_difference(base, arm, paired=True, n_boot=n_boot, seed=seed)
    draw = np.random.default_rng(seed)
    c_arm = draw.multinomial(12, np.full(12, 1 / 12), size=n_boot)
    w_arm = draw.multinomial(3, np.full(3, 1 / 3), size=n_boot)
    w_base = draw.multinomial(2, np.full(2, 1 / 2), size=n_boot)
    for b in range(n_boot):
        items = np.repeat(np.arange(12), c_arm[b])
        arm_runs = np.repeat(np.arange(3), w_arm[b])
        base_runs = np.repeat(np.arange(2), w_base[b])
        slow = arm[np.ix_(arm_runs, items)].mean() - base[np.ix_(base_runs, items)].mean()
        assert fast[b] == pytest.approx(slow)


def test_bootstrap_refuses_mismatched_shapes():
    with pytest.raises(ValueError, match="item axis"):
        bootstrap_difference(np.zeros((1, 3)), np.zeros((1, 4)), paired=True, n_boot=5, seed=0)


# ---------------------------------------------------------------- compare


def test_compare_point_estimates_by_hand(tmp_path):
    base = run(tmp_path, "base", [0, 1, 0, 0, 2, 0, 0, 0, 0, 0])  # 3/40 pass, 2/10 covered
    arms = [
        run(tmp_path, "arm1", [1, 1, 0, 0, 2, 0, 0, 1, 0, 0], generation=gen(seed=1)),  # 5/40, 4/10
        run(tmp_path, "arm2", [2, 1, 0, 0, 4, 0, 0, 0, 1, 0], generation=gen(seed=2)),  # 8/40, 4/10
    ]
    result = compare([base], arms, paired=True, n_boot=400, seed=3)
    pr = result.metrics["pass_rate"]
    assert pr.base_runs == [pytest.approx(7.5)]
    assert pr.arm_runs == [pytest.approx(12.5), pytest.approx(20.0)]
    assert pr.difference == pytest.approx(16.25 - 7.5)
    cov = result.metrics["coverage"]
    assert cov.difference == pytest.approx(40.0 - 20.0)
    for m in (pr, cov):
        assert m.low <= m.difference <= m.high
        assert re.fullmatch(r"[+-]\d+\.\d\d points, 95% interval \[[+-]\d+\.\d\d, [+-]\d+\.\d\d\]",
                            m.sentence())
    assert "percentile bootstrap, B=400, seed=3" in result.method
    assert "paired" in result.method
    again = compare([base], arms, paired=True, n_boot=400, seed=3)
    assert again.metrics == result.metrics


def test_run_matrix_orders_by_item_id(tmp_path):
    r = run(tmp_path, "r", list(range(4)) + [4] * 6)
    m = run_matrix([r], list(reversed(IDS)), "pass_rate")
    assert m.shape == (1, 10)
    assert m[0, -4:].tolist() == [0.75, 0.5, 0.25, 0.0]
    assert run_matrix([r], IDS, "coverage")[0, :2].tolist() == [0.0, 1.0]


def test_a_large_effect_excludes_zero_and_no_effect_straddles_it(tmp_path):
    rng = np.random.default_rng(5)
    ids = [f"i{k:03d}" for k in range(60)]
    base = read_eval(write_run(tmp_path / "b.jsonl", dict(zip(ids, rng.integers(0, 2, 60)))))
    strong = [
        read_eval(write_run(tmp_path / f"s{s}.jsonl", dict(zip(ids, rng.integers(2, 5, 60))),
                            generation=gen(seed=s)))
        for s in range(3)
    ]
    result = compare([base], strong, paired=True, n_boot=1000, seed=0)
    assert result.metrics["pass_rate"].low > 0
    same = compare([base], [base], paired=True, n_boot=1000, seed=0).metrics["pass_rate"]
    assert (same.difference, same.low, same.high) == (0.0, 0.0, 0.0)


def test_comparison_json_and_png(tmp_path):
    base = run(tmp_path, "base", [1] * 10)
    arms = [run(tmp_path, f"a{s}", [2, 1] * 5, generation=gen(seed=s)) for s in range(3)]
    result = compare([base], arms, n_boot=100, seed=0)
    data = json.loads(write_comparison_json(result, tmp_path / "c.json").read_text())
    assert data["kind"] == "comparison"
    assert data["metrics"]["pass_rate"]["difference"] == pytest.approx(37.5 - 25.0)
    assert data["method"] == result.method
    png = write_comparison_png(result, tmp_path / "c.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
