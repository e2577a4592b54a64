"""CodeExecTask end to end: completion -> extraction -> sandbox -> checks -> metric -> reward."""

from __future__ import annotations

import io
import json
import math
from pathlib import Path

import pandas as pd
import pytest

from graders.code_exec.build import build_tasks
from config.code_exec import CodeExecConfig
from graders.code_exec.grading import reward_of
from graders.code_exec.ladder import RUNGS, run_ladder
from graders.code_exec.verifier import CodeExecTask


def _py(code: str) -> str:
    return f"Here is my solution.\n```python\n{code}\n```\n"


@pytest.fixture(scope="module")
def tasks_dir(tmp_path_factory):
    return build_tasks(tmp_path_factory.mktemp("ce") / "tasks", seed=0)


@pytest.fixture(scope="module")
def verifier(tasks_dir):
    return CodeExecTask(CodeExecConfig(tasks_dir=str(tasks_dir), timeout_s=20.0, grace_s=0.5,
                                       sentinel=-0.25))


def test_cases_carry_description_preview_and_metadata(verifier):
    cases = verifier.cases("train")
    assert [c["id"] for c in cases] == ["docs-topic", "positive-regression", "tabular-binary"]
    for c in cases:
        sys_msg, user = c["prompt_messages"]
        assert sys_msg["role"] == "system" and "submission.csv" in sys_msg["content"]
        assert "## Evaluation" in user["content"] and "train.csv: " in user["content"]
        assert c["task"]["metric"] in ("roc_auc", "log_loss", "rmsle")
    assert "answers" not in json.dumps(cases)


def test_failed_statuses_get_the_sentinel(verifier):
    r = verifier.score("tabular-binary", "I would train a model.")
    assert (r.status, r.reward, r.test_metric, r.code) == ("no_code", -0.25, None, "")
    r = verifier.score("tabular-binary", _py("import pandas as pd\npd.read_csv('nope.csv')"))
    assert (r.status, r.reward, r.exc_type) == ("crashed", -0.25, "FileNotFoundError")
    assert "FileNotFoundError" in r.term_tail and r.limits["cpu_s"] == verifier.cfg.cpu_s
    r = verifier.score("tabular-binary", _py("x = (1,"))
    assert (r.status, r.exc_type) == ("crashed", "SyntaxError")
    r = verifier.score("tabular-binary", _py(
        "import pandas as pd\npd.read_csv('sample_submission.csv').iloc[:10].to_csv('submission.csv', index=False)"))
    assert (r.status, r.reward, r.oriented) == ("invalid_submission", -0.25, None)
    assert "rows, expected" in r.message
    assert r.isolation == "namespaces"


def test_constant_submission_without_reading_train_is_ok(verifier, tasks_dir):
    r = verifier.score("docs-topic", _py(
        "import shutil\nshutil.copy('sample_submission.csv', 'submission.csv')"))
    assert r.status == "ok" and r.exc_type is None
    assert r.test_metric == pytest.approx(math.log(3)) and r.val_metric == pytest.approx(math.log(3))
    assert r.reward == pytest.approx(reward_of("log_loss", r.val_metric))
    assert r.oriented == -r.val_metric


def test_submission_linked_to_the_answers_is_invalid(verifier, tasks_dir):
    ans = tasks_dir / "tabular-binary" / "private" / "answers.csv"
    r = verifier.score("tabular-binary", _py(
        f"import os\nos.symlink({str(ans)!r}, 'submission.csv')"))
    assert (r.status, r.reward) == ("invalid_submission", -0.25)


