"""`counterpoint replicate --grid` without running anything: the grid spec and its refusals, every
cell's config checked up front, the interval math, and the per-cell aggregation over synthetic
run directories written by the real writers (records/run_dir.py RunDir, services/tree_round.py's
tree_round_record over real search rounds, evals/eval_file.py write_eval)."""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from rich.console import Console

from config.search import SearchConfig
from evals.grid import (NO_INTERVAL, ArmFiles, aggregate, grid_table, read_grid_json, round_summaries,
                        t_interval, tree_arm_metrics, write_grid_json, write_grid_png)
from evals.eval_file import EvalItem, GenerationSettings, header_for, write_eval
from search.prompts import mode_of
from search.round import grow_round
from search.tree import Generation
from records.exec_result import ExecResult
from records.run_dir import RunDir
from services.replicate import (Arm, Cell, GridSpecError, ReplicatePlan, arm_name, check_grid, grid_cells,
                                parse_grid, plan_arms)
from services.tree_round import tree_round_record

REPO = Path(__file__).resolve().parents[1]
SMOKE = REPO / "configs" / "smoke.yaml"


# ------------------------------------------------------------------------------- interval math


def test_t_interval_matches_the_t_table():
    got = t_interval([1.0, 2.0, 3.0])
    half = 4.302652729749464 * 1.0 / np.sqrt(3)  # t(0.975, 2), s = 1
    assert got.mean == pytest.approx(2.0)
    assert (got.low, got.high) == (pytest.approx(2 - half), pytest.approx(2 + half))
    two = t_interval([0.5, 1.5])  # t(0.975, 1) = 12.706, s = 0.7071
    assert two.high - two.mean == pytest.approx(12.706204736 * np.sqrt(0.5) / np.sqrt(2))


def test_one_seed_has_no_interval_and_none_has_no_mean():
    one = t_interval([0.7])
    assert one.mean == 0.7 and one.low is None and one.high is None
    assert NO_INTERVAL in one.text() and one.method == NO_INTERVAL
    assert t_interval([]).mean is None and t_interval([]).text() == "n/a"
    with pytest.raises(ValueError, match="finite"):
        t_interval([1.0, float("nan")])


def test_t_interval_covers_the_mean_95_percent_of_the_time():
    rng = np.random.default_rng(0)
    hits = 0
    reps = 4000
    for _ in range(reps):
        x = rng.normal(3.0, 2.0, size=3)
        iv = t_interval(x.tolist())
        hits += iv.low <= 3.0 <= iv.high
    # binomial sd at 0.95 over 4000 draws: 0.0034; a z-interval (1.96) would cover ~0.81 at n=3
    assert abs(hits / reps - 0.95) < 0.015


# ------------------------------------------------------------------------------- grid spec


def test_cells_are_the_cartesian_product_in_axis_order():
    axes = parse_grid(["learner.lr=3e-5,1e-4", "learner.advantage=grpo_valid_only,rank_valid_only"])
    cells = grid_cells(axes)
    assert [c.overrides for c in cells] == [
        ("learner.lr=3e-5", "learner.advantage=grpo_valid_only"),
        ("learner.lr=3e-5", "learner.advantage=rank_valid_only"),
        ("learner.lr=1e-4", "learner.advantage=grpo_valid_only"),
        ("learner.lr=1e-4", "learner.advantage=rank_valid_only"),
    ]
    assert cells[0].name == "c1_lr-3e-5_advantage-grpo_valid_only"
    assert len({c.name for c in cells}) == 4
    assert arm_name(cells[3], 2) == "c4_lr-1e-4_advantage-rank_valid_only__seed2"
    assert grid_cells([]) == [Cell("")] and arm_name(Cell(""), 7) == "seed7"  # a plain replicate
    # a YAML list stays one value; two axes sharing a leaf are named by their whole key
    assert parse_grid(["learner.lora.target_modules=[q_proj,v_proj],[q_proj]"]) == [
        ("learner.lora.target_modules", ["[q_proj,v_proj]", "[q_proj]"])]
    shared = grid_cells(parse_grid(["learner.lora.r=4,8", "rollout.r=1"]))
    assert shared[0].name == "c1_learner-lora-r-4_rollout-r-1"


