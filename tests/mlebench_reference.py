"""MLE-bench's own grading code, copied as the oracle the `mle-bench` rule set is tested against.

From openai/mle-bench at 783b15af77404fbaffe7255b0c4a934b46153389 (MIT licence, below), function
bodies unchanged; only the imports are local and the logger is dropped:

- mlebench/grade_helpers.py: InvalidSubmissionError, Grader.__call__ (any exception -> None,
  the score rounded to 5 decimals)
- mlebench/utils.py: read_csv
- mlebench/competitions/utils.py: one_hot_dfs_to_log_loss_inputs, is_one_hot_encoded,
  prepare_for_auroc_metric
- mlebench/competitions/random-acts-of-pizza/grade.py
- mlebench/competitions/spooky-author-identification/grade.py (+ classes.py)
- mlebench/competitions/nomad2018-predict-transparent-conductors/grade.py

MIT License

Copyright (c) 2024 OpenAI

Permission is hereby granted, free of charge, to any person obtaining a copy of this software and
associated documentation files (the "Software"), to deal in the Software without restriction,
including without limitation the rights to use, copy, modify, merge, publish, distribute,
sublicense, and/or sell copies of the Software, and to permit persons to whom the Software is
furnished to do so, subject to the following conditions:

The above copyright notice and this permission notice shall be included in all copies or
substantial portions of the Software.

THE SOFTWARE IS PROVIDED "AS IS", WITHOUT WARRANTY OF ANY KIND, EXPRESS OR IMPLIED, INCLUDING BUT
NOT LIMITED TO THE WARRANTIES OF MERCHANTABILITY, FITNESS FOR A PARTICULAR PURPOSE AND
NONINFRINGEMENT. IN NO EVENT SHALL THE AUTHORS OR COPYRIGHT HOLDERS BE LIABLE FOR ANY CLAIM,
DAMAGES OR OTHER LIABILITY, WHETHER IN AN ACTION OF CONTRACT, TORT OR OTHERWISE, ARISING FROM, OUT
OF OR IN CONNECTION WITH THE SOFTWARE OR THE USE OR OTHER DEALINGS IN THE SOFTWARE.
"""
# ruff: noqa

from typing import Optional, Tuple

import numpy as np
import pandas as pd
from numpy import ndarray
from pandas import DataFrame
from scipy.special import softmax
from sklearn import metrics
from sklearn.metrics import log_loss, roc_auc_score


class InvalidSubmissionError(Exception):
    """
    A custom exception for when the agent submission cannot be graded.
    """

    pass


def grader_call(grade_fn, submission: pd.DataFrame, answers) -> Optional[float]:
    """Grader.__call__ (grade_helpers.py) without the logging."""
    try:
        score = grade_fn(submission, answers)
    except InvalidSubmissionError as e:
        return None
    except Exception as e:
        return None
    rounded_score = round(score, 5)
    return rounded_score


def read_csv(*args, **kwargs) -> DataFrame:
    """Reads a CSV file and returns a DataFrame with custom default kwargs."""

    try:
        new_default_kwargs = {"float_precision": "round_trip"}
        new_kwargs = {**new_default_kwargs, **kwargs}
        return pd.read_csv(*args, **new_kwargs)
    except pd.errors.EmptyDataError:
        return pd.DataFrame()


# ---- mlebench/competitions/utils.py -------------------------------------------------------------


