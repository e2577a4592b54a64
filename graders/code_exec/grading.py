"""MLE-bench-style grading: submission checks, metrics, reward maps, under one of two rule sets.

A submission is checked before it is scored; every defect is an `InvalidSubmission` with a
one-line message (never a crash). The metrics are scikit-learn's (roc_auc_score, log_loss,
root_mean_squared_log_error), the functions MLE-bench's graders call. Rewards follow the reference
(mle-tree-spec.md): error metrics `exp(-m)`, AUC `max(0, 2*AUC - 1)`, a fixed sentinel for any
failed node.

A task picks its rule set (task.json `grading_rules`, else grader.code_exec.grading_rules):

- `mle-bench`: what MLE-bench's grade.py does (openai/mle-bench at 783b15a), read from its files
  and generalised from the competition it mirrors to any task of that metric:
  roc_auc  = random-acts-of-pizza: competitions/utils.py `prepare_for_auroc_metric` (id and target
             columns present, extra columns ignored, same row count, numeric, every score in
             [0, 1], both frames sorted by id and the ids equal) + `roc_auc_score`;
  log_loss = spooky-author-identification: grade.py `prepare_for_metric` (shape exactly rows x
             (classes + 1), every row of the columns after the first summing to 1 by
             `np.isclose(sum, 1, atol=1e-6)`, each in [0, 1]) + utils.py
             `one_hot_dfs_to_log_loss_inputs` (sorted by id, ids equal) + `log_loss` (clipped at
             the float64 eps) on one-hot answers;
  rmsle    = nomad2018-predict-transparent-conductors: grade.py (target columns present, same
             row count, rows compared BY POSITION, the id column never read) + the mean over the
             targets of `root_mean_squared_log_error` (which refuses values <= -1 in the pinned
             scikit-learn 1.9).
  Any exception while grading makes the submission invalid, as MLE-bench's `Grader.__call__`
  returns no score for one. Its report rounds the score to 5 decimals; the metric here keeps full
  precision (round(m, 5) is MLE-bench's reported score).
- `counterpoint`: the same metrics and checks except COUNTERPOINT_DIFFERENCES, each with its
  reason. The bundled tasks use it (their descriptions state these rules to the policy).
"""

from __future__ import annotations

import io
import math
from dataclasses import dataclass
from typing import get_args

import numpy as np
import pandas as pd

from config.code_exec import GradingRules

METRICS = {"roc_auc": "higher", "log_loss": "lower", "rmsle": "lower"}
REWARD_MAPS = {"roc_auc": "max(0, 2*m - 1)", "log_loss": "exp(-m)", "rmsle": "exp(-m)"}
RULE_SETS = get_args(GradingRules)
PROB_SUM_TOL = 1e-6  # both rule sets' stated tolerance; mle-bench applies it as np.isclose's atol
COUNTERPOINT_DIFFERENCES = {
    "rows_by_id": "Rows are matched to the answers by id for every metric, ids compared by value "
    "(numeric ids as numbers: 1.0 is 1; others as text); a missing, duplicate or unknown id is "
    "invalid. Why: a script that reorders its rows (a groupby, a sort) is scored on what it "
    "predicted; MLE-bench's RMSLE compares rows by position and never reads the id column, so a "
    "reordered or mis-keyed submission gets a silently wrong metric there.",
    "prob_sum_abs_1e-6": "Probability rows must sum to 1 within 1e-6 absolute. Why: that is the "
    "bound the task description states; MLE-bench's np.isclose(sum, 1, atol=1e-6) adds its "
    "default rtol (1e-5), accepting rows off by up to 1.1e-5.",
    "auc_any_real_score": "An AUC score may be any finite real number (a logit, a rank). Why: "
    "AUC depends only on the order of the scores and the bundled descriptions say so; MLE-bench "
    "rejects scores outside [0, 1].",
    "rmsle_nonnegative": "RMSLE predictions must be >= 0. Why: the bundled targets are positive and "
    "the description says so, and the rule does not move with the scikit-learn version; "
    "MLE-bench accepts whatever root_mean_squared_log_error does (values > -1 in 1.9).",
    "log_loss_columns_by_name": "Log-loss class columns are read by name, the id column anywhere. "
    "Why: column order carries no meaning in a CSV; MLE-bench takes every column after the first "
    "as probabilities, so an id written last makes the submission invalid there.",
}


class InvalidSubmission(ValueError):
    """The submission cannot be graded; the message says why in one line."""


def roc_auc(y_true: np.ndarray, score: np.ndarray) -> float:
    """Area under the ROC curve of binary labels (scikit-learn's roc_auc_score)."""
    from sklearn.metrics import roc_auc_score

    return float(roc_auc_score(y_true, score))


