"""A real `counterpoint train` on a real multi-node Ray cluster on this machine: placement by the
run's own config, and no shared filesystem.

The cluster (module-scoped, shared by the tests here) is four `ray start --block` nodes this
module owns (it stops them by pid; never `ray stop`, which would stop other engineers' clusters):

- the head (the driver joins it: the learner's coordinator, the adapter registry, Serve's and
  Ray Train's controllers run here, next to the run directory);
- a rollout node (custom resource `rollout_slot`, label counterpoint-role=rollout);
- a grader node (`grader_slot`, counterpoint-role=grader);
- a learner node (`learner_slot`, counterpoint-role=learner) that CANNOT SEE THE RUN DIRECTORY:
  its `ray start` runs under `unshare -m` (a mount namespace of its own; as root this needs no
  more than CAP_SYS_ADMIN, which this machine's root has) with a tmpfs mounted over the runs
  directory first. Its raylet and every worker it forks inherit that namespace, so anything the
  learner workers write "into the run directory" lands in a private tmpfs that disappears with
  the node, and anything they read from it is absent. The fixture proves the mask holds: a file
  the test writes into the runs dir is not visible through `nsenter -m` into that node.

The nodes' --temp-dir is the module's own, so the cluster's address file never replaces
/tmp/ray/ray_current_cluster (another engineer's `ray.init("auto")` would join this cluster).

Every wait is bounded (BUDGET_S for the module's runs).
"""

from __future__ import annotations

import contextlib
import json
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import pytest
import yaml

from cliharness import CLI, REPO
from rayharness import ray_env, start_head, start_node, stop_nodes

pytestmark = [pytest.mark.slow, pytest.mark.subprocess]

ROLES = {  # node -> (CPUs, custom resources): each part's section asks for its node's resource
    "rollout": (1, {"rollout_slot": 1}),
    "grader": (1, {"grader_slot": 2}),
    "learner": (1, {"learner_slot": 1}),
}
PLACED = {
    "rollout": {"resources": {"rollout_slot": 1}, "label_selector": {"counterpoint-role": "rollout"}},
    # vowel-share: a dense reward the tiny model earns, so rewards differ within groups and every
    # update moves the adapter (voice-leading gives it 0 everywhere: an adapter comparison after a
    # fault would then prove nothing). Short prompts: the tiny model's speed, not the benches'.
    "grader": {"resources": {"grader_slot": 1}, "label_selector": {"counterpoint-role": "grader"},
               "task": "vowel-share", "vowel_share": {"prompt_words": 16}},
    "learner": {"resources_per_worker": {"learner_slot": 1}, "label_selector": {"counterpoint-role": "learner"}},
}
GRADER_APP = "grader"  # config/grader.py app_name's default
BUDGET_S = 600.0  # the module's training runs together
NODE_START_S = 240.0


@dataclass
class Cluster:
    address: str
    runs: Path
    base: Path
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)
    node_of_role: dict[str, str] = field(default_factory=dict)  # role -> node id

    def state(self) -> dict:
        """Ray's own view, read by a separate driver: nodes (id, alive, labels) and every actor
        of the cluster, dead ones included (class, node, pid, state)."""
        code = (
            "import json, ray\n"
            "from ray._private.state import actors\n"
            f"ray.init(address={self.address!r}, log_to_driver=False)\n"
            "nodes = [{'id': n['NodeID'], 'alive': n['Alive'], 'labels': n.get('Labels') or {}} for n in ray.nodes()]\n"
            "acts = [{'cls': a['ActorClassName'], 'node': a['Address']['NodeID'], 'pid': a['Pid'], 'state': a['State']}\n"
            "        for a in actors().values()]\n"
            "print('STATE' + json.dumps({'nodes': nodes, 'actors': acts}))\n"
        )
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO,
                             env=ray_env())
        line = [ln for ln in out.stdout.splitlines() if ln.startswith("STATE")]
        assert line, f"could not read the cluster's state:\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}"
        return json.loads(line[-1][len("STATE"):])


