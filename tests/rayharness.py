"""Real `ray start --block` nodes that tests own, and the one head node the end-to-end runs join.

A node here is started with its own --temp-dir, so its address file never replaces
/tmp/ray/ray_current_cluster (another engineer's `ray.init("auto")` would join it), and stopped by
pid, never with `ray stop` (which stops every cluster on the machine).

`SharedHead` is one head node for the whole test run (tests/conftest.py's `ray_head`). The `counterpoint`
runs whose tests are not about a local cluster's own start-up and shutdown join it
(`trainer.ray_address`, `replicate --address`): each then skips starting Ray, Serve's controller
and the shutdown, ~17 s of the ~67 s a smoke run costs on the 2-core box (measured 2026-12-03:
50 s joined against 67 s starting its own, the same run back to back). The runs that test the
local path (the smoke run with Prometheus, relative paths, the console, the raylet retry, SIGTERM
inside ray.init) still start their own. Joined runs follow each other on the same cluster, as a
user's runs do on theirs: a run deletes its Serve apps as it ends, and the next run's apps of the
same name replace whatever a killed driver left.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[1]
RAY = str(Path(sys.executable).with_name("ray"))
STOP_GRACE_S = 10.0  # then SIGKILL: a `ray start --block` started in a new session can ignore SIGTERM


def ray_env() -> dict[str, str]:
    """`ray start` turns Ray's token authentication on (the token in ~/.ray/auth_token); a driver
    sends it only when RAY_AUTH_MODE says token, so every process of such a cluster is told so."""
    return {**os.environ, "RAY_AUTH_MODE": "token", "PYTHONUNBUFFERED": "1"}


def ensure_ray_token() -> Path:
    """~/.ray/auth_token, made once whatever starts at the same moment. Ray's own set-up of the
    token (``generate_and_save_token`` when none is found) takes no lock: on a fresh machine the
    two pytest-xdist workers' first heads (the shared head, the multi-node cluster's) start
    together, and one or both then fail ("Token authentication is enabled but no authentication
    token was found"), taking every test on them down. Made here, under an exclusive lock, with
    Ray's own function, before any node starts."""
    import fcntl

    from ray._private.authentication.authentication_token_setup import generate_and_save_token

    path = Path.home() / ".ray" / "auth_token"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.parent / ".auth_token.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not path.is_file() or not path.read_text().strip():
            generate_and_save_token()  # writes `path`
    return path


@contextlib.contextmanager
def local_ray(request, **init_kwargs):
    """``ray.init`` in the test's own process (a local cluster of its own) until the block ends,
    then ``ray.shutdown`` (Serve's apps first) and its /tmp/ray session removed as a finished
    run removes its own (services.launch.remove_ray_session): each such module left one behind.
    It stays, for its logs, when the block raised or a test failed meanwhile (a module fixture's
    block sees its tests' failures only in ``request.session.testsfailed``). Yields Ray's context."""
    import ray
    from ray import serve

    from services.launch import remove_ray_session

    failed_before = request.session.testsfailed
    context = ray.init(include_dashboard=False, **init_kwargs)
    session_dir = context.address_info["session_dir"]
    finished = False
    try:
        yield context
        finished = True
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()
            passed = finished and request.session.testsfailed == failed_before
            remove_ray_session(Path(session_dir), logs_kept=passed)


def start_node(base: Path, name: str, args: list[str], prefix: list[str] = ()) -> subprocess.Popen:
    """`ray start --block ARGS` as a process of its own session; its output in BASE/node-NAME.log."""
    ensure_ray_token()
    log = open(base / f"node-{name}.log", "w")
    return subprocess.Popen([*prefix, RAY, "start", "--block", "--disable-usage-stats", *args],
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=REPO, env=ray_env())


def stop_nodes(procs: list[subprocess.Popen]) -> None:
    """Stop nodes a test started: SIGTERM each `ray start --block` (which stops its raylet and
    workers), all at once, then SIGKILL whatever of their process trees is left after
    STOP_GRACE_S."""
    families = []
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            families.append([psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)])
            proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + STOP_GRACE_S
    for proc in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
    for family in families:
        for p in family:
            with contextlib.suppress(psutil.Error):
                p.kill()
    for proc in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=5)


def start_head(base: Path, args: list[str] = (), within_s: float = 120.0) -> tuple[subprocess.Popen, str]:
    """A head node with BASE/ray as its temp dir; returns (its process, its address) once it has
    written its address. Its GCS binds a port of its own choosing (--port=0): a port picked here
    could be taken by another process before the head bound it."""
    proc = start_node(base, "head", ["--head", "--port=0", "--include-dashboard=false",
                                     f"--temp-dir={base / 'ray'}", *args])
    written = base / "ray" / "ray_current_cluster"
    deadline = time.monotonic() + within_s
    while not (written.exists() and written.read_text().strip()):
        if proc.poll() is not None or time.monotonic() > deadline:
            stop_nodes([proc])
            raise RuntimeError("the Ray head did not start:\n" + (base / "node-head.log").read_text()[-3000:])
        time.sleep(0.5)
    return proc, written.read_text().strip()


@dataclass
class SharedHead:
    """The test run's head node: `address` to join, `env` for a process that joins it."""

    address: str
    base: Path
    proc: subprocess.Popen

    @classmethod
    def start(cls, cpus: int = 8) -> "SharedHead":
        # Short: Ray's Unix socket paths live under the temp dir (108-byte limit).
        base = Path(tempfile.mkdtemp(prefix="cphead-", dir="/tmp"))
        proc, address = start_head(base, [f"--num-cpus={cpus}"])
        return cls(address=address, base=base, proc=proc)

    @property
    def running(self) -> bool:
        return self.proc.poll() is None

    def ensure_running(self) -> None:
        """Start a new head in place of a stopped one (a new address)."""
        if not self.running:
            self.stop()  # its temp dir: the stopped head's logs and sockets
            fresh = SharedHead.start()
            self.address, self.base, self.proc = fresh.address, fresh.base, fresh.proc

    @property
    def env(self) -> dict[str, str]:
        return ray_env()

    @property
    def sets(self) -> list[str]:
        """The `--set` a `counterpoint train` or `eval` run joins this head with."""
        return ["--set", f"trainer.ray_address={self.address}"]

    def serve_apps(self) -> list[str]:
        """The Serve applications alive on this head now, read by a driver of its own."""
        import json

        code = ("import json, ray\nfrom ray import serve\n"
                f"ray.init(address={self.address!r}, log_to_driver=False)\n"
                "print('APPS' + json.dumps(sorted(serve.status().applications)))\n")
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                             cwd=REPO, env=self.env)
        line = [ln for ln in out.stdout.splitlines() if ln.startswith("APPS")]
        assert line, f"could not read the head's Serve apps:\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}"
        return json.loads(line[-1][len("APPS"):])

    def stop(self) -> None:
        import shutil

        if self.running:
            stop_nodes([self.proc])
        shutil.rmtree(self.base, ignore_errors=True)
