"""The voice-leading task's five-options probe: ask the model for five openings of the first
chord with probabilities at once (the prompt), and read the options back from its answer with the
grader's tolerant JSON search. The counts over items are evals/probe.py's; the command is
`counterpoint probe-options` (services/commands.py), which reaches these through the task's
profile (graders/voice_leading/profile.py)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from graders.types import ProbeOption
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
