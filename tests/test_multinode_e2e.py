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
import os
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

pytestmark = pytest.mark.slow

RAY = str(Path(sys.executable).with_name("ray"))
ROLES = {  # node -> (CPUs, custom resources): each part's section asks for its node's resource
    "rollout": (1, {"rollout_slot": 1}),
    "grader": (1, {"grader_slot": 2}),
    "learner": (1, {"learner_slot": 1}),
}
PLACED = {
    "rollout": {"resources": {"rollout_slot": 1}, "label_selector": {"counterpoint-role": "rollout"}},
    "grader": {"resources": {"grader_slot": 1}, "label_selector": {"counterpoint-role": "grader"}},
    "learner": {"resources_per_worker": {"learner_slot": 1}, "label_selector": {"counterpoint-role": "learner"}},
}
GRADER_APP = "grader"  # config/grader.py app_name's default
BUDGET_S = 600.0  # the module's training runs together
NODE_START_S = 240.0


def ray_env() -> dict[str, str]:
    """`ray start` turns Ray's token authentication on (the token in ~/.ray/auth_token); a driver
    sends it only when RAY_AUTH_MODE says token, so every process of this cluster is told so."""
    return {**os.environ, "RAY_AUTH_MODE": "token", "PYTHONUNBUFFERED": "1"}


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


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


def _stop(proc: subprocess.Popen) -> None:
    """Stop one node this module started: SIGTERM its `ray start --block` (which stops its
    raylet and workers), then SIGKILL whatever of its own process tree is left."""
    with contextlib.suppress(psutil.Error):
        family = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
        proc.send_signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=30)
        for p in family:
            with contextlib.suppress(psutil.Error):
                p.kill()


def _start_node(base: Path, name: str, args: list[str], prefix: list[str] = ()) -> subprocess.Popen:
    log = open(base / f"node-{name}.log", "w")
    return subprocess.Popen([*prefix, RAY, "start", "--block", "--disable-usage-stats", *args],
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=REPO, env=ray_env())


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    # Short: Ray's Unix socket paths live under the temp dir (108-byte limit).
    base = Path(tempfile.mkdtemp(prefix="cpmn-", dir="/tmp"))
    runs = tmp_path_factory.mktemp("multinode") / "runs"
    runs.mkdir()
    port = _free_port()
    from ray._private.services import get_node_ip_address

    ip = get_node_ip_address()
    c = Cluster(address=f"{ip}:{port}", runs=runs, base=base)
    try:
        c.procs["head"] = _start_node(base, "head", [
            "--head", f"--port={port}", "--num-cpus=1", "--include-dashboard=false",
            f"--temp-dir={base / 'ray'}", "--labels=counterpoint-role=head"])
        deadline = time.monotonic() + NODE_START_S
        while not (base / "ray" / "ray_current_cluster").exists() and time.monotonic() < deadline:
            assert c.procs["head"].poll() is None, (base / "node-head.log").read_text()[-3000:]
            time.sleep(0.5)
        for role, (cpus, resources) in ROLES.items():
            prefix: list[str] = []
            if role == "learner":  # its own mount namespace, the runs dir masked by a tmpfs
                prefix = ["unshare", "-m", "--propagation", "private", "sh", "-c",
                          f'mount -t tmpfs cp-masked "{runs}" && exec "$0" "$@"']
            # One at a time: a raylet that cannot register within Ray's fixed 30 s fails its
            # `ray start`, and three registering at once on this 2-core machine did.
            c.procs[role] = _start_node(base, role, [
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
        for name in ("learner", "grader", "rollout", "head"):
            if name in c.procs:
                _stop(c.procs[name])
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
    return cluster.runs / "placed"


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

