"""search.diagnostics: model families from code, and the per-round learning-signal scalars."""

from __future__ import annotations

import pytest

from search.diagnostics import model_family, round_diagnostics
from records.exec_result import ExecResult
from search.tree import Node, Tree


@pytest.mark.parametrize("code, family", [
    ("from sklearn.ensemble import HistGradientBoostingClassifier\nm = HistGradientBoostingClassifier()", "gradient_boosting"),
    ("import lightgbm as lgb\nm = lgb.train(params, d)", "gradient_boosting"),
    ("from xgboost import XGBRegressor\nm = XGBRegressor()", "gradient_boosting"),
    ("from sklearn.ensemble import GradientBoostingRegressor as G\nG()", "gradient_boosting"),
    ("from sklearn.ensemble import RandomForestClassifier\nRandomForestClassifier(n_estimators=10)", "random_forest"),
    ("from sklearn.ensemble import ExtraTreesRegressor", "random_forest"),
    ("from sklearn.linear_model import LogisticRegression\nLogisticRegression(C=2)", "linear"),
    ("from sklearn.linear_model import Ridge, Lasso", "linear"),
    ("from sklearn.linear_model import LinearRegression", "linear"),
    ("from sklearn.svm import SVC\nSVC(probability=True)", "svm"),
    ("from sklearn.svm import SVR", "svm"),
    ("from sklearn.neighbors import KNeighborsClassifier", "knn"),
    ("from sklearn.neural_network import MLPClassifier", "neural_net"),
    ("from sklearn.naive_bayes import MultinomialNB", "naive_bayes"),
    ("from sklearn.tree import DecisionTreeClassifier", "decision_tree"),
    ("from sklearn.dummy import DummyClassifier", "constant"),
    ("import shutil\nshutil.copy('sample_submission.csv', 'submission.csv')", "constant"),
    ("from sklearn.linear_model import LogisticRegression\nfrom sklearn.ensemble import RandomForestClassifier",
     "linear+random_forest"),
    ("from sklearn.dummy import DummyRegressor\nfrom sklearn.linear_model import Ridge", "linear"),
    # names in comments and strings are not models; a script that does not tokenize still classifies
    ("# try RandomForestClassifier later\nprint('SVC')\nimport numpy as np", "constant"),
    ("from sklearn.svm import SVC\nx = (1,", "svm"),
])
def test_model_family(code, family):
    assert model_family(code) == family


def mk(id, mode="draft", parent=None, status="ok", val=None, test=None, reward=None, group=0,
       code="", depth=0):
    return Node(id=id, parent_id=parent, mode=mode, step=1, round=0, expansion=group, sibling_group=group,
                index=0, prompt_messages=[], assistant_prefix="", raw_completion="", prompt_token_ids=[1],
                response_token_ids=[], response_logprobs=[], adapter_version=0, finish_reason="stop",
                debug_depth=depth,
                result=ExecResult(task_id="t", status=status, reward=-0.5 if reward is None else reward,
                                  test_metric=test, val_metric=val, oriented=None if val is None else -val,
                                  exec_time=0.1, term_tail="", exc_type=None, message=None, isolation="none",
                                  limits={}, code=code))


LADDER = {"metric": "rmsle",
          "constant": {"status": "ok", "val_metric": 0.20, "test_metric": 0.19},
          "linear": {"status": "ok", "val_metric": 0.10, "test_metric": 0.11},
          "gbm": {"status": "crashed", "val_metric": None, "test_metric": None}}


def test_round_diagnostics_counts_rates_and_ladder():
    old = mk("p", val=0.15, test=0.16, reward=0.86, code="Ridge()")  # an earlier round's parent
    crashed_old = mk("q", status="crashed")
    tree = Tree("positive-regression", "rmsle", "lower")
    tree.add(old)
    tree.add(crashed_old)
    nodes = [
        mk("d0", code="from sklearn.linear_model import Ridge", val=0.12, test=0.13, reward=0.89),
        mk("d1", status="crashed"),
        mk("i0", "improve", "p", group=1, val=0.11, test=0.30, reward=0.9, code="RandomForestRegressor()"),
        mk("i1", "improve", "p", group=1, val=0.18, test=0.10, reward=0.84, code="Ridge()"),
        mk("i2", "improve", "p", group=1, status="timeout"),
        mk("g0", "debug", "q", group=2, status="no_code", depth=1),
        mk("g1", "debug", "q", group=2, status="invalid_submission", depth=1),
        mk("g2", "debug", "q", group=2, val=0.30, test=0.31, reward=0.74, code="", depth=1),
    ]
    for n in nodes:
        tree.add(n)
    d = round_diagnostics(nodes, tree, ladder=LADDER)
    assert (d["nodes"], d["valid"], d["valid_share"]) == (8, 4, 0.5)
    assert (d["status_ok"], d["status_crashed"], d["status_timeout"], d["status_no_code"],
            d["status_invalid_submission"]) == (4, 1, 1, 1, 1)
    assert (d["mode_draft"], d["mode_improve"], d["mode_debug"]) == (2, 3, 3)
    assert d["debug_success_rate"] == pytest.approx(1 / 3)
    assert d["improve_success_rate"] == pytest.approx(1 / 3)  # i0 beats 0.15, i1 does not, i2 failed
    rewards = [0.89, -0.5, 0.9, 0.84, -0.5, -0.5, -0.5, 0.74]
    assert d["reward_mean"] == pytest.approx(sum(rewards) / 8)
    assert d["groups"] == 3 and d["frac_groups_zero_reward_std"] == 0.0
    assert d["best_val_metric"] == pytest.approx(0.11) and d["median_val_metric"] == pytest.approx(0.15)
    assert d["honest_test_metric"] == pytest.approx(0.30)  # chosen on validation: i0, test 0.30
    assert d["best_vs_constant"] == pytest.approx(0.09) and d["best_vs_linear"] == pytest.approx(-0.01)
    assert d["median_vs_linear"] == pytest.approx(-0.05)
    assert d["honest_vs_linear"] == pytest.approx(-0.19)
    assert "best_vs_gbm" not in d and "best_vs_metric" not in d
    assert d["model_families"] == 3  # linear (d0, i1), random_forest (i0), constant (g2)
    assert all(v is None or isinstance(v, (int, float)) for v in d.values())  # metrics.jsonl scalars


def test_round_diagnostics_of_a_round_without_valid_nodes():
    tree = Tree("t", "roc_auc", "higher")
    nodes = [mk("a", status="crashed"), mk("b", status="no_code"), mk("c", status="crashed", group=1)]
    for n in nodes:
        tree.add(n)
    d = round_diagnostics(nodes, tree, ladder={"linear": {"val_metric": 0.6, "test_metric": 0.6}})
    assert d["valid_share"] == 0 and d["frac_groups_zero_reward_std"] == 1.0
    assert d["debug_success_rate"] is None and d["improve_success_rate"] is None
    assert d["best_val_metric"] is None and d["honest_test_metric"] is None
    assert d["best_vs_linear"] is None and d["honest_vs_linear"] is None and d["model_families"] == 0
    assert d["reward_std"] == 0.0
