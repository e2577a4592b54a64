"""Per-round learning-signal diagnostics (issue 14), pure functions of a round's nodes.

The reference diagnosed a "strategy monoculture on a flat reward": every valid node fitted the
same kind of model and rewards inside a group barely differed, so GRPO had nothing to rank.
These scalars make that visible per round (metrics.jsonl, Prometheus, the dashboard):

- valid_share, status_<s> / mode_<m> counts;
- debug_success_rate: share of debug nodes that are ok; improve_success_rate: share of improve
  nodes that are ok AND beat their parent on the selection metric (an invalid child fails);
- reward_mean / reward_std (population std over the round's nodes);
- frac_groups_zero_reward_std: share of sibling groups whose rewards are all equal;
- best / median selection metric of the valid nodes, and their oriented gap to each rung of the
  task's reference ladder (positive = better than the rung), plus the honest test metric of the
  chosen node against each rung's test metric;
- model_families: distinct model families (`model_family`) among valid nodes.
"""

from __future__ import annotations

import io
import re
import statistics
import tokenize
from collections import Counter, defaultdict
from collections.abc import Mapping, Sequence
from typing import Any

from config.search import SearchConfig
from records.exec_result import EXEC_STATUSES
from search.tree import MODES, Node, Tree, oriented_value

_SEARCH = SearchConfig()  # the schema's defaults: declared there, read here

# Identifier patterns (a NAME token of the script, comments and strings excluded) -> family.
FAMILY_PATTERNS: tuple[tuple[str, str], ...] = (
    ("gradient_boosting", r"(Hist)?GradientBoosting\w*|LGBM\w*|lightgbm|XGB\w*|xgboost|CatBoost\w*|catboost|AdaBoost\w*"),
    ("random_forest", r"RandomForest\w*|ExtraTrees\w*"),
    ("decision_tree", r"DecisionTree\w*"),
    ("linear", r"Logistic\w*|Linear(Regression|Discriminant\w*)|Ridge\w*|Lasso\w*|ElasticNet\w*|SGD(Classifier|Regressor)|Perceptron|PassiveAggressive\w*|BayesianRidge|HuberRegressor|PoissonRegressor|TweedieRegressor|LinearSVC|LinearSVR"),
    ("svm", r"SVC|SVR|NuSVC|NuSVR"),
    ("knn", r"KNeighbors\w*|RadiusNeighbors\w*"),
    ("naive_bayes", r"(Multinomial|Gaussian|Bernoulli|Complement|Categorical)NB"),
    ("neural_net", r"MLP\w*|torch|tensorflow|keras"),
    ("constant", r"Dummy\w*"),
)
_FAMILY_RES = tuple((fam, re.compile(rf"(?:{pat})\Z")) for fam, pat in FAMILY_PATTERNS)


def _names(code: str) -> list[str]:
    try:
        return [t.string for t in tokenize.generate_tokens(io.StringIO(code).readline)
                if t.type == tokenize.NAME]
    except (tokenize.TokenError, IndentationError, SyntaxError):
        return re.findall(r"[A-Za-z_]\w*", re.sub(r"#.*", "", code))


def model_family(code: str) -> str:
    """The model family of a script, from the model names it imports or calls: one of the
    FAMILY_PATTERNS families, several joined by '+' (sorted; an ensemble is its own strategy),
    or 'constant' when it names no model at all (a fixed or copied prediction)."""
    found = set()
    for name in _names(code):
        for fam, rx in _FAMILY_RES:
            if rx.match(name):
                found.add(fam)
                break
    if len(found) > 1:
        found.discard("constant")  # a Dummy baseline beside a real model does not make a new family
    return "+".join(sorted(found)) if found else "constant"


def _rate(hits: int, total: int) -> float | None:
    return hits / total if total else None


def _median(xs: Sequence[float]) -> float | None:
    return statistics.median(xs) if xs else None


def round_diagnostics(nodes: Sequence[Node], tree: Tree, select_on: str = _SEARCH.select_on,
                      ladder: Mapping[str, Any] | None = None) -> dict[str, float | int | None]:
    """Scalars of one round (`nodes`; `tree` holds their parents, possibly from earlier rounds).
    `ladder`: the task's entry of ladder.json, {rung: {"val_metric", "test_metric", ...}}."""
    n = len(nodes)
    valid = [x for x in nodes if not x.is_buggy]
    out: dict[str, float | int | None] = {"nodes": n, "valid": len(valid),
                                          "valid_share": _rate(len(valid), n)}
    statuses = Counter(x.result.status for x in nodes)
    for s in sorted(set(EXEC_STATUSES) | set(statuses)):
        out[f"status_{s}"] = statuses.get(s, 0)
    modes = Counter(x.mode for x in nodes)
    for m in MODES:
        out[f"mode_{m}"] = modes.get(m, 0)
    debugs = [x for x in nodes if x.mode == "debug"]
    out["debug_success_rate"] = _rate(sum(not x.is_buggy for x in debugs), len(debugs))
    improves = [x for x in nodes if x.mode == "improve"]
    beat = sum(not x.is_buggy and tree.selection_value(x, select_on)
               > tree.selection_value(tree.get(x.parent_id), select_on) for x in improves)
    out["improve_success_rate"] = _rate(beat, len(improves))
    rewards = [x.result.reward for x in nodes]
    out["reward_mean"] = statistics.fmean(rewards) if rewards else None
    out["reward_std"] = statistics.pstdev(rewards) if rewards else None
    groups: dict[int, list[float]] = defaultdict(list)
    for x in nodes:
        groups[x.sibling_group].append(x.result.reward)
    out["groups"] = len(groups)
    out["frac_groups_zero_reward_std"] = _rate(sum(len(set(g)) == 1 for g in groups.values()), len(groups))

    sel = [tree.selection_value(x, select_on) for x in valid]  # oriented: higher is better
    best_o, median_o = (max(sel) if sel else None), _median(sel)
    sign = 1.0 if tree.direction == "higher" else -1.0
    out[f"best_{select_on}_metric"] = None if best_o is None else sign * best_o
    out[f"median_{select_on}_metric"] = None if median_o is None else sign * median_o
    chosen = tree.best_valid(select_on, among=list(nodes))
    out["honest_test_metric"] = chosen.result.test_metric if chosen else None
    for rung, entry in sorted((ladder or {}).items()):
        if not isinstance(entry, Mapping) or entry.get("status", "ok") != "ok":
            continue  # "metric": "roc_auc" and failed rungs carry no yardstick
        ref = oriented_value(entry.get(f"{select_on}_metric"), tree.direction)
        if ref is not None:
            out[f"best_vs_{rung}"] = None if best_o is None else best_o - ref
            out[f"median_vs_{rung}"] = None if median_o is None else median_o - ref
        ref_t = oriented_value(entry.get("test_metric"), tree.direction)
        if ref_t is not None:
            honest = oriented_value(out["honest_test_metric"], tree.direction)
            out[f"honest_vs_{rung}"] = None if honest is None else honest - ref_t
    out["model_families"] = len({model_family(x.result.code) for x in valid})
    return out