def one_hot_dfs_to_log_loss_inputs(
    submission_one_hot: pd.DataFrame,
    answers_one_hot: pd.DataFrame,
    id_column: str = "id",
    apply_softmax: bool = True,
) -> dict:
    """
    Frequently used logic to prepare one-hotted dfs for log loss calculation.
    """
    required_cols = set(answers_one_hot.columns)
    submission_cols = set(submission_one_hot.columns)

    if not submission_cols.issuperset(required_cols):
        raise InvalidSubmissionError(
            f"The submission DataFrame is missing some columns required by the `answers` DataFrame. "
            f"Missing columns: {required_cols - submission_cols}."
        )
    if id_column not in submission_one_hot.columns:
        raise InvalidSubmissionError(f"Submission is missing id column '{id_column}'.")

    assert id_column in answers_one_hot.columns, f"Answers is missing id column '{id_column}'."

    # Filter submission to only include columns that are in the answers
    submission_filtered = submission_one_hot[
        [col for col in answers_one_hot.columns if col in submission_cols]
    ]

    # Sort submission and answers by id to align them
    submission_sorted = submission_filtered.sort_values(by=id_column).reset_index(drop=True)
    answers_sorted = answers_one_hot.sort_values(by=id_column).reset_index(drop=True)

    assert submission_sorted[id_column].tolist() == answers_sorted[id_column].tolist(), (
        f"Mismatch in {id_column.capitalize()}s between `submission` and `answers` after sorting. "
        f"Number of mismatched {id_column.capitalize()}s: {len(set(submission_sorted[id_column]) ^ set(answers_sorted[id_column]))}. "
        f"Ensure both DataFrames have the same {id_column.capitalize()}s."
    )

    assert list(submission_sorted.columns) == list(answers_sorted.columns), (
        "Column order mismatch after filtering and sorting. "
        "Ensure both DataFrames have columns in the same order."
    )

    y_true = answers_sorted.drop(columns=[id_column]).to_numpy()
    y_pred = submission_sorted.drop(columns=[id_column]).to_numpy()

    if apply_softmax and is_one_hot_encoded(y_pred):
        pass  # logger.warning(...)

    if apply_softmax and not is_one_hot_encoded(y_pred):
        y_pred = softmax(y_pred, axis=-1)

    log_loss_inputs = {
        "y_true": y_true,
        "y_pred": y_pred,
    }

    return log_loss_inputs


def is_one_hot_encoded(xs: ndarray) -> bool:
    """Check if a 2D NumPy array is one-hot encoded."""

    assert isinstance(xs, ndarray), f"Expected a NumPy array, got {type(xs)}."
    assert xs.ndim == 2, f"Expected a 2D array, got {xs.ndim}D."

    is_binary_matrix = np.bitwise_or(xs == 0, xs == 1).all()
    is_normalized = np.allclose(xs.sum(axis=-1), 1)
    is_one_hot = bool(is_binary_matrix and is_normalized)

    assert isinstance(is_one_hot, bool), f"Expected a boolean, got {type(is_one_hot)}."

    return is_one_hot


def prepare_for_auroc_metric(
    submission: pd.DataFrame, answers: pd.DataFrame, id_col: str, target_col: str
) -> dict:

    # Answers checks
    assert id_col in answers.columns, f"answers dataframe should have an {id_col} column"
    assert target_col in answers.columns, f"answers dataframe should have a {target_col} column"

    # Submission checks
    if id_col not in submission.columns:
        raise InvalidSubmissionError(f"Submission should have an {id_col} column")
    if target_col not in submission.columns:
        raise InvalidSubmissionError(f"Submission should have a {target_col} column")
    if len(submission) != len(answers):
        raise InvalidSubmissionError(f"Submission and answers should have the same number of rows")
    try:
        pd.to_numeric(submission[target_col])
    except ValueError:
        raise InvalidSubmissionError(
            f"Expected {target_col} column to be numeric, got {submission[target_col].dtype} instead"
        )
    if submission[target_col].min() < 0 or submission[target_col].max() > 1:
        raise InvalidSubmissionError(
            f"Submission {target_col} column should contain probabilities,"
            " and therefore contain values between 0 and 1 inclusive"
        )
    # Sort
    submission = submission.sort_values(id_col)
    answers = answers.sort_values(id_col)

    if (submission[id_col].values != answers[id_col].values).any():
        raise InvalidSubmissionError(f"Submission and answers should have the same {id_col} values")

    roc_auc_inputs = {
        "y_true": answers[target_col].to_numpy(),
        "y_score": submission[target_col].to_numpy(),
    }

    return roc_auc_inputs


