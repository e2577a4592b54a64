"""The five-options probe: ask the model for five openings with probabilities at once, and
compare how many distinct admissible openings it *knows* per item with how many single-sample
decoding *shows* (the support of an EVAL.jsonl, prior-shape's measure).

Pure parts here (the probe prompt, parsing the answer, per-item counts); the command runs the
probe on the rollout service (services/commands.py).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from graders.voice_leading.jsnum import number_to_string
from graders.voice_leading.parser import entry_list, find_json_value

PROBE_INSTRUCTION = (
    "Before voicing anything: list five DIFFERENT options for the \"degrees\" of the first chord "
    "(measure {measure}), each with your probability that it is the best opening. Answer with "
    "only a JSON array of five objects, e.g. "
    "[{{\"degrees\": [{example}], \"probability\": 0.4}}, ...]."
)


def probe_messages(messages: Sequence[Mapping[str, str]], first_measure: float, voices: int) -> list[dict[str, str]]:
    """The case's system + user messages with the probe instruction appended to the user turn."""
    out = [dict(m) for m in messages]
    example = ", ".join(str(i % 3) for i in range(voices))
    out[-1]["content"] += "\n\n" + PROBE_INSTRUCTION.format(measure=number_to_string(first_measure), example=example)
    return out


@dataclass(frozen=True)
class ProbeOption:
    opening: str  # degrees joined by "," as the spec's openings are written
    probability: float | None


def parse_options(completion: str) -> list[ProbeOption]:
    """Options in answer order, from the first JSON array the completion holds (the grader's
    tolerant search: whole text, a code fence, or the first balanced bracket)."""
    options = []
    for entry in entry_list(find_json_value(completion)):
        if not isinstance(entry, dict):
            continue
        degrees = entry.get("degrees")
        if not isinstance(degrees, list) or not degrees or not all(
                isinstance(d, (int, float)) and not isinstance(d, bool) for d in degrees):
            continue
        p = entry.get("probability", entry.get("p"))
        prob = float(p) if isinstance(p, (int, float)) and not isinstance(p, bool) else None
        options.append(ProbeOption(",".join(number_to_string(float(d)) for d in degrees), prob))
    return options


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
