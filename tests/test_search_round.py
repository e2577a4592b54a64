"""Whole rounds of tree search: a scripted policy (deterministic completions keyed on the prompt's
mode) through the REAL CodeExecTask and its sandbox, in-process. Every mode and status, the parent
choice on validation, sibling groups, sentinel rewards, n_children, archive rows, and a round
continued from a tree saved to JSON (resume in the middle of a tree run).

tabular-binary (seed 0) is graded on validation AUC; single-feature scores give known metrics:
f00 val 0.544 / test 0.498, f03 val 0.479 / test 0.563, f13 val 0.468 / test 0.548,
f00-f09 val 0.588 / test 0.498: the best on validation is not the best on test.
"""

from __future__ import annotations

import json
import re

import pytest

from graders.code_exec.build import build_tasks
from config.code_exec import CodeExecConfig
from graders.code_exec.verifier import CodeExecTask
from config.search import SearchConfig
from search.diagnostics import round_diagnostics
from search.prompts import mode_of
from search.round import RoundError, grow_round
from records.exec_result import ExecResult
from records.jsonl import RecordError
from records.rows import NODE_FIELDS, TREE_FIELDS, TREE_NODE_FIELDS, check_node_rows, node_row
from records.run_dir import RunDir
from search.rows import round_rows
from search.tree import Generation, Tree

TASK = "tabular-binary"


def score_script(expr: str) -> str:
    """A fast script (csv module, no pandas) predicting `expr` over the features."""
    return ("import csv\n"
            "rows = list(csv.DictReader(open('test.csv')))\n"
            "with open('submission.csv', 'w', newline='') as f:\n"
            "    w = csv.writer(f); w.writerow(['id', 'target'])\n"
            "    for r in rows:\n"
            "        v = {k: float(x or 0) for k, x in r.items() if k.startswith('f')}\n"
            f"        w.writerow([r['id'], eval({expr!r}, {{}}, v)])\n")


def py(code: str) -> str:
    return f"Plan: {code.splitlines()[0]}\n```python\n{code}```\n"


CRASH = "import csv\nrows = list(csv.DictReader(open('train_v2.csv')))\n"
SCRIPTED = {  # mode -> the siblings' completions, by sample index
    "draft": [py(score_script("f00")), py(score_script("f03")), py(CRASH),
              "I would train a random forest on the features."],
    "debug": [py(score_script("f13")), py("import time\ntime.sleep(60)\n"),
              py("open('submission.csv', 'w').write('id,target\\n')\n"), py("print(1 / 0)\n")],
    "improve": [py(score_script("f00 - f09")), py(score_script("f03")), py("print(undefined_name)\n"),
                py(score_script("f00"))],
}
DRAFT_STATUS = ["ok", "ok", "crashed", "no_code"]
DEBUG_STATUS = ["ok", "timeout", "invalid_submission", "crashed"]
IMPROVE_STATUS = ["ok", "ok", "crashed", "ok"]


class ScriptedPolicy:
    """generate(prompts, n): the scripted completions of the prompt's mode, with token ids and
    log-probs shaped like the rollout's; records every prompt it was given."""

    def __init__(self, version: int = 0):
        self.version = version
        self.prompts: list[list[dict]] = []

    def __call__(self, prompts, n):
        assert len(prompts) == 1  # one (mode, parent) per expansion
        self.prompts.append(prompts[0])
        texts = SCRIPTED[mode_of(prompts[0])]
        assert n == len(texts)
        return [Generation(text=t, prompt_token_ids=[7, 8, 9], token_ids=[ord(c) for c in t[:6]],
                           logprobs=[-0.5] * min(len(t), 6), adapter_version=self.version) for t in texts]


@pytest.fixture(scope="module")
def verifier(tmp_path_factory):
    tasks = build_tasks(tmp_path_factory.mktemp("search") / "tasks", seed=0)
    return CodeExecTask(CodeExecConfig(tasks_dir=str(tasks), timeout_s=2.0, grace_s=0.2,
                                       max_concurrent=2, sentinel=-0.5))


@pytest.fixture(scope="module")
def case(verifier):
    return next(c for c in verifier.cases("train") if c["id"] == TASK)


class Executor:
    def __init__(self, verifier):
        self.verifier, self.batches = verifier, []

    def __call__(self, items):
        self.batches.append(len(items))
        return self.verifier.score_many(items)


# run seed 3, search seed 3, step 5: expansion 1 draws debug (0.31 < 0.5, picks the crashed
# draft), expansion 2 improve (0.86); steps 1-2 of SMALL below: debug (0.28), improve (0.81, 0.73)
RUN_SEED = 3
CFG = SearchConfig(nodes_per_round=12, expansions_per_round=3, num_drafts=2, seed=3)


