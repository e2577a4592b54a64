"""End to end on configs/smoke.yaml with the real services: `counterpoint replicate --pin-init`
(arms share one saved init, one arm fails and is reported), and `counterpoint probe-options`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cliharness import cli
from evals.records import read_eval

pytestmark = pytest.mark.slow


def test_replicate_pins_the_init_and_survives_a_failed_arm(tmp_path: Path):
    out = tmp_path / "rep"
    # Arm seed 9 cannot create its run directory (a file is in the way): a real failure, late
    # in the list, that must be reported while the other arms complete.
    (out / "runs").mkdir(parents=True)
    (out / "runs" / "seed9").write_text("not a directory")
    done = cli("replicate", "--config", "configs/smoke.yaml", "--seeds", "7,8,9", "--pin-init", "--out", str(out),
               "--set", "trainer.steps=2", "--set", "eval.before_and_after=false",
               "--generations", "2", "--max-new-tokens", "8", timeout=840)  # inside pytest's 900 s
    log = done.stdout[-3000:] + done.stderr[-3000:]
    assert done.returncode == 1, log  # one arm failed: the command says so
    assert "1 of 3 arms failed (seeds [9])" in done.stderr, log

    receipt = json.loads((out / "replicate.json").read_text())
    assert receipt["kind"] == "replicate" and receipt["status"] == "completed"
    arms = {a["seed"]: a for a in receipt["artifacts"]["arms"]}
    assert [arms[s]["status"] for s in (7, 8, 9)] == ["completed", "completed", "failed"], arms
    assert "exited" in arms[9]["error"] and "seed9.log" in arms[9]["error"]
    pinned = out / "runs" / "seed7" / "adapters" / "init"
    assert arms[7]["init_adapter"] == f"{pinned} (saved by this arm)"
    assert arms[8]["init_adapter"] == str(pinned)

    runs = {s: json.loads((out / "runs" / f"seed{s}" / "run.json").read_text()) for s in (7, 8)}
    assert runs[7]["init_adapter"] == "seeded (adapters/init)"
    assert runs[8]["init_adapter"] == str(pinned)
    # Same init bytes, different seeds: the pinned arm started from the first arm's artifact.
    assert runs[8]["init_adapter_sha256"] == runs[7]["init_adapter_sha256"]
    assert runs[7]["seeds"]["seed"] == 7 and runs[8]["seeds"]["seed"] == 8
    for s in (7, 8):
        assert runs[s]["status"] == "completed" and runs[s]["steps_trained"] == [1, 2]
        ev = read_eval(out / f"eval_seed{s}.jsonl")
        assert ev.header.generation.generations == 2 and len(ev.items) == ev.header.prompt_set.n_items > 0
        assert all(len(item.completions) == 2 for item in ev.items)
    # Both arms were evaluated on the same prompts with the same settings: compare accepts them.
    done = cli("compare", str(out / "eval_seed7.jsonl"), str(out / "eval_seed8.jsonl"), "--seed", "1")
    assert done.returncode == 0, done.stderr
    assert "95% interval" in done.stdout


# What single-sample decoding showed on the three items, as an EVAL.jsonl would hold it: the
# probe's --eval join must find supports 2, 1 and 3 ("(none)" is not an opening).
DECODED = (["0,1", "0,1", "1,0", "(none)"], ["0,0"] * 4, ["0,1", "1,2", "2,0", "(none)"])


def _decoded_eval(path: Path, ids: list[str]) -> Path:
    from evals.records import EvalItem, GenerationSettings, header_for, write_eval

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

    from evals.probe import parse_options

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


def test_probe_options_on_smoke(tmp_path: Path):
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
               "--max-new-tokens", "16", "--eval", str(decoded), "--out", str(out))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "five-options probe (heldout, 3 items)" in done.stdout
    assert "probe answers parsed:" in done.stdout
    assert "decoded_support" in done.stdout and "2.00" in done.stdout and "3.00" in done.stdout

    def refuse(token):
        raise AssertionError(f"probe report holds {token}: not strict JSON")

    check_probe_report(json.loads(out.read_text(), parse_constant=refuse), cases)
