"""Prior shape: how a model spreads its G completions over openings (spec §13.4).

Per item, over *parseable* completions (opening != "(none)"):
  support              distinct openings (0 when nothing parsed)
  modal_share          count of the mode / parseable count; the mode is the most frequent opening,
                       ties to the one seen first. NaN when nothing parsed (as the reference).
  mode_admissible      1 if the mode has an admitted completion (0 when nothing parsed)
  distinct_passing     distinct openings with an admitted completion (None when nothing parsed)
  off_mode_pass_rate   admitted off-mode completions / (parseable - mode count); None unless that
                       denominator is positive
  alphabet_support     distinct openings that belong to the alphabet of valid openings (spec §13.2:
                       N degrees, each 0..3, written as integers); raw openings such as "1.5,3" or
                       "0,1,2,0" (N=2) count in support but not here
  alphabet_share       alphabet_support / the item's alphabet size (None for an empty alphabet)
Separately: unparseable_share = (none) completions / G.
Concentration over ALL completions, "(none)" counted as an ordinary bucket:
  top_share            largest bucket / G
  entropy_bits         Shannon entropy of the bucket distribution
  effective_openings   2**entropy_bits (perplexity; compare with the alphabet size, 16 for N=2)
  normalized_entropy   entropy / log2(min(G, max(alphabet_size + 1, buckets seen))): 1 = as spread
                       as G samples over the alphabet plus "(none)" can be, 0 = one bucket

Aggregates over items report mean, median, min and max. The median is the element at index
floor(n/2) of the sorted values (the reference's definition for support, used for every stat).

The reference's NaN quirk (spec §15.16): the mean modal share over items is NaN as soon as one
item has no parseable completion. ``modal_share_mean_reference`` reproduces that; the NaN-free
variant ``modal_share_parseable_items`` averages only items with at least one parseable completion.
JSON has no NaN: non-finite numbers are written as null (see :func:`to_jsonable`).
"""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from evals.eval_file import NO_OPENING, EvalFile, EvalFileError, EvalItem


@dataclass(frozen=True)
class ItemShape:
    item_id: str
    generations: int
    parseable: int
    unparseable_share: float
    support: int
    mode: str | None
    modal_share: float  # NaN when nothing parsed (reference behaviour)
    mode_admissible: int
    distinct_passing: int | None
    off_mode_pass_rate: float | None
    alphabet_size: int
    alphabet_support: int
    alphabet_share: float | None
    top_share: float
    entropy_bits: float
    effective_openings: float
    normalized_entropy: float
    histogram: dict[str, int]  # parseable openings, first-seen order


def _entropy_bits(counts: Sequence[int]) -> float:
    total = sum(counts)
    h = -sum(c / total * math.log2(c / total) for c in counts if c > 0)
    return h + 0.0  # -0.0 -> 0.0


def in_alphabet(opening: str, voices: int) -> bool:
    """True for the openings of the full alphabet: `voices` degrees over 0..3 (spec §13.2)."""
    parts = opening.split(",")
    return len(parts) == voices and all(p in ("0", "1", "2", "3") for p in parts)


def item_shape(item: EvalItem, voices: int) -> ItemShape:
    g = item.generations
    parseable = [(o, a) for o, a in zip(item.openings, item.admitted) if o != NO_OPENING]
    histogram = Counter(o for o, _ in parseable)  # insertion order = first seen
    passing = {o for o, a in parseable if a}
    n_parse = len(parseable)
    if n_parse:
        # max() keeps the first maximal key in iteration (first-seen) order: the reference tie-break
        mode = max(histogram, key=histogram.__getitem__)
        mode_count = histogram[mode]
        modal_share = mode_count / n_parse
        mode_admissible = int(mode in passing)
        distinct_passing: int | None = len(passing)
        off_den = n_parse - mode_count
        off_mode = (
            sum(a for o, a in parseable if a and o != mode) / off_den if off_den > 0 else None
        )
    else:
        mode, modal_share, mode_admissible, distinct_passing, off_mode = (
            None, float("nan"), 0, None, None,
        )
    all_buckets = Counter(item.openings)
    h = _entropy_bits(list(all_buckets.values())) if g else 0.0
    # the most buckets G completions could fill: the alphabet plus (none), or more when the model
    # writes openings outside the alphabet; keeps normalized_entropy within [0, 1]
    max_buckets = min(g, max(item.alphabet_size + 1, len(all_buckets)))
    alphabet_support = (
        sum(in_alphabet(o, voices) for o in histogram) if item.alphabet_size else 0
    )
    return ItemShape(
        item_id=item.item_id,
        generations=g,
        parseable=n_parse,
        unparseable_share=(g - n_parse) / g if g else float("nan"),
        support=len(histogram),
        mode=mode,
        modal_share=modal_share,
        mode_admissible=mode_admissible,
        distinct_passing=distinct_passing,
        off_mode_pass_rate=off_mode,
        alphabet_size=item.alphabet_size,
        alphabet_support=alphabet_support,
        alphabet_share=alphabet_support / item.alphabet_size if item.alphabet_size else None,
        top_share=max(all_buckets.values()) / g if g else float("nan"),
        entropy_bits=h,
        effective_openings=2.0**h,
        normalized_entropy=h / math.log2(max_buckets) if max_buckets > 1 else 0.0,
        histogram=dict(histogram),
    )


@dataclass(frozen=True)
class Distribution:
    n: int  # items that contributed
    mean: float
    median: float  # sorted[n // 2]
    min: float
    max: float


