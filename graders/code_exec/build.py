"""Seeded, offline builder of the three bundled code-exec tasks (byte-stable for a seed).

Data comes only from what pip packages ship: scikit-learn's generators and the CPython
standard library's own documentation text (`pydoc_data.topics`, the text `help()` shows).

- `tabular-binary` (ROC-AUC): make_classification, 3 clusters per class, label noise, a
  categorical column and missing values; a stand-in for random-acts-of-pizza.
- `docs-topic` (multi-class log loss, text): paragraphs of the Python language reference topics
  labelled by part (statements / expressions / data model & types); a stand-in for
  spooky-author-identification. Its text follows the interpreter's version (recorded).
- `positive-regression` (mean column-wise RMSLE): two positive targets, nonlinear in 10 features
  (Friedman #1 and an exponential interaction) plus a categorical column; a stand-in for
  nomad2018-predict-transparent-conductors.

Splits: 60% train (labelled, public), 20% val and 20% test (inputs in public/test.csv, shuffled
together; answers in private/answers.csv with a `split` column). See task.py.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np
import pandas as pd

# 2: task.json carries a scaffold; 3: its head ends "model =" (no trailing space); 4: task.json
# names grading_rules "counterpoint" and log loss clips at the float64 eps (scikit-learn's); 5: the
# scaffold's head imports only the estimators of the task's kind (classifiers or regressors)
BUILD_VERSION = 5
FLOAT_FORMAT = "%.6g"
_TOPIC_GROUPS = {
    "statements": "assert assignment augassign async break class compound continue del else "
                  "for function global if import nonlocal pass raise return try while with yield "
                  "exceptions execmodel naming dynamic-features".split(),
    "expressions": "atom-identifiers atom-literals attribute-references await binary bitwise "
                   "booleans calls comparisons conversions exprlists floating imaginary in "
                   "integers lambda lists dict numbers operator-summary power shifting slicings "
                   "strings subscriptions unary formatstrings identifiers id-classes".split(),
}


def _split(n: int, rng: np.random.Generator) -> np.ndarray:
    """'train' / 'val' / 'test' per row: 60/20/20 in a seeded random order."""
    labels = np.array(["train"] * n, dtype=object)
    order = rng.permutation(n)
    n_val = n_test = n // 5
    labels[order[:n_val]] = "val"
    labels[order[n_val:n_val + n_test]] = "test"
    return labels


def _ids(n: int, rng: np.random.Generator, prefix: str) -> np.ndarray:
    return np.array([f"{prefix}{i:05d}" for i in rng.permutation(n)], dtype=object)


def _tabular_binary(rng: np.random.Generator, seed: int) -> tuple[pd.DataFrame, pd.DataFrame]:
    from sklearn.datasets import make_classification

    X, y = make_classification(n_samples=1600, n_features=14, n_informative=6, n_redundant=3,
                               n_clusters_per_class=3, class_sep=0.8, flip_y=0.08,
                               weights=[0.7, 0.3], random_state=seed)
    X = pd.DataFrame(X, columns=[f"f{i:02d}" for i in range(X.shape[1])])
    codes = np.digitize(X["f00"] + rng.normal(0, 0.5, len(X)), [-1.0, 0.0, 1.0])
    X.insert(0, "region", np.array(["north", "east", "south", "west"], dtype=object)[codes])
    for col in ("f03", "f07", "f11"):
        X.loc[rng.random(len(X)) < 0.06, col] = np.nan
    return X, pd.DataFrame({"target": y.astype(int)})


def _docs_topic(rng: np.random.Generator, seed: int) -> tuple[pd.DataFrame, pd.DataFrame]:
    import pydoc_data.topics

    rows = []
    for key in sorted(pydoc_data.topics.topics):
        if key == "debugger":
            continue
        label = next((g for g, keys in _TOPIC_GROUPS.items() if key in keys), "datamodel")
        for para in re.split(r"\n\s*\n", pydoc_data.topics.topics[key]):
            if para.startswith(" "):  # grammar and code listings: prose only
                continue
            text = re.sub(r"\s+", " ", para).strip()
            if 60 <= len(text) <= 600 and not re.fullmatch(r"[*=\-]+", text):
                rows.append((text, label))
    df = pd.DataFrame(rows, columns=["text", "label"]).drop_duplicates("text")
    df = df.iloc[rng.permutation(len(df))].reset_index(drop=True)
    return df[["text"]], df[["label"]]


def _positive_regression(rng: np.random.Generator, seed: int) -> tuple[pd.DataFrame, pd.DataFrame]:
    from sklearn.datasets import make_friedman1

    X, y1 = make_friedman1(n_samples=1200, n_features=10, noise=1.0, random_state=seed)
    y1 = np.maximum(y1, 0.5) / 10.0
    y2 = np.exp(0.9 * X[:, 5] - 1.2 * X[:, 6] * X[:, 7] + 0.15 * rng.normal(size=len(X)))
    feats = pd.DataFrame(X, columns=[f"x{i}" for i in range(10)])
    group = np.digitize(X[:, 8] + 0.1 * rng.normal(size=len(X)), [0.25, 0.5, 0.75])
    feats.insert(0, "group", np.array(["g1", "g2", "g3", "g4"], dtype=object)[group])
    return feats, pd.DataFrame({"y1": y1, "y2": y2})


_DESCRIPTIONS = {
    "tabular-binary": (
        "Predict whether each row belongs to the positive class (`target` = 1). Tabular data: "
        "14 numeric features `f00`..`f13` (some missing) and a categorical `region`. About 30% "
        "of rows are positive and some labels are noisy."
    ),
    "docs-topic": (
        "Each row is a paragraph of the Python language reference. Predict which part of the "
        "reference it comes from: `statements` (simple and compound statements, the execution "
        "model), `expressions` (literals, operators, calls, ...) or `datamodel` (the data model "
        "and built-in types)."
    ),
    "positive-regression": (
        "Predict two positive quantities `y1` and `y2` from 10 numeric features `x0`..`x9` and "
        "a categorical `group`."
    ),
}
_SPECS = {
    "tabular-binary": ("roc_auc", _tabular_binary),
    "docs-topic": ("log_loss", _docs_topic),
    "positive-regression": ("rmsle", _positive_regression),
}


def _metric_text(metric: str, targets: list[str]) -> str:
    if metric == "roc_auc":
        return ("Submissions are scored by the area under the ROC curve between the predicted "
                f"score in `{targets[0]}` (any real number; higher = more likely positive) and "
                "the true label.")
    if metric == "log_loss":
        return ("Submissions are scored by multi-class log loss. Give one probability per class "
                f"({', '.join(f'`{c}`' for c in targets)}); each row must sum to 1 (within "
                "1e-6). Probabilities are clipped to [eps, 1 - eps], eps = 2.2e-16 (the float64 "
                "machine epsilon, as scikit-learn's log_loss does).")
    return ("Submissions are scored by the mean over the target columns of the root mean "
            "squared logarithmic error, sqrt(mean((log(1 + pred) - log(1 + true))^2)). "
            "Predictions must be >= 0.")


# The head imports only what the task's kind can use: the estimators a `model =` line may name
# (classifiers with predict_proba, or regressors) and the preprocessing its features need. With
# every estimator and SimpleImputer imported (BUILD_VERSION <= 4), the 135M model completed a
# classification task's `model =` with Ridge or SimpleImputer in 12 of 16 step-1 nodes (it names
# what it last read), and a default run's valid share hung on one lucky sample per seed
# (bench/results/mle-tree-base.md).
_SCAFFOLD_BASE_IMPORTS = "import numpy as np\nimport pandas as pd\nfrom sklearn.pipeline import make_pipeline\n"
_SCAFFOLD_PREP_IMPORTS = {
    True: "from sklearn.feature_extraction.text import TfidfVectorizer\n",
    False: "from sklearn.compose import ColumnTransformer\n"
           "from sklearn.impute import SimpleImputer\n"
           "from sklearn.preprocessing import OneHotEncoder, StandardScaler\n",
}
_SCAFFOLD_MODEL_IMPORTS = {
    "classifier": "from sklearn.linear_model import LogisticRegression\n"
                  "from sklearn.neighbors import KNeighborsClassifier\n"
                  "from sklearn.tree import DecisionTreeClassifier\n"
                  "from sklearn.ensemble import (RandomForestClassifier, ExtraTreesClassifier,\n"
                  "                              GradientBoostingClassifier)\n",
    "regressor": "from sklearn.linear_model import Ridge\n"
                 "from sklearn.neighbors import KNeighborsRegressor\n"
                 "from sklearn.tree import DecisionTreeRegressor\n"
                 "from sklearn.ensemble import (RandomForestRegressor, ExtraTreesRegressor,\n"
                 "                              GradientBoostingRegressor)\n"
                 "from sklearn.multioutput import MultiOutputRegressor\n",
}
_SCAFFOLD_READ = '\ntrain = pd.read_csv("train.csv")\ntest = pd.read_csv("test.csv")\n'


def _scaffold_imports(regression: bool, text: bool) -> str:
    """The head's imports and data reading for a task of this kind (see above)."""
    return (_SCAFFOLD_BASE_IMPORTS + _SCAFFOLD_PREP_IMPORTS[text]
            + _SCAFFOLD_MODEL_IMPORTS["regressor" if regression else "classifier"] + _SCAFFOLD_READ)