def log_loss(y_true: np.ndarray, proba: np.ndarray) -> float:
    """Multi-class log loss (scikit-learn's: p clipped to [eps, 1 - eps], eps the float64 machine
    epsilon). `y_true`: class indices into proba's columns, or a one-hot matrix like proba."""
    from sklearn.metrics import log_loss as sk_log_loss

    p = np.asarray(proba, dtype=float)
    y = np.asarray(y_true)
    if y.ndim == 1:
        return float(sk_log_loss(y.astype(int), p, labels=np.arange(p.shape[1])))
    return float(sk_log_loss(y, p))


def rmsle(y_true: np.ndarray, y_pred: np.ndarray) -> float:
    """Mean over the target columns of scikit-learn's root_mean_squared_log_error (nomad2018's
    grade.py: the two targets' RMSLE summed and halved)."""
    from sklearn.metrics import root_mean_squared_log_error

    t = np.asarray(y_true, dtype=float).reshape(len(y_true), -1)
    p = np.asarray(y_pred, dtype=float).reshape(len(y_pred), -1)
    per_col = [root_mean_squared_log_error(t[:, j], p[:, j]) for j in range(t.shape[1])]
    return float(sum(per_col) / len(per_col))


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


# pandas 3.1 parses floats round-trip by default and deprecates `float_precision` (checked on
# 200,000 random repr()-written floats: none off); older pandas' default parser can be one ulp off.
_ROUND_TRIP = {} if tuple(int(x) for x in pd.__version__.split(".")[:2]) >= (3, 1) else {"float_precision": "round_trip"}


def read_csv_exact(source) -> pd.DataFrame:
    """pandas' read_csv with round-trip float parsing, as MLE-bench's `read_csv` reads both the
    submission and the answers."""
    return pd.read_csv(source, **_ROUND_TRIP)


def parse_submission(data: bytes) -> pd.DataFrame:
    """The bytes of a submission.csv as a frame; an empty or unparsable file is InvalidSubmission
    (MLE-bench: an empty frame, which no grader accepts)."""
    try:
        return read_csv_exact(io.BytesIO(data))
    except Exception as e:  # any parse failure is the submission's
        why = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise InvalidSubmission(f"submission.csv is not a readable CSV: {why}") from None


@dataclass(frozen=True)
class Aligned:
    """Answers and predictions row by row, as a rule set matched them: y_true (AUC: labels;
    log loss: one-hot, columns = task.target_columns; RMSLE: targets), y_pred (scores, class
    probabilities or predictions, same columns) and `rows`, the position in the answers file of
    each aligned row (where its held-out split is read)."""

    y_true: np.ndarray
    y_pred: np.ndarray
    rows: np.ndarray


def answers_one_hot(task, answers: pd.DataFrame) -> pd.DataFrame:
    """Log-loss answers as MLE-bench keeps them: the id column, then one 0/1 column per class
    (task.target_columns order). Accepts a label column (answer_columns = one column, the bundled
    tasks) or answers already one-hot (answer_columns = the classes, MLE-bench's spooky)."""
    idc, classes = task.id_column, list(task.target_columns)
    if set(task.answer_columns) == set(classes):
        return answers[[idc, *classes]].reset_index(drop=True)
    labels = answers[task.answer_columns[0]].astype(str)
    unknown = sorted(set(labels) - set(classes))
    if unknown:
        raise ValueError(f"task {task.id}: answers hold labels {unknown[:3]} that are not classes")
    onehot = pd.DataFrame({c: (labels == c).astype(int).to_numpy() for c in classes})
    onehot.insert(0, idc, answers[idc].to_numpy())
    return onehot


def _numeric(sub: pd.DataFrame, cols: list[str]) -> np.ndarray:
    try:
        arr = sub[cols].to_numpy(dtype=float)
    except (ValueError, TypeError):
        raise InvalidSubmission(f"non-numeric values in columns {cols}") from None
    if not np.all(np.isfinite(arr)):
        raise InvalidSubmission(f"NaN or infinite values in columns {cols}")
    return arr


def _id_keys(sub_ids: pd.Series, answer_ids: pd.Series) -> tuple[pd.Index, pd.Index]:
    """Ids as comparable keys: numbers when the answers' ids are numeric (1.0 is 1; a
    non-number matches nothing), text otherwise."""
    if pd.api.types.is_numeric_dtype(answer_ids) and not pd.api.types.is_bool_dtype(answer_ids):
        return (pd.Index(pd.to_numeric(sub_ids, errors="coerce"), dtype=float),
                pd.Index(answer_ids, dtype=float))
    return pd.Index(sub_ids.astype(str)), pd.Index(answer_ids.astype(str))


