"""End to end on configs/smoke.yaml with the real services: one `counterpoint replicate --grid
--pin-init` run, 2 cells × 2 seeds of two steps each (every arm a real train subprocess that
evaluates the held-out prompts before and after training inside its run; the second arm of the
second cell made to fail), shared by two tests: the grid's files (the receipt, grid.json, grid.png
and the table) and the pinned init (each cell's second arm starts from its first arm's saved init
adapter; the failed arm is reported); and bad grid input refused in one line before any arm runs.

The two runs this replaces (a --grid run, ~5-8 min, and a --pin-init run over seeds 7,8,9, ~3 min)
were the suite's largest repeated set-up; --pin-init pins per cell, so one grid run exercises both.
Its arms once ran a separate `counterpoint eval` each, and one per seed for the base model: five
more start-ups of a grader and a replica (~3 min); tests/test_eval_e2e.py runs that command."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from cliharness import cli
from evals.grid import read_grid_json, t_interval
from evals.eval_file import read_eval

pytestmark = [pytest.mark.slow, pytest.mark.subprocess]

CELLS = {"c1_lr-1e-3": "learner.lr=1e-3", "c2_lr-1e-4": "learner.lr=1e-4"}
STEPS = 2


def pass_rate(path: Path) -> float:
    ev = read_eval(path)
    return 100 * sum(i.pass_count for i in ev.items) / sum(i.generations for i in ev.items)


@pytest.fixture(scope="module")
def grid_run(tmp_path_factory, ray_head) -> tuple[Path, subprocess.CompletedProcess]:
    """The one replicate run both tests below read: (its --out, the finished command). Its arms
    join the test run's Ray head (--address): replicate's own orchestration is what is tested
    here; every other e2e run of a local cluster tests the arms' start-up."""
    out = tmp_path_factory.mktemp("replicate") / "grid"
    # Arm c2 seed 2 cannot create its run directory (a file is in the way): a real failure, late in
    # the list and of a pinned arm, that must be reported while every other arm completes and is
    # aggregated.
    (out / "runs").mkdir(parents=True)
    (out / "runs" / "c2_lr-1e-4__seed2").write_text("not a directory")
    done = cli("replicate", "--config", "configs/smoke.yaml", "--seeds", "1,2", "--out", str(out),
               "--grid", "learner.lr=1e-3,1e-4", "--pin-init", "--set", f"trainer.steps={STEPS}",
               "--set", "eval.limit=4", "--generations", "2", "--max-new-tokens", "8", "--address", ray_head.address,
               timeout=870, env=ray_head.env)  # inside pytest's 900 s
    return out, done