def test_reward_split_test_and_score_many_order(tasks_dir):
    # 8 s, not 2: the "ok" script imports pandas, which took over 2 s on a CI box at load 8 and
    # then read as a timeout; the looping script still times out (in its own slot, 8 s).
    v = CodeExecTask(CodeExecConfig(tasks_dir=str(tasks_dir), reward_split="test",
                                    timeout_s=8.0, grace_s=0.2, max_concurrent=2))
    score = ("import pandas as pd\ns = pd.read_csv('sample_submission.csv')\n"
             "t = pd.read_csv('test.csv')\ns['target'] = t['f00'].fillna(0)\n"
             "s.to_csv('submission.csv', index=False)")
    items = [("tabular-binary", _py(score)), ("tabular-binary", "none"),
             ("tabular-binary", _py("while True: pass")), ("docs-topic", _py("raise SystemExit(3)"))]
    rs = v.score_many(items)
    assert [r.status for r in rs] == ["ok", "no_code", "timeout", "crashed"]
    assert rs[0].reward == pytest.approx(max(0.0, 2 * rs[0].test_metric - 1))
    assert rs[0].val_metric != rs[0].test_metric
    assert rs[2].exc_type == "WallTimeout" and rs[2].reward == -0.5


def test_unknown_task_is_a_key_error(verifier):
    with pytest.raises(KeyError):
        verifier.score("no-such-task", _py("pass"))


def test_ladder_orders_constant_below_gbm_and_is_written(verifier, tasks_dir):
    out = run_ladder(verifier, tasks_dir / "ladder.json")
    assert json.loads((tasks_dir / "ladder.json").read_text()) == out
    for tid, rungs in out.items():
        assert all(rungs[r]["status"] == "ok" for r in RUNGS), (tid, rungs)
        best = max(rungs["linear"]["reward"], rungs["gbm"]["reward"])
        assert best > rungs["constant"]["reward"], (tid, rungs)
    assert out["tabular-binary"]["constant"]["test_metric"] == 0.5
    assert pd.read_csv(tasks_dir / "tabular-binary" / "public" / "train.csv").shape[0] == 960


def test_a_users_mlebench_style_task_dir_works_unchanged(tmp_path):
    """An MLE-bench prepared competition: public/ and private/test.csv (answers with no split
    column) as MLE-bench lays them out, plus only a task.json naming its grading rule and answers
    file. Every answer row is test: test_metric is reported, there is no val_metric."""
    comp = tmp_path / "tasks" / "my-comp"
    (comp / "public").mkdir(parents=True)
    (comp / "private").mkdir()
    ids = [f"r{i:03d}" for i in range(40)]
    pd.DataFrame({"id": [f"t{i}" for i in range(80)], "x": range(80), "y": [i % 2 for i in range(80)]}).to_csv(
        comp / "public" / "train.csv", index=False)
    pd.DataFrame({"id": ids, "x": range(40)}).to_csv(comp / "public" / "test.csv", index=False)
    pd.DataFrame({"id": ids, "y": 0.5}).to_csv(comp / "public" / "sample_submission.csv", index=False)
    (comp / "public" / "description.md").write_text("Predict y.\n")
    pd.DataFrame({"id": ids, "y": [i % 2 for i in range(40)]}).to_csv(comp / "private" / "test.csv", index=False)
    (comp / "task.json").write_text(json.dumps({"id": "my-comp", "metric": "roc_auc", "id_column": "id",
                                                "target_columns": ["y"], "answers": "private/test.csv"}))
    v = CodeExecTask(CodeExecConfig(tasks_dir=str(tmp_path / "tasks"), timeout_s=20.0, grace_s=0.5))
    r = v.score("my-comp", _py(
        "import pandas as pd\nt = pd.read_csv('test.csv')\n"
        "pd.DataFrame({'id': t['id'], 'y': t['x'] % 2}).to_csv('submission.csv', index=False)"))
    assert (r.status, r.test_metric, r.val_metric, r.reward) == ("ok", 1.0, None, 1.0)


