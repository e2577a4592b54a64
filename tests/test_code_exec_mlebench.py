"""The grading rule sets against MLE-bench's own grade.py (tests/mlebench_reference.py, copied
from openai/mle-bench at 783b15a) on generated valid and adversarial submissions of its three
competitions, each prepared the MLE-bench way (answers = its private/test.csv format, a task.json
that names no rule set, so the config's default applies).

- `mle-bench` gives MLE-bench's verdict and metric on every submission;
- `counterpoint` gives the same, except on submissions that hit one of COUNTERPOINT_DIFFERENCES,
  and every documented difference is hit (each one is real, none is undocumented);
- each difference, spelled out against scikit-learn on a small hand-made case.
"""

from __future__ import annotations

import io
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import pandas as pd
import pytest
from sklearn import metrics as skm

import mlebench_reference as ref
from config.code_exec import CodeExecConfig
from graders.code_exec.grading import (COUNTERPOINT_DIFFERENCES, InvalidSubmission, grade,
                                       parse_submission, read_csv_exact)
from graders.code_exec.task import load_task

ROWS = 40
SEEDS = range(10)
CLASSES = ["EAP", "HPL", "MWS"]
NOMAD = ["formation_energy_ev_natom", "bandgap_energy_ev"]


# ---- the three competitions, prepared the MLE-bench way ----------------------------------------

def pizza_answers(rng) -> pd.DataFrame:
    y = (rng.random(ROWS) < 0.3).astype(int)
    y[:2] = [0, 1]  # both classes
    ids = [f"t3_{x:05x}" for x in rng.choice(16 ** 5, ROWS, replace=False)]
    return pd.DataFrame({"request_id": ids, "requester_received_pizza": y})


def spooky_answers(rng) -> pd.DataFrame:
    labels = rng.integers(0, 3, ROWS)
    labels[:3] = [0, 1, 2]
    onehot = pd.DataFrame(0, index=range(ROWS), columns=["id", *CLASSES])  # df_to_one_hot's layout
    onehot["id"] = [f"id{x:05d}" for x in rng.choice(10 ** 5, ROWS, replace=False)]
    for i, k in enumerate(labels):
        onehot.loc[i, CLASSES[k]] = 1
    return onehot


def nomad_answers(rng) -> pd.DataFrame:  # private/test.csv: id 1..n, inputs and both targets
    return pd.DataFrame({"id": np.arange(1, ROWS + 1), "spacegroup": rng.choice([12, 33, 167, 206], ROWS),
                         "number_of_total_atoms": rng.choice([10, 20, 40, 80], ROWS),
                         NOMAD[0]: np.round(rng.uniform(0.0, 0.5, ROWS), 4),
                         NOMAD[1]: np.round(rng.uniform(0.2, 5.0, ROWS), 4)})


def pizza_submission(ans, rng) -> pd.DataFrame:
    p = np.clip(0.35 * ans["requester_received_pizza"] + 0.65 * rng.random(ROWS), 0, 1)
    sub = pd.DataFrame({"request_id": ans["request_id"], "requester_received_pizza": p})
    return sub.iloc[rng.permutation(ROWS)].reset_index(drop=True)


def spooky_submission(ans, rng) -> pd.DataFrame:
    p = rng.dirichlet(np.ones(3), ROWS) + 2 * ans[CLASSES].to_numpy()
    p /= p.sum(axis=1, keepdims=True)
    sub = pd.DataFrame(p, columns=CLASSES)
    sub.insert(0, "id", ans["id"])
    return sub.iloc[rng.permutation(ROWS)].reset_index(drop=True)


def nomad_submission(ans, rng) -> pd.DataFrame:  # rows in test.csv order, as a script writes them
    pred = ans[NOMAD].to_numpy() * np.exp(rng.normal(0, 0.2, (ROWS, 2)))
    return pd.DataFrame({"id": ans["id"], NOMAD[0]: pred[:, 0], NOMAD[1]: pred[:, 1]})


def _set(df, col, row, value):
    df = df.copy()
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        df[col] = df[col].astype(object)
    df.loc[row, col] = value
    return df


def _add_to(df, col, delta, row=0):
    df = df.copy()
    df.loc[row, col] = df.loc[row, col] + delta
    return df