def test_replicate_grid_on_smoke(grid_run):
    out, done = grid_run
    log = done.stdout[-4000:] + done.stderr[-3000:]
    assert done.returncode == 1, log  # one arm failed: the command says so
    assert "1 of 4 arms failed (arms c2_lr-1e-4__seed2)" in done.stderr, log
    assert "note: c2_lr-1e-4 seed 2: arm failed: `services.cli train --config ...` exited 1" in done.stderr, log

    receipt = json.loads((out / "replicate.json").read_text())
    assert receipt["kind"] == "replicate" and receipt["status"] == "completed"
    assert receipt["seeds"] == {"seeds": [1, 2]} and receipt["notes"]["pin_init"] is True
    assert receipt["notes"]["eval"] == ["eval.generations=2", "eval.max_tokens=8"]
    grid = receipt["notes"]["grid"]
    assert grid["options"] == ["learner.lr=1e-3,1e-4"]
    assert [(c["cell"], c["overrides"], c["rollout_mode"]) for c in grid["cells"]] == [
        (name, [o], "flat") for name, o in CELLS.items()]
    arms = receipt["artifacts"]["arms"]
    assert [(a["cell"], a["seed"], a["status"]) for a in arms] == [
        (c, s, "failed" if (c, s) == ("c2_lr-1e-4", 2) else "completed") for c in CELLS for s in (1, 2)], arms
    assert "exited" in arms[3]["error"] and "c2_lr-1e-4__seed2.log" in arms[3]["error"]
    assert receipt["artifacts"]["grid_json"] == str(out / "grid.json")

    done_arms = [a for a in arms if a["status"] == "completed"]
    for a in done_arms:  # each arm trained with its cell's exact value and its seed
        run_dir = Path(a["run_dir"])
        assert run_dir == out / "runs" / f"{a['cell']}__seed{a['seed']}"
        run = json.loads((run_dir / "run.json").read_text())
        assert run["status"] == "completed" and run["steps_trained"] == list(range(1, STEPS + 1))
        assert run["config"]["learner"]["lr"] == float(CELLS[a["cell"]].split("=")[1])
        assert run["config"]["seed"] == a["seed"] and run["config"]["trainer"]["steps"] == STEPS
        assert run["config"]["eval"]["before_and_after"] is True and run["config"]["eval"]["seed"] == a["seed"]
        # The run's own evals, before and after training, with the arm's seed and replicate's settings.
        assert (a["before_file"], a["eval_file"]) == (str(run_dir / "heldout_before.jsonl"),
                                                      str(run_dir / "heldout_after.jsonl"))
        assert run["heldout"]["after"]["eval_file"] == a["eval_file"]
        after, before = read_eval(a["eval_file"]), read_eval(a["before_file"])
        for ev in (after, before):
            assert ev.header.run == str(run_dir) and ev.header.generation.seed == a["seed"]
            assert ev.header.prompt_set.n_items == 4 and ev.header.generation.generations == 2
            assert ev.header.generation.max_new_tokens == 8
        # Before: the base model where the arm seeded its init (identity), the pinned init adapter
        # (version 1) where it was given one; after: the last step's adapter.
        assert before.header.adapter == f"rollout adapter v{0 if a['seed'] == 1 else 1}"
        assert after.header.adapter == f"rollout adapter v{STEPS + 1}"

    report = read_grid_json(out / "grid.json")
    assert [c["cell"] for c in report["cells"]] == list(CELLS)
    for cell in report["cells"]:
        mine = [a for a in done_arms if a["cell"] == cell["cell"]]
        after = [pass_rate(Path(a["eval_file"])) for a in mine]
        delta = [x - pass_rate(Path(a["before_file"])) for x, a in zip(after, mine)]
        m = cell["metrics"]
        assert cell["seeds"] == [1, 2] and cell["completed"] == len(mine)
        assert m["heldout_pass_rate"]["values"] == pytest.approx(after)
        assert m["heldout_pass_rate_delta"]["values"] == pytest.approx(delta)
        assert m["train_frac_reward_zero_std"]["n"] == m["heldout_reward"]["n"] == len(mine)
    full, partial = report["cells"]
    c1 = [a for a in done_arms if a["cell"] == "c1_lr-1e-3"]
    iv = t_interval([pass_rate(Path(a["eval_file"])) - pass_rate(Path(a["before_file"])) for a in c1])
    delta = full["metrics"]["heldout_pass_rate_delta"]
    assert (delta["n"], delta["low"], delta["high"]) == (2, pytest.approx(iv.low), pytest.approx(iv.high))
    assert all(arm["notes"] == [] for arm in full["arms"])
    assert partial["metrics"]["heldout_pass_rate_delta"]["interval"] == "n=1, no interval"
    assert partial["metrics"]["heldout_pass_rate_delta"]["low"] is None
    assert partial["arms"][1]["status"] == "failed" and partial["arms"][1]["notes"][0].startswith("arm failed:")

    png = (out / "grid.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    table = done.stdout
    assert "replicate grid: per cell across seeds" in table
    for name in CELLS:
        assert name in table
    assert "held-out pass rate after - before (points)" in table
    assert "(n=1, no interval)" in table  # the cell with one completed seed
    assert f"grid: {out / 'grid.json'}, {out / 'grid.png'}" in table.replace("\n", "")


def test_replicate_pins_the_init_and_survives_a_failed_arm(grid_run):
    """--pin-init, per cell: each cell's first arm saves adapters/init and its later arms start
    from those bytes with their own seed; the failed (pinned) arm is reported, the others complete."""
    out, done = grid_run
    log = done.stdout[-3000:] + done.stderr[-3000:]
    assert done.returncode == 1, log  # one arm failed: the command says so
    assert "1 of 4 arms failed (arms c2_lr-1e-4__seed2)" in done.stderr, log

    receipt = json.loads((out / "replicate.json").read_text())
    assert receipt["kind"] == "replicate" and receipt["status"] == "completed"
    arms = {(a["cell"], a["seed"]): a for a in receipt["artifacts"]["arms"]}
    c1, c2 = CELLS
    assert [arms[k]["status"] for k in ((c1, 1), (c1, 2), (c2, 1), (c2, 2))] == [
        "completed", "completed", "completed", "failed"], arms
    assert "exited" in arms[c2, 2]["error"] and f"{c2}__seed2.log" in arms[c2, 2]["error"]
    pinned = {c: out / "runs" / f"{c}__seed1" / "adapters" / "init" for c in CELLS}  # one init per cell
    for c in CELLS:
        assert arms[c, 1]["init_adapter"] == f"{pinned[c]} (saved by this arm)"
        assert arms[c, 2]["init_adapter"] == str(pinned[c])  # c2's, though that arm then failed

    runs = {s: json.loads((out / "runs" / f"{c1}__seed{s}" / "run.json").read_text()) for s in (1, 2)}
    assert runs[1]["init_adapter"] == "seeded (adapters/init)"
    assert runs[2]["init_adapter"] == str(pinned[c1])
    # Same init bytes, different seeds: the pinned arm started from the first arm's artifact.
    assert runs[2]["init_adapter_sha256"] == runs[1]["init_adapter_sha256"]
    assert runs[1]["seeds"]["seed"] == 1 and runs[2]["seeds"]["seed"] == 2
    run_c2 = json.loads((out / "runs" / f"{c2}__seed1" / "run.json").read_text())
    assert run_c2["init_adapter"] == "seeded (adapters/init)" and run_c2["seeds"]["seed"] == 1
    for s in (1, 2):
        assert runs[s]["status"] == "completed" and runs[s]["steps_trained"] == list(range(1, STEPS + 1))
        ev = read_eval(out / "runs" / f"{c1}__seed{s}" / "heldout_after.jsonl")
        assert ev.header.generation.generations == 2 and len(ev.items) == ev.header.prompt_set.n_items > 0
        assert all(len(item.completions) == 2 for item in ev.items)
    # Both arms were evaluated on the same prompts with the same settings: compare accepts them.
    done = cli("compare", *(str(out / "runs" / f"{c1}__seed{s}" / "heldout_after.jsonl") for s in (1, 2)), "--seed", "1")
    assert done.returncode == 0, done.stderr
    assert "95% interval" in done.stdout


@pytest.mark.parametrize("args, message", [
    (["--grid", "learner.lr=1e-3,fast"], "error: grid cell c2_lr-fast (learner.lr=fast): "),
    (["--grid", "learner.no_such_key=1,2"], "learner.no_such_key"),
    (["--grid", "learner.lr=1e-3,1e-4", "--set", "learner.lr=1e-2"], "also given by --set learner.lr"),
])
def test_bad_grid_is_refused_before_any_arm_runs(tmp_path: Path, args: list[str], message: str):
    out = tmp_path / "grid"
    done = cli("replicate", "--config", "configs/smoke.yaml", "--seeds", "1,2", "--out", str(out), *args)
    assert done.returncode == 2, done.stdout + done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], done.stderr
    assert not out.exists()  # nothing ran: no receipt, no arm directory, no log