_SCAFFOLD_PREP = {
    True: 'prep = TfidfVectorizer(sublinear_tf=True)  # text -> sparse tf-idf features\n'
          'X, X_test = train["text"], test["text"]\n',
    False: 'cat = [c for c in X.columns if not pd.api.types.is_numeric_dtype(X[c])]\n'
           'num = [c for c in X.columns if c not in cat]\n'
           'prep = ColumnTransformer([("num", make_pipeline(SimpleImputer(), StandardScaler()), num),\n'
           '                          ("cat", OneHotEncoder(handle_unknown="ignore"), cat)])\n',
}
_SCAFFOLD_TAIL = {
    "log_loss": 'clf = make_pipeline(prep, model).fit(X, y)\n'
                'proba = pd.DataFrame(clf.predict_proba(X_test), columns=clf.classes_)\n'
                'sub = proba[{targets}]\n'
                'sub.insert(0, "{idc}", test["{idc}"].values)\n'
                'sub.to_csv("submission.csv", index=False)\n',
    "roc_auc": 'clf = make_pipeline(prep, model).fit(X, y)\n'
               'sub = pd.DataFrame({{"{idc}": test["{idc}"], "{target}": clf.predict_proba(X_test)[:, 1]}})\n'
               'sub.to_csv("submission.csv", index=False)\n',
    "rmsle": 'reg = make_pipeline(prep, MultiOutputRegressor(model)).fit(X, np.log1p(y))\n'
             'pred = np.clip(np.expm1(reg.predict(X_test)), 0, None)\n'
             'sub = pd.DataFrame(pred, columns={targets})\n'
             'sub.insert(0, "{idc}", test["{idc}"].values)\n'
             'sub.to_csv("submission.csv", index=False)\n',
}