@pytest.mark.parametrize("specs, sets, message", [
    (["learner.lr"], [], "expected KEY=v1,v2"),
    (["learner.lr="], [], "expected KEY=v1,v2"),
    (["learner.lr=1e-4,,2e-4"], [], "an empty value"),
    (["learner.lr=1e-4,1e-4"], [], "a value is repeated"),
    (["seed=1,2"], [], "the seed is --seeds"),
    (["trainer.runs_dir=a,b"], [], "replicate places each arm"),
    (["learner.lr=1,2", "learner.lr=3,4"], [], "overlaps --grid learner.lr"),
    (["learner.lora=1,2", "learner.lora.r=3,4"], [], "overlaps --grid learner.lora"),
    (["learner.lr=1e-4,2e-4"], ["learner.lr=3e-4"], "also given by --set learner.lr"),
])
def test_bad_grid_options_are_refused(specs, sets, message):
    with pytest.raises(GridSpecError, match=message):
        parse_grid(specs, sets)


def test_every_cell_config_is_checked_before_anything_runs():
    cells, modes = check_grid(SMOKE, ["trainer.steps=1"], ["learner.lr=1e-3,1e-4", "learner.beta=0,0.04"], [1, 2])
    assert len(cells) == 4 and set(modes.values()) == {"flat"}

    def refusal(*args) -> str:
        with pytest.raises(GridSpecError) as err:
            check_grid(SMOKE, *args)
        text = str(err.value)
        assert "\n" not in text  # one line
        return text

    assert "learner.no_such_key" in refusal([], ["learner.no_such_key=1,2"], [1])
    text = refusal([], ["learner.lr=1e-4,fast"], [1])
    assert text.startswith("grid cell c2_lr-fast (learner.lr=fast)") and "learner.lr" in text
    assert "trainer.steps" in refusal([], ["trainer.steps=1,0"], [1])  # a bound of the schema
    # A cell that only the cross-field check refuses (tree rollouts need the code-exec grader).
    assert "code-exec" in refusal([], ["trainer.rollout_mode=flat,tree"], [1])
    # A flat cell is checked as its arms run it, with the in-run eval replicate adds: that eval
    # is held-out only, so a config evaluating the train split is refused before any arm runs.
    text = refusal(["eval.split=train"], ["learner.lr=1e-3,1e-4"], [1], ["eval.generations=2"])
    assert text.startswith("grid cell c1_lr-1e-3") and "eval.before_and_after" in text
    assert "eval.max_tokens" in refusal([], [], [1], ["eval.max_tokens=0"])


@pytest.mark.parametrize("key", ["seed", "eval.seed", "eval.before_and_after", "trainer.runs_dir"])
def test_keys_replicate_sets_itself_are_refused_in_set(key):
    with pytest.raises(GridSpecError, match=f"--set {key}: "):
        check_grid(SMOKE, [f"{key}=1"], [], [1])


def test_plan_gives_each_flat_arm_its_own_runs_before_and_after_evals(tmp_path):
    cells = grid_cells(parse_grid(["learner.lr=1e-3,1e-4"]))
    plan = ReplicatePlan(SMOKE, [1, 2], tmp_path, cells=cells, modes={c.name: "flat" for c in cells})
    arms = plan_arms(plan)
    assert [(a.cell, a.seed) for a in arms] == [(cells[0].name, 1), (cells[0].name, 2),
                                                 (cells[1].name, 1), (cells[1].name, 2)]
    run = tmp_path / "runs" / f"{cells[0].name}__seed2"
    assert (arms[1].run_dir, arms[1].before_file, arms[1].eval_file) == (
        run, run / "heldout_before.jsonl", run / "heldout_after.jsonl")
    tree = ReplicatePlan(SMOKE, [1], tmp_path, cells=cells, modes={c.name: "tree" for c in cells})
    assert all(a.eval_file is None and a.before_file is None for a in plan_arms(tree))


# ------------------------------------------------------------------------------- flat arms