# A mutation: (name, sub -> (frame, write the index too), COUNTERPOINT_DIFFERENCES it may hit)
Mutation = tuple[str, Callable[[pd.DataFrame, np.random.Generator], tuple[pd.DataFrame, bool]], frozenset]


def _m(name, fn, *tags, index=False) -> Mutation:
    return name, (lambda s, rng: (fn(s, rng), index)), frozenset(tags)


def _common(idc: str, target: str) -> list[Mutation]:
    """What every competition gets: the sample as written, NaN, inf, text, missing/renamed
    columns, row count, duplicate and unknown ids, an extra index column, an empty file."""
    return [
        _m("valid", lambda s, r: s),
        _m("index_column", lambda s, r: s, index=True),  # to_csv without index=False: `Unnamed: 0`
        _m("extra_named_column", lambda s, r: s.assign(note="x")),
        _m("nan", lambda s, r: _set(s, target, 3, np.nan)),
        _m("inf", lambda s, r: _set(s, target, 3, np.inf)),
        _m("text_value", lambda s, r: _set(s, target, 3, "high")),
        _m("missing_target", lambda s, r: s.drop(columns=[target])),
        _m("renamed_target", lambda s, r: s.rename(columns={target: "prediction"})),
        _m("fewer_rows", lambda s, r: s.iloc[:-1]),
        _m("extra_row", lambda s, r: pd.concat([s, s.iloc[[0]]]).reset_index(drop=True), "rows_by_id"),
        _m("empty", lambda s, r: s.iloc[:0]),
        _m("duplicate_id", lambda s, r: _set(s, idc, 1, s.loc[0, idc]), "rows_by_id"),
        _m("unknown_id", lambda s, r: _set(s, idc, 2, "nope"), "rows_by_id"),
        _m("missing_id", lambda s, r: s.drop(columns=[idc]), "rows_by_id"),
        _m("renamed_id", lambda s, r: s.rename(columns={idc: "ID"}), "rows_by_id"),
    ]


def _pizza_mutations() -> list[Mutation]:
    t = "requester_received_pizza"
    return _common("request_id", t) + [
        _m("hard_labels", lambda s, r: s.assign(**{t: (s[t] > 0.5).astype(int)})),
        _m("ties", lambda s, r: s.assign(**{t: s[t].round(1)})),
        _m("bounds_inclusive", lambda s, r: _set(_set(s, t, 0, 0.0), t, 1, 1.0)),
        _m("logits", lambda s, r: s.assign(**{t: np.log((s[t] + 1e-3) / (1.001 - s[t]))}), "auc_any_real_score"),
        _m("percent", lambda s, r: s.assign(**{t: 100 * s[t]}), "auc_any_real_score"),
        _m("ranks", lambda s, r: s.assign(**{t: s[t].rank()}), "auc_any_real_score"),
        _m("one_negative", lambda s, r: _set(s, t, 4, -0.01), "auc_any_real_score"),
    ]


def _spooky_mutations() -> list[Mutation]:
    def confident(s, r, value):
        s = s.copy()
        s.loc[0, CLASSES] = [value, 1 - value, 0.0]
        return s

    return _common("id", "EAP") + [
        _m("columns_reordered", lambda s, r: s[["id", "MWS", "EAP", "HPL"]]),
        _m("one_hot_exact", lambda s, r: s.assign(**{c: (s[CLASSES].idxmax(axis=1) == c).astype(float) for c in CLASSES})),
        _m("confident_zero", lambda s, r: confident(s, r, 0.0)),  # clipping decides the metric
        _m("confident_1e-17", lambda s, r: confident(s, r, 1e-17)),
        _m("sum_off_5e-7", lambda s, r: _add_to(s, "EAP", 5e-7 * (1 - 2 * (s.loc[0, "EAP"] > 0.5)))),
        _m("sum_off_5e-6", lambda s, r: _add_to(s, "EAP", 5e-6 * (1 - 2 * (s.loc[0, "EAP"] > 0.5))), "prob_sum_abs_1e-6"),
        _m("sum_off_2e-5", lambda s, r: _add_to(s, "EAP", 2e-5 * (1 - 2 * (s.loc[0, "EAP"] > 0.5)))),
        _m("unnormalised", lambda s, r: s.assign(**{c: 2 * s[c] for c in CLASSES})),
        _m("negative_sums_to_one", lambda s, r: confident(s, r, -0.2)),
        _m("above_one_sums_to_one", lambda s, r: confident(s, r, 1.2)),
        _m("id_last", lambda s, r: s[[*CLASSES, "id"]], "log_loss_columns_by_name"),
        _m("id_middle", lambda s, r: s[["EAP", "id", "HPL", "MWS"]], "log_loss_columns_by_name"),
    ]