def test_an_mlebench_prepared_task_gets_mlebench_verdict_and_metric(tmp_path):
    """spooky-author-identification as MLE-bench prepares it (one-hot private/test.csv) and a
    task.json naming no rule set: the default config grades it by MLE-bench's rules, so a script
    whose rows sum to 1 + 5e-6 scores what MLE-bench's grade.py gives; the same task naming
    `counterpoint` refuses those rows (its stated 1e-6 bound)."""
    import sys

    sys.path.insert(0, str(Path(__file__).parent))
    import mlebench_reference as ref

    comp = tmp_path / "tasks" / "spooky-author-identification"
    (comp / "public").mkdir(parents=True)
    (comp / "private").mkdir()
    ids = [f"id{i:05d}" for i in range(30)]
    answers = pd.DataFrame({"id": ids, **{c: [int(i % 3 == k) for i in range(30)] for k, c in enumerate(ref.CLASSES)}})
    answers.to_csv(comp / "private" / "test.csv", index=False)
    pd.DataFrame({"id": ids, "text": ["a"] * 30}).to_csv(comp / "public" / "test.csv", index=False)
    (comp / "public" / "description.md").write_text("Who wrote it?\n")
    task_json = {"id": "spooky-author-identification", "metric": "log_loss", "id_column": "id",
                 "target_columns": ref.CLASSES, "answer_columns": ref.CLASSES, "answers": "private/test.csv"}
    (comp / "task.json").write_text(json.dumps(task_json))
    script = _py("import pandas as pd\nt = pd.read_csv('test.csv')\n"
                 "s = pd.DataFrame({'id': t['id'], 'EAP': 0.5 + 5e-6, 'HPL': 0.3, 'MWS': 0.2})\n"
                 "s.iloc[::-1].to_csv('submission.csv', index=False)")
    v = CodeExecTask(CodeExecConfig(tasks_dir=str(tmp_path / "tasks"), timeout_s=20.0, grace_s=0.5))
    assert v.grading_rules == {"spooky-author-identification": "mle-bench"}
    assert v.cases()[0]["task"]["grading_rules"] == "mle-bench"
    r = v.score("spooky-author-identification", script)
    sub = pd.DataFrame({"id": ids[::-1], "EAP": 0.5 + 5e-6, "HPL": 0.3, "MWS": 0.2})
    want = ref.spooky_grade(ref.read_csv(io.BytesIO(sub.to_csv(index=False).encode())),
                            ref.read_csv(comp / "private" / "test.csv"))
    assert (r.status, r.val_metric) == ("ok", None) and r.test_metric == want
    (comp / "task.json").write_text(json.dumps({**task_json, "grading_rules": "counterpoint"}))
    v = CodeExecTask(CodeExecConfig(tasks_dir=str(tmp_path / "tasks"), timeout_s=20.0, grace_s=0.5))
    r = v.score("spooky-author-identification", script)
    assert r.status == "invalid_submission" and "do not sum to 1 within 1e-06" in r.message


EXTRA_COLUMN = {  # one column more than the task's, as scripts write them; header as pandas reads it
    "pandas index": ("s.to_csv('submission.csv')", "Unnamed: 0"),
    "note column": ("s.assign(note='hand-tuned').to_csv('submission.csv', index=False)", "note"),
    "<target>.1 column": ("pd.concat([s, s[[T[0]]]], axis=1).to_csv('submission.csv', index=False)", ".1"),
}
PREDICT = {  # id + targets, valid under both rule sets (AUC scores in [0, 1], RMSLE >= 0)
    "tabular-binary": "T = ['target']\ns = pd.DataFrame({'id': t['id'], 'target': t['f00'].fillna(0).rank(pct=True)})",
    "positive-regression": "T = ['y1', 'y2']\ns = pd.DataFrame({'id': t['id'], 'y1': 10 * t['x0'].fillna(0).abs(), "
                           "'y2': 5 * t['x1'].fillna(0).abs()})",
}


def _extra_column_script(tid: str, kind: str) -> str:
    return f"import pandas as pd\nt = pd.read_csv('test.csv')\n{PREDICT[tid]}\n{EXTRA_COLUMN[kind][0]}"