def align_counterpoint(task, sub: pd.DataFrame, answers: pd.DataFrame) -> Aligned:
    """The `counterpoint` rule set's checks (MLE-bench's with COUNTERPOINT_DIFFERENCES); rows in
    answer order. Raises InvalidSubmission."""
    idc, targets = task.id_column, list(task.target_columns)
    expected = [idc, *targets]
    if task.metric == "log_loss":  # exactly these columns, as MLE-bench's shape check
        if set(sub.columns) != set(expected) or len(sub.columns) != len(expected):
            raise InvalidSubmission(f"columns {list(sub.columns)[:12]} != expected {expected}")
    else:  # other columns (an index written by to_csv) are ignored, as MLE-bench does
        missing = [c for c in expected if c not in sub.columns]
        if missing:
            raise InvalidSubmission(f"columns {list(sub.columns)[:12]} lack {missing}")
    if len(sub) != len(answers):
        raise InvalidSubmission(f"{len(sub)} rows, expected {len(answers)}")
    got, want = _id_keys(sub[idc], answers[idc])
    if got.isna().any():
        raise InvalidSubmission(f"ids must be numbers like the test set's, e.g. not "
                                f"'{sub[idc][got.isna()].iloc[0]}'")
    if got.duplicated().any():
        raise InvalidSubmission(f"duplicate ids, e.g. {sub[idc][got.duplicated()].iloc[0]!r}")
    rows = got.get_indexer(want)
    if (rows < 0).any():
        missing = list(answers[idc][rows < 0].astype(str).iloc[:3])
        raise InvalidSubmission(f"ids do not match the test set (missing e.g. {missing})")
    pred = _numeric(sub, targets)[rows]  # rows in answer order
    if task.metric == "log_loss":
        if np.any(pred < 0) or np.any(pred > 1):
            raise InvalidSubmission("probabilities outside [0, 1]")
        bad = np.abs(pred.sum(axis=1) - 1.0) > PROB_SUM_TOL
        if bad.any():
            raise InvalidSubmission(
                f"{int(bad.sum())} probability rows do not sum to 1 within {PROB_SUM_TOL}"
            )
        truth = answers_one_hot(task, answers)[targets].to_numpy()
    elif task.metric == "rmsle":
        if np.any(pred < 0):
            raise InvalidSubmission("negative predictions (RMSLE needs values >= 0)")
        truth = answers[list(task.answer_columns)].to_numpy(dtype=float)
    else:
        truth = answers[task.answer_columns[0]].to_numpy()
        pred = pred[:, 0]
    return Aligned(truth, pred, np.arange(len(answers)))


class _MLEBenchInvalid(Exception):
    """MLE-bench's InvalidSubmissionError (grade_helpers.py)."""


def _mlebench_auc(task, submission: pd.DataFrame, answers: pd.DataFrame) -> Aligned:
    # competitions/utils.py prepare_for_auroc_metric, id_col / target_col from the task.
    id_col, target_col, answer_col = task.id_column, task.target_columns[0], task.answer_columns[0]
    if id_col not in submission.columns:
        raise _MLEBenchInvalid(f"Submission should have an {id_col} column")
    if target_col not in submission.columns:
        raise _MLEBenchInvalid(f"Submission should have a {target_col} column")
    if len(submission) != len(answers):
        raise _MLEBenchInvalid("Submission and answers should have the same number of rows")
    try:
        pd.to_numeric(submission[target_col])
    except ValueError:
        raise _MLEBenchInvalid(f"Expected {target_col} column to be numeric, got "
                               f"{submission[target_col].dtype} instead") from None
    if submission[target_col].min() < 0 or submission[target_col].max() > 1:
        raise _MLEBenchInvalid(f"Submission {target_col} column should contain probabilities, "
                               "and therefore contain values between 0 and 1 inclusive")
    submission = submission.sort_values(id_col)
    answers = answers.sort_values(id_col)
    if (submission[id_col].values != answers[id_col].values).any():
        raise _MLEBenchInvalid(f"Submission and answers should have the same {id_col} values")
    rows = answers.index.to_numpy()  # answers keep a RangeIndex: positions before the sort
    return Aligned(answers[answer_col].to_numpy(), submission[target_col].to_numpy(), rows)


