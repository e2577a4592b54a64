"""The five-options probe's pure parts: prompt and parsing (the voice-leading task's,
graders/voice_leading/probe.py, reached through its profile), per-item counts (evals/probe.py)."""

from __future__ import annotations

import math

from evals.probe import ProbeItem, ProbeOption, summarize
from graders.voice_leading.probe import parse_options, probe_messages

ALPHABET = frozenset(f"{a},{b}" for a in range(4) for b in range(4))


def test_probe_prompt_appends_to_the_user_turn_only():
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
    out = probe_messages(msgs, 1.0, 2)
    assert out[0] == msgs[0] and msgs[1]["content"] == "U"  # input untouched
    assert out[1]["content"].startswith("U\n\n") and "measure 1)" in out[1]["content"]
    assert '"degrees": [0, 1]' in out[1]["content"]


def test_parse_options_tolerates_prose_and_fences_and_skips_junk():
    text = ('Sure!\n```json\n[{"degrees": [0, 1], "probability": 0.5}, {"degrees": [2, 2], "p": 0.2},'
            ' {"degrees": "0 1"}, {"degrees": [true, 1]}, 7, {"degrees": [1.5, 3]}]\n```')
    assert parse_options(text) == [ProbeOption("0,1", 0.5), ProbeOption("2,2", 0.2), ProbeOption("1.5,3", None)]
    assert parse_options("I think root position.") == []


def test_distinct_admissible_counts_alphabet_members_once():
    item = ProbeItem("a", [ProbeOption("0,1", 0.4), ProbeOption("0,1", 0.3), ProbeOption("1.5,3", 0.1),
                           ProbeOption("3,3", 0.1), ProbeOption("0,1,2", 0.1)], ALPHABET)
    assert item.distinct_admissible == 2


def test_summary_against_decoded_support():
    items = [ProbeItem("a", [ProbeOption("0,1", None), ProbeOption("2,0", None)], ALPHABET),
             ProbeItem("b", [], ALPHABET)]
    s = summarize(items, {"a": 1, "b": 0})
    assert s["probe_parsed_share"] == 0.5
    assert s["probe_distinct_admissible"] == {"mean": 1.0, "median": 2.0, "min": 0.0, "max": 2.0}
    assert s["decoded_support"]["mean"] == 0.5
    assert s["probe_minus_decoded"]["max"] == 1.0
    assert math.isnan(summarize([], None)["probe_distinct_admissible"]["mean"])


def test_the_probe_is_reached_through_the_task_profile():
    """`counterpoint probe-options` asks the configured task for the probe's prompt and parsing:
    voice-leading's are graders/voice_leading/probe.py's; a task without a probe says so."""
    from types import SimpleNamespace

    import pytest

    from graders.tasks import NoProbe, task_profile

    vl = task_profile("voice-leading")
    assert vl.has_probe
    case = SimpleNamespace(messages=[{"role": "user", "content": "U"}], voices=2,
                           progression={"chords": [{"measure": 1, "chordSymbol": "C"}]})
    assert vl.probe_messages(case) == probe_messages(case.messages, 1, 2)
    assert vl.probe_options('[{"degrees": [0, 1], "p": 0.5}]') == [ProbeOption("0,1", 0.5)]
    for name in ("code-exec", "vowel-share", "tests.grader_testtask:make_task"):
        assert not task_profile(name).has_probe
        with pytest.raises(NoProbe, match="no five-options probe"):
            task_profile(name).probe_options("[]")