def _scaffold(metric: str, idc: str, label_cols: list[str], targets: list[str], text: bool) -> dict:
    """The template script of a task (search/scaffold.py): the policy completes the line
    `model =` with one scikit-learn estimator (the head shows three examples); data loading,
    features and the submission are fixed. Chosen by bench/mle_tree_base.py."""
    kind = "regressor" if metric == "rmsle" else "classifier with predict_proba"
    y = f'train[{label_cols!r}]' if len(label_cols) > 1 else f'train["{label_cols[0]}"]'
    examples = ([("Ridge", "alpha=1.0"), ("RandomForestRegressor", "n_estimators=100, max_depth=8"),
                 ("KNeighborsRegressor", "n_neighbors=10")] if metric == "rmsle" else
                [("LogisticRegression", "C=1.0"), ("RandomForestClassifier", "n_estimators=100, max_depth=8"),
                 ("GradientBoostingClassifier", "learning_rate=0.1")])
    head = (_scaffold_imports(metric == "rmsle", text)
            + f'X = train[[c for c in test.columns if c != "{idc}"]]\nX_test = test[X.columns]\n'
            + f"y = {y}\n" + _SCAFFOLD_PREP[text]
            + f"\n# The model: one scikit-learn {kind} (imported above), for example\n"
            + "".join(f"#   model = {name}({kw})\n" for name, kw in examples)
            + "model =")  # no trailing space: " Ridge" is one token, a bare space derails the model
    tail = _SCAFFOLD_TAIL[metric].format(idc=idc, targets=repr(list(targets)),
                                          target=targets[0])
    hint = (f"Complete the line `model = ...` with one scikit-learn {kind} and its settings "
            "(the estimators imported in the script); choose what should score best.")
    return {"head": head, "tail": tail, "hint": hint, "stop": ["\n"]}