def _nomad_mutations() -> list[Mutation]:
    f, b = NOMAD
    return _common("id", f) + [
        _m("zeros", lambda s, r: _set(s, b, 0, 0.0)),
        _m("float_ids", lambda s, r: s.assign(id=s["id"].astype(float))),
        _m("rows_shuffled", lambda s, r: s.iloc[r.permutation(ROWS)].reset_index(drop=True), "rows_by_id"),
        _m("rows_sorted_by_prediction", lambda s, r: s.sort_values(b).reset_index(drop=True), "rows_by_id"),
        _m("text_ids", lambda s, r: s.assign(id=[f"x{i}" for i in s["id"]]), "rows_by_id"),
        _m("negative_small", lambda s, r: _set(s, f, 2, -0.05), "rmsle_nonnegative"),
        _m("negative_half", lambda s, r: _set(s, b, 5, -0.5), "rmsle_nonnegative"),
        _m("minus_one", lambda s, r: _set(s, f, 2, -1.0)),
        _m("minus_three", lambda s, r: _set(s, b, 2, -3.0)),
    ]


@dataclass(frozen=True)
class Competition:
    name: str
    task_json: dict
    answers: Callable
    submission: Callable
    mutations: list[Mutation]
    reference: Callable  # MLE-bench's grade(submission, answers)


COMPETITIONS = [
    Competition("random-acts-of-pizza",
                {"metric": "roc_auc", "id_column": "request_id", "target_columns": ["requester_received_pizza"]},
                pizza_answers, pizza_submission, _pizza_mutations(), ref.pizza_grade),
    Competition("spooky-author-identification",
                {"metric": "log_loss", "id_column": "id", "target_columns": CLASSES, "answer_columns": CLASSES},
                spooky_answers, spooky_submission, _spooky_mutations(), ref.spooky_grade),
    Competition("nomad2018-predict-transparent-conductors",
                {"metric": "rmsle", "id_column": "id", "target_columns": NOMAD},
                nomad_answers, nomad_submission, _nomad_mutations(), ref.nomad_grade),
]


def prepared_task(root: Path, comp: Competition, answers: pd.DataFrame):
    """An MLE-bench prepared competition as a counterpoint task dir: public/, private/test.csv
    and a task.json naming no rule set."""
    d = root / comp.name
    (d / "public").mkdir(parents=True)
    (d / "private").mkdir()
    (d / "public" / "description.md").write_text(comp.name)
    answers.to_csv(d / "private" / "test.csv", index=False)
    (d / "task.json").write_text(json.dumps({"id": comp.name, "answers": "private/test.csv", **comp.task_json}))
    return load_task(d)


@dataclass(frozen=True)
class Case:
    competition: str
    mutation: str
    tags: frozenset
    oracle: float | None  # MLE-bench's grade() value; None = no score (invalid)
    oracle_reported: float | None  # Grader.__call__: rounded to 5 decimals
    ours: dict[str, float | None]  # rule set -> our test metric, None = InvalidSubmission


def _ours(task, rules: str, data: bytes, answers: pd.DataFrame) -> float | None:
    try:
        return grade(task, parse_submission(data), answers, rules).test
    except InvalidSubmission:
        return None


@pytest.fixture(scope="module")
def cases(tmp_path_factory) -> list[Case]:
    out = []
    default_rules = CodeExecConfig().grading_rules
    for seed in SEEDS:
        root = tmp_path_factory.mktemp(f"mlebench{seed}")
        for comp in COMPETITIONS:
            rng = np.random.default_rng([seed, COMPETITIONS.index(comp)])
            task = prepared_task(root, comp, comp.answers(rng))
            assert task.grading_rules is None and task.rules(default_rules) == "mle-bench"
            answers = read_csv_exact(task.answers_path)
            base = comp.submission(answers, rng)
            for name, mutate, tags in comp.mutations:
                frame, index = mutate(base.copy(), rng)
                data = frame.to_csv(index=index).encode()
                sub, ans = ref.read_csv(io.BytesIO(data)), ref.read_csv(task.answers_path)
                try:
                    oracle = comp.reference(sub, ans)
                except Exception:  # Grader.__call__: any exception is no score
                    oracle = None
                out.append(Case(comp.name, name, tags, oracle, ref.grader_call(comp.reference, sub, ans),
                                {r: _ours(task, r, data, answers) for r in ("mle-bench", "counterpoint")}))
    return out