def _kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL a driver that is still running, and its children (a test that failed midway)."""
    if proc.poll() is None:
        with contextlib.suppress(psutil.Error):
            for p in [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]:
                p.kill()


def _completed(proc: subprocess.Popen, until: float, log: Path, run: Path) -> dict:
    """Wait for the driver to finish the run (exit 0); its receipt, status completed."""
    code = proc.wait(timeout=max(1.0, until - time.monotonic()))
    assert code == 0, log.read_text()[-6000:]
    receipt = json.loads((run / "run.json").read_text())
    assert receipt["status"] == "completed"
    return receipt


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    # Short: Ray's Unix socket paths live under the temp dir (108-byte limit).
    base = Path(tempfile.mkdtemp(prefix="cpmn-", dir="/tmp"))
    runs = tmp_path_factory.mktemp("multinode") / "runs"
    runs.mkdir()
    c = Cluster(address="", runs=runs, base=base)
    try:
        deadline = time.monotonic() + NODE_START_S
        c.procs["head"], c.address = start_head(base, ["--num-cpus=1", "--labels=counterpoint-role=head"], NODE_START_S)
        for role, (cpus, resources) in ROLES.items():
            prefix: list[str] = []
            if role == "learner":  # its own mount namespace, the runs dir masked by a tmpfs
                prefix = ["unshare", "-m", "--propagation", "private", "sh", "-c",
                          f'mount -t tmpfs cp-masked "{runs}" && exec "$0" "$@"']
            # One at a time: a raylet that cannot register within Ray's fixed 30 s fails its
            # `ray start`, and three registering at once on this 2-core machine did.
            c.procs[role] = start_node(base, role, [
                f"--address={c.address}", f"--num-cpus={cpus}", f"--resources={json.dumps(resources)}",
                f"--labels=counterpoint-role={role}"], prefix)
            while "Ray runtime started" not in (base / f"node-{role}.log").read_text():
                assert c.procs[role].poll() is None, f"node {role} exited:\n" + (base / f"node-{role}.log").read_text()[-3000:]
                assert time.monotonic() < deadline, f"node {role} did not start within {NODE_START_S:.0f} s"
                time.sleep(0.5)
        while time.monotonic() < deadline:
            for name, proc in c.procs.items():
                assert proc.poll() is None, f"node {name} exited:\n" + (base / f"node-{name}.log").read_text()[-3000:]
            state = c.state()
            alive = {n["labels"].get("counterpoint-role"): n["id"] for n in state["nodes"] if n["alive"]}
            if set(alive) >= {"head", *ROLES}:
                c.node_of_role = alive
                break
            time.sleep(1.0)
        else:
            raise AssertionError(f"the cluster's nodes did not all join within {NODE_START_S:.0f} s")
        # The mask holds: the learner node does not see what the head's side writes into runs/.
        probe = runs / "visible-to-the-head-only"
        probe.write_text("x")
        seen = subprocess.run(["nsenter", "-t", str(c.procs["learner"].pid), "-m", "ls", "-A", str(runs)],
                              capture_output=True, text=True, timeout=30)
        assert seen.returncode == 0 and "visible-to-the-head-only" not in seen.stdout, seen
        probe.unlink()
        yield c
    finally:
        stop_nodes([c.procs[name] for name in ("learner", "grader", "rollout", "head") if name in c.procs])
        shutil.rmtree(base, ignore_errors=True)


def _config(c: Cluster, name: str, **sections) -> Path:
    """configs/smoke.yaml, joined to the cluster, each part placed on its node."""
    cfg = yaml.safe_load((REPO / "configs" / "smoke.yaml").read_text())
    cfg.setdefault("trainer", {}).update(ray_address=c.address, runs_dir=str(c.runs))
    for section, fields in {**PLACED, **sections}.items():
        cfg.setdefault(section, {}).update(fields)
    path = c.base / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _train(c: Cluster, name: str, *extra: str, timeout: float = BUDGET_S) -> subprocess.CompletedProcess:
    args = ["train", "--config", str(_config(c, name)), "--run-name", name, *extra]
    out = subprocess.run(CLI + args, cwd=REPO, capture_output=True, text=True, timeout=timeout, env=ray_env())
    (c.base / f"{name}.log").write_text(out.stdout + out.stderr)
    return out


@pytest.fixture(scope="module")
def placed(cluster: Cluster) -> Path:
    """An uninterrupted smoke run on the cluster, each part on its node (what the learner fault
    run is compared with)."""
    t0 = time.monotonic()
    out = _train(cluster, "placed")
    assert out.returncode == 0, (out.stdout + out.stderr)[-6000:]
    print(f"placed run: {time.monotonic() - t0:.0f} s")
    _assert_every_update_moved(cluster.runs / "placed")
    return cluster.runs / "placed"


def _assert_every_update_moved(run: Path) -> None:
    """Rewards differed within some group of every step and every update's gradient was
    non-zero: an adapter compared after a fault has moved at every step."""
    for m in (json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()):
        assert m["frac_reward_zero_std"] < 1 and m["grad_norm"] > 0, m


def test_each_part_on_its_node_and_every_artifact_in_the_drivers_run_dir(cluster: Cluster, placed: Path):
    run = placed
    receipt = json.loads((run / "run.json").read_text())
    assert receipt["status"] == "completed"

    # 1. Placement, as the driver recorded it and as Ray itself has it.
    role_of = {nid: role for role, nid in cluster.node_of_role.items()}
    parts = receipt["placement"]["parts"]
    by_part: dict[str, set[str]] = {}
    for p in parts:
        by_part.setdefault(p["part"], set()).add(role_of.get(p["node_id"], p["node_id"]))
    assert by_part == {"rollout": {"rollout"}, "grader": {"grader"}, "learner": {"learner"}}, parts
    assert sum(p["part"] == "grader" for p in parts) == 2  # smoke's two grader replicas, both placed
    actors = cluster.state()["actors"]
    recorded_pids = {p["pid"] for p in parts}

    def nodes_of(prefix: str) -> set[str]:
        return {role_of.get(a["node"], a["node"]) for a in actors
                if a["cls"].startswith(prefix) and a["pid"] in recorded_pids}

    assert nodes_of("ServeReplica:counterpoint-rollout:") == {"rollout"}, actors
    assert nodes_of(f"ServeReplica:{GRADER_APP}:") == {"grader"}, actors
    assert nodes_of("RayTrainWorker") == {"learner"}, actors

    # 2. No shared filesystem: the learner node could not see runs/, yet every adapter and
    # checkpoint it produced is in the driver's run directory, complete.
    steps = yaml.safe_load((REPO / "configs" / "smoke.yaml").read_text())["trainer"]["steps"]
    for name in ["init", *(f"step_{s}" for s in range(1, steps + 1))]:
        assert (run / "adapters" / name / "adapter_model.safetensors").is_file(), name
        assert (run / "adapters" / name / "adapter_config.json").is_file(), name
    for s in range(1, steps + 1):
        ckpt = run / "checkpoints" / f"step_{s}"
        assert (ckpt / "state.json").is_file() and (ckpt / "rng_rank0.pt").is_file(), sorted(ckpt.iterdir())
        assert json.loads((ckpt / "state.json").read_text())["step"] == s
    timing = [json.loads(x) for x in (run / "timing.jsonl").read_text().splitlines()]
    assert [t["step"] for t in timing] == list(range(1, steps + 1))
    assert len((run / "metrics.jsonl").read_text().splitlines()) >= steps
    for s in range(1, steps + 1):
        assert list((run / f"round_{s}").glob("*.jsonl")), f"round {s} not recorded"
    assert not list(run.rglob(".*.partial-*")), "a half-written artifact was left"
    # The learner node's own view of runs/ stayed empty of the run: the files above came through
    # the driver, not through a disk both could see.
    seen = subprocess.run(["nsenter", "-t", str(cluster.procs["learner"].pid), "-m", "ls", "-A", str(cluster.runs)],
                          capture_output=True, text=True, timeout=30)
    assert "placed" not in seen.stdout.split(), seen.stdout


# ------------------------------------------------------------------ faults
def _replicas(node: subprocess.Popen, app: str) -> list[psutil.Process]:
    """The live Serve replica workers of ``app`` on one node (Ray titles them
    ``ray::ServeReplica:<app>:...``): descendants of that node's `ray start`, never another's."""
    out = []
    with contextlib.suppress(psutil.Error):
        for p in psutil.Process(node.pid).children(recursive=True):
            with contextlib.suppress(psutil.Error):
                if " ".join(p.cmdline()).startswith(f"ray::ServeReplica:{app}:") and p.status() != psutil.STATUS_ZOMBIE:
                    out.append(p)
    return out


def _cpu(p: psutil.Process) -> float:
    t = p.cpu_times()
    return t.user + t.system


def _wait_busy(p: psutil.Process, within_s: float, burst_s: float = 0.025, window_s: float = 0.05) -> bool:
    """Whether ``p`` starts working (``burst_s`` of CPU within ``window_s``: an idle replica
    uses next to none) before ``within_s`` runs out."""
    deadline = time.monotonic() + within_s
    last_t, last_cpu = time.monotonic(), _cpu(p)
    while time.monotonic() < deadline:
        time.sleep(window_s)
        now, cpu = time.monotonic(), _cpu(p)
        if cpu - last_cpu >= burst_s * (now - last_t) / window_s:
            return True
        last_t, last_cpu = now, cpu
    return False


def _wait_idle(p: psutil.Process, quiet_s: float, within_s: float) -> bool:
    """Whether ``p`` stays (nearly) idle for ``quiet_s`` before ``within_s`` runs out."""
    deadline = time.monotonic() + within_s
    quiet_since, last = time.monotonic(), _cpu(p)
    while time.monotonic() < deadline:
        time.sleep(0.1)
        cpu = _cpu(p)
        if cpu - last > 0.02:
            quiet_since = time.monotonic()
        last = cpu
        if time.monotonic() - quiet_since >= quiet_s:
            return True
    return False


def _trained(run: Path) -> list[int]:
    path = run / "timing.jsonl"
    return [json.loads(x)["step"] for x in path.read_text().splitlines()] if path.exists() else []


def _wait(predicate, until: float, proc: subprocess.Popen, what: str, log: Path, poll: float = 0.2):
    while time.monotonic() < until:
        got = predicate()
        if got:
            return got
        assert proc.poll() is None, f"train exited ({proc.returncode}) while waiting for {what}:\n" + log.read_text()[-6000:]
        time.sleep(poll)
    raise AssertionError(f"timed out waiting for {what}:\n" + log.read_text()[-4000:])


def _recoveries(run: Path) -> list[dict]:
    with contextlib.suppress(OSError, ValueError):
        return json.loads((run / "run.json").read_text()).get("recoveries") or []
    return []


FAULT_STEPS = 6


def test_rollout_replica_and_grader_replica_killed_mid_call_inside_a_run(cluster: Cluster, placed: Path):
    """One run, two faults, each on its own node:

    - the rollout replica is frozen (SIGSTOP) while it generates step k (the first busy moment
      right after step k-1's timing line: the step's sync is over, so the work in flight is
      generation). It is alive to Ray and to Serve; its reports stop, so once
      rollout.replica_liveness_s has passed the driver kills it (config/liveness.py), Serve starts
      a replacement on the rollout node, which loads the latest adapter before it takes traffic,
      and the driver's generate call is retried and answered.
    - both grader replicas are frozen (SIGSTOP: replicas that hang) when step j's generation
      starts, so step j's ScoreBatch goes to frozen replicas. They leave the driver's pings
      unanswered, and once grader.replica_liveness_s=5 has passed the driver kills them
      (graders/autoscale.py ReplicaPinger); nothing else does: the test only waits, and Serve's
      own health check would take about a minute. The call held on them fails and is retried by
      the grader client (grader.max_retries=6), answered by the replicas Serve starts instead.
      (A replica killed while it merely holds the request queued is invisible to the client:
      Serve's router re-routes a request no replica accepted; the entry then names the killed
      replicas without errors.)

    Proof that each recovery path ran: run.json's `recoveries` holds a rollout entry for step k
    (a `generate` retried, every live replica then at the adapter version it was asked for; the
    frozen replica named, found quiet within a poll of rollout.replica_liveness_s, and the outage
    counted from its last report) and
    a grader entry for step j naming both frozen replicas, found quiet within a poll of
    grader.replica_liveness_s, the outage counted from their last answer, and one for the spell
    the app ran no replica (its outage, with a console line when it began); /metrics counts them in
    counterpoint_recoveries_total{part}; no sample of any step carries another adapter version
    than the one the step asked for; the replaced replicas have new pids. Nothing was lost: the
    retried calls sampled and scored what the first attempts would have, so the steps this run
    shares with the uninterrupted `placed` run (the same config but for the fault settings and
    its length) have the same rows and the same adapter."""
    name = "faults"
    run = cluster.runs / name
    log = cluster.base / f"{name}.log"
    until = time.monotonic() + BUDGET_S
    proc = subprocess.Popen(CLI + ["train", "--config", str(_config(cluster, name)), "--run-name", name,
                                   "--set", f"trainer.steps={FAULT_STEPS}", "--set", "grader.replica_liveness_s=5",
                                   "--set", "grader.max_retries=6"],
                            cwd=REPO, stdout=open(log, "w"), stderr=subprocess.STDOUT, env=ray_env(),
                            start_new_session=True)
    try:
        # rollout: killed in step k's generation
        _wait(lambda: len(_trained(run)) >= 1, until, proc, "step 1 trained", log)
        (replica,) = _replicas(cluster.procs["rollout"], "counterpoint-rollout")
        k = len(_trained(run)) + 1
        assert _wait_busy(replica, within_s=60), "the rollout replica never started generating"
        assert len(_trained(run)) == k - 1, "the step moved on before the freeze"
        replica.send_signal(signal.SIGSTOP)
        frozen_at = time.monotonic()
        rollout_killed = replica.pid
        try:  # the driver kills it; nothing else does
            _wait(lambda: not psutil.pid_exists(replica.pid) or replica.status() == psutil.STATUS_ZOMBIE,
                  until, proc, "the driver to kill the frozen rollout replica", log)
        finally:
            with contextlib.suppress(psutil.Error):
                replica.kill()
        print(f"frozen rollout replica gone after {time.monotonic() - frozen_at:.1f} s")
        _wait(lambda: any(r["part"] == "rollout" for r in _recoveries(run)), until, proc,
              "the rollout recovery entry", log)

        # grader: killed mid-ScoreBatch of step j
        done = _wait(lambda: _trained(run)[-1:] if _trained(run) and _trained(run)[-1] >= k else None,
                     until, proc, f"step {k} trained", log)
        j = done[0] + 1
        assert j <= FAULT_STEPS, "no step left for the grader fault"
        graders = _replicas(cluster.procs["grader"], GRADER_APP)
        assert len(graders) == 2, graders
        (replica,) = _replicas(cluster.procs["rollout"], "counterpoint-rollout")
        assert replica.pid != rollout_killed  # Serve's replacement, on the rollout node
        for g in graders:
            g.send_signal(signal.SIGSTOP)
        frozen_at = time.monotonic()
        try:
            assert _wait_busy(replica, within_s=60), f"step {j}'s generation never started"
            assert _wait_idle(replica, quiet_s=1.0, within_s=120), f"step {j}'s generation never ended"
            assert len(_trained(run)) == j - 1  # its ScoreBatch waits on the frozen replicas
            # the driver kills them; nothing else does
            _wait(lambda: all(not psutil.pid_exists(g.pid) or g.status() == psutil.STATUS_ZOMBIE for g in graders),
                  until, proc, "the driver to kill the frozen grader replicas", log)
        finally:
            for g in graders:
                with contextlib.suppress(psutil.Error):
                    g.kill()
        print(f"frozen grader replicas gone after {time.monotonic() - frozen_at:.1f} s")
        grader_killed = {g.pid for g in graders}
        entry = _wait(lambda: [r for r in _recoveries(run) if r["part"] == "grader"], until, proc,
                      "the grader recovery entry", log)
        replaced = {p.pid for p in _replicas(cluster.procs["grader"], GRADER_APP)} - grader_killed
        assert replaced, "no new grader replica on the grader node answered the retry"
        endpoint = json.loads((run / "run.json").read_text())["metrics_endpoint"]["trainer"]
        import urllib.request

        with urllib.request.urlopen(f"http://{endpoint}/metrics", timeout=10) as resp:
            scraped = resp.read().decode()
        receipt = _completed(proc, until, log, run)
    finally:
        _kill_tree(proc)

    recs = receipt["recoveries"]
    rollout = [r for r in recs if r["part"] == "rollout"]
    assert [r["step"] for r in rollout] == [k], recs
    assert rollout[0]["what"].startswith(f"generate (step {k}, adapter v"), rollout[0]
    asked = int(rollout[0]["what"].split("adapter v")[1].split(")")[0])
    versions = rollout[0]["details"]["replica_versions"]
    assert versions and set(versions.values()) == {asked}, versions  # the replacement caught up
    assert rollout[0]["what"].endswith("made no progress and was replaced"), rollout[0]
    (quiet,) = rollout[0]["details"]["replaced_quiet"]
    liveness_s = receipt["config"]["rollout"]["replica_liveness_s"]
    # found at the first poll (1 s) after its reports (every heartbeat_s) stopped for liveness_s
    assert liveness_s < quiet["quiet_s"] <= liveness_s + 5.0, quiet
    assert quiet["node_id"] == cluster.node_of_role["rollout"] and "no report for" in quiet["why"], quiet
    assert rollout[0]["outage_s"] > quiet["quiet_s"] and rollout[0]["outage_s"] > rollout[0]["seconds"], rollout[0]
    assert "made no progress" in log.read_text() and "killing it" in log.read_text()  # on the console
    _assert_every_update_moved(run)
    grader = [r for r in recs if r["part"] == "grader"]
    (held,) = [r for r in grader if r["details"].get("replaced_quiet")]
    assert held["step"] == j and held["what"].endswith("made no progress and was replaced"), held
    grader_liveness_s = receipt["config"]["grader"]["replica_liveness_s"]
    assert len(held["details"]["replaced_quiet"]) == 2, held  # both frozen replicas, named
    for q in held["details"]["replaced_quiet"]:
        # found within a poll or two (grader.replica_poll_s=1) of its unanswered ping's deadline
        assert grader_liveness_s <= q["quiet_s"] <= grader_liveness_s + 4.0, q
        assert q["replica_id"].startswith(f"{GRADER_APP}#") and "grader.replica_liveness_s=5" in q["why"], q
    assert held["outage_s"] >= max(q["quiet_s"] for q in held["details"]["replaced_quiet"]), held
    assert "grader replica" in log.read_text() and "made no progress" in log.read_text()  # on the console
    # Both replicas were killed: the app ran none until Serve's new ones did, an outage of its
    # own (recorded at the first ScoreBatch, or the run's end, after a read saw one running again).
    (empty,) = [r for r in grader if r["what"].startswith("the grader app had no running replica for ")]
    assert empty["step"] >= j and empty["outcome"] == "recovered" and 0 < empty["outage_s"] < 120, empty
    assert len(grader) == 2, recs
    assert "the grader app has no running replica" in log.read_text()  # the console line
    assert 'counterpoint_recoveries_total{part="rollout"} 1.0' in scraped, scraped[-3000:]
    # scraped once the retry was recorded; the outage entry may come later
    assert re.search(r'counterpoint_recoveries_total\{part="grader"\} [12]\.0', scraped), scraped[-3000:]
    # no sample carries a stale version: every row of step s was sampled with the version the
    # step asked for (metrics.jsonl: the version live after step s-1; step 1: the init's)
    metrics = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    live_after = {m["step"]: int(m["adapter_version"]) for m in metrics}
    assert sorted(live_after) == list(range(1, FAULT_STEPS + 1))
    for s in range(2, FAULT_STEPS + 1):
        rows = [json.loads(x) for f in (run / f"round_{s}").glob("*__*.jsonl") if "__summary" not in f.name
                for x in f.read_text().splitlines()]
        assert rows and {r["adapter_version"] for r in rows} == {live_after[s - 1]}, (s, {r["adapter_version"] for r in rows})
    assert live_after[k - 1] == asked
    shared = len((placed / "metrics.jsonl").read_text().splitlines())  # smoke's steps, FAULT_STEPS > shared >= k
    assert k <= shared < FAULT_STEPS
    for s in range(1, shared + 1):
        assert [(r["prompt_messages"], r["response_token_ids"], r["reward"]) for r in _rows(run, s)] == [
            (r["prompt_messages"], r["response_token_ids"], r["reward"]) for r in _rows(placed, s)], f"step {s} differs"
    assert (run / "adapters" / f"step_{shared}" / "adapter_model.safetensors").read_bytes() == (
        placed / "adapters" / f"step_{shared}" / "adapter_model.safetensors").read_bytes(), "the faults changed training"


def _rows(run: Path, step: int) -> list[dict]:
    return [json.loads(x) for f in sorted((run / f"round_{step}").glob("*__*.jsonl")) if "__summary" not in f.name
            for x in f.read_text().splitlines()]


def test_learner_worker_killed_then_driver_killed_and_resumed_equals_the_uninterrupted_run(cluster: Cluster,
                                                                                          placed: Path):
    """Three faults of one run, then the uninterrupted `placed` run of the same config to compare with.

    - The learner's Ray Train worker (on the learner node) is SIGKILLed while it trains step 2
      (the first busy moment after step 1's timing line: step 2's old_log_prob/ref/update). With
      no `--resume`, the driver restores the learner from checkpoints/step_1 (smoke saves every
      step) and sends step 2's batch again.
    - Then the driver itself (only it: the cluster's nodes and Serve's detached controller stay)
      is SIGKILLed once step 2 is trained; `counterpoint train --resume` on the same cluster
      finishes the run.
    - In that resumed attempt the new worker is frozen (SIGSTOP) while it trains step 3: alive to
      the OS and to Ray, silent to the driver. Once it has made no progress for the stall deadline
      (liveness.floor_s=15 here: 4 x the slowest micro-batch interval is below it) the driver
      kills it, says so on the console, and restores the learner from checkpoints/step_2.

    Proof that every recovery ran: run.json's `recoveries` holds the first attempt's learner entry
    for step 2 (restored from checkpoint step 1; the worker pid changed), a `driver` entry of
    attempt 2 naming the checkpoint it resumed from, and attempt 2's learner entry for step 3
    (kind stalled: found quiet past its recorded deadline, within a poll and a report of it; the
    outage counted from the last progress); `previous_attempts` holds the killed attempt; every
    step is trained exactly once. Proof that nothing was lost: the run equals `placed`: the same
    prompts and completions in the same order, the same LR per step, the same final adapter, byte
    for byte."""
    name = "learner-fault"
    run = cluster.runs / name
    log = cluster.base / f"{name}.log"
    until = time.monotonic() + BUDGET_S
    proc = subprocess.Popen(CLI + ["train", "--config", str(_config(cluster, name)), "--run-name", name,
                                   "--set", "liveness.floor_s=15", "--set", "liveness.notice_s=5"],
                            cwd=REPO, stdout=open(log, "w"), stderr=subprocess.STDOUT, env=ray_env(),
                            start_new_session=True)

    def workers() -> list[psutil.Process]:
        out = []
        with contextlib.suppress(psutil.Error):
            for p in psutil.Process(cluster.procs["learner"].pid).children(recursive=True):
                with contextlib.suppress(psutil.Error):
                    if " ".join(p.cmdline()).startswith("ray::RayTrainWorker") and p.status() != psutil.STATUS_ZOMBIE:
                        out.append(p)
        return out

    try:
        _wait(lambda: len(_trained(run)) >= 1, until, proc, "step 1 trained", log)
        (worker,) = workers()
        assert _wait_busy(worker, within_s=120), "the learner worker never started on step 2"
        assert _trained(run) == [1]
        worker.kill()
        _wait(lambda: len(_trained(run)) >= 2, until, proc, "step 2 trained after the learner's restore", log,
              poll=0.05)
        proc.kill()
        proc.wait(timeout=60)
    finally:
        _kill_tree(proc)
    assert "learner lost at step 2" in log.read_text()
    steps = yaml.safe_load((REPO / "configs" / "smoke.yaml").read_text())["trainer"]["steps"]
    killed_at = _trained(run)
    assert killed_at == [1, 2] and killed_at[-1] < steps, f"the driver was not killed between steps 2 and 3: {killed_at}"
    resume_log = cluster.base / f"{name}.resume.log"
    earlier = {w.pid for w in workers()}  # the killed attempt's, if Ray has not reaped them yet
    proc = subprocess.Popen(CLI + ["train", "--resume", str(run)], cwd=REPO, stdout=open(resume_log, "w"),
                            stderr=subprocess.STDOUT, env=ray_env(), start_new_session=True)
    frozen = None
    try:
        # the resumed attempt's worker, once its Init is over (the console's "learner" start-up
        # stage line) and it works on step 3
        _wait(lambda: re.search(r"^  learner\s+[0-9.]+ s$", resume_log.read_text(), re.M), until, proc,
              "the resumed attempt's learner to start", resume_log)
        (worker,) = [w for w in workers() if w.pid not in earlier]
        assert _wait_busy(worker, within_s=180), "the resumed learner worker never started on step 3"
        assert _trained(run) == [1, 2]
        worker.send_signal(signal.SIGSTOP)
        frozen = worker
        _wait(lambda: not psutil.pid_exists(worker.pid) or worker.status() == psutil.STATUS_ZOMBIE, until, proc,
              "the driver to kill the frozen learner worker", resume_log)
        code = proc.wait(timeout=max(1.0, until - time.monotonic()))
    finally:
        if frozen is not None:
            with contextlib.suppress(psutil.Error):
                frozen.kill()
        _kill_tree(proc)
    text = resume_log.read_text()
    assert code == 0, text[-6000:]
    assert "has made no progress in 'step'" in text and "learner lost at step 3 (learner rank [0] made no progress" in text, text[-6000:]  # both on the console
    receipt = json.loads((run / "run.json").read_text())
    assert receipt["status"] == "completed"

    rec, stalled = [r for r in receipt["recoveries"] if r["part"] == "learner"]
    assert stalled["attempt"] == 2 and stalled["step"] == 3 and stalled["outcome"] == "recovered", stalled
    assert "learner lost (stalled: " in stalled["what"] and stalled["details"]["restored_from_step"] == 2, stalled
    quiet, deadline = stalled["details"]["quiet_before_seen_s"], stalled["details"]["stall_deadline_s"]
    assert deadline == 15.0, stalled  # the floor: the measured intervals x 4 stay below it
    # not before its deadline, and within a driver poll (1 s) and a worker report (0.25 s) of it
    assert deadline < quiet <= deadline + 3.0, stalled
    assert stalled["outage_s"] == pytest.approx(quiet + stalled["seconds"], abs=0.01), stalled
    # run.json's placement names the restored worker, not the frozen one it replaced
    (rank0,) = [p for p in receipt["placement"]["parts"] if p["part"] == "learner"]
    assert rank0["pid"] != frozen.pid and rank0["node_id"] == cluster.node_of_role["learner"], rank0
    assert rec["attempt"] == 1 and rec["step"] == 2 and rec["outcome"] == "recovered", rec
    assert rec["details"]["restored_from_step"] == 1, rec
    # The live v2 died with the old rank 0; the restored learner's export of it has the published
    # checksum, so the registry serves it again (a replica starting now could fetch it).
    assert rec["details"]["adapter_reexported"] is True, rec
    assert "restored from checkpoint step 1" in rec["what"], rec
    # killed: its run.json still said running, and its pid is gone
    assert [a["status"] for a in receipt["previous_attempts"]] == ["died"]
    (rec,) = [r for r in receipt["recoveries"] if r["part"] == "driver"]
    resumed_from = receipt["resumed_from_step"]
    assert rec["attempt"] == 2 and rec["step"] == resumed_from + 1, rec
    assert rec["what"].startswith("previous attempt died") and f"checkpoint step {resumed_from}" in rec["what"], rec

    assert _trained(run) == list(range(1, steps + 1))
    _assert_every_update_moved(run)
    mine = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    theirs = [json.loads(x) for x in (placed / "metrics.jsonl").read_text().splitlines()]
    assert [m["learning_rate"] for m in mine] == [m["learning_rate"] for m in theirs]
    for s in range(1, steps + 1):
        assert [(r["prompt_messages"], r["response_token_ids"]) for r in _rows(run, s)] == [
            (r["prompt_messages"], r["response_token_ids"]) for r in _rows(placed, s)], f"step {s} differs"
    for name_ in ("adapter_model.safetensors",):
        assert (run / "adapters" / f"step_{steps}" / name_).read_bytes() == (
            placed / "adapters" / f"step_{steps}" / name_).read_bytes(), "the restored run trained otherwise"


def test_rollout_node_removed_stops_in_one_line_and_resume_continues(cluster: Cluster):
    """The rollout node is removed (its `ray start`, raylet and every worker of it SIGKILLed)
    once step 1 is trained. No other node offers `rollout_slot`, so Serve cannot place the
    replica again: step 2's generate calls time out (rollout.request_timeout_s=20,
    max_retries=1) and the run stops with one line naming the node, that it held the rollout
    replica, and the command that continues it. A new rollout node joins; that command finishes
    the run. Proof: the error line, a `node` entry (outcome stopped) in run.json, the resumed
    attempt's `driver` entry, every step trained once. Last in the module: it replaces a node."""
    name = "node-loss"
    run = cluster.runs / name
    log = cluster.base / f"{name}.log"
    until = time.monotonic() + BUDGET_S
    proc = subprocess.Popen(CLI + ["train", "--config", str(_config(cluster, name)), "--run-name", name,
                                   "--set", "rollout.request_timeout_s=20", "--set", "rollout.max_retries=1"],
                            cwd=REPO, stdout=open(log, "w"), stderr=subprocess.STDOUT, env=ray_env(),
                            start_new_session=True)
    try:
        _wait(lambda: len(_trained(run)) >= 1, until, proc, "step 1 trained", log)
        node = cluster.procs["rollout"]
        family = [psutil.Process(node.pid), *psutil.Process(node.pid).children(recursive=True)]
        for p in family:
            with contextlib.suppress(psutil.Error):
                p.kill()
        node.wait(timeout=30)
        code = proc.wait(timeout=max(1.0, until - time.monotonic()))
    finally:
        if proc.poll() is None:
            proc.kill()
    text = log.read_text()
    assert code != 0, text[-4000:]
    (line,) = [x for x in text.splitlines() if x.startswith("error: ")]
    lost = cluster.node_of_role["rollout"]
    assert f"node {lost[:12]} (counterpoint-role=rollout) is gone, it held rollout replica" in line, line
    receipt = json.loads((run / "run.json").read_text())
    assert receipt["status"] == "failed"  # run.json has the whole line (the console cuts it at 200)
    assert receipt["error"].startswith("NodeLost: node ") and receipt["error"].endswith(
        f"counterpoint train --resume {run}"), receipt["error"]
    (stop,) = [r for r in receipt["recoveries"] if r["part"] == "node"]
    assert stop["outcome"] == "stopped" and stop["step"] == 2, stop

    cpus, resources = ROLES["rollout"]
    cluster.procs["rollout"] = start_node(cluster.base, "rollout-2", [
        f"--address={cluster.address}", f"--num-cpus={cpus}", f"--resources={json.dumps(resources)}",
        "--labels=counterpoint-role=rollout"])
    while "Ray runtime started" not in (cluster.base / "node-rollout-2.log").read_text():
        assert cluster.procs["rollout"].poll() is None and time.monotonic() < until
        time.sleep(0.5)
    out = subprocess.run(CLI + ["train", "--resume", str(run)], cwd=REPO, capture_output=True, text=True,
                         timeout=max(1.0, until - time.monotonic()), env=ray_env())
    (cluster.base / f"{name}.resume.log").write_text(out.stdout + out.stderr)
    assert out.returncode == 0, (out.stdout + out.stderr)[-6000:]
    receipt = json.loads((run / "run.json").read_text())
    assert receipt["status"] == "completed"
    (rec,) = [r for r in receipt["recoveries"] if r["part"] == "driver"]
    assert rec["attempt"] == 2 and "previous attempt failed (NodeLost: node" in rec["what"], rec
    steps = yaml.safe_load((REPO / "configs" / "smoke.yaml").read_text())["trainer"]["steps"]
    assert _trained(run) == list(range(1, steps + 1))