def _eval(path: Path, passes: list[int], g: int = 4, seed: int = 1, max_new_tokens: int = 8) -> Path:
    items = []
    for i, p in enumerate(passes):
        admitted = [k < p for k in range(g)]
        completions = [f"c{i}-{k}" for k in range(g)]
        items.append(EvalItem(item_id=f"item{i}", completions=completions, openings=["0 1"] * g, lengths=[3] * g,
                              rewards=[1.0 if a else 0.25 for a in admitted], verdicts=["ok"] * g, admitted=admitted,
                              distinct_exact=g, distinct_stripped=g, pass_count=p, alphabet_size=16))
    gen = GenerationSettings(generations=g, max_new_tokens=max_new_tokens, temperature=1.0, top_p=1.0, top_k=-1,
                             seed=seed)
    return write_eval(path, header_for(items, generation=gen, model="tiny-random", voices=2), items)


def _flat_run(root: Path, pass_rates: list[float], zero_std: list[float]) -> Path:
    run = RunDir(root).create()
    for step, (p, z) in enumerate(zip(pass_rates, zero_std), start=1):
        run.append_metrics(step, {"reward_mean": p, "pass_rate": p, "frac_reward_zero_std": z, "ppl_ratio": 1.0})
        run.append_timing(step, 1.0, {"gen": 0.5, "update_actor": 0.5})
    run.append_metrics(len(pass_rates) + 1, {"pass_rate": 1.0})  # a step that never committed: not counted
    return run.root


