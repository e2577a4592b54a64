"""search.scaffold: a task's template script, the block the policy writes, what runs; the bundled
tasks' scaffolds run as real scripts; the tree-mode held-out eval's test-rows scoring."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from config.search import SearchConfig
from graders.code_exec.extract import extract_code
from search.prompts import BLOCK_INSTRUCTION, FORMAT_INSTRUCTION, HEADINGS, mode_of, render_prompt
from search.round import grow_round
from search.scaffold import BLOCK_MARK, Scaffold, ScaffoldError, cut_at_stop, join_script, scaffold_of
from records.exec_result import ExecResult
from search.tree import Generation

RAW = {"head": "import pandas as pd\nmodel = ", "tail": "model.fit()\n", "hint": "Pick a model.",
       "stop": ["\n"]}
TASK = {"id": "t", "metric": "roc_auc", "direction": "higher", "scaffold": RAW}
CASE = {"id": "t", "task": TASK, "prompt_messages": [
    {"role": "system", "content": "sys"}, {"role": "user", "content": "# t\nPredict."}]}


def test_cut_at_stop_takes_the_earliest_stop():
    assert cut_at_stop("Ridge()\nmore\n```", ("```", "\n")) == "Ridge()"
    assert cut_at_stop("a```b\nc", ("\n", "```")) == "a"
    assert cut_at_stop("no stop here", ("\n\n",)) == "no stop here"
    assert cut_at_stop("", ("\n",)) == ""


def test_join_script_keeps_parts_on_their_own_lines():
    assert join_script("a = 1\n", "b = 2", "c = 3\n") == "a = 1\nb = 2\nc = 3\n"
    assert join_script("x = ", "f()", "y\n") == "x = f()\ny\n"  # the block continues the head's line
    assert join_script("a = 1", "", "c\n") == "a = 1\nc\n"


def test_scaffold_of_reads_and_checks_the_task():
    sc = scaffold_of(TASK)
    assert sc == Scaffold(head=RAW["head"], tail=RAW["tail"], hint="Pick a model.", stop=("\n", "```"))
    assert sc.prefix == "```python\n" + RAW["head"]
    assert scaffold_of({"id": "t"}) is None and scaffold_of(None) is None
    for bad, what in [({**RAW, "head": ""}, "scaffold.head"), ({**RAW, "tail": 3}, "scaffold.tail"),
                      ({**RAW, "extra": 1}, "unknown keys"), ({**RAW, "stop": "\n"}, "scaffold.stop"),
                      ({**RAW, "tail": "```\n"}, "must not contain"), ("x", "must be an object")]:
        with pytest.raises(ScaffoldError, match=what):
            scaffold_of({"id": "t", "scaffold": bad})


def test_completion_runs_head_block_tail_through_the_graders_extraction():
    sc = scaffold_of(TASK)
    sampled = "LogisticRegression(C=2.0)\nprint('runs past the stop')\n```"
    assert sc.block(sampled) == "LogisticRegression(C=2.0)"
    assert sc.script(sampled) == "import pandas as pd\nmodel = LogisticRegression(C=2.0)\nmodel.fit()\n"
    assert extract_code(sc.completion(sampled)) == sc.script(sampled)
    assert sc.template() == f"import pandas as pd\nmodel = <YOUR CODE>  {BLOCK_MARK}\nmodel.fit()\n"
    block_sc = Scaffold(head="a = 1\n", tail="b\n")
    assert block_sc.template() == f"a = 1\n{BLOCK_MARK}\nb\n"


def _node(status, raw, val=None, tail="", exc=None):
    from search.tree import Node

    return Node(id="p", parent_id=None, mode="draft", step=1, round=0, expansion=0, sibling_group=0, index=0,
                prompt_messages=[], assistant_prefix="```python\n" + RAW["head"], raw_completion=raw,
                prompt_token_ids=[1], response_token_ids=[], response_logprobs=[], adapter_version=1,
                finish_reason="stop",
                result=ExecResult(task_id="t", status=status, reward=0.1, test_metric=0.987654, val_metric=val,
                                  oriented=val, exec_time=0.1, term_tail=tail, exc_type=exc, message=None,
                                  isolation="none", limits={}, code="import pandas as pd\nmodel = X\n"))


def test_scaffolded_prompts_show_the_tail_hint_and_the_parents_block_only():
    sc, cfg = scaffold_of(TASK), SearchConfig(scaffold=True)
    draft = render_prompt("draft", CASE, None, cfg, sc)
    text = draft[-1]["content"]
    assert draft[0] == CASE["prompt_messages"][0] and text.startswith("# t\nPredict.")
    assert HEADINGS["draft"] in text and mode_of(draft) == "draft"
    assert "```python\nmodel.fit()\n```" in text and "Pick a model." in text
    assert text.endswith(BLOCK_INSTRUCTION) and FORMAT_INSTRUCTION not in text
    assert RAW["head"] not in text  # the head is forced in the assistant turn, not repeated

    parent = _node("ok", "Ridge(alpha=3.0)\njunk after the stop", val=0.61)
    text = render_prompt("improve", CASE, parent, cfg, sc)[-1]["content"]
    assert "```python\nmodel = Ridge(alpha=3.0)\n```" in text and "junk after the stop" not in text
    assert "validation roc_auc was 0.61" in text and "0.987654" not in text  # never the test metric
    assert "import pandas" not in text  # the parent's block, not its whole script

    failed = _node("crashed", "Forest()", tail="NameError: name 'Forest' is not defined", exc="NameError")
    text = render_prompt("debug", CASE, failed, cfg, sc)[-1]["content"]
    assert "```python\nmodel = Forest()\n```" in text and "NameError: name 'Forest'" in text
    assert "return the corrected block" in text and text.endswith(BLOCK_INSTRUCTION)


def test_grow_round_forces_the_head_stops_the_block_and_runs_head_block_tail():
    calls, runs = [], []

    def generate(prompts, n, **kw):
        calls.append(kw)
        return [Generation(text=f"M{i}()\nextra", token_ids=[1], logprobs=[-0.5]) for i in range(n)]

    def execute(items):
        runs.extend(items)
        return [ExecResult(task_id=CASE["id"], status="ok", reward=0.5, test_metric=0.6, val_metric=0.7, oriented=0.7,
                           exec_time=0.1, term_tail="", exc_type=None, message=None, isolation="none",
                           code=extract_code(c)) for _, c in items]

    cfg = SearchConfig(nodes_per_round=4, expansions_per_round=2, num_drafts=2, scaffold=True)
    rnd = grow_round(None, CASE, cfg, generate, execute, round_index=1, run_seed=0)
    sc = scaffold_of(TASK)
    assert calls == [{"assistant_prefix": sc.prefix, "stop": sc.stop}] * 2
    assert [c for _, c in runs[:2]] == [sc.completion("M0()"), sc.completion("M1()")]
    node = rnd.nodes[0]
    assert node.assistant_prefix == sc.prefix and node.raw_completion == "M0()\nextra"
    assert node.result.code == "import pandas as pd\nmodel = M0()\nmodel.fit()\n"  # head + block + tail ran
    assert [n.mode for n in rnd.nodes] == ["draft", "draft", "improve", "improve"]
    assert "model = M0()" in rnd.nodes[2].prompt_messages[-1]["content"]

    with pytest.raises(ValueError, match="has no scaffold"):
        grow_round(None, {**CASE, "task": {k: v for k, v in TASK.items() if k != "scaffold"}}, cfg,
                   generate, execute, round_index=1, run_seed=0)
    plain = grow_round(None, CASE, SearchConfig(nodes_per_round=2, expansions_per_round=1), 
                       lambda p, n: [Generation(text="```python\nx\n```")] * n, execute, round_index=1,
                       run_seed=0)
    assert plain.nodes[0].assistant_prefix == "" and "model = " not in runs[-1][1]  # switch off: whole scripts


@pytest.fixture(scope="module")
def bundled():
    from graders.code_exec.verifier import CodeExecTask

    return CodeExecTask()


def test_bundled_tasks_ship_scaffolds_whose_scripts_run(bundled):
    """Each bundled task's template with a plain block is a working script (valid, real sandbox),
    and a block naming no estimator crashes: the scaffold leaves the policy real choices."""
    for case in bundled.cases():
        sc = scaffold_of(case["task"])
        assert sc is not None and sc.head.endswith("model =") and sc.stop == ("\n", "```")
        good = "Ridge(alpha=1.0)" if case["task"]["metric"] == "rmsle" else "LogisticRegression(C=1.0)"
        ok = bundled.score(case["id"], sc.completion(" " + good + "\nanything after the newline"))
        assert ok.status == "ok" and ok.val_metric is not None, (case["id"], ok.term_tail[-300:])
        bad = bundled.score(case["id"], sc.completion(" Forest()"))
        assert bad.status == "crashed" and bad.exc_type == "NameError"
        meta = json.loads((bundled.tasks[case["id"]].dir / "task.json").read_text())
        assert meta["scaffold"] == sc.to_dict() | {"stop": ["\n"]}


def test_test_rows_score_uses_the_test_metric_and_the_sentinel():
    from evals.heldout import test_rows_score

    ok = SimpleNamespace(status="ok", test_metric=0.75, reward=0.99)  # reward is the val rows': ignored
    s = test_rows_score(ok, "roc_auc", -0.5, "code-exec")
    assert (s.admitted, s.verdict, s.reward) == (True, "ok", pytest.approx(0.5))
    assert test_rows_score(SimpleNamespace(status="ok", test_metric=0.5, reward=0), "log_loss", -0.5, "code-exec").reward \
        == pytest.approx(0.6065306597)
    bad = test_rows_score(SimpleNamespace(status="crashed", test_metric=None, reward=-0.5), "rmsle", -0.5, "code-exec")
    assert (bad.admitted, bad.reward, bad.status) == (False, -0.5, "crashed")


def test_mean_reward_difference_pairs_items_and_brackets_the_difference():
    from evals.heldout import mean_reward_difference

    item = lambda i, r: SimpleNamespace(item_id=i, rewards=r)
    before = SimpleNamespace(items=[item("a", [-0.5, 0.1]), item("b", [0.2, 0.2]), item("c", [0.0, 0.0])])
    after = SimpleNamespace(items=[item("c", [0.1, 0.1]), item("a", [0.3, 0.3]), item("b", [0.4, 0.2])])
    d = mean_reward_difference(before, after, n_boot=500)
    assert d["n_items"] == 3 and d["difference"] == pytest.approx((0.5 + 0.1 + 0.1) / 3)
    assert d["low"] <= d["difference"] <= d["high"] and d["low"] >= 0.1 - 1e-9 and d["high"] <= 0.5 + 1e-9