def build_task(task_id: str, out_dir: Path, seed: int) -> Path:
    metric, make = _SPECS[task_id]
    task_seed = seed * 1000 + sorted(_SPECS).index(task_id)
    rng = np.random.default_rng(task_seed)
    X, Y = make(rng, task_seed)
    n = len(X)
    split = _split(n, rng)
    ids = _ids(n, rng, "id")
    idc = "id"
    X.insert(0, idc, ids)
    if metric == "log_loss":
        classes = sorted(Y["label"].unique())
        targets, answer_cols = classes, ["label"]
    else:
        classes, targets, answer_cols = [], list(Y.columns), list(Y.columns)
    d = out_dir / task_id
    (d / "public").mkdir(parents=True)
    (d / "private").mkdir()
    tr = split == "train"
    held = ~tr
    train = pd.concat([X[tr], Y[tr]], axis=1)
    test = X[held].sort_values(idc)
    answers = pd.concat([X.loc[held, [idc]], Y[held]], axis=1)
    answers["split"] = split[held]
    answers = answers.sort_values(idc)
    if metric == "log_loss":
        sample = pd.DataFrame({idc: test[idc], **{c: 1.0 / len(classes) for c in classes}})
    elif metric == "roc_auc":
        sample = pd.DataFrame({idc: test[idc], targets[0]: 0.5})
    else:
        sample = pd.DataFrame({idc: test[idc], **{c: 1.0 for c in targets}})
    kw = dict(index=False, float_format=FLOAT_FORMAT, lineterminator="\n")
    train.to_csv(d / "public" / "train.csv", **kw)
    test.to_csv(d / "public" / "test.csv", **kw)
    # full precision: 1/3 written as 0.333333 would not sum to 1 within 1e-6
    sample.to_csv(d / "public" / "sample_submission.csv", index=False, lineterminator="\n")
    answers.to_csv(d / "private" / "answers.csv", **kw)
    rows = {"train": int(tr.sum()), "val": int((split == "val").sum()),
            "test": int((split == "test").sum())}
    from graders.code_exec.grading import METRICS, REWARD_MAPS

    desc = (
        f"# {task_id}\n\n{_DESCRIPTIONS[task_id]}\n\n## Files\n\n"
        f"- `train.csv`: {rows['train']} labelled rows (`{idc}`, inputs, "
        f"{', '.join(f'`{c}`' for c in Y.columns)}).\n"
        f"- `test.csv`: {rows['val'] + rows['test']} unlabelled rows (`{idc}` and inputs).\n"
        f"- `sample_submission.csv`: the submission format, one row per test id.\n\n"
        f"## Evaluation\n\n{_metric_text(metric, targets)}\n\n## Submission\n\n"
        f"Write `submission.csv` in the working directory with columns "
        f"{', '.join(f'`{c}`' for c in [idc, *targets])} and one row per id of `test.csv`.\n"
    )
    (d / "public" / "description.md").write_text(desc)
    source = {
        "tabular-binary": "sklearn.datasets.make_classification",
        "docs-topic": f"pydoc_data.topics of Python {sys.version_info.major}."
                      f"{sys.version_info.minor}.{sys.version_info.micro}",
        "positive-regression": "sklearn.datasets.make_friedman1 + numpy",
    }[task_id]
    meta = {
        "id": task_id, "metric": metric, "direction": METRICS[metric], "id_column": idc,
        "target_columns": targets, "answer_columns": answer_cols,
        **({"classes": classes} if classes else {}),
        "reward": REWARD_MAPS[metric], "answers": "private/answers.csv",
        "grading_rules": "counterpoint",  # the rules the descriptions above state (grading.py)
        "split_seed": task_seed, "rows": rows, "source": source,
        "build_version": BUILD_VERSION,
        "scaffold": _scaffold(metric, idc, answer_cols, targets, "text" in X.columns),
    }
    (d / "task.json").write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
    os.chmod(d / "private", 0o700)
    return d


def build_tasks(out_dir: str | os.PathLike, seed: int = 0) -> Path:
    """Write the three bundled tasks under `out_dir` (which must not hold them yet)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for task_id in sorted(_SPECS):
        build_task(task_id, out, seed)
    return out


def ensure_built(target: Path, seed: int) -> Path:
    """Build into a temp sibling and rename into place once; a concurrent builder's result wins."""
    if (target / "done").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        build_tasks(tmp, seed)
        (tmp / "done").write_text("ok\n")
        os.chmod(tmp, 0o755)
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target / "done").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target
