"""The tree-mode driver (trainer.rollout_mode = tree, issue 14) with a scripted policy standing in
for the rollout only; everything else is the run's own: the code-exec grader as a real gRPC server
on 127.0.0.1 (real sandbox) behind graders/client.py's GraderClient, the driver's step loop
(services/orchestrator.py run_steps) with services/tree_round.py's TreeRounds as the collect,
services/train.py's StepRecorder and resume_point over the run directory, TrainerMetrics served
and scraped, and the learner policy (learner/policy.py PolicyLearner, answering as the Ray worker's
rank 0 does: services/inprocess.py InProcessLearner) in-process on configs/smoke.yaml's tiny model.

The scripted rollout chooses the TOKENS only (tests/test_search_round.py SCRIPTED, keyed on the
prompt's mode): it renders the prompt and loads every published adapter like an engine
(rollout/engines/hf.py HFEngine) and returns the log-probs of its tokens under that adapter at the
sampling temperature, plus an optional fixed shift. So ppl_ratio is exp(shift) and the TIS weight
min(exp(-shift), cap): what the files must show when the options are wired.

Everything is checked from the run's files (rows, summaries, tree.json, timing.jsonl,
metrics.jsonl) and a scrape of /metrics, not from the driver's objects.
"""

from __future__ import annotations

import json
import math
import shutil
import statistics
import urllib.request
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from config import GraderConfig, load_config
from graders.client import GraderClient
from graders.code_exec.build import build_task
from graders.service import GraderCore, start_server
from graders.tasks import make_task
from learner.types import StepResult
from model.base import resolve_model
from records.jsonl import read_jsonl
from records.run_dir import RunDir
from rollout.engines.hf import HFEngine
from rollout.types import Sample
from search.prompts import mode_of
from search.tree import Tree
from services.inprocess import InProcessLearner, InProcessRollout
from services.metrics import TrainerMetrics
from services.orchestrator import RunParts, run_steps
from services.progress import StepProgress
from services.sampler import sampler_from_config
from services.train import StepRecorder, resume_point
from services.tree_round import TreeRounds
from test_search_round import DEBUG_STATUS, DRAFT_STATUS, IMPROVE_STATUS, SCRIPTED, TASK

pytestmark = pytest.mark.slow

SENTINEL = -0.5
TEMPERATURE = 0.7  # not 1: both sides must apply it
# A hand-made reference ladder for the task (ladder.json beside the tasks, as `grader ladder`
# writes it): known rungs make the best_vs_<rung> values exact.
LADDER = {"metric": "roc_auc", "constant": {"status": "ok", "val_metric": 0.5, "test_metric": 0.5},
          "oracle": {"status": "ok", "val_metric": 0.9, "test_metric": 0.95},
          "broken": {"status": "crashed", "val_metric": None, "test_metric": None}}
STATUSES = {"ok", "no_code", "crashed", "timeout", "invalid_submission"}


# ---------------------------------------------------------------- the grader service
@pytest.fixture(scope="module")
def grader(tmp_path_factory):
    """The code-exec grader on 127.0.0.1, serving only the scripted policy's task."""
    tasks = tmp_path_factory.mktemp("tree-driver") / "tasks"
    build_task(TASK, tasks, seed=0)
    (tasks / "ladder.json").write_text(json.dumps({TASK: LADDER}))
    cfg = GraderConfig(task="code-exec", code_exec={"tasks_dir": str(tasks), "timeout_s": 2.0, "grace_s": 0.2,
                                                    "max_concurrent": 2, "sentinel": SENTINEL})
    server = start_server(GraderCore(make_task(cfg)), "127.0.0.1", 0)
    with GraderClient(server.address, max_retries=0) as client:
        yield client, tasks
    server.stop(None)


def run_config(tasks: Path, runs: Path, *sets: str):
    """configs/smoke.yaml in tree mode on the test's grader, plus `sets`."""
    return load_config("configs/smoke.yaml", [
        "grader.task=code-exec", f"grader.code_exec.tasks_dir={tasks}", "grader.code_exec.timeout_s=2",
        "grader.code_exec.grace_s=0.2", f"grader.code_exec.sentinel={SENTINEL}",
        "trainer.rollout_mode=tree", "trainer.prompts_per_step=1", "trainer.limit=1", f"trainer.runs_dir={runs}",
        f"rollout.temperature={TEMPERATURE}", "rollout.max_tokens=256", "rollout.max_model_len=2048",
        "rollout.max_retries=0", "learner.micro_batch_size=4", *sets,
    ])