@pytest.fixture(scope="module")
def grown(verifier, case):
    policy, execute = ScriptedPolicy(version=4), Executor(verifier)
    rnd = grow_round(None, case, CFG, policy, execute, round_index=5, run_seed=RUN_SEED)
    return rnd, policy, execute


def test_round_grows_every_mode_and_status(grown, verifier):
    rnd, policy, execute = grown
    assert [e["mode"] for e in rnd.expansions] == ["draft", "debug", "improve"]
    assert [e["reason"] for e in rnd.expansions] == ["initial_drafts", "debug", "improve_best"]
    assert execute.batches == [4, 4, 4]  # each expansion's siblings executed as one batch
    assert [n.result.status for n in rnd.nodes] == DRAFT_STATUS + DEBUG_STATUS + IMPROVE_STATUS
    assert rnd.groups == [0] * 4 + [1] * 4 + [2] * 4
    assert [n.id for n in rnd.nodes[:2]] == ["s5-r0-g0-0", "s5-r0-g0-1"]
    assert all(n.step == 5 and n.round == 0 and n.adapter_version == 4 for n in rnd.nodes)
    for n in rnd.nodes:
        if n.result.status == "ok":
            assert n.result.reward == pytest.approx(max(0.0, 2 * n.result.val_metric - 1))  # val feeds the reward
            assert n.result.test_metric is not None and n.result.code.startswith("import csv")
        else:  # the sentinel, whatever the failure
            r = n.result
            assert r.reward == verifier.cfg.sentinel and r.val_metric is None and r.test_metric is None
    by = {n.id: n for n in rnd.nodes}
    assert by["s5-r0-g0-3"].result.code == "" and by["s5-r0-g0-2"].result.exc_type == "FileNotFoundError"
    assert by["s5-r0-g1-1"].result.exc_type == "WallTimeout" and by["s5-r0-g1-3"].result.exc_type == "ZeroDivisionError"
    assert "ZeroDivisionError" in by["s5-r0-g1-3"].result.term_tail
    assert by["s5-r0-g0-0"].result.limits["cpu_s"] == verifier.cfg.cpu_s


def test_parents_debug_depth_and_n_children(grown):
    rnd, policy, _ = grown
    tree = rnd.tree
    crashed, f00, f03 = "s5-r0-g0-2", "s5-r0-g0-0", "s5-r0-g0-1"
    debug, improve = rnd.nodes[4:8], rnd.nodes[8:]
    assert all(n.parent_id == crashed and n.debug_depth == 1 for n in debug)
    # parent of improve = best on VALIDATION among f00 (0.544), f03 (0.479), f13 (0.468);
    # f03 has the best test metric (0.563) and is not chosen
    assert all(n.parent_id == f00 and n.debug_depth == 0 for n in improve)
    assert tree.get(f03).result.test_metric > tree.get(f00).result.test_metric
    assert tree.get(f03).result.val_metric < tree.get(f00).result.val_metric
    assert (tree.get(crashed).n_children, tree.get(f00).n_children, tree.get(f03).n_children) == (4, 4, 0)
    # what the policy saw: the crashed draft's code and error for debug; f00's code and val for improve
    debug_prompt, improve_prompt = policy.prompts[1][-1]["content"], policy.prompts[2][-1]["content"]
    assert "train_v2.csv" in debug_prompt and "FileNotFoundError" in debug_prompt
    assert "eval('f00'" in improve_prompt and f"{tree.get(f00).result.val_metric:.6g}" in improve_prompt
    assert f"{tree.get(f00).result.test_metric:.6g}" not in improve_prompt
    assert all(n.prompt_messages == policy.prompts[n.sibling_group] for n in rnd.nodes)


def test_summary_chooses_on_validation_and_reports_test(grown, verifier):
    rnd, _, _ = grown
    s, tree = rnd.summary, rnd.tree
    assert (s["nodes"], s["valid"], s["expansions"], s["step"], s["round"]) == (12, 6, 3, 5, 0)
    assert s["mode_counts"] == {"draft": 4, "debug": 4, "improve": 4}
    assert s["status_counts"] == {"ok": 6, "crashed": 3, "no_code": 1, "timeout": 1, "invalid_submission": 1}
    best = tree.get(s["best_node_id"])
    assert s["best_node_id"] == "s5-r0-g2-0"
    assert best.result.val_metric == max(n.result.val_metric for n in tree.nodes.values() if not n.is_buggy)
    assert s["honest_test_metric"] == best.result.test_metric == pytest.approx(0.498, abs=1e-3)
    assert s["best_test_metric"] == pytest.approx(0.563, abs=1e-3)
    assert s["best_test_metric"] > s["honest_test_metric"]
    assert tree.get(s["best_test_node_id"]).result.val_metric < best.result.val_metric
    assert s["tree_best_node_id"] == s["best_node_id"] and s["tree_nodes"] == 12
    assert s["gen_llm_seconds"] >= 0 and s["gen_exec_seconds"] > 1.0  # one timeout of 2 s ran
    assert s["gen_exec_seconds"] == pytest.approx(sum(e["exec_seconds"] for e in rnd.expansions))
    assert s["exec_time_sum"] == pytest.approx(sum(n.result.exec_time for n in rnd.nodes))
    assert s["adapter_versions"] == [4] and s["exec_backend"] == verifier.isolation
    json.dumps(s)