def distribution(values: Sequence[float | int | None]) -> Distribution:
    """Over the items that contribute (None = does not contribute). NaN values poison the mean,
    as in the reference; pass only finite values where that is not wanted."""
    xs = [float(v) for v in values if v is not None]
    if not xs:
        nan = float("nan")
        return Distribution(0, nan, nan, nan, nan)
    s = sorted(xs)
    return Distribution(len(xs), sum(xs) / len(xs), s[len(s) // 2], min(xs), max(xs))


@dataclass(frozen=True)
class PriorShape:
    source: str
    prefix_mode: str | None  # "forced_opening": openings were imposed, not the model's prior
    n_items: int
    generations: int
    voices: int
    alphabet_size: int
    modal_share_mean_reference: float  # NaN if any item parsed nothing (spec §15.16)
    stats: dict[str, Distribution]
    pooled: dict[str, float | int | None]
    items: tuple[ItemShape, ...]


def prior_shape(eval_file: EvalFile) -> PriorShape:
    if any(i.openings is None for i in eval_file.items):
        raise EvalFileError(f"{eval_file.path}: a code-exec eval (its items have statuses, no openings); "
                            "the prior shape is of voice-leading openings")
    voices = eval_file.header.voices
    shapes = tuple(item_shape(i, voices) for i in eval_file.items)
    parsed = [s for s in shapes if s.parseable > 0]

    stats = {
        "unparseable_share": distribution([s.unparseable_share for s in shapes]),
        "support": distribution([s.support for s in shapes]),
        "alphabet_support": distribution([s.alphabet_support for s in shapes]),
        "alphabet_share": distribution([s.alphabet_share for s in shapes]),
        # NaN-free variant of the reference's modal share: items with >= 1 parseable completion
        "modal_share_parseable_items": distribution([s.modal_share for s in parsed]),
        "mode_admissible": distribution([s.mode_admissible for s in shapes]),
        "distinct_passing": distribution([s.distinct_passing for s in shapes]),
        "off_mode_pass_rate": distribution([s.off_mode_pass_rate for s in shapes]),
        "top_share": distribution([s.top_share for s in shapes]),
        "effective_openings": distribution([s.effective_openings for s in shapes]),
        "normalized_entropy": distribution([s.normalized_entropy for s in shapes]),
    }
    modal_reference = (
        sum(s.modal_share for s in shapes) / len(shapes) if shapes else float("nan")
    )
    return PriorShape(
        source=str(eval_file.path),
        prefix_mode=eval_file.header.prompt_set.prefix_mode,
        n_items=len(shapes),
        generations=eval_file.header.generation.generations,
        voices=eval_file.header.voices,
        alphabet_size=eval_file.header.alphabet_size,
        modal_share_mean_reference=modal_reference,
        stats=stats,
        pooled=_pooled(eval_file.items),
        items=shapes,
    )


def _pooled(items: Sequence[EvalItem]) -> dict[str, float | int | None]:
    """Pooled over all items (spec §13.4 "pooled variants")."""
    admitted = Counter(o for i in items for o, a in zip(i.openings, i.admitted) if a)
    everything = Counter(o for i in items for o in i.openings)
    n_adm, n_all = sum(admitted.values()), sum(everything.values())
    h = _entropy_bits(list(everything.values())) if n_all else None
    return {
        "admitted_completions": n_adm,
        "completions": n_all,
        # most common opening among admitted completions / admitted completions
        "top_first_measure_share": max(admitted.values()) / n_adm if n_adm else None,
        # "(none)" counted as an ordinary bucket
        "top_share_all_completions": max(everything.values()) / n_all if n_all else None,
        "distinct_openings_all_completions": len(everything),
        "effective_openings_all_completions": 2.0**h if h is not None else None,
    }


def to_jsonable(obj: Any) -> Any:
    """Dataclasses to dicts; NaN/inf to None so the output is strict JSON."""
    if hasattr(obj, "__dataclass_fields__"):
        obj = asdict(obj)
    if isinstance(obj, dict):
        return {k: to_jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [to_jsonable(v) for v in obj]
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    return obj


def write_prior_shape_json(shape: PriorShape, path: str | Path) -> Path:
    payload = {"kind": "prior_shape", **to_jsonable(shape)}
    payload["modal_share_mean_reference_is_nan"] = math.isnan(shape.modal_share_mean_reference)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2, allow_nan=False) + "\n", encoding="utf-8")
    return path


def write_prior_shape_png(shape: PriorShape, path: str | Path) -> Path:
    """Left: histogram of support per item. Right: share of the alphabet each item uses."""
    from matplotlib.ticker import MaxNLocator

    from evals.figures import pyplot, save_figure

    plt = pyplot()

    supports = [s.support for s in shape.items]
    top = max([shape.alphabet_size, *supports, 1])
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    ax1.hist(supports, bins=[b - 0.5 for b in range(top + 2)], color="tab:blue", edgecolor="k")
    ax1.axvline(
        shape.alphabet_size, color="tab:red", ls="--", label=f"alphabet {shape.alphabet_size}"
    )
    if shape.generations < shape.alphabet_size:  # support can never exceed G
        ax1.axvline(shape.generations, color="tab:gray", ls=":", label=f"G = {shape.generations}")
    ax1.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax1.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax1.set_xlabel("support (distinct parseable openings)")
    ax1.set_ylabel("items")
    ax1.set_title(f"support per item (G={shape.generations})")
    ax1.legend()

    ranked = sorted(shape.items, key=lambda s: -(s.alphabet_share or 0.0))
    ax2.bar(range(len(ranked)), [s.alphabet_share or 0.0 for s in ranked], color="tab:green")
    ax2.set_ylim(0, 1)
    ax2.set_xlabel("item (sorted)")
    ax2.set_ylabel("openings in the alphabet / alphabet size")
    ax2.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax2.set_title("share of the alphabet each item uses")
    fig.suptitle(Path(shape.source).name)
    fig.tight_layout()
    return save_figure(fig, path)