def test_flat_cells_aggregate_after_and_after_minus_before(tmp_path):
    before = _eval(tmp_path / "before_s1.jsonl", [1, 1, 0, 2], seed=1)  # 4 / 16 = 25 %
    before2 = _eval(tmp_path / "before_s2.jsonl", [2, 1, 0, 1], seed=2)  # 25 %
    arms = [
        # cell a: after 50 % and 75 % -> +25 and +50 points
        ArmFiles("a", 1, "completed", _flat_run(tmp_path / "a1", [0.5, 0.75], [0.5, 0.0]),
                 _eval(tmp_path / "a1.jsonl", [2, 2, 2, 2], seed=1), before),
        ArmFiles("a", 2, "completed", _flat_run(tmp_path / "a2", [0.25], [1.0]),
                 _eval(tmp_path / "a2.jsonl", [3, 3, 3, 3], seed=2), before2),
        # cell b: one seed completed, one failed; the completed one's before is not comparable
        ArmFiles("b", 1, "completed", _flat_run(tmp_path / "b1", [0.5], [0.5]),
                 _eval(tmp_path / "b1.jsonl", [4, 4, 4, 4], seed=1, max_new_tokens=16), before),
        ArmFiles("b", 2, "failed", tmp_path / "b2", tmp_path / "b2.jsonl", before2,
                 error="`train --config ...` exited 1 (log: b2.log)"),
    ]
    report = aggregate([{"cell": "a", "overrides": ["learner.lr=1e-3"]},
                        {"cell": "b", "overrides": ["learner.lr=1e-4"]}], arms)
    path = write_grid_json(report, tmp_path / "grid.json")
    report = read_grid_json(path)  # everything below from the file
    a, b = report["cells"]
    m = a["metrics"]
    assert m["heldout_pass_rate"]["values"] == [50.0, 75.0]
    assert m["heldout_pass_rate_delta"]["values"] == [25.0, 50.0]
    iv = t_interval([25.0, 50.0])
    assert (m["heldout_pass_rate_delta"]["mean"], m["heldout_pass_rate_delta"]["low"],
            m["heldout_pass_rate_delta"]["high"]) == (37.5, pytest.approx(iv.low), pytest.approx(iv.high))
    # mean reward over completions: passes 1.0, fails 0.25
    assert m["heldout_reward"]["values"] == [pytest.approx(0.625), pytest.approx(0.8125)]
    assert m["heldout_reward_delta"]["values"] == [pytest.approx(0.625 - 0.4375), pytest.approx(0.8125 - 0.4375)]
    assert m["train_pass_rate"]["values"] == [pytest.approx(62.5), pytest.approx(25.0)]
    assert m["train_frac_reward_zero_std"]["values"] == [pytest.approx(0.25), pytest.approx(1.0)]
    assert a["completed"] == 2 and a["seeds"] == [1, 2]

    assert b["completed"] == 1 and b["metrics"]["heldout_pass_rate"]["n"] == 1
    assert b["metrics"]["heldout_pass_rate"]["interval"] == NO_INTERVAL
    assert "heldout_pass_rate_delta" not in b["metrics"]
    notes = {arm["seed"]: arm["notes"] for arm in b["arms"]}
    assert "max_new_tokens" in notes[1][0] and "after - before not computed" in notes[1][0]
    assert notes[2] == ["arm failed: `train --config ...` exited 1 (log: b2.log)"]

    console = Console(record=True, width=200)
    console.print(grid_table(report))
    text = console.export_text()
    assert "held-out pass rate after - before (points)" in text
    assert f"37.500 [{iv.low:.3f}, {iv.high:.3f}]" in text
    assert f"100.000 ({NO_INTERVAL})" in text
    png = write_grid_png(report, tmp_path / "grid.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ------------------------------------------------------------------------------- tree arms


def _scripted_policy(prompts, n):
    mode = mode_of(prompts[0])
    return [Generation(text=f"{mode} {k}\n```python\nprint({k})\n```\n", prompt_token_ids=[1, 2],
                       token_ids=[3, 4], logprobs=[-0.1, -0.2]) for k in range(n)]


def _scripted_execute(quality: dict[int, float]):
    """Sibling k of every expansion: status ok (val quality[k], test quality[k] - 0.2k: the best on
    validation is not the best on test) or crashed."""
    def execute(items):
        out = []
        for _, text in items:
            k = int(text.split()[1])
            q = quality.get(k)
            out.append(ExecResult(
                task_id=CASE["id"], status="ok" if q is not None else "crashed", reward=-0.5 if q is None else q,
                val_metric=q, test_metric=None if q is None else q - 0.2 * k, oriented=q, exec_time=0.1,
                term_tail="" if q is not None else "Traceback", exc_type=None, message=None, isolation="",
                code="from sklearn.linear_model import LogisticRegression\n" if k % 2 else
                "from sklearn.ensemble import RandomForestClassifier\n"))
        return out
    return execute


CASE = {"id": "tabular-binary", "prompt_messages": [{"role": "user", "content": "task"}],
        "task": {"metric": "roc_auc", "direction": "higher", "description": "d", "preview": "p"}}


def _tree_run(root: Path, qualities: list[dict[int, float]], untrained: dict[int, float] | None = None) -> list:
    """A tree run written as the driver writes it: per trained step the round through
    tree_round_record, its search_* scalars, then the timing line; optionally one more round
    written without a timing line (generated, never trained)."""
    run = RunDir(root).create()
    cfg = SearchConfig(nodes_per_round=4, expansions_per_round=2, num_drafts=2, seed=1)
    tree, rounds = None, []
    for step, quality in enumerate([*qualities, *([untrained] if untrained else [])], start=1):
        rnd = grow_round(tree, CASE, cfg, _scripted_policy, _scripted_execute(quality), step, run_seed=0)
        from search.diagnostics import round_diagnostics
        rnd.summary["diagnostics"] = round_diagnostics(rnd.nodes, rnd.tree, cfg.select_on, {})
        tree = rnd.tree
        rec = SimpleNamespace(rollouts=SimpleNamespace(search=rnd), advantages=[0.0] * len(rnd.nodes), step=step)
        scalars = tree_round_record(run, rec, "code-exec", 0)
        if step <= len(qualities):
            run.append_metrics(step, scalars)
            run.append_timing(step, 1.0, {"gen": 0.5, "score": 0.5})
            rounds.append(rnd)
    return rounds


def test_tree_cells_report_round_best_honest_and_diagnostics(tmp_path):
    qualities = [{0: 0.6, 1: 0.7}, {0: 0.65}, {1: 0.9}, {0: 0.7, 1: 0.75}]
    rounds = _tree_run(tmp_path / "t1", qualities, untrained={0: 0.99})
    assert RunDir(tmp_path / "t1").untrained_rounds() == [5]
    assert len(round_summaries(tmp_path / "t1")) == 4  # the untrained round 5 is not read
    figures, notes = tree_arm_metrics(tmp_path / "t1", last_k=3)
    assert notes == []
    summaries = [r.summary for r in rounds]
    task = "tabular-binary"
    # hand check of the final round: siblings 0 (val .70, test .70) and 1 (val .75, test .55) of
    # both expansions: the oracle round-best is .70, the node chosen on validation tests .55
    assert figures[f"round_best_final/{task}"] == pytest.approx(0.70)
    assert figures[f"honest_final/{task}"] == pytest.approx(0.55)
    assert figures[f"round_best_last_k/{task}"] == pytest.approx((0.65 + 0.70 + 0.70) / 3)  # round 3: .9 - .2
    assert figures[f"round_best_last_k/{task}"] == pytest.approx(
        statistics.fmean(s["best_test_metric"] for s in summaries[-3:]))
    assert figures[f"honest_last_k/{task}"] == pytest.approx(
        statistics.fmean(s["honest_test_metric"] for s in summaries[-3:]))
    diags = [s["diagnostics"] for s in summaries]
    assert figures["valid_share"] == pytest.approx(statistics.fmean(d["valid_share"] for d in diags))
    assert figures["frac_groups_zero_reward_std"] == pytest.approx(
        statistics.fmean(d["frac_groups_zero_reward_std"] for d in diags))
    assert figures["model_families"] == pytest.approx(statistics.fmean(d["model_families"] for d in diags))
    rates = [d["improve_success_rate"] for d in diags if d["improve_success_rate"] is not None]
    assert rates and figures["improve_success_rate"] == pytest.approx(statistics.fmean(rates))

    assert not [k for k in figures if k.startswith("heldout_")]  # no held-out eval in this run
    # With eval.before_and_after the run holds drafts per task before and after (test-rows rewards).
    _eval(tmp_path / "t1" / "heldout_before.jsonl", [1, 0])
    _eval(tmp_path / "t1" / "heldout_after.jsonl", [3, 0])
    figures, notes = tree_arm_metrics(tmp_path / "t1", last_k=3)
    assert notes == [] and figures["heldout_test_reward/item0"] == pytest.approx((3 * 1.0 + 0.25) / 4)
    assert figures["heldout_test_reward_delta/item0"] == pytest.approx(2 * (1.0 - 0.25) / 4)
    assert figures["heldout_test_reward_delta/item1"] == 0.0

    _tree_run(tmp_path / "t2", [{0: 0.5}, {1: 0.6}, {0: 0.7, 1: 0.72}, {0: 0.6}])
    arms = [ArmFiles("t", s, "completed", tmp_path / f"t{s}", None, mode="tree") for s in (1, 2)]
    report = aggregate([{"cell": "t", "overrides": ["learner.lr=1e-4"]}], arms, last_k=3)
    m = report["cells"][0]["metrics"]
    assert m[f"round_best_final/{task}"]["n"] == 2
    assert m[f"round_best_final/{task}"]["values"] == [pytest.approx(0.70), pytest.approx(0.60)]
    assert m[f"round_best_final/{task}"]["low"] is not None
    console = Console(record=True, width=200)
    console.print(grid_table(report))
    text = console.export_text()
    assert f"round-best test metric, mean of last 3 rounds (oracle), task {task}" in text
    assert "honest held-out metric (node chosen on validation), final round" in text
    assert "distinct model families" in text
    assert write_grid_png(report, tmp_path / "grid.png").stat().st_size > 0


def test_an_unreadable_arm_is_noted_not_fatal(tmp_path):
    run = RunDir(tmp_path / "bad").create()
    run.append_timing(1, 1.0, {"gen": 1.0})
    (run.round_dir(1)).mkdir()
    (run.round_dir(1) / "code-exec__summary_0.json").write_text(json.dumps({"step": 1, "rows": 4}))
    _tree_run(tmp_path / "good", [{0: 0.5}])
    report = aggregate([{"cell": "t", "overrides": []}],
                       [ArmFiles("t", 1, "completed", run.root, None, mode="tree"),
                        ArmFiles("t", 2, "completed", tmp_path / "good", None, mode="tree")])
    cell = report["cells"][0]
    assert "not a tree round summary" in cell["arms"][0]["notes"][0]
    assert cell["metrics"]["round_best_final/tabular-binary"]["n"] == 1


def test_arm_name_is_its_run_directory(tmp_path):
    assert Arm(1, tmp_path / "runs" / "x__seed1", None).name == "x__seed1"