def test_the_submissions_cover_valid_and_invalid_verdicts(cases):
    valid = sum(c.oracle is not None for c in cases)
    assert len(cases) >= 500 and 0.3 * len(cases) <= valid <= 0.7 * len(cases), (len(cases), valid)
    for comp in COMPETITIONS:
        mine = [c for c in cases if c.competition == comp.name]
        assert {c.oracle is None for c in mine} == {True, False}, comp.name


def test_mlebench_rules_give_mlebench_verdict_and_metric(cases):
    disagree = [(c.competition, c.mutation, c.oracle, c.ours["mle-bench"]) for c in cases
                if (c.oracle is None) != (c.ours["mle-bench"] is None)
                or (c.oracle is not None and c.ours["mle-bench"] != c.oracle)]
    assert not disagree, f"{len(disagree)}/{len(cases)} disagree, e.g. {disagree[:5]}"
    # MLE-bench's report rounds to 5 decimals; the full value rounds to it
    assert all(c.oracle_reported == (None if c.ours["mle-bench"] is None else round(c.ours["mle-bench"], 5))
               for c in cases)


def test_counterpoint_rules_differ_only_where_documented(cases):
    undocumented, hit = [], set()
    for c in cases:
        ours, oracle = c.ours["counterpoint"], c.oracle
        same = (ours is None) == (oracle is None) and (ours is None or math.isclose(ours, oracle, rel_tol=1e-12))
        if not same:
            if not c.tags:
                undocumented.append((c.competition, c.mutation, oracle, ours))
            hit |= c.tags
    assert not undocumented, undocumented[:5]
    assert hit == set(COUNTERPOINT_DIFFERENCES), set(COUNTERPOINT_DIFFERENCES) - hit


# ---- each difference, against scikit-learn on hand-made cases ------------------------------------

def _task(tmp_path, comp_index: int, answers: pd.DataFrame):
    return prepared_task(tmp_path, COMPETITIONS[comp_index], answers)


def _both(task, sub: pd.DataFrame, answers: pd.DataFrame, index: bool = False) -> dict[str, float | str]:
    data = sub.to_csv(index=index).encode()
    out = {}
    for rules in ("mle-bench", "counterpoint"):
        try:
            out[rules] = grade(task, parse_submission(data), answers, rules).test
        except InvalidSubmission as e:
            out[rules] = f"invalid: {e}"
    return out


def test_rmsle_rows_by_position_or_by_id(tmp_path):
    ans = pd.DataFrame({"id": [1, 2, 3], NOMAD[0]: [0.1, 0.2, 0.3], NOMAD[1]: [1.0, 2.0, 3.0]})
    task = _task(tmp_path, 2, ans)
    shuffled = pd.DataFrame({"id": [3, 1, 2], NOMAD[0]: [0.3, 0.1, 0.2], NOMAD[1]: [3.0, 1.0, 2.0]})
    got = _both(task, shuffled, ans)
    by_position = np.mean([skm.root_mean_squared_log_error(ans[c], shuffled[c]) for c in NOMAD])
    assert got["mle-bench"] == pytest.approx(by_position) and by_position > 0.1
    assert got["counterpoint"] == 0.0  # the same predictions, matched by id
    floats = _both(task, ans.assign(id=[1.0, 2.0, 3.0]), ans)
    assert floats == {"mle-bench": 0.0, "counterpoint": 0.0}  # 1.0 is id 1
    no_id = _both(task, ans.drop(columns=["id"]), ans)
    assert no_id["mle-bench"] == 0.0 and "lack ['id']" in no_id["counterpoint"]
    text_ids = _both(task, ans.assign(id=["a", "b", "c"]), ans)
    assert text_ids["mle-bench"] == 0.0 and "ids must be numbers like the test set's, e.g. not 'a'" in text_ids["counterpoint"]