# ---- random-acts-of-pizza/grade.py --------------------------------------------------------------


def pizza_grade(submission: pd.DataFrame, answers: pd.DataFrame) -> float:
    roc_auc_inputs = prepare_for_auroc_metric(
        submission=submission,
        answers=answers,
        id_col="request_id",
        target_col="requester_received_pizza",
    )
    return roc_auc_score(y_true=roc_auc_inputs["y_true"], y_score=roc_auc_inputs["y_score"])


# ---- spooky-author-identification/grade.py ------------------------------------------------------

CLASSES = ["EAP", "HPL", "MWS"]

tolerance = 1e-6


def spooky_prepare_for_metric(submission: pd.DataFrame, answers: pd.DataFrame) -> dict:
    id_col = "id"

    if submission.shape != (len(answers), len(CLASSES) + 1):
        raise InvalidSubmissionError(
            f"Submission shape {submission.shape} does not match answers shape {answers.shape}."
        )

    # assert that each row in submission sums to one, accounting for floating point errors
    if not np.all(np.isclose(submission.iloc[:, 1:].sum(axis=1), 1, atol=tolerance)):
        raise InvalidSubmissionError("Each row in submission should sum to one, as probabilities.")
    if not ((submission.iloc[:, 1:] >= 0) & (submission.iloc[:, 1:] <= 1)).all().all():
        raise InvalidSubmissionError(
            "All probabilities in submission DataFrame must be between 0 and 1."
        )

    log_loss_inputs = one_hot_dfs_to_log_loss_inputs(
        submission, answers, id_column=id_col, apply_softmax=False
    )

    return log_loss_inputs


def spooky_grade(submission: pd.DataFrame, answers: pd.DataFrame) -> float:
    log_loss_inputs = spooky_prepare_for_metric(submission, answers)
    return log_loss(**log_loss_inputs)


# ---- nomad2018-predict-transparent-conductors/grade.py ------------------------------------------


def nomad_prepare_for_metric(
    submission: pd.DataFrame, answers: pd.DataFrame
) -> Tuple[pd.Series, pd.Series, pd.Series, pd.Series]:
    assert (
        "formation_energy_ev_natom" in answers.columns
    ), "Expected 'formation_energy_ev_natom' column in answers"
    assert "bandgap_energy_ev" in answers.columns, "Expected 'bandgap_energy_ev' column in answers"
    if "formation_energy_ev_natom" not in submission.columns:
        raise InvalidSubmissionError("Expected 'formation_energy_ev_natom' column in submission")
    if "bandgap_energy_ev" not in submission.columns:
        raise InvalidSubmissionError("Expected 'bandgap_energy_ev' column in submission")
    if len(submission) != len(answers):
        raise InvalidSubmissionError(
            f"Expected {len(answers)} rows in submission, got {len(submission)}"
        )

    true_labels_formation, true_labels_bandgap = (
        answers["formation_energy_ev_natom"],
        answers["bandgap_energy_ev"],
    )
    predictions_formation, predictions_bandgap = (
        submission["formation_energy_ev_natom"],
        submission["bandgap_energy_ev"],
    )

    return true_labels_formation, true_labels_bandgap, predictions_formation, predictions_bandgap


def nomad_grade(submission: pd.DataFrame, answers: pd.DataFrame) -> float:
    (
        true_labels_formation,
        true_labels_bandgap,
        predictions_formation,
        predictions_bandgap,
    ) = nomad_prepare_for_metric(submission, answers)
    return (
        metrics.root_mean_squared_log_error(true_labels_formation, predictions_formation)
        + metrics.root_mean_squared_log_error(true_labels_bandgap, predictions_bandgap)
    ) / 2