# ---------------------------------------------------------------- the stand-ins
class ScriptedRollout(InProcessRollout):
    """The in-process rollout (publish / sync) over a real HF engine that holds the published
    adapters; only the choice of tokens is scripted (SCRIPTED[mode][sibling])."""

    def __init__(self, cfg, shift: float = 0.0):
        super().__init__(HFEngine(resolve_model(cfg.model), cfg.model, cfg.rollout))
        self.shift = shift
        self.published: list[int] = []

    def publish(self, payload) -> None:
        super().publish(payload)
        self.published.append(payload.version)

    @torch.no_grad()
    def generate(self, prompts, params, version) -> list[Sample]:
        prompt_ids, stop = self.engine.prepare(prompts, params, version)  # renders; refuses a stale version
        texts = SCRIPTED[mode_of(list(prompts[0].messages))]
        assert params.n == 1 and len(prompts) == len(texts) and all(p == prompts[0] for p in prompts)
        out = []
        for i, (pids, text) in enumerate(zip(prompt_ids, texts)):
            ids = self.engine.tokenizer(text, add_special_tokens=False)["input_ids"] + [stop[0]]
            assert len(ids) <= params.max_tokens
            logits = self.engine.model(input_ids=torch.tensor([pids + ids]), logits_to_keep=len(ids) + 1).logits
            logp = torch.log_softmax(logits[0, :-1].float() / params.temperature, -1)
            lp = logp.gather(-1, torch.tensor(ids)[:, None])[:, 0] + self.shift
            out.append(Sample(prompt_index=i, sample_index=0, text=text, prompt_token_ids=list(pids), token_ids=ids,
                              logprobs=lp.tolist(), finish_reason="stop", adapter_version=version))
        return out


class Killed(RuntimeError):
    pass


class KilledBeforeCommit(RunDir):
    """A run directory whose driver dies after writing step `at`'s round and metrics line but
    before its timing line (the commit): a round generated and archived, never marked trained."""

    def __init__(self, root: Path, at: int):
        super().__init__(root)
        self.at = at

    def append_timing(self, step, total_s, phases_s) -> None:
        if step == self.at:
            raise Killed(f"driver killed before step {step} was committed")
        super().append_timing(step, total_s, phases_s)


def scrape(port: int) -> dict[str, list]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    return {f.name: f.samples for f in text_string_to_metric_families(text)}


class DiesInUpdate(InProcessLearner):
    """A learner whose process dies inside the update of step `at` (after the round was scored)."""

    at = 2

    def step(self, batch) -> StepResult:
        if self.policy.step_count + 1 == self.at:
            raise Killed(f"driver killed inside the update of step {self.at}")
        return super().step(batch)


def drive(cfg, client, run: RunDir, *, resume: bool = False, shift: float = 0.0,
          learner_cls: type[InProcessLearner] = InProcessLearner) -> dict[str, list]:
    """One driver process's worth: assemble RunParts as services/train.py does (cases from the
    grader, the sampler, the init adapter published and synced, StepRecorder, TreeRounds) and run
    the step loop from where the files say. Returns a scrape of its /metrics at the end."""
    first_step, ckpt = resume_point(run) if resume else (1, None)
    run.create()
    health = client.health()
    cases = {c.id: c for c in client.cases(limit=cfg.trainer.limit or 0, split="train")}
    sampler = sampler_from_config(list(cases), cfg.trainer, cfg.seed)
    learner = learner_cls.for_run(cfg, run.root, resume_from=ckpt)
    init = learner.start()
    rollout = ScriptedRollout(cfg, shift)
    rollout.publish(init.init_payload)
    rollout.sync(init.init_payload.version)
    metrics = TrainerMetrics("127.0.0.1", 0)
    port = metrics.start()
    progress = StepProgress(cfg.trainer.steps, first_step, lambda s: sampler.position(s)["epoch"], interactive=False)
    recorder = StepRecorder(run, metrics, progress, health.task)
    parts = RunParts(cfg=cfg, cases=cases, sampler=sampler, grader=client, rollout=rollout, learner=learner,
                     record=recorder, archive=recorder.archive, version=init.init_payload.version,
                     collect=TreeRounds(run.root))
    try:
        run_steps(parts, first_step)
        return scrape(port)
    finally:
        progress.close()
        metrics.stop()


