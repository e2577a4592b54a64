"""The five-options probe's pure parts: prompt, parsing, per-item counts."""

from __future__ import annotations

import math

from evals.probe import ProbeItem, ProbeOption, parse_options, probe_messages, summarize

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
