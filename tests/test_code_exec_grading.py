"""Pure parts of the code-exec grader: metrics vs scikit-learn, reward maps, submission checks,
code extraction."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from sklearn import metrics as skm

from graders.code_exec.extract import extract_code
from graders.code_exec.grading import (InvalidSubmission, grade, log_loss, oriented, reward_of,
                                       rmsle, roc_auc)
from graders.code_exec.task import TaskSpec


@pytest.mark.parametrize("seed", range(5))
def test_metrics_agree_with_sklearn(seed):
    rng = np.random.default_rng(seed)
    y = rng.integers(0, 2, 300)
    s = np.round(rng.normal(size=300) + y, 1)  # rounded: many ties
    assert roc_auc(y, s) == pytest.approx(skm.roc_auc_score(y, s), abs=1e-12)
    k = 4
    p = rng.dirichlet(np.ones(k), 300)
    yi = rng.integers(0, k, 300)
    assert log_loss(yi, p) == pytest.approx(skm.log_loss(yi, p, labels=range(k)), abs=1e-12)
    t = rng.gamma(2.0, 1.0, (300, 2))
    q = np.abs(t + rng.normal(0, 0.3, t.shape))
    ref = np.mean([skm.root_mean_squared_log_error(t[:, j], q[:, j]) for j in range(2)])
    assert rmsle(t, q) == pytest.approx(ref, abs=1e-12)


def test_reward_maps_match_the_reference_records():
    assert reward_of("rmsle", 0.06570251263152488) == pytest.approx(0.9364093928262915, abs=1e-15)
    assert reward_of("roc_auc", 0.7850193012579306) == pytest.approx(0.5700386025158612, abs=1e-15)
    assert reward_of("log_loss", 0.5) == math.exp(-0.5)
    assert reward_of("roc_auc", 0.3) == 0.0
    assert (oriented("roc_auc", 0.7), oriented("log_loss", 0.4)) == (0.7, -0.4)


def _task(metric, targets, answer_cols, classes=()):
    return TaskSpec(id="t", dir=Path("/nonexistent"), metric=metric,
                    direction="higher" if metric == "roc_auc" else "lower", id_column="id",
                    target_columns=tuple(targets), answer_columns=tuple(answer_cols),
                    classes=tuple(classes))


def _answers_ll():
    return pd.DataFrame({"id": ["a", "b", "c", "d"], "label": ["x", "y", "z", "x"],
                         "split": ["val", "test", "test", "val"]})


def _sub_ll(rows=None):
    rows = rows or [[0.7, 0.2, 0.1], [0.1, 0.8, 0.1], [0.2, 0.2, 0.6], [0.5, 0.25, 0.25]]
    return pd.DataFrame({"id": ["d", "c", "b", "a"], **dict(zip("xyz", np.array(rows[::-1]).T))})


def test_grade_log_loss_splits_val_and_test():
    t = _task("log_loss", "xyz", ["label"], "xyz")
    g = grade(t, _sub_ll(), _answers_ll(), "counterpoint")
    assert g.test == pytest.approx(-(math.log(0.8) + math.log(0.6)) / 2)
    assert g.val == pytest.approx(-(math.log(0.7) + math.log(0.5)) / 2)


@pytest.mark.parametrize("mutate, msg", [
    (lambda s: s.drop(columns=["z"]), "columns"),
    (lambda s: s.assign(w=0.0), "columns"),
    (lambda s: s.iloc[:3], "3 rows, expected 4"),
    (lambda s: s.assign(id=["a", "a", "b", "c"]), "duplicate ids"),
    (lambda s: s.assign(id=["a", "b", "c", "e"]), "ids do not match"),
    (lambda s: s.assign(x=[np.nan, 0.7, 0.1, 0.2]), "NaN or infinite"),
    (lambda s: s.assign(x=["p", 0.7, 0.1, 0.2]), "non-numeric"),
    (lambda s: s.assign(x=s["x"] + 2e-6), "do not sum to 1"),
    (lambda s: s.assign(x=-s["x"], y=s["y"] + 2 * s["x"]), "outside [0, 1]"),
])
def test_invalid_log_loss_submissions(mutate, msg):
    t = _task("log_loss", "xyz", ["label"], "xyz")
    with pytest.raises(InvalidSubmission, match=msg.replace("[", r"\[").replace("]", r"\]")):
        grade(t, mutate(_sub_ll()), _answers_ll(), "counterpoint")


def test_probability_rows_within_tolerance_are_valid():
    t = _task("log_loss", "xyz", ["label"], "xyz")
    assert grade(t, _sub_ll().assign(x=lambda s: s["x"] + 5e-7), _answers_ll(), "counterpoint").test > 0


def test_rmsle_and_auc_checks():
    t = _task("rmsle", ["y1", "y2"], ["y1", "y2"])
    ans = pd.DataFrame({"id": [1, 2], "y1": [1.0, 2.0], "y2": [0.5, 0.1], "split": ["test", "test"]})
    sub = pd.DataFrame({"id": [2, 1], "y1": [2.0, 1.0], "y2": [0.1, 0.5]})
    assert grade(t, sub, ans, "counterpoint").test == 0.0 and grade(t, sub, ans, "counterpoint").val is None
    with pytest.raises(InvalidSubmission, match="negative"):
        grade(t, sub.assign(y2=[-0.1, 0.5]), ans, "counterpoint")
    with pytest.raises(InvalidSubmission, match="NaN or infinite"):
        grade(t, sub.assign(y1=[np.inf, 1.0]), ans, "counterpoint")
    a = _task("roc_auc", ["target"], ["target"])
    ans = pd.DataFrame({"id": [1, 2, 3], "target": [0, 1, 1]})  # no split column: all test
    g = grade(a, pd.DataFrame({"id": [1, 2, 3], "target": [0.1, 0.9, 0.05]}), ans, "counterpoint")
    assert g.test == pytest.approx(0.5) and g.val is None


def test_extraction_rules():
    assert extract_code("no code here") is None
    assert extract_code("```bash\nls\n```") is None
    assert extract_code("```python\n   \n```") is None
    assert extract_code("a\n```python\nx = 1\n```\nthen\n```py\nx = 2\n```\n") == "x = 2\n"
    assert extract_code("```\nuntagged = 1\n```") == "untagged = 1\n"
    assert extract_code("```\nuntagged\n```\n```python\ntagged\n```") == "tagged\n"
    assert extract_code("<think>```python\nhidden\n```</think>") is None
    assert extract_code("<think>plan</think>```python\nshown\n```") == "shown\n"
    assert extract_code("```python\nimport os\nprint(") == "import os\nprint(\n"  # truncated