# ---------------------------------------------------------------- reading the files
def rows_of(root: Path, step: int) -> list[dict[str, Any]]:
    (path,) = (root / f"round_{step}").glob("code-exec__*[0-9].jsonl")
    return read_jsonl(path)


def summary_of(root: Path, step: int) -> dict[str, Any]:
    (path,) = (root / f"round_{step}").glob("code-exec__summary_*.json")
    return json.loads(path.read_text())


def groups_of(rows: list[dict]) -> dict[tuple[int, int], list[dict]]:
    """(step, sibling_group) -> the group's rows (group numbers restart every round)."""
    out: dict[tuple[int, int], list[dict]] = {}
    for r in rows:
        out.setdefault((r["step"], r["sibling_group"]), []).append(r)
    return out


def assert_valid_only_advantages(rows: list[dict], estimator: str, invalid_advantage: float) -> None:
    """Failed nodes get the fixed advantage; valid ones are scored among the valid siblings only
    (z-score with the unbiased std and TRL's eps, or centred average ranks over n-1)."""
    for members in groups_of(rows).values():
        valid = [r for r in members if r["status"] == "ok"]
        for r in members:
            if r["status"] != "ok":
                assert r["advantage"] == pytest.approx(invalid_advantage), r["id"]
        rewards = [r["reward"] for r in valid]
        for r in valid:
            if len(valid) < 2:
                want = 0.0
            elif estimator == "grpo_valid_only":
                want = (r["reward"] - statistics.fmean(rewards)) / (statistics.stdev(rewards) + 1e-4)
            else:  # rank_valid_only
                rank = sum(x < r["reward"] for x in rewards) + (sum(x == r["reward"] for x in rewards) - 1) / 2
                want = (rank - (len(valid) - 1) / 2) / (len(valid) - 1)
            assert r["advantage"] == pytest.approx(want, abs=1e-5), (r["id"], estimator)


# ---------------------------------------------------------------- a tree run, killed and resumed
# search.seed 13989 with smoke.yaml's run seed 7: the 11 coins of expansions 1-11 (steps 1-4) are
# debug, improve, improve, debug, debug, debug, improve x4, debug: round 1 drafts, debugs, improves;
# round 3's debug picks a buggy leaf grown in round 2 (what the resume test looks for).
MAIN = ("trainer.steps=4", "trainer.save_every=1", "search.nodes_per_round=12", "search.expansions_per_round=3",
        "search.num_drafts=2", "search.seed=13989", "search.carry_tree=true", "learner.advantage=grpo_valid_only",
        "learner.invalid_advantage=-0.75")


@pytest.fixture(scope="module")
def tree_run(grader, tmp_path_factory):
    client, tasks = grader
    runs = tmp_path_factory.mktemp("runs")
    cfg = run_config(tasks, runs, *MAIN)
    root = runs / "tree"
    with pytest.raises(Killed, match="before step 3"):
        drive(cfg, client, KilledBeforeCommit(root, at=3))
    killed = tmp_path_factory.mktemp("killed") / "tree"
    shutil.copytree(root, killed)  # the files as the dead driver left them
    scrape_ = drive(cfg, client, RunDir(root), resume=True)  # a fresh driver, from the files alone
    return cfg, root, killed, scrape_


STEPS, N, E = 4, 12, 3


def all_rows(root: Path) -> list[dict]:
    return [r for step in range(1, STEPS + 1) for r in rows_of(root, step)]


