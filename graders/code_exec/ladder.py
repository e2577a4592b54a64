"""The reference ladder: constant, linear and gradient-boosting scripts per task, run through the
same sandbox and grader as a policy's scripts. Its metrics and rewards are the yardstick for
training curves (`ladder.json` beside the built tasks).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

_COMMON = """\
import numpy as np, pandas as pd
train = pd.read_csv("train.csv"); test = pd.read_csv("test.csv")
sample = pd.read_csv("sample_submission.csv")
ID = sample.columns[0]; TARGETS = list(sample.columns[1:])
label = [c for c in train.columns if c not in test.columns]
"""

_FEATURES = """\
from sklearn.compose import ColumnTransformer
from sklearn.pipeline import make_pipeline
from sklearn.impute import SimpleImputer
from sklearn.preprocessing import OneHotEncoder, StandardScaler
X, Xt = train[[c for c in test.columns if c != ID]], test.drop(columns=[ID])
TEXT = "text" in X.columns
if TEXT:
    from sklearn.feature_extraction.text import TfidfVectorizer
    prep = ColumnTransformer([("t", TfidfVectorizer(ngram_range=(1, 2), min_df=2, sublinear_tf=True), "text")])
else:
    cat = [c for c in X.columns if not pd.api.types.is_numeric_dtype(X[c])]
    num = [c for c in X.columns if c not in cat]
    prep = ColumnTransformer([
        ("n", make_pipeline(SimpleImputer(), StandardScaler()), num),
        ("c", OneHotEncoder(handle_unknown="ignore"), cat)])