def test_diagnostics_of_the_real_round(grown):
    rnd, _, _ = grown
    d = round_diagnostics(rnd.nodes, rnd.tree, ladder={"constant": {"val_metric": 0.5, "test_metric": 0.5}})
    assert d["valid_share"] == 0.5 and d["debug_success_rate"] == 0.25
    assert d["improve_success_rate"] == 0.25  # f00-f09 beats f00; f03 worse, the crash fails, f00 ties
    assert d["frac_groups_zero_reward_std"] == 0.0 and d["model_families"] == 1  # all "constant" csv
    assert d["best_vs_constant"] == pytest.approx(rnd.tree.get("s5-r0-g2-0").result.val_metric - 0.5)


def test_rows_fit_the_archive(grown, tmp_path):
    rnd, _, _ = grown
    rows = round_rows(rnd.nodes, "run-x", advantages=[0.1] * 12)
    assert tuple(rows[0]) == TREE_NODE_FIELDS == (*NODE_FIELDS, *TREE_FIELDS)
    check_node_rows(rows)
    with pytest.raises(RecordError, match="missing fields"):  # a tree row without its tree fields
        check_node_rows([{k: rows[0][k] for k in NODE_FIELDS}])
    for r in rows:  # the flat constructor builds the same row from the core and tree fields
        core = {k: v for k, v in r.items() if k in NODE_FIELDS and k != "is_buggy"}
        assert node_row(**core, is_buggy=r["is_buggy"], tree={k: r[k] for k in TREE_FIELDS}) == r
    with pytest.raises(RecordError, match="tree fields"):
        node_row(**{k: v for k, v in rows[0].items() if k in NODE_FIELDS})
    paths = RunDir(tmp_path / "run").create().write_round(5, TASK, 0, rows, pass_verdicts=("ok",),
                                                          tree_json=rnd.tree.dumps())
    assert Tree.loads(paths["tree_json"].read_text()).to_dict() == rnd.tree.to_dict()
    summary = json.loads(paths["summary"].read_text())
    assert summary["pass_rate"] == 0.5 and summary["mode_counts"] == {"draft": 4, "debug": 4, "improve": 4}
    tree_txt = paths["tree"].read_text()
    assert "s5-r0-g1-0 [debug]" in tree_txt
    assert re.search(r"s5-r0-g0-0 \[draft\] ok ok test \d", tree_txt) and "[draft] BUGGY" in tree_txt
    assert "output tail:" in paths["transcript"].read_text()
    row = {r["id"]: r for r in rows}
    assert row["s5-r0-g0-3"]["plan"] == "I would train a random forest on the features."
    assert row["s5-r0-g0-0"]["val_metric"] is not None and row["s5-r0-g0-0"]["grade_error"] is None
    assert row["s5-r0-g1-2"]["grade_error"] == "0 rows, expected 640"
    assert row["s5-r0-g0-2"]["is_buggy"] and row["s5-r0-g0-2"]["n_children"] == 4


SMALL = SearchConfig(nodes_per_round=8, expansions_per_round=2, num_drafts=2, seed=3, carry_tree=True)


def test_round_continued_from_a_saved_tree_is_the_same_round(verifier, case):
    r1 = grow_round(None, case, SMALL, ScriptedPolicy(), Executor(verifier), 1, run_seed=RUN_SEED)
    saved = r1.tree.dumps()
    live = grow_round(r1.tree, case, SMALL, ScriptedPolicy(), Executor(verifier), 2, run_seed=RUN_SEED)
    resumed = grow_round(Tree.loads(saved), case, SMALL, ScriptedPolicy(), Executor(verifier), 2,
                         run_seed=RUN_SEED)
    assert r1.tree.dumps() == saved  # growing a round never touches the caller's tree
    assert [e["mode"] for e in r1.expansions] == ["draft", "debug"]
    assert [e["mode"] for e in live.expansions] == ["improve", "improve"]
    assert [e["expansion"] for e in live.expansions] == [2, 3] and live.round == 1

    def key(rnd):
        return [(n.id, n.parent_id, n.mode, n.result.status, n.result.val_metric, n.result.test_metric,
                 n.result.reward, n.debug_depth) for n in rnd.nodes]

    assert key(resumed) == key(live)
    assert [e["parent_id"] for e in live.expansions] == ["s1-r0-g0-0", "s2-r1-g0-0"]  # f00, then f00-f09
    assert live.tree.get("s1-r0-g0-0").n_children == 4 and live.summary["tree_nodes"] == 16
    assert live.summary["nodes"] == 8 and live.summary["tree_best_node_id"] == "s2-r1-g0-0"
    assert {n.id for n in live.tree.nodes.values()} == {n.id for n in resumed.tree.nodes.values()}


