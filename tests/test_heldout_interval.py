"""A train run's held-out before/after as one seed's paired difference with a 95 % interval:
the per-item EVAL files it keeps, run.json's heldout section, and the console text."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from heldoutharness import write_before_after
from evals.compare import compare
from evals.cli import eval_app
from evals.eval_file import read_eval
from evals.heldout import heldout_lines, heldout_section, replicate_command
from services.receipt import Receipt
from services.train import print_heldout

N = 40
BEFORE = [i < 16 for i in range(N)]  # 40 %
AFTER = [i < 24 for i in range(N)]  # 60 %: 8 items gained, none lost
ARGV = ["counterpoint", "train", "--config", "configs/voice-leading.yaml", "--set", "seed=3",
        "--set", "trainer.steps=8", "--set", "trainer.runs_dir=/tmp/x"]


def test_before_after_files_keep_every_item_and_pair_up(tmp_path: Path) -> None:
    run = write_before_after(tmp_path / "run", BEFORE, AFTER)
    before, after = read_eval(run.heldout_path("before")), read_eval(run.heldout_path("after"))
    assert [i.item_id for i in before.items] == [i.item_id for i in after.items]
    assert [i.pass_count for i in before.items] == [int(b) for b in BEFORE]
    assert [i.pass_count for i in after.items] == [int(a) for a in AFTER]
    # Both carry the rendered prompts' hash: compare refuses a pair made on other prompts.
    assert before.header.prompt_set.prompts_sha256 == after.header.prompt_set.prompts_sha256 is not None
    assert before.header.prompt_set.prefix_mode == "forced_opening"


def test_section_is_what_compare_paired_computes(tmp_path: Path) -> None:
    run = write_before_after(tmp_path / "run", BEFORE, AFTER)
    section = heldout_section(run.heldout_path("before"), run.heldout_path("after"), seed=7, argv=ARGV)
    assert section["before"]["summary"]["pass_rate"] == pytest.approx(0.4)
    assert section["after"]["summary"]["pass_rate"] == pytest.approx(0.6)
    assert section["after"]["eval_file"] == str(run.heldout_path("after"))
    d = section["difference"]
    p = d["pass_rate"]
    assert (p["before"], p["after"], p["difference"]) == pytest.approx((40.0, 60.0, 20.0))
    assert 0 < p["low"] < 20 < p["high"] < 40
    assert d["n_items"] == N and d["n_boot"] == 2000 and "paired" in d["interval"]
    assert d["scope"].startswith("one seed's result (seed 7)")

    # The same numbers as `counterpoint compare BEFORE AFTER --paired`, run as a user would.
    out = tmp_path / "cmp.json"
    done = CliRunner().invoke(eval_app, ["compare", str(run.heldout_path("before")),
                                         str(run.heldout_path("after")), "--paired", "--out-json", str(out)])
    assert done.exit_code == 0, done.output
    cli = json.loads(out.read_text())["metrics"]["pass_rate"]
    assert (cli["difference"], cli["low"], cli["high"]) == (p["difference"], p["low"], p["high"])

    # Pairing is what makes it narrow: every item that moved, moved up.
    unpaired = compare([read_eval(run.heldout_path("before"))], [read_eval(run.heldout_path("after"))],
                       paired=False).metrics["pass_rate"]
    assert unpaired.high - unpaired.low > 1.5 * (p["high"] - p["low"])


def test_receipt_records_the_difference_and_interval(tmp_path: Path) -> None:
    run = write_before_after(tmp_path / "run", BEFORE, AFTER)
    receipt = Receipt(run.receipt_path, kind="train", run_name="run")
    receipt.start(config={"seed": 7}, seeds={"seed": 7})
    receipt.update(heldout=heldout_section(run.heldout_path("before"), run.heldout_path("after"), seed=7, argv=ARGV))
    heldout = json.loads(run.receipt_path.read_text())["heldout"]
    assert set(heldout) == {"before", "after", "difference"}
    d = heldout["difference"]
    assert d["pass_rate"]["difference"] == pytest.approx(20.0)
    assert d["pass_rate"]["low"] < d["pass_rate"]["high"]
    assert d["across_seeds"][0].startswith("counterpoint replicate --config configs/voice-leading.yaml --seeds 7,8,9,10,11")


def test_printed_text_names_one_seed_and_the_replicate_command(tmp_path: Path, capsys) -> None:
    run = write_before_after(tmp_path / "run", BEFORE, AFTER)
    section = heldout_section(run.heldout_path("before"), run.heldout_path("after"), seed=7, argv=ARGV)
    p = section["difference"]["pass_rate"]
    print_heldout(section)
    out = capsys.readouterr().out
    table = out.splitlines()
    assert any(line.startswith("│ before │    40 │          40 │   40.00 % │") for line in table), out
    assert any(line.startswith("│ after  │    40 │          40 │   60.00 % │") for line in table), out
    assert (f"held-out pass rate, after - before: +20.00 points, 95% interval [{p['low']:+.2f}, "
            f"{p['high']:+.2f}] (paired bootstrap over 40 items, B=2000)") in out
    assert "This is one seed's result (seed 7): the interval covers item sampling only" in out
    assert ("  counterpoint replicate --config configs/voice-leading.yaml --seeds 7,8,9,10,11 --out runs/replicate "
            "--set trainer.steps=8\n") in out
    assert ("  counterpoint compare runs/replicate/runs/seed7/heldout_before.jsonl "
            "runs/replicate/runs/seed*/heldout_after.jsonl --paired\n") in out


def test_without_a_before_eval_there_is_no_difference(tmp_path: Path) -> None:
    # A resumed run whose first attempt predates the before file: the after eval alone.
    run = write_before_after(tmp_path / "run", BEFORE, None)
    section = heldout_section(run.heldout_path("before"), run.heldout_path("after"), seed=0, argv=[])
    assert set(section) == {"before"} and heldout_lines(section) == []
    assert heldout_section(tmp_path / "nothing" / "heldout_before.jsonl", tmp_path / "nothing" / "heldout_after.jsonl", seed=0,
                           argv=[]) == {}


def test_replicate_command_keeps_config_and_overrides_but_not_seed_or_naming() -> None:
    argv = ["counterpoint", "train", "-c", "my configs/a.yaml", "--set", "learner.lr=1e-4", "--set", "seed=9",
            "--set", "run_name=x", "--run-name", "y", "--set", "eval.before_and_after=true", "--set", "eval.seed=3"]
    assert replicate_command(argv, seed=9, n_seeds=3) == [
        "counterpoint replicate --config 'my configs/a.yaml' --seeds 9,10,11 --out runs/replicate "
        "--set learner.lr=1e-4",
        "counterpoint compare runs/replicate/runs/seed9/heldout_before.jsonl "
        "runs/replicate/runs/seed*/heldout_after.jsonl --paired",
    ]
    resumed = replicate_command(["counterpoint", "train", "--resume", "runs/r"], seed=0, n_seeds=2)
    assert resumed[0] == "counterpoint replicate --config <config.yaml> --seeds 0,1 --out runs/replicate"


def test_per_task_reward_differences_and_their_lines():
    """Tree runs: one line per code-exec task, its interval over that task's completions."""
    from types import SimpleNamespace

    from evals.heldout import _per_task_lines, per_task_reward_differences

    def ev(**rewards):
        return SimpleNamespace(items=[SimpleNamespace(item_id=k, rewards=v) for k, v in rewards.items()])

    before = ev(a=[-0.5] * 4, b=[0.5, 0.5, 0.5, 0.5], c=[0.1, 0.2])
    after = ev(a=[0.5, 0.5, -0.5, 0.5], b=[0.5, 0.5, 0.5, 0.5], c=[0.1, 0.2, 0.3])
    got = per_task_reward_differences(before, after, n_boot=500)
    assert set(got) == {"a", "b"}  # c: different generation counts, no shared axis
    assert got["a"]["difference"] == 0.75 and got["a"]["low"] <= 0.75 <= got["a"]["high"]
    assert 0 < got["a"]["low"]  # 3 of 4 fixed against 0 of 4: the interval leaves 0 out
    assert (got["b"]["difference"], got["b"]["low"], got["b"]["high"]) == (0.0, 0.0, 0.0)
    lines = _per_task_lines({"per_task": got, "trained_on": ["a"]})
    assert lines[0].startswith("  a (trained on): -0.500 -> +0.250, +0.750, 95% interval [")
    assert lines[1].startswith("  b (not trained on):") and lines[1].endswith("over 4+4 completions")
