"""MLE-bench-style grading: submission checks, metrics, reward maps. numpy + pandas only.

A submission is checked before it is scored; every defect is an `InvalidSubmission` with a
one-line message (never a crash). Metrics are implemented here (tests compare them with
scikit-learn's on the same arrays). Rewards follow the reference (mle-tree-spec.md):
error metrics `exp(-m)`, AUC `max(0, 2*AUC - 1)`, a fixed sentinel for any failed node.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pandas as pd

STATUSES = ("ok", "no_code", "crashed", "timeout", "invalid_submission")
METRICS = {"roc_auc": "higher", "log_loss": "lower", "rmsle": "lower"}
REWARD_MAPS = {"roc_auc": "max(0, 2*m - 1)", "log_loss": "exp(-m)", "rmsle": "exp(-m)"}
PROB_SUM_TOL = 1e-6
LOG_LOSS_EPS = 1e-15


class InvalidSubmission(ValueError):
    """The submission cannot be graded; the message says why in one line."""


def roc_auc(y_true: np.ndarray, score: np.ndarray) -> float:
    """Area under the ROC curve of binary labels (0/1) by the rank-sum formula, ties averaged."""
    y = np.asarray(y_true).astype(bool)
    s = np.asarray(score, dtype=float)
    n_pos, n_neg = int(y.sum()), int((~y).sum())
    if n_pos == 0 or n_neg == 0:
        raise ValueError("roc_auc needs both classes in y_true")
    order = np.argsort(s, kind="mergesort")
    ranks = np.empty(len(s), dtype=float)
    sorted_s = s[order]
    i = 0
    while i < len(s):  # average ranks over ties
        j = i
        while j + 1 < len(s) and sorted_s[j + 1] == sorted_s[i]:
            j += 1
        ranks[order[i:j + 1]] = (i + j) / 2.0 + 1.0
        i = j + 1
    return float((ranks[y].sum() - n_pos * (n_pos + 1) / 2.0) / (n_pos * n_neg))


def log_loss(y_index: np.ndarray, proba: np.ndarray) -> float:
    """Multi-class log loss: mean of -log p[true class], p clipped to [1e-15, 1 - 1e-15]."""
    p = np.clip(np.asarray(proba, dtype=float), LOG_LOSS_EPS, 1 - LOG_LOSS_EPS)
    idx = np.asarray(y_index, dtype=int)
    return float(-np.mean(np.log(p[np.arange(len(idx)), idx])))


def rmsle(y_true: np.ndarray, y_pred: np.ndarray) -> float:
    """Mean column-wise root mean squared log error (columns = targets)."""
    t = np.asarray(y_true, dtype=float).reshape(len(y_true), -1)
    p = np.asarray(y_pred, dtype=float).reshape(len(y_pred), -1)
    per_col = np.sqrt(np.mean((np.log1p(p) - np.log1p(t)) ** 2, axis=0))
    return float(np.mean(per_col))


def reward_of(metric: str, value: float) -> float:
    """The reference's reward map for a graded metric value."""
    if metric == "roc_auc":
        return max(0.0, 2.0 * value - 1.0)
    if metric in ("log_loss", "rmsle"):
        return math.exp(-value)
    raise ValueError(f"unknown metric {metric!r}")


def oriented(metric: str, value: float) -> float:
    """Higher is better across tasks: the value itself or its negation."""
    return value if METRICS[metric] == "higher" else -value


@dataclass(frozen=True)
class Grade:
    """Metrics of one valid submission per held-out split (None where the split is absent)."""

    test: float
    val: float | None


def read_submission(path, max_bytes: int) -> pd.DataFrame:
    """Read a CSV the sandboxed script wrote, refusing symlinks, non-regular files and huge ones."""
    import os
    import stat

    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        raise InvalidSubmission("no submission.csv written") from None
    except OSError as e:
        raise InvalidSubmission(f"submission.csv cannot be opened safely: {e.strerror}") from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise InvalidSubmission("submission.csv is not a regular file")
        if st.st_size > max_bytes:
            raise InvalidSubmission(f"submission.csv is {st.st_size} bytes (limit {max_bytes})")
        try:
            return pd.read_csv(f)
        except Exception as e:  # any parse error is the submission's fault
            raise InvalidSubmission(f"submission.csv is not a readable CSV: {e}".splitlines()[0])


def _numeric(sub: pd.DataFrame, cols: list[str]) -> np.ndarray:
    try:
        arr = sub[cols].to_numpy(dtype=float)
    except (ValueError, TypeError):
        raise InvalidSubmission(f"non-numeric values in columns {cols}") from None
    if not np.all(np.isfinite(arr)):
        raise InvalidSubmission(f"NaN or infinite values in columns {cols}")
    return arr


def grade(task, sub: pd.DataFrame, answers: pd.DataFrame) -> Grade:
    """Check `sub` against the task's answers and score it; raises InvalidSubmission."""
    idc = task.id_column
    expected = [idc, *task.target_columns]
    if set(sub.columns) != set(expected) or len(sub.columns) != len(expected):
        raise InvalidSubmission(
            f"columns {list(sub.columns)[:12]} != expected {expected}"
        )
    if len(sub) != len(answers):
        raise InvalidSubmission(f"{len(sub)} rows, expected {len(answers)}")
    ids = sub[idc].astype(str)
    if ids.duplicated().any():
        raise InvalidSubmission(f"duplicate ids, e.g. {ids[ids.duplicated()].iloc[0]!r}")
    want = answers[idc].astype(str)
    if set(ids) != set(want):
        missing = sorted(set(want) - set(ids))[:3]
        raise InvalidSubmission(f"ids do not match the test set (missing e.g. {missing})")
    pred = _numeric(sub, list(task.target_columns))
    pred = pred[pd.Index(ids).get_indexer(want)]  # rows in answer order
    if task.metric == "log_loss":
        if np.any(pred < 0) or np.any(pred > 1):
            raise InvalidSubmission("probabilities outside [0, 1]")
        bad = np.abs(pred.sum(axis=1) - 1.0) > PROB_SUM_TOL
        if bad.any():
            raise InvalidSubmission(
                f"{int(bad.sum())} probability rows do not sum to 1 within {PROB_SUM_TOL}"
            )
    if task.metric == "rmsle" and np.any(pred < 0):
        raise InvalidSubmission("negative predictions (RMSLE needs values >= 0)")

    split = answers["split"].to_numpy() if "split" in answers.columns else None

    def on(mask) -> float:
        a, p = answers[mask], pred[mask]
        if task.metric == "roc_auc":
            return roc_auc(a[task.answer_columns[0]].to_numpy(), p[:, 0])
        if task.metric == "log_loss":
            idx = pd.Index(task.classes).get_indexer(a[task.answer_columns[0]].astype(str))
            return log_loss(idx, p)
        return rmsle(a[list(task.answer_columns)].to_numpy(dtype=float), p)

    if split is None:
        return Grade(test=on(np.ones(len(answers), bool)), val=None)
    return Grade(test=on(split == "test"), val=on(split == "val") if (split == "val").any() else None)