class Broken:
    def __init__(self, n):
        self.n = n

    def __call__(self, prompts, n):
        return ScriptedPolicy()(prompts, n)[: self.n]


def test_collaborators_breaking_the_contract_fail_the_round(verifier, case):
    tiny = SearchConfig(nodes_per_round=4, expansions_per_round=1, num_drafts=1)
    with pytest.raises(RoundError, match="generate returned 3 completions, asked 4"):
        grow_round(None, case, tiny, Broken(3), Executor(verifier), round_index=1, run_seed=RUN_SEED)
    with pytest.raises(RoundError, match="execute returned 0 results for 4"):
        grow_round(None, case, tiny, ScriptedPolicy(), lambda items: [], round_index=1, run_seed=RUN_SEED)
    with pytest.raises(ValueError, match="tree is of task"):
        grow_round(Tree("docs-topic", "log_loss", "lower"), case, tiny, ScriptedPolicy(), Executor(verifier), 1,
                   run_seed=RUN_SEED)


def test_driver_adapters_give_the_same_round_as_the_verifier(grown, verifier, case):
    """services/tree_round.py feeds grow_round from the grader's wire records: the case from a
    CaseInfo, each result from a Score's details (the verifier's whole ExecResult, the script it
    ran included). A round grown through them is the round grown on the verifier's own results."""
    from graders.code_exec.service import CodeExecGraderTask, score_record
    from services.tree_round import case_dict

    (info,) = [c for c in CodeExecGraderTask(verifier).cases(0, "train") if c.id == TASK]
    assert case_dict(info) == {k: case[k] for k in ("id", "prompt_messages", "task")}

    def execute(items):
        return [ExecResult.from_details(score_record(cid, r).details)
                for (cid, _), r in zip(items, verifier.score_many(items))]

    rnd, _, _ = grown
    again = grow_round(None, case_dict(info), CFG, ScriptedPolicy(version=4), execute, round_index=5,
                       run_seed=RUN_SEED)
    node_keys = ("id", "parent_id", "mode", "debug_depth", "n_children")
    result_keys = ("status", "reward", "val_metric", "test_metric", "oriented", "code", "exc_type", "limits",
                   "isolation")

    def key(n):
        return [getattr(n, k) for k in node_keys] + [getattr(n.result, k) for k in result_keys]

    assert [key(n) for n in again.nodes] == [key(n) for n in rnd.nodes]


def test_fresh_tree_rounds_toss_new_coins_every_step():
    """carry_tree false, AIDE's defaults (32 nodes, 4 expansions: 8 drafts, then 3 coins), 120
    rounds: the debug share of the coin-tossing expansions is debug_prob within 4 binomial
    standard deviations, for several run seeds, and a round grown again at the same (run seed,
    step) makes the same choices. Keyed on the expansion alone, each round drew the same three
    coins: seed 0 debugged in 120 of 120 rounds, seed 2 in 0."""
    cfg = SearchConfig()
    case = {"id": TASK, "prompt_messages": [{"role": "user", "content": "task"}],
            "task": {"metric": "roc_auc", "direction": "higher"}}

    def generate(prompts, n):
        return [Generation(text=py("x = 1\n"), prompt_token_ids=[1], token_ids=[2], logprobs=[-0.1])] * n

    def result(status, reward, val=None, test=None):
        return ExecResult(task_id=TASK, status=status, reward=reward, test_metric=test, val_metric=val,
                          oriented=val, exec_time=0.0, term_tail="", exc_type=None, message=None, isolation="")

    def execute(items):  # half the siblings crash: a buggy leaf is always there to debug
        return [result("ok", 0.4, 0.7, 0.6) if k % 2 else result("crashed", -0.5) for k in range(len(items))]

    for run_seed in (0, 1, 2):
        rounds = [grow_round(None, case, cfg, generate, execute, step, run_seed=run_seed) for step in range(1, 121)]
        coins = [e["mode"] for r in rounds for e in r.expansions[1:]]
        n, share = len(coins), coins.count("debug") / len(coins)
        assert n == 360 and abs(share - cfg.debug_prob) <= 4 * (0.25 / n) ** 0.5, (run_seed, share)
        again = grow_round(None, case, cfg, generate, execute, 7, run_seed=run_seed)

        def choices(rnd):
            return [(e["mode"], e["parent_id"], e["reason"]) for e in rnd.expansions]

        assert choices(again) == choices(rounds[6])