def test_one_extra_column_is_graded_as_grade_grades_it(verifier, tasks_dir, tmp_path):
    """A submission with one column more than the task's (the index of a to_csv without
    index=False, a note column, a duplicated target read back as `<target>.1`) is graded by
    score() exactly as grade() grades the same file, under both rule sets (MLE-bench's grader
    ignores extra columns for AUC and RMSLE): status ok and the same metrics. The width check
    before pandas used to refuse it ("line 1 has 3 fields, expected 2")."""
    import contextlib
    import shutil

    from graders.code_exec.grading import grade, parse_submission, read_csv_exact

    mle_dir = tmp_path / "mle"  # the bundled tasks without their own rule set: the default mle-bench
    for tid in PREDICT:
        shutil.copytree(tasks_dir / tid, mle_dir / tid)
        tj = mle_dir / tid / "task.json"
        tj.write_text(json.dumps({k: v for k, v in json.loads(tj.read_text()).items() if k != "grading_rules"}))
    mle = CodeExecTask(CodeExecConfig(tasks_dir=str(mle_dir), timeout_s=20.0, grace_s=0.5, max_concurrent=2))
    assert set(mle.grading_rules.values()) == {"mle-bench"}
    assert {verifier.grading_rules[tid] for tid in PREDICT} == {"counterpoint"}
    items = [(tid, kind) for tid in PREDICT for kind in EXTRA_COLUMN]
    completions = [(tid, _py(_extra_column_script(tid, kind))) for tid, kind in items]
    got = {"counterpoint": verifier.score_many(completions), "mle-bench": mle.score_many(completions)}
    for i, (tid, kind) in enumerate(items):
        work = tmp_path / f"{tid}-{i}"
        shutil.copytree(tasks_dir / tid / "public", work)
        with contextlib.chdir(work):  # the same script, here: the same bytes the sandbox collected
            exec(_extra_column_script(tid, kind), {})
        sub = parse_submission((work / "submission.csv").read_bytes())
        t = verifier.tasks[tid]
        assert len(sub.columns) == 2 + len(t.target_columns), (tid, kind, list(sub.columns))
        assert list(sub.columns)[0 if kind == "pandas index" else -1].endswith(EXTRA_COLUMN[kind][1])
        answers = read_csv_exact(t.answers_path)
        for rules, results in got.items():
            r, want = results[i], grade(t, sub, answers, rules)
            assert (r.status, r.message) == ("ok", None), (tid, kind, rules, r.message)
            assert (r.test_metric, r.val_metric) == (want.test, want.val), (tid, kind, rules)
            assert r.reward == reward_of(t.metric, want.val) and 0 < r.reward < 1


def test_width_bound_is_the_columns_plus_slack():
    """check_width lets through any line of up to columns + WIDTH_SLACK fields (grade() decides
    what extra columns mean) and refuses the first line past it; quoted commas do not count."""
    from graders.code_exec.grading import InvalidSubmission
    from graders.code_exec.verifier import WIDTH_SLACK, check_width

    def line(n, quoted=""):
        return ",".join([quoted or "1"] * n).encode() + b"\n"

    at_bound = 2 + WIDTH_SLACK
    check_width(b"id,target\n" + line(3) + line(at_bound), 2)
    check_width(line(at_bound) + line(at_bound - 1, '"a,b"'), 2)  # each quoted field is one
    with pytest.raises(InvalidSubmission, match=rf"^line 3 has {at_bound + 1} fields, over the "
                                                rf"{at_bound} read \(2 columns \+ {WIDTH_SLACK}\)$"):
        check_width(b"id,target\n" + line(at_bound) + line(at_bound + 1) + line(9_999), 2)
    with pytest.raises(InvalidSubmission, match=r"^line 1 has 1028 fields, over the 1027 read"):
        check_width(line(at_bound + 2), 3)
