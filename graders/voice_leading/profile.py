"""What the driver and evals may ask of the voice-leading task (graders/tasks.py TaskProfile):
its pool checked before anything starts, an eval completion's opening, the five-options probe."""

from __future__ import annotations

from typing import Any

from graders.types import ProbeOption
from graders.tasks import TaskProfile, register_profile
from graders.voice_leading.task import NAME


@register_profile
class VoiceLeadingProfile(TaskProfile):
    name = NAME
    has_probe = True
    # admitted, a format or structure gate failed, or a part-writing rule rejected it (the
    # verdict is then the list of rules, unbounded: one label for all of them)
    verdict_labels = ("admitted", "structure", "rule_failure")

    def verdict_label(self, verdict: str) -> str:
        return verdict if verdict in self.verdict_labels[:2] else self.verdict_labels[2]

    def check_pool(self, cfg: Any) -> None:
        """Both splits load (the fixtures exist, parse and fit voices, style and bars)."""
        from graders.voice_leading.pool import load_pool

        load_pool(cfg.fixture, cfg.heldout_fixture, cfg.voices, cfg.style, cfg.bars)

    def opening_of(self, completion: str) -> str:
        """§13.1: the opening under the reference parser, or ``(none)``."""
        from graders.voice_leading.openings import opening_of

        return opening_of(completion)

    def probe_messages(self, case: Any) -> list[dict[str, str]]:
        """The case's messages asking for five openings of its first chord (graders/voice_leading/probe.py)."""
        from graders.voice_leading.probe import probe_messages

        return probe_messages(case.messages, case.progression["chords"][0]["measure"], case.voices)

    def probe_options(self, completion: str) -> list[ProbeOption]:
        from graders.voice_leading.probe import parse_options

        return parse_options(completion)
