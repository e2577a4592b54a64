"""The five-options probe: ask the model for five openings with probabilities at once, and
compare how many distinct admissible openings it *knows* per item with how many single-sample
decoding *shows* (the support of an EVAL.jsonl, prior-shape's measure).

The per-item counts are here; the probe's prompt and the parsing of its answer are the task's
(its TaskProfile's probe_messages / probe_options: graders/voice_leading/probe.py for
voice-leading); the command runs the probe on the rollout service (services/commands.py).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

# What a task's probe_options returns (graders/tasks.py TaskProfile); imported here for callers.
from graders.types import ProbeOption  # noqa: F401


@dataclass(frozen=True)
class ProbeItem:
    item_id: str
    options: list[ProbeOption]
    alphabet: frozenset[str]

    @property
    def distinct_admissible(self) -> int:
        """Distinct stated openings that belong to the item's valid-openings alphabet."""
        return len({o.opening for o in self.options if o.opening in self.alphabet})

    @property
    def parsed(self) -> bool:
        return bool(self.options)


def summarize(items: Sequence[ProbeItem], decoded_support: Mapping[str, int] | None = None) -> dict[str, Any]:
    """Per-item distributions of what the probe states and, when an EVAL.jsonl was given, of
    what single-sample decoding shows on the same items."""
    def dist(values: list[float]) -> dict[str, float]:
        if not values:
            return {"mean": float("nan"), "median": float("nan"), "min": float("nan"), "max": float("nan")}
        return {"mean": statistics.fmean(values), "median": sorted(values)[len(values) // 2],
                "min": min(values), "max": max(values)}

    out: dict[str, Any] = {
        "items": len(items),
        "probe_parsed_share": sum(i.parsed for i in items) / max(1, len(items)),
        "probe_distinct_admissible": dist([float(i.distinct_admissible) for i in items]),
    }
    if decoded_support is not None:
        shared = [i for i in items if i.item_id in decoded_support]
        out["decoded_support"] = dist([float(decoded_support[i.item_id]) for i in shared])
        out["probe_minus_decoded"] = dist([float(i.distinct_admissible - decoded_support[i.item_id]) for i in shared])
    return out
