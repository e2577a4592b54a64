"""End to end on configs/smoke.yaml with the real services: `counterpoint probe-options`.
(`replicate --pin-init` is checked in tests/test_replicate_grid_e2e.py, on the grid run it shares.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cliharness import cli

pytestmark = [pytest.mark.slow, pytest.mark.subprocess]


# What single-sample decoding showed on the three items, as an EVAL.jsonl would hold it: the
# probe's --eval join must find supports 2, 1 and 3 ("(none)" is not an opening).
DECODED = (["0,1", "0,1", "1,0", "(none)"], ["0,0"] * 4, ["0,1", "1,2", "2,0", "(none)"])


def _decoded_eval(path: Path, ids: list[str]) -> Path:
    from evals.eval_file import EvalItem, GenerationSettings, header_for, write_eval

    items = [EvalItem(item_id=i, completions=[f"c{k}" for k in range(4)], openings=list(o), lengths=[1] * 4,
                      rewards=[0.0] * 4, verdicts=["structure"] * 4, admitted=[False] * 4, distinct_exact=4,
                      distinct_stripped=4, pass_count=0, alphabet_size=16) for i, o in zip(ids, DECODED, strict=True)]
    generation = GenerationSettings(generations=4, max_new_tokens=16, temperature=1.0, top_p=1.0, top_k=-1)
    return write_eval(path, header_for(items, generation=generation, model="tiny-random", voices=2), items)


def check_probe_report(report: dict, cases) -> None:
    """The probe report holds one entry per case, in order, with the model's real answer; its
    options are what parse_options reads from that answer, its admissible count is over the
    case's alphabet, and the summary is exactly those items' numbers beside the decoded supports."""
    import statistics

    from graders.voice_leading.probe import parse_options

    def dist(xs):
        return {"mean": statistics.fmean(xs), "median": sorted(xs)[len(xs) // 2], "min": min(xs), "max": max(xs)}

    assert [i["item_id"] for i in report["items"]] == [c.id for c in cases] and len(cases) == 3
    for case, item in zip(cases, report["items"], strict=True):
        assert item["raw"].strip(), item  # the model answered this item
        options = parse_options(item["raw"])
        assert item["options"] == [vars(o) for o in options], item
        assert item["distinct_admissible"] == len({o.opening for o in options if o.opening in set(case.openings)})
        assert len(case.openings) > 0
    admissible = [float(i["distinct_admissible"]) for i in report["items"]]
    support = [float(len({o for o in d if o != "(none)"})) for d in DECODED]
    assert support == [2.0, 1.0, 3.0]
    assert report["summary"] == {
        "items": 3,
        "probe_parsed_share": sum(bool(i["options"]) for i in report["items"]) / 3,
        "probe_distinct_admissible": dist(admissible),
        "decoded_support": {"mean": 2.0, "median": 2.0, "min": 1.0, "max": 3.0},
        "probe_minus_decoded": dist([a - d for a, d in zip(admissible, support)]),
    }


def test_probe_options_on_smoke(tmp_path: Path, ray_head):
    """`probe-options` on three held-out items with --eval: the items are the grader's (ids and
    alphabets), each answer is the model's text parsed as parse_options parses it, and the
    decoded supports of the EVAL.jsonl are joined by item id. The tiny random model never writes
    a parseable probe answer, so the options' own parsing is tests/test_services_probe.py's."""
    from config import load_config
    from graders.tasks import make_task

    cases = make_task(load_config("configs/smoke.yaml").grader).cases(3, "heldout")
    assert [c.id for c in cases] == ["heldout-000", "heldout-001", "heldout-002"]
    decoded = _decoded_eval(tmp_path / "decoded.jsonl", [c.id for c in cases])
    out = tmp_path / "probe.json"
    done = cli("probe-options", "--config", "configs/smoke.yaml", "--split", "heldout", "--limit", "3",
               "--max-new-tokens", "16", "--eval", str(decoded), "--out", str(out), *ray_head.sets, env=ray_head.env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "five-options probe (heldout, 3 items)" in done.stdout
    assert "probe answers parsed:" in done.stdout
    assert "decoded_support" in done.stdout and "2.00" in done.stdout and "3.00" in done.stdout

    def refuse(token):
        raise AssertionError(f"probe report holds {token}: not strict JSON")

    check_probe_report(json.loads(out.read_text(), parse_constant=refuse), cases)
