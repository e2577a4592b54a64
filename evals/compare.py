"""Arm vs base on held-out evals: pass-rate and coverage differences with a bootstrap interval.

Each EVAL file is one run (one seed). The base is one or more runs, the arm several runs.

Statistic: mean over arm runs of the run's metric minus the mean over base runs, in percentage
points. A run's pass rate is the mean over items of (admitted / G) (every item has the same G, so
this equals admitted / completions); its coverage is the share of items with >= 1 admitted.

Interval: percentile bootstrap over runs and items. Each of B replicates draws the arm's runs
with replacement, the base's runs with replacement, and the items with replacement; with
``paired`` one item draw is shared by base and arm (the same prompts on both sides), otherwise
base and arm draw their items independently. The 95 % interval is the 2.5th and 97.5th
percentiles of the B replicate statistics. With one run on a side, that side's run draw is a
no-op and the interval reflects item sampling only; the method line says so.

Runs are comparable only when they share the prompt set (split, ids hash, item count, prefix mode,
and the prompts hash when both carry it), every generation setting except the seed, the voice
count, and the scoring settings (style, checker) when both carry them; anything else is refused
with the difference named. A differing fixture_source (a path) or model is only a warning.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from evals.eval_file import EvalFile

METRICS = ("pass_rate", "coverage")


class NotComparableError(ValueError):
    """Evals that were not made on the same prompts with the same generation settings."""


def _differences(a: dict, b: dict, prefix: str) -> list[str]:
    return [
        f"{prefix}.{k}: {a.get(k)!r} vs {b.get(k)!r}"
        for k in sorted(set(a) | set(b))
        if a.get(k) != b.get(k)
    ]


def check_comparable(reference: EvalFile, others: Sequence[EvalFile]) -> None:
    """Raise NotComparableError naming every differing field of the first mismatching file."""
    ref = reference.header
    ref_ids = sorted(i.item_id for i in reference.items)
    for other in others:
        h = other.header
        ref_ps = ref.prompt_set.model_dump(exclude={"fixture_source", "prompts_sha256"})
        diffs = _differences(
            ref_ps, h.prompt_set.model_dump(exclude={"fixture_source", "prompts_sha256"}),
            "prompt_set",
        )
        a, b = ref.prompt_set.prompts_sha256, h.prompt_set.prompts_sha256
        if a is not None and b is not None and a != b:
            diffs.append(f"prompt_set.prompts_sha256: {a[:12]}… vs {b[:12]}…")
        diffs += _differences(
            ref.generation.comparable_fields(), h.generation.comparable_fields(), "generation"
        )
        if ref.voices != h.voices:
            diffs.append(f"voices: {ref.voices} vs {h.voices}")
        if ref.scoring is not None and h.scoring is not None:
            diffs += _differences(ref.scoring.model_dump(), h.scoring.model_dump(), "scoring")
        if not diffs and sorted(i.item_id for i in other.items) != ref_ids:
            diffs.append("item ids differ")  # read_eval already ties ids to the header hash
        if diffs:
            raise NotComparableError(
                f"cannot compare {other.path} with {reference.path}: " + "; ".join(diffs)
            )


def run_matrix(runs: Sequence[EvalFile], item_ids: Sequence[str], metric: str) -> np.ndarray:
    """runs × items matrix of the per-item metric (item order = item_ids)."""
    rows = []
    for run in runs:
        by_id = {i.item_id: i for i in run.items}
        if metric == "pass_rate":
            rows.append([by_id[k].pass_count / by_id[k].generations for k in item_ids])
        elif metric == "coverage":
            rows.append([float(by_id[k].pass_count > 0) for k in item_ids])
        else:
            raise ValueError(f"unknown metric {metric!r}; expected one of {METRICS}")
    return np.asarray(rows, dtype=np.float64)


def bootstrap_difference(
    base: np.ndarray, arm: np.ndarray, *, paired: bool, n_boot: int, seed: int
) -> np.ndarray:
    """B replicate statistics of mean(arm) - mean(base) (fractions, not points).

    base: (R_base, n) and arm: (R_arm, n) per-run, per-item values over the same item order.
    A replicate weights runs and items by their multinomial draw counts, so
    stat = w_arm · arm · c_arm / (R_arm n) - w_base · base · c_base / (R_base n).
    """
    if base.ndim != 2 or arm.ndim != 2 or base.shape[1] != arm.shape[1]:
        raise ValueError(f"shapes {base.shape} and {arm.shape} do not share the item axis")
    if n_boot < 1:
        raise ValueError("n_boot must be >= 1")
    rng = np.random.default_rng(seed)
    n = base.shape[1]
    r_base, r_arm = base.shape[0], arm.shape[0]
    uniform_items = np.full(n, 1.0 / n)
    c_arm = rng.multinomial(n, uniform_items, size=n_boot)  # (B, n)
    c_base = c_arm if paired else rng.multinomial(n, uniform_items, size=n_boot)
    w_arm = rng.multinomial(r_arm, np.full(r_arm, 1.0 / r_arm), size=n_boot)  # (B, R_arm)
    w_base = rng.multinomial(r_base, np.full(r_base, 1.0 / r_base), size=n_boot)
    arm_stat = np.einsum("br,rn,bn->b", w_arm, arm, c_arm) / (r_arm * n)
    base_stat = np.einsum("br,rn,bn->b", w_base, base, c_base) / (r_base * n)
    return arm_stat - base_stat


@dataclass(frozen=True)
class MetricComparison:
    metric: str
    base_runs: list[float]  # per-run metric, points
    arm_runs: list[float]
    base_mean: float
    arm_mean: float
    difference: float  # points
    low: float  # 95 % percentile interval, points
    high: float

    def sentence(self) -> str:
        return f"{self.difference:+.2f} points, 95% interval [{self.low:+.2f}, {self.high:+.2f}]"


@dataclass(frozen=True)
class Comparison:
    base_files: list[str]
    arm_files: list[str]
    n_items: int
    paired: bool
    n_boot: int
    seed: int
    method: str
    metrics: dict[str, MetricComparison]
    warnings: list[str]


def method_text(paired: bool, n_boot: int, seed: int, r_base: int, r_arm: int, n: int) -> str:
    items = "one item draw shared by base and arm (paired)" if paired else (
        "independent item draws for base and arm (unpaired)"
    )
    text = (
        f"percentile bootstrap, B={n_boot}, seed={seed}: each replicate resamples the {r_arm} arm "
        f"run(s) and {r_base} base run(s) with replacement and the {n} items with replacement, "
        f"{items}; statistic = mean arm metric - mean base metric; "
        "95% interval = 2.5th..97.5th percentiles"
    )
    if r_arm == 1 or r_base == 1:
        sides = [s for s, r in (("arm", r_arm), ("base", r_base)) if r == 1]
        text += (
            f" (a single {' and a single '.join(sides)} run: no run-to-run variance is "
            f"captured on {'that side' if len(sides) == 1 else 'either side'})"
        )
    return text


def compare(
    base: Sequence[EvalFile],
    arms: Sequence[EvalFile],
    *,
    paired: bool = False,
    n_boot: int = 2000,
    seed: int = 0,
) -> Comparison:
    if not base or not arms:
        raise ValueError("compare needs at least one base eval and one arm eval")
    reference = base[0]
    check_comparable(reference, [*base[1:], *arms])
    item_ids = sorted(i.item_id for i in reference.items)
    if not item_ids:
        raise NotComparableError(f"{reference.path}: the prompt set has no items")
    metrics: dict[str, MetricComparison] = {}
    for metric in METRICS:
        b = run_matrix(base, item_ids, metric)
        a = run_matrix(arms, item_ids, metric)
        # the same seed for every metric: one set of run/item draws serves them all
        reps = bootstrap_difference(b, a, paired=paired, n_boot=n_boot, seed=seed)
        low, high = np.percentile(reps, [2.5, 97.5]) * 100
        base_runs = (b.mean(axis=1) * 100).tolist()
        arm_runs = (a.mean(axis=1) * 100).tolist()
        base_mean, arm_mean = float(np.mean(base_runs)), float(np.mean(arm_runs))
        metrics[metric] = MetricComparison(
            metric=metric,
            base_runs=base_runs,
            arm_runs=arm_runs,
            base_mean=base_mean,
            arm_mean=arm_mean,
            difference=arm_mean - base_mean,
            low=float(low),
            high=float(high),
        )
    return Comparison(
        base_files=[str(f.path) for f in base],
        arm_files=[str(f.path) for f in arms],
        n_items=len(item_ids),
        paired=paired,
        n_boot=n_boot,
        seed=seed,
        method=method_text(paired, n_boot, seed, len(base), len(arms), len(item_ids)),
        metrics=metrics,
        warnings=_seed_warnings(base, arms) + _source_warnings(reference, [*base[1:], *arms]),
    )


def _seed_warnings(base: Sequence[EvalFile], arms: Sequence[EvalFile]) -> list[str]:
    warnings = []
    for side, runs in (("base", base), ("arm", arms)):
        seeds = [r.header.generation.seed for r in runs]
        known = [s for s in seeds if s is not None]
        if len(known) != len(set(known)):
            warnings.append(
                f"{side} runs repeat a generation seed ({seeds}): they are not independent runs"
            )
    return warnings


def _source_warnings(reference: EvalFile, others: Sequence[EvalFile]) -> list[str]:
    src = reference.header.prompt_set.fixture_source
    model = reference.header.model
    return [
        f"{o.path}: model {o.header.model!r} differs from {model!r} (compared anyway)"
        for o in others
        if o.header.model != model
    ] + [
        f"{o.path}: fixture_source {o.header.prompt_set.fixture_source!r} differs from {src!r} "
        "(same item ids; compared anyway)"
        for o in others
        if o.header.prompt_set.fixture_source != src
    ]


def write_comparison_json(comparison: Comparison, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {"kind": "comparison", **asdict(comparison)}
    path.write_text(json.dumps(payload, indent=2) + "\n", encoding="utf-8")
    return path


def write_comparison_png(comparison: Comparison, path: str | Path) -> Path:
    """Per metric: each arm run's difference to the base mean (points), the mean difference and
    its 95 % bootstrap interval, and a zero line."""
    from evals.figures import pyplot, save_figure

    plt = pyplot()

    fig, axes = plt.subplots(1, len(comparison.metrics), figsize=(5 * len(comparison.metrics), 4))
    for ax, m in zip(np.atleast_1d(axes), comparison.metrics.values()):
        per_run = [r - m.base_mean for r in m.arm_runs]
        jitter = np.linspace(-0.08, 0.08, len(per_run)) if len(per_run) > 1 else [0.0]
        ax.scatter(jitter, per_run, color="tab:blue", alpha=0.7, label="arm run − base mean")
        ax.errorbar(
            [0.3], [m.difference], yerr=[[m.difference - m.low], [m.high - m.difference]],
            fmt="o", color="tab:red", capsize=6, label="mean, 95% interval",
        )
        ax.axhline(0, color="k", lw=0.8)
        ax.set_xlim(-0.5, 0.8)
        ax.set_xticks([])
        ax.set_ylabel("difference (points)")
        ax.set_title(f"{m.metric}: {m.sentence()}", fontsize=9)
        ax.legend(fontsize=8, loc="best")
    fig.suptitle(
        f"arm vs base, {comparison.n_items} items, paired={comparison.paired}", fontsize=10
    )
    fig.tight_layout()
    return save_figure(fig, path)