def _mlebench_log_loss(task, submission: pd.DataFrame, answers: pd.DataFrame) -> Aligned:
    # spooky-author-identification/grade.py prepare_for_metric, then competitions/utils.py
    # one_hot_dfs_to_log_loss_inputs(apply_softmax=False), classes = task.target_columns.
    id_column, classes = task.id_column, list(task.target_columns)
    onehot = answers_one_hot(task, answers)
    if submission.shape != (len(onehot), len(classes) + 1):
        raise _MLEBenchInvalid(f"Submission shape {submission.shape} does not match answers "
                               f"shape {onehot.shape}.")
    if not np.all(np.isclose(submission.iloc[:, 1:].sum(axis=1), 1, atol=PROB_SUM_TOL)):
        raise _MLEBenchInvalid("Each row in submission should sum to one, as probabilities.")
    if not ((submission.iloc[:, 1:] >= 0) & (submission.iloc[:, 1:] <= 1)).all().all():
        raise _MLEBenchInvalid("All probabilities in submission DataFrame must be between 0 and 1.")
    required_cols, submission_cols = set(onehot.columns), set(submission.columns)
    if not submission_cols.issuperset(required_cols):
        raise _MLEBenchInvalid("The submission DataFrame is missing some columns required by the "
                               f"`answers` DataFrame. Missing columns: {required_cols - submission_cols}.")
    if id_column not in submission.columns:
        raise _MLEBenchInvalid(f"Submission is missing id column '{id_column}'.")
    filtered = submission[[col for col in onehot.columns if col in submission_cols]]
    submission_sorted = filtered.sort_values(by=id_column).reset_index(drop=True)
    order = onehot.sort_values(by=id_column).index.to_numpy()
    answers_sorted = onehot.loc[order].reset_index(drop=True)
    assert submission_sorted[id_column].tolist() == answers_sorted[id_column].tolist(), (
        f"Mismatch in {id_column.capitalize()}s between `submission` and `answers` after sorting.")
    assert list(submission_sorted.columns) == list(answers_sorted.columns), "Column order mismatch"
    y_true = answers_sorted.drop(columns=[id_column]).to_numpy()
    y_pred = submission_sorted.drop(columns=[id_column]).to_numpy()
    return Aligned(y_true, y_pred, order)


def _mlebench_rmsle(task, submission: pd.DataFrame, answers: pd.DataFrame) -> Aligned:
    # nomad2018-predict-transparent-conductors/grade.py prepare_for_metric: by row position.
    for col in task.target_columns:
        if col not in submission.columns:
            raise _MLEBenchInvalid(f"Expected '{col}' column in submission")
    if len(submission) != len(answers):
        raise _MLEBenchInvalid(f"Expected {len(answers)} rows in submission, got {len(submission)}")
    truth = answers[list(task.answer_columns)]
    pred = submission[list(task.target_columns)]
    return Aligned(truth.to_numpy(), pred.to_numpy(), np.arange(len(answers)))


_MLEBENCH = {"roc_auc": _mlebench_auc, "log_loss": _mlebench_log_loss, "rmsle": _mlebench_rmsle}


def _metric(metric: str, y_true: np.ndarray, y_pred: np.ndarray) -> float:
    if metric == "roc_auc":
        return roc_auc(y_true, y_pred)
    if metric == "log_loss":
        return log_loss(y_true, y_pred)
    return rmsle(y_true, y_pred)


def _scores(task, al: Aligned, answers: pd.DataFrame) -> Grade:
    if "split" not in answers.columns:  # e.g. MLE-bench's private/test.csv: all test
        return Grade(test=_metric(task.metric, al.y_true, al.y_pred), val=None)
    split = answers["split"].to_numpy()[al.rows]
    on = {s: split == s for s in ("test", "val")}
    val = _metric(task.metric, al.y_true[on["val"]], al.y_pred[on["val"]]) if on["val"].any() else None
    return Grade(test=_metric(task.metric, al.y_true[on["test"]], al.y_pred[on["test"]]), val=val)


def grade(task, sub: pd.DataFrame, answers: pd.DataFrame, rules: str) -> Grade:
    """Check `sub` against the task's answers under rule set `rules` (RULE_SETS) and score it on
    each held-out split; raises InvalidSubmission."""
    answers = answers.reset_index(drop=True)
    if rules == "counterpoint":
        return _scores(task, align_counterpoint(task, sub, answers), answers)
    if rules != "mle-bench":
        raise ValueError(f"unknown grading rules {rules!r}; one of {list(RULE_SETS)}")
    try:
        return _scores(task, _MLEBENCH[task.metric](task, sub, answers), answers)
    except Exception as e:  # noqa: BLE001 - MLE-bench's Grader.__call__: any exception = no score
        why = str(e).splitlines()[0] if str(e) else ""
        kind = "" if isinstance(e, _MLEBenchInvalid) else f"{type(e).__name__}: "
        raise InvalidSubmission(f"{kind}{why}" or type(e).__name__) from None