"""

SCRIPTS = {
    "constant": {
        "roc_auc": _COMMON + "sample[TARGETS[0]] = 0.5\nsample.to_csv('submission.csv', index=False)\n",
        "log_loss": _COMMON + (
            "p = train[label[0]].value_counts(normalize=True)\n"
            "for c in TARGETS: sample[c] = p.get(c, 0.0)\n"
            "sample[TARGETS] = sample[TARGETS].div(sample[TARGETS].sum(axis=1), axis=0)\n"
            "sample.to_csv('submission.csv', index=False)\n"),
        "rmsle": _COMMON + (
            "for c in TARGETS: sample[c] = np.expm1(np.log1p(train[c]).mean())\n"
            "sample.to_csv('submission.csv', index=False)\n"),
    },
    "linear": {
        "roc_auc": _COMMON + _FEATURES + (
            "from sklearn.linear_model import LogisticRegression\n"
            "m = make_pipeline(prep, LogisticRegression(max_iter=2000)).fit(X, train[TARGETS[0]])\n"
            "sub = pd.DataFrame({ID: test[ID], TARGETS[0]: m.predict_proba(Xt)[:, 1]})\n"
            "sub.to_csv('submission.csv', index=False)\n"),
        "log_loss": _COMMON + _FEATURES + (
            "from sklearn.linear_model import LogisticRegression\n"
            "m = make_pipeline(prep, LogisticRegression(C=4.0, max_iter=2000)).fit(X, train[label[0]])\n"
            "p = m.predict_proba(Xt)\n"
            "sub = pd.DataFrame(p, columns=m.classes_)[TARGETS]\n"
            "sub.insert(0, ID, test[ID].to_numpy())\n"
            "sub.to_csv('submission.csv', index=False)\n"),
        "rmsle": _COMMON + _FEATURES + (
            "from sklearn.linear_model import Ridge\n"
            "sub = pd.DataFrame({ID: test[ID]})\n"
            "for c in TARGETS:\n"
            "    m = make_pipeline(prep, Ridge(alpha=1.0)).fit(X, np.log1p(train[c]))\n"
            "    sub[c] = np.clip(np.expm1(m.predict(Xt)), 0, None)\n"
            "sub.to_csv('submission.csv', index=False)\n"),
    },
    "gbm": {
        "roc_auc": _COMMON + _FEATURES + (
            "from sklearn.ensemble import HistGradientBoostingClassifier\n"
            "Xc = X.copy(); Xtc = Xt.copy()\n"
            "for c in cat: Xc[c] = Xc[c].astype('category'); Xtc[c] = pd.Categorical(Xtc[c], categories=Xc[c].cat.categories)\n"
            "m = HistGradientBoostingClassifier(max_iter=300, learning_rate=0.05, categorical_features='from_dtype', random_state=0)\n"
            "m.fit(Xc, train[TARGETS[0]])\n"
            "sub = pd.DataFrame({ID: test[ID], TARGETS[0]: m.predict_proba(Xtc)[:, 1]})\n"
            "sub.to_csv('submission.csv', index=False)\n"),
        "log_loss": _COMMON + _FEATURES + (
            "from sklearn.decomposition import TruncatedSVD\n"
            "from sklearn.ensemble import HistGradientBoostingClassifier\n"
            "m = make_pipeline(prep, TruncatedSVD(100, random_state=0),\n"
            "                  HistGradientBoostingClassifier(max_iter=200, learning_rate=0.05, random_state=0))\n"
            "m.fit(X, train[label[0]])\n"
            "p = np.clip(m.predict_proba(Xt), 1e-6, None); p = p / p.sum(axis=1, keepdims=True)\n"
            "sub = pd.DataFrame(p, columns=m.classes_)[TARGETS]\n"
            "sub.insert(0, ID, test[ID].to_numpy())\n"
            "sub.to_csv('submission.csv', index=False)\n"),
        "rmsle": _COMMON + _FEATURES + (
            "from sklearn.ensemble import HistGradientBoostingRegressor\n"
            "Xc = X.copy(); Xtc = Xt.copy()\n"
            "for c in cat: Xc[c] = Xc[c].astype('category'); Xtc[c] = pd.Categorical(Xtc[c], categories=Xc[c].cat.categories)\n"
            "sub = pd.DataFrame({ID: test[ID]})\n"
            "for c in TARGETS:\n"
            "    m = HistGradientBoostingRegressor(max_iter=300, learning_rate=0.05, categorical_features='from_dtype', random_state=0)\n"
            "    m.fit(Xc, np.log1p(train[c]))\n"
            "    sub[c] = np.clip(np.expm1(m.predict(Xtc)), 0, None)\n"
            "sub.to_csv('submission.csv', index=False)\n"),
    },
}
RUNGS = ("constant", "linear", "gbm")
LADDER_FILE = "ladder.json"  # beside the tasks (task.json folders); the code-exec profile reads it


def ladder_script(rung: str, metric: str) -> str:
    return SCRIPTS[rung][metric]


def as_completion(script: str) -> str:
    """A model-style completion holding the script (so the ladder goes through extraction too)."""
    return f"Reference solution.\n\n```python\n{script}```\n"


def run_ladder(verifier, out_path: str | os.PathLike | None = None) -> dict:
    """Score every rung of every task through `verifier` (a CodeExecTask); optionally write JSON.

    Returns {task_id: {rung: {status, test_metric, val_metric, reward, exec_time}}}.
    """
    items = [(tid, rung) for tid in sorted(verifier.tasks) for rung in RUNGS]
    results = verifier.score_many(
        [(tid, as_completion(ladder_script(rung, verifier.tasks[tid].metric))) for tid, rung in items]
    )
    out: dict = {}
    for (tid, rung), r in zip(items, results):
        out.setdefault(tid, {"metric": verifier.tasks[tid].metric})[rung] = {
            "status": r.status, "test_metric": r.test_metric, "val_metric": r.val_metric,
            "reward": r.reward, "exec_time": round(r.exec_time, 3), "message": r.message,
        }
    if out_path is not None:
        Path(out_path).write_text(json.dumps(out, indent=2, sort_keys=True) + "\n")
    return out


def main() -> None:
    """`python -m graders.code_exec.ladder [--seed S]`: build the bundled tasks (once) and write
    ladder.json beside them; prints the table."""
    import argparse

    from config.code_exec import CodeExecConfig
    from graders.code_exec.verifier import CodeExecTask

    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("--seed", type=int, default=None, help="task seed (default: the config's)")
    ap.add_argument("--tasks-dir", default=None, help="absolute tasks dir (default: bundled)")
    args = ap.parse_args()
    kw = {k: v for k, v in (("seed", args.seed), ("tasks_dir", args.tasks_dir)) if v is not None}
    v = CodeExecTask(CodeExecConfig(**kw))
    out = run_ladder(v, v.tasks_dir / LADDER_FILE)
    print(f"# {v.tasks_dir / LADDER_FILE} (isolation {v.isolation})")
    for tid, rungs in out.items():
        for rung in RUNGS:
            r = rungs[rung]
            print(f"{tid:22s} {rung:9s} {r['status']:18s} test={r['test_metric']} "
                  f"val={r['val_metric']} reward={r['reward']:.4f} {r['exec_time']:.2f}s")


if __name__ == "__main__":
    main()