def test_every_mode_and_status_in_sibling_groups_with_sentinel_rewards(tree_run):
    cfg, root, _, _ = tree_run
    rows = all_rows(root)
    assert {r["mode"] for r in rows} == {"draft", "debug", "improve"}
    assert {r["status"] for r in rows} == STATUSES
    # Round 1 (search.seed 13989): drafts, a debug of the crashed draft, an improve of the best.
    assert [r["mode"] for r in rows_of(root, 1)] == ["draft"] * 4 + ["debug"] * 4 + ["improve"] * 4
    assert [r["status"] for r in rows_of(root, 1)] == DRAFT_STATUS + DEBUG_STATUS + IMPROVE_STATUS
    for step in range(1, STEPS + 1):
        rs = rows_of(root, step)
        assert [r["sibling_group"] for r in rs] == [g for g in range(E) for _ in range(N // E)]
        assert [r["id"] for r in rs] == [f"s{step}-r{step - 1}-g{g}-{i}" for g in range(E) for i in range(N // E)]
        assert all(r["step"] == step and r["round"] == step - 1 for r in rs)
        assert all(r["adapter_version"] == step for r in rs)  # sampled with the adapter live at the step
        for members in groups_of(rs).values():  # one (mode, parent, prompt) per expansion
            assert len({(r["mode"], r["parent_id"], json.dumps(r["prompt_messages"])) for r in members}) == 1
            assert mode_of(members[0]["prompt_messages"]) == members[0]["mode"]
            assert [r["raw_completion"] for r in members] == SCRIPTED[members[0]["mode"]]
    for r in rows:
        assert len(r["response_token_ids"]) == len(r["response_logprobs"]) > 0
        if r["status"] == "ok":
            assert not r["is_buggy"] and r["val_metric"] is not None and r["test_metric"] is not None
            assert r["reward"] == pytest.approx(max(0.0, 2 * r["val_metric"] - 1))  # validation feeds the reward
        else:  # the sentinel, whatever the failure
            assert r["is_buggy"] and r["reward"] == SENTINEL and r["val_metric"] is None and r["test_metric"] is None
    # The valid-only estimator of the run, from the rows alone.
    assert_valid_only_advantages(rows, "grpo_valid_only", -0.75)


def test_parents_chosen_on_validation_and_debug_depth(tree_run):
    cfg, root, _, _ = tree_run
    seen: dict[str, dict] = {}
    improve_over_best_test = 0
    for step in range(1, STEPS + 1):
        for members in groups_of(rows_of(root, step)).values():
            child = members[0]
            parent = seen.get(child["parent_id"])
            if child["mode"] == "draft":
                assert child["parent_id"] is None and child["debug_depth"] == 0
            elif child["mode"] == "improve":  # the best valid node so far, on VALIDATION
                valid = [r for r in seen.values() if r["status"] == "ok"]
                assert parent["status"] == "ok" and parent["val_metric"] == max(r["val_metric"] for r in valid)
                best_test = max(valid, key=lambda r: r["test_metric"])
                if best_test["test_metric"] > parent["test_metric"]:
                    improve_over_best_test += 1  # the test metric was there and was not used
            else:  # debug: a failed node, one level deeper, never past search.max_debug_depth
                assert parent["is_buggy"] and all(r["debug_depth"] == parent["debug_depth"] + 1 for r in members)
                assert child["debug_depth"] <= cfg.search.max_debug_depth
            seen.update({r["id"]: r for r in members})
    assert improve_over_best_test >= 3
    assert max(r["debug_depth"] for r in seen.values()) == cfg.search.max_debug_depth
    # n_children in the last tree counts every child the rows name.
    tree = Tree.loads((root / f"round_{STEPS}" / "tree.json").read_text())
    for node_id in seen:
        assert tree.get(node_id).n_children == sum(r["parent_id"] == node_id for r in seen.values()), node_id


def test_round_files_metrics_and_ladder_export(tree_run):
    cfg, root, _, scraped = tree_run
    timing = read_jsonl(root / "timing.jsonl")
    metrics = read_jsonl(root / "metrics.jsonl")
    assert [t["step"] for t in timing] == [m["step"] for m in metrics] == list(range(1, STEPS + 1))
    ids: set[str] = set()
    for step, t, m in zip(range(1, STEPS + 1), timing, metrics):
        rs = rows_of(root, step)
        ids |= {r["id"] for r in rs}
        s = summary_of(root, step)
        valid = [r for r in rs if r["status"] == "ok"]
        best = max(valid, key=lambda r: r["val_metric"])
        assert (s["nodes"], s["valid"], s["case"], s["step"]) == (N, len(valid), TASK, step)
        assert s["best_node_id"] == best["id"] and s["honest_test_metric"] == best["test_metric"]
        assert s["status_counts"] == dict(Counter(r["status"] for r in rs))
        assert s["tree_nodes"] == N * step and s["gen_llm_seconds"] > 0 and s["gen_exec_seconds"] > 0
        assert t["phases_s"]["gen"] == pytest.approx(s["gen_llm_seconds"])  # the round's own clocks
        assert t["phases_s"]["score"] == pytest.approx(s["gen_exec_seconds"])
        assert {"adv", "ref", "update_actor", "update_weights", "save_checkpoint"} <= set(t["phases_s"])
        tree = Tree.loads((root / f"round_{step}" / "tree.json").read_text())
        assert tree.rounds == step and {n.id for n in tree.nodes.values()} == ids  # the tree continues
        assert "BUGGY" in next((root / f"round_{step}").glob("*__tree.txt")).read_text()
        assert "output tail:" in next((root / f"round_{step}").glob("*__transcript.md")).read_text()
        # Round diagnostics from the rows, and against the ladder: the best / median VALIDATION
        # metric and the chosen node's test metric minus each rung's (roc_auc: higher is better).
        vals = sorted(r["val_metric"] for r in valid)
        assert m["search_valid"] == len(valid) and m["search_nodes"] == N
        assert m["search_reward_mean"] == pytest.approx(statistics.fmean(r["reward"] for r in rs))
        for status in STATUSES:
            assert m[f"search_status_{status}"] == sum(r["status"] == status for r in rs)
        for rung in ("constant", "oracle"):
            assert m[f"search_best_vs_{rung}"] == pytest.approx(vals[-1] - LADDER[rung]["val_metric"])
            assert m[f"search_median_vs_{rung}"] == pytest.approx(statistics.median(vals) - LADDER[rung]["val_metric"])
            assert m[f"search_honest_vs_{rung}"] == pytest.approx(best["test_metric"] - LADDER[rung]["test_metric"])
        assert not [k for k in m if "broken" in k]  # a failed rung is no yardstick
        # what the learner did, per step: its KL leash, rollout agreement, importance weights
        assert m["kl"] >= 0 and m["ppl_ratio"] == pytest.approx(1.0, abs=1e-4)
        assert m["tis_weight"] == pytest.approx(1.0, abs=1e-4)
    assert metrics[-1]["kl"] > 0  # beta 0.04 (smoke.yaml): the policy moved off the reference
    # The same last round on the trainer's /metrics, labelled by rung.
    last = metrics[-1]
    ladder = {(x.labels["rung"], x.labels["stat"]): x.value for x in scraped["counterpoint_search_vs_ladder"]}
    assert ladder == {(rung, stat): pytest.approx(last[f"search_{stat}_vs_{rung}"])
                      for rung in ("constant", "oracle") for stat in ("best", "median", "honest")}
    selection = {x.labels["stat"]: x.value for x in scraped["counterpoint_search_selection_metric"]}
    assert selection == {"best": pytest.approx(last["search_best_val_metric"]),
                         "median": pytest.approx(last["search_median_val_metric"])}
    assert scraped["counterpoint_step"][0].value == STEPS


def test_resume_in_the_middle_of_a_tree_run(tree_run):
    cfg, root, killed, _ = tree_run
    # What the dead driver left: round 3 archived (rows, metrics line, checkpoint) but never
    # committed; the files alone say so.
    dead = RunDir(killed)
    assert dead.trained_steps() == [1, 2] and dead.untrained_rounds() == [3]
    assert [m["step"] for m in read_jsonl(killed / "metrics.jsonl")] == [1, 2, 3]
    assert (killed / "checkpoints" / "step_3").is_dir() and rows_of(killed, 3)
    # The fresh driver went back to step 2's checkpoint and grew round 3 again on the saved tree:
    # numbering continues, each step is recorded once, and the regenerated round is the one the
    # dead driver grew (same parents, statuses, rewards, advantages, adapter version and tokens).
    run = RunDir(root)
    assert run.trained_steps() == list(range(1, STEPS + 1)) and run.untrained_rounds() == []
    assert [m["step"] for m in run.metrics()] == list(range(1, STEPS + 1))
    before, after = rows_of(killed, 3), rows_of(root, 3)
    keys = ("id", "round", "parent_id", "mode", "status", "reward", "advantage", "adapter_version",
            "response_token_ids", "debug_depth")
    assert [[r[k] for k in keys] for r in after] == [[r[k] for k in keys] for r in before]
    for a, b in zip(after, before):
        assert a["response_logprobs"] == pytest.approx(b["response_logprobs"], abs=1e-5)
    round2_ids = {r["id"] for r in rows_of(root, 2)}
    assert any(r["parent_id"] in round2_ids for r in after)  # it expands a node of the saved tree
    tree3 = Tree.loads((root / "round_3" / "tree.json").read_text())
    assert tree3.rounds == 3 and len(tree3.nodes) == 3 * N
    clocks = ("exec_time", "queue_wait")  # measured, not decided (fields of a node's execution result)

    def decided(tree: Tree) -> list[dict]:
        return [{**n, "result": {k: v for k, v in n["result"].items() if k not in clocks}}
                for n in tree.to_dict()["nodes"]]

    assert decided(tree3) == decided(Tree.loads((killed / "round_3" / "tree.json").read_text()))
    # Nothing the dead driver produced is lost: its round 3, metrics line and checkpoint sit in
    # superseded/attempt_1 exactly as it left them.
    aside = root / "superseded" / "attempt_1"
    assert rows_of(aside, 3) == rows_of(killed, 3)
    assert [m["step"] for m in read_jsonl(aside / "metrics.jsonl")] == [3]
    assert (aside / "checkpoints" / "step_3").is_dir() and not (root / "superseded" / "attempt_2").exists()
    assert json.loads((aside / "superseded.json").read_text())["uncommitted_steps"] == [3]


def test_a_driver_dying_in_the_update_leaves_its_round_on_disk(grader, tmp_path):
    """The round is archived as soon as it is scored: a driver that dies inside the learner's
    update (or the sync, or the save) leaves the executed nodes on disk, marked untrained."""
    client, tasks = grader
    cfg = run_config(tasks, tmp_path, "trainer.steps=2", "trainer.save_every=1", "search.nodes_per_round=4",
                     "search.expansions_per_round=1", "search.carry_tree=false")
    run = RunDir(tmp_path / "dies")
    with pytest.raises(Killed, match="inside the update of step 2"):
        drive(cfg, client, run, learner_cls=DiesInUpdate)
    assert run.trained_steps() == [1] and run.untrained_rounds() == [2]
    rows = rows_of(run.root, 2)
    assert len(rows) == 4 and all(r["step"] == 2 and r["advantage"] is not None for r in rows)
    assert [m["step"] for m in run.metrics()] == [1]  # metrics are written once trained


# ---------------------------------------------------------------- learner options in a tree run
# Two steps of one draft expansion each (a fresh tree per round): f00 ok, f03 ok, a crash, no code.
# The rollout's log-probs are the adapter's own plus SHIFT: ppl_ratio = exp(SHIFT) and every
# importance weight exp(old - rollout) = exp(-SHIFT), clamped at tis_cap.
OPTION_RUNS = {
    "grpo_valid_only": dict(shift=-0.3, sets=(
        "learner.advantage=grpo_valid_only", "learner.invalid_advantage=-0.75", "learner.beta=0.1",
        "learner.entropy_coef=0.01", "learner.entropy_floor=1000", "learner.tis_cap=2.0")),
    "rank_valid_only": dict(shift=-0.3, sets=(
        "learner.advantage=rank_valid_only", "learner.invalid_advantage=-1.0", "learner.beta=0",
        "learner.entropy_coef=0.01", "learner.entropy_floor=0", "learner.tis_cap=1.2")),
    "grpo": dict(shift=0.2, sets=(
        "learner.advantage=grpo", "learner.beta=0", "learner.entropy_coef=0", "learner.tis_cap=null")),
}


@pytest.fixture(scope="module")
def option_runs(grader, tmp_path_factory):
    client, tasks = grader
    out = {}
    for name, spec in OPTION_RUNS.items():
        runs = tmp_path_factory.mktemp(f"opt-{name}")
        cfg = run_config(tasks, runs, "trainer.steps=2", "trainer.save_every=0", "search.nodes_per_round=4",
                         "search.expansions_per_round=1", "search.carry_tree=false", *spec["sets"])
        drive(cfg, client, RunDir(runs / name), shift=spec["shift"])
        out[name] = (cfg, runs / name)
    return out


@pytest.mark.parametrize("name", list(OPTION_RUNS))
def test_learner_options_reach_a_tree_run(option_runs, name):
    cfg, root = option_runs[name]
    lc, shift = cfg.learner, OPTION_RUNS[name]["shift"]
    metrics, timing = read_jsonl(root / "metrics.jsonl"), read_jsonl(root / "timing.jsonl")
    assert [m["step"] for m in metrics] == [t["step"] for t in timing] == [1, 2]
    rows = [r for step in (1, 2) for r in rows_of(root, step)]
    assert [r["status"] for r in rows] == DRAFT_STATUS * 2
    # Advantages as the rows record them.
    if lc.advantage.endswith("_valid_only"):
        assert_valid_only_advantages(rows, lc.advantage, lc.invalid_advantage)
        assert {r["advantage"] for r in rows if r["status"] != "ok"} == {lc.invalid_advantage}
    else:  # plain z-score over all four: the two failures share the sentinel, not a fixed value
        for members in groups_of(rows).values():
            rewards = [r["reward"] for r in members]
            for r in members:
                want = (r["reward"] - statistics.fmean(rewards)) / (statistics.stdev(rewards) + 1e-4)
                assert r["advantage"] == pytest.approx(want, abs=1e-5)
            assert all(r["advantage"] not in (-1.0, -0.75) for r in members)
    for m, t in zip(metrics, timing):
        # Rollout correction: the engine's log-probs are the trainer's + shift.
        assert m["ppl_ratio"] == pytest.approx(math.exp(shift), rel=1e-4)
        assert m["rollout_kl"] == pytest.approx(shift, abs=1e-4)
        cap = lc.tis_cap
        assert m["tis_weight"] == pytest.approx(1.0 if cap is None else min(math.exp(-shift), cap), rel=1e-4)
        # Entropy bonus: on only with a coefficient and the step's entropy under the floor.
        floor = lc.entropy_floor
        on = lc.entropy_coef > 0 and (floor is None or m["entropy"] < floor)
        assert m["entropy_bonus_active"] == float(on)
        # KL leash: a reference pass and a KL only with beta > 0.
        if lc.beta > 0:
            assert t["phases_s"]["ref"] > 0
        else:
            assert m["kl"] == 0.0 and t["phases_s"]["ref"] == 0.0
    if lc.beta > 0:  # step 1 starts from the identity adapter (policy = reference); step 2 has moved
        assert metrics[0]["kl"] == pytest.approx(0.0, abs=1e-6) and metrics[1]["kl"] > 1e-6


def test_option_runs_differ_where_the_options_do(option_runs):
    """The same scripted round under each option set: the learner's records differ as the
    options say (not just each run agreeing with its own formula)."""
    last = {name: read_jsonl(root / "metrics.jsonl")[-1] for name, (_, root) in option_runs.items()}
    assert last["grpo_valid_only"]["tis_weight"] > 1.2 == pytest.approx(last["rank_valid_only"]["tis_weight"])
    assert [last[n]["entropy_bonus_active"] for n in OPTION_RUNS] == [1.0, 0.0, 0.0]
    assert last["grpo_valid_only"]["kl"] > 0 == last["rank_valid_only"]["kl"] == last["grpo"]["kl"]
    adv = {name: [r["advantage"] for r in rows_of(root, 1)] for name, (_, root) in option_runs.items()}
    assert len({tuple(a) for a in adv.values()}) == 3, adv