def test_rmsle_negative_predictions(tmp_path):
    ans = pd.DataFrame({"id": [1, 2], NOMAD[0]: [0.1, 0.2], NOMAD[1]: [1.0, 2.0]})
    task = _task(tmp_path, 2, ans)
    sub = ans.assign(**{NOMAD[0]: [-0.5, 0.2]})
    got = _both(task, sub, ans)
    assert got["mle-bench"] == pytest.approx(np.mean([skm.root_mean_squared_log_error(ans[c], sub[c]) for c in NOMAD]))
    assert "negative predictions" in got["counterpoint"]
    at_minus_one = _both(task, ans.assign(**{NOMAD[0]: [-1.0, 0.2]}), ans)
    assert all(v.startswith("invalid") for v in at_minus_one.values()), at_minus_one


def test_auc_scores_outside_unit_interval_and_extra_columns(tmp_path):
    ans = pd.DataFrame({"request_id": ["t3_a", "t3_b", "t3_c", "t3_d"], "requester_received_pizza": [0, 1, 1, 0]})
    task = _task(tmp_path, 0, ans)
    logits = ans.assign(requester_received_pizza=[-2.0, 1.5, 0.3, 0.7])
    got = _both(task, logits, ans)
    assert "between 0 and 1" in got["mle-bench"]
    assert got["counterpoint"] == skm.roc_auc_score(ans["requester_received_pizza"], logits["requester_received_pizza"]) == 0.75
    probs = ans.assign(requester_received_pizza=[0.1, 0.8, 0.4, 0.6])
    assert _both(task, probs, ans, index=True) == {"mle-bench": 0.75, "counterpoint": 0.75}  # `Unnamed: 0` ignored


def test_log_loss_clipping_tolerance_and_column_order(tmp_path):
    ans = pd.DataFrame({"id": ["a", "b"], "EAP": [1, 0], "HPL": [0, 1], "MWS": [0, 0]})
    task = _task(tmp_path, 1, ans)
    wrong = pd.DataFrame({"id": ["a", "b"], "EAP": [0.0, 0.2], "HPL": [1.0, 0.7], "MWS": [0.0, 0.1]})
    expect = skm.log_loss(ans[CLASSES].to_numpy(), wrong[CLASSES].to_numpy())
    assert expect == pytest.approx((-math.log(np.finfo(float).eps) - math.log(0.7)) / 2)  # not 1e-15
    assert _both(task, wrong, ans) == {"mle-bench": expect, "counterpoint": expect}
    off = wrong.assign(EAP=[5e-6, 0.2])  # row sums 1 + 5e-6
    got = _both(task, off, ans)
    assert got["mle-bench"] == pytest.approx(skm.log_loss(ans[CLASSES].to_numpy(), off[CLASSES].to_numpy()))
    assert "do not sum to 1 within 1e-06" in got["counterpoint"]
    id_last = _both(task, wrong[[*CLASSES, "id"]], ans)
    assert id_last["counterpoint"] == expect and id_last["mle-bench"].startswith("invalid")


def test_default_rule_set_and_task_json_choice(tmp_path):
    """A task.json naming no rule set takes grader.code_exec.grading_rules (default mle-bench);
    one naming a rule set keeps it; an unknown name is a one-line TaskError."""
    from graders.code_exec.task import TaskError

    ans = pd.DataFrame({"id": [1, 2], NOMAD[0]: [0.1, 0.2], NOMAD[1]: [1.0, 2.0]})
    task = _task(tmp_path, 2, ans)
    assert CodeExecConfig().grading_rules == "mle-bench" and task.rules("mle-bench") == "mle-bench"
    tj = task.dir / "task.json"
    tj.write_text(json.dumps({**json.loads(tj.read_text()), "grading_rules": "counterpoint"}))
    assert load_task(task.dir).rules("mle-bench") == "counterpoint"
    tj.write_text(json.dumps({**json.loads(tj.read_text()), "grading_rules": "kaggle"}))
    with pytest.raises(TaskError, match=r"grading_rules 'kaggle' is not one of \['mle-bench', 'counterpoint'\]"):
        load_task(task.dir)
