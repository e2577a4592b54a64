"""Starting (or joining) the parts of a run: Ray, the grader, the rollout replicas. Shared by
`counterpoint train`, `eval`, `probe-options` and `replicate`."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Sequence
from contextlib import ExitStack, suppress
from pathlib import Path
from typing import Any, Callable, TypeVar

from config import RunConfig
from config.runtime_env import apply_defaults
from graders.ports import free_port

T = TypeVar("T")

# Whether the live Ray cluster is the local one start_ray started (and shuts down with Serve).
_cluster_started_here = False
_session_dir: str | None = None  # the session directory of the cluster start_ray started or joined


def start_ray(cfg: RunConfig, stack: ExitStack) -> str | None:
    """Join cfg.trainer.ray_address or start a local cluster; a cluster started here is shut
    down (Serve apps first) when the stack closes. An already initialised Ray is reused.
    Returns the local metrics-agent endpoint (host:port) when Ray was started here.

    Inside `counterpoint train` (services/console.py) workers' output is not streamed to the
    driver unless --verbose: it stays in Ray's session logs, linked as runs/<run>/logs/ray and
    copied there when a cluster started here shuts down, its /tmp session directory then removed.
    Outside a run (eval, probe-options) the session is removed when the command ends without an
    error, and kept, its place said, when it fails.
    (A joined cluster's other nodes keep their logs; --verbose streams them.)"""
    import ray

    from services.console import current

    env = apply_defaults()
    if ray.is_initialized():
        return None
    logs = current()
    kwargs: dict[str, Any] = {"runtime_env": {"env_vars": env}, "log_to_driver": logs is None or logs.verbose}
    if cfg.trainer.ray_address:
        context = _init_keeping_sigterm(ray, address=cfg.trainer.ray_address, **kwargs)
        _link_session_logs(_note_session_dir(context), logs)
        stack.callback(_leave_joined_cluster, ray)  # last: after this run's apps are deleted
        return None
    from config.runtime_env import bind_local_cluster_to_loopback

    bind_local_cluster_to_loopback(ray)
    shm_before = set(shared_memory_files())
    metrics_port = cfg.trainer.ray_metrics_port or free_port()
    context = init_retrying_startup_timeout(lambda: _init_keeping_sigterm(
        ray, num_cpus=cfg.trainer.ray_num_cpus, include_dashboard=False, _metrics_export_port=metrics_port, **kwargs),
        ray.shutdown)
    session_dir = _note_session_dir(context)
    session_logs = _link_session_logs(session_dir, logs)

    def _shutdown(exc_type, exc, tb) -> bool:
        from ray import serve

        global _cluster_started_here
        kept = False
        try:
            serve.shutdown()  # every app at once, each replica given its graceful shutdown
        finally:
            try:
                ray.shutdown()
                _cluster_started_here = False
                remove_leftover_shared_memory(shm_before)
                if logs is not None and session_logs is not None:
                    kept = logs.keep_ray_logs(session_logs)
                elif logs is None:
                    # eval, probe-options: no run directory to copy Ray's logs into.
                    # They matter only when the command failed; then the session stays (and
                    # where is said), else nothing in it is wanted.
                    kept = exc_type is None
            finally:  # also when the shutdown failed: then the directory stays, and where is said
                if session_dir:
                    remove_ray_session(Path(session_dir), logs_kept=kept)
        return False  # the command's own exception, if any, goes on

    global _cluster_started_here
    _cluster_started_here = True
    stack.push(_shutdown)
    return f"127.0.0.1:{metrics_port}"


SHM_DIR = Path("/dev/shm")


def shared_memory_files() -> list[str]:
    """The names in /dev/shm (none where the host has no such directory)."""
    try:
        return os.listdir(SHM_DIR)
    except OSError:
        return []


def torch_shm_maker(name: str) -> int | None:
    """The pid that made a torch shared-memory file (torch_<pid>_<random>_<n>, the file_system
    strategy's name); None for any other file."""
    parts = name.split("_")
    if len(parts) == 4 and parts[0] == "torch" and all(x.isdigit() for x in parts[1:]):
        return int(parts[1])
    return None


def leftover_shared_memory(names: Iterable[str], before: set[str], alive: Callable[[int], bool]) -> list[str]:
    """The torch shared-memory files made since ``before`` whose maker is dead. A CPU run that
    shares the base or hands adapters over in memory (model/shared_base.py) shares them through
    such files, and their cleaner, the torch_shm_manager each worker starts, dies with the worker
    when Ray shuts the cluster down: every such run left the model's size in /dev/shm (RAM).
    Unlinking a file ends no mapping of it; a dead maker's file has no new opener to expect."""
    out = []
    for name in names:
        pid = torch_shm_maker(name)
        if name not in before and pid is not None and not alive(pid):
            out.append(name)
    return sorted(out)


def remove_leftover_shared_memory(before: set[str], wait_s: float = 5.0) -> list[str]:
    """After the local cluster's shutdown: remove ``leftover_shared_memory``, waiting up to
    ``wait_s`` for the makers of the new files to exit (Ray's workers die after its shutdown
    returns). Returns the names removed."""
    import time

    import psutil

    def alive(pid: int) -> bool:  # a zombie has exited: only its parent has not reaped it yet
        try:
            return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
        except psutil.Error:
            return False

    deadline = time.monotonic() + wait_s
    while True:
        names = shared_memory_files()
        makers = {torch_shm_maker(n) for n in names if n not in before} - {None}
        if not any(alive(pid) for pid in makers) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    removed = leftover_shared_memory(names, before, alive)
    for name in removed:
        with suppress(OSError):
            os.unlink(SHM_DIR / name)
    if removed:
        logging.getLogger("counterpoint").info("removed %d shared-memory file(s) left by the run's dead processes",
                                               len(removed))
    return removed


def _leave_joined_cluster(ray) -> None:
    """Disconnect from a joined cluster, Serve's handles first. Left to the interpreter's exit,
    Ray's atexit shutdown ran while the handles' router thread still pushed metrics: it then
    called ray.init() from that thread (Ray's auto-init) and printed '--- Logging error ---'
    tracebacks to a console already closed. The cluster and its Serve stay up."""
    from ray.serve.context import _get_global_client  # Serve has no public call for this

    with suppress(Exception):  # leaving must never fail a run that finished
        client = _get_global_client(raise_if_no_controller_running=False)
        if client is not None:
            client.shutdown_cached_handles()
    ray.shutdown()


STARTUP_TIMEOUT = "timed out during startup"  # Ray's words when its raylet misses its fixed 30 s


def init_retrying_startup_timeout(init: Callable[[], T], shutdown: Callable[[], None]) -> T:
    """``init()`` (a local cluster's ray.init), once more if Ray says the node "timed out during
    startup": on a loaded host the raylet can miss the 30 s Ray gives it to register with the
    GCS (seen once in CI, on a 2-core box, in a run that was otherwise fine). The processes the
    failed attempt started are killed first, or they would live on beside the second cluster."""
    import psutil

    me = psutil.Process()
    before = {p.pid for p in me.children(recursive=True)}
    try:
        return init()
    except Exception as err:
        if STARTUP_TIMEOUT not in str(err):
            raise
        logging.getLogger("counterpoint").warning("Ray's local node %s; starting it again", STARTUP_TIMEOUT)
    left = [p for p in me.children(recursive=True) if p.pid not in before]
    for proc in left:
        with suppress(psutil.NoSuchProcess):
            proc.kill()
    psutil.wait_procs(left, timeout=10)
    shutdown()
    return init()


def _init_keeping_sigterm(ray, **kwargs):
    """ray.init, leaving SIGTERM to the caller's own handler when it has one (`counterpoint
    train`'s, which makes SIGTERM an interruption that prints the resume command). ray.init sets
    one that exits with status 15 while it starts, then one that kills the node and exits 1: a
    SIGTERM during or right after start-up would otherwise end the run as "failed", in silence."""
    import signal

    before = signal.getsignal(signal.SIGTERM)
    ours = callable(before)
    try:
        return ray.init(**kwargs)
    except SystemExit as err:
        if ours and err.code == signal.SIGTERM:  # Ray's start-up handler caught our SIGTERM
            before(signal.SIGTERM, None)
        raise
    finally:
        if ours:
            signal.signal(signal.SIGTERM, before)


def _note_session_dir(context) -> str | None:
    """Ray's session directory of the cluster just started or joined, kept for ``ray_session``."""
    global _session_dir
    _session_dir = (getattr(context, "address_info", None) or {}).get("session_dir")
    return _session_dir


def ray_session() -> dict[str, Any] | None:
    """run.json's ``ray_session``: Ray's session directory of this driver's cluster and whether the
    run started it (then the directory is removed when the run ends) or joined it."""
    if _session_dir is None:
        return None
    return {"session_dir": _session_dir, "cluster": "started" if _cluster_started_here else "joined"}


def _link_session_logs(session_dir: str | None, logs):
    if logs is None or not session_dir:
        return None
    session_logs = Path(session_dir) / "logs"
    logs.link_ray_logs(session_logs)
    return session_logs


SESSION_LATEST = "session_latest"  # Ray's link, beside the session directories, to the newest one


def ray_session_leftovers(started_here: bool, session_dir: str | Path | None, logs_kept: bool,
                          latest_target: str | None, written_under: Sequence[str] = ()) -> list[Path]:
    """What of Ray's session to remove after the run: the directory of a cluster the run started,
    once its logs are kept elsewhere (``logs_kept``: copied into runs/<run>/logs/ray, or a command
    without a run directory finished without an error), and ``session_latest`` when it points there
    (``latest_target``: that link's target, None without the link). A joined cluster's session is
    its head's; logs not copied are the only copy. ``written_under``: files under the session's
    ``artifacts/``, where a Ray Train worker's relative path lands (its working directory): those
    are the run's output gone astray, and removing them would lose it, so the session stays."""
    if not (started_here and session_dir and logs_kept) or written_under:
        return []
    session = Path(session_dir)
    latest = session.parent / SESSION_LATEST
    out = [session]
    if latest_target is not None and os.path.normpath(latest.parent / latest_target) == os.path.normpath(session):
        out.insert(0, latest)  # the link first: nothing follows it into a half-removed directory
    return out


def remove_ray_session(session_dir: Path, logs_kept: bool) -> list[Path]:
    """After the shutdown of the local cluster the run started: remove ``ray_session_leftovers``;
    when its logs are not kept elsewhere, say where they stay instead. Never raises (a run that
    finished must not fail here). Returns the paths removed."""
    log = logging.getLogger("counterpoint")
    if not logs_kept:
        log.info("Ray's logs stay in %s (not copied into a run directory)", session_dir / "logs")
    try:
        written = files_under(session_dir / "artifacts")
    except OSError as err:  # a directory vanishing mid-walk: what is there is unknown, so it stays
        written = [f"{session_dir / 'artifacts'} (unreadable: {err})"]
    if written:
        log.warning("Ray's session directory %s is kept: %d file(s) were written under its artifacts/ (a "
                    "relative path in a Ray worker?), e.g. %s", session_dir, len(written), written[0])
    try:
        latest_target: str | None = os.readlink(session_dir.parent / SESSION_LATEST)
    except OSError:
        latest_target = None
    removed = []
    for path in ray_session_leftovers(True, session_dir, logs_kept, latest_target, written_under=written):
        if remove_path(path):
            removed.append(path)
    return removed


def files_under(root: Path) -> list[str]:
    """The files below ``root``, sorted ([] without it)."""
    return sorted(str(f) for f in root.rglob("*") if not f.is_dir()) if root.is_dir() else []


def remove_path(path: Path, attempts: int = 5, pause_s: float = 0.2) -> bool:
    """Remove a link, file or directory tree, trying again while Ray's processes, still exiting
    after ray.shutdown() returned, make or remove files in it; a failure is logged at debug level,
    never raised. Whether the path is gone."""
    import shutil
    import time

    for attempt in range(attempts):
        try:
            if path.is_symlink() or not path.is_dir():
                path.unlink()
            else:
                shutil.rmtree(path)
            return True
        except FileNotFoundError:  # the path, or a file inside that vanished mid-walk
            if not os.path.lexists(path):
                return True
        except OSError as err:
            logging.getLogger("counterpoint").debug("removing %s (attempt %d): %s", path, attempt + 1, err)
        time.sleep(pause_s)
    return not os.path.lexists(path)


def required_resources(cfg: RunConfig, with_learner: bool = True) -> dict[str, float]:
    """CPUs and GPUs the run's parts reserve in Ray (grader Serve replicas at their autoscaling
    start, rollout replicas, learner workers)."""
    grader_replicas = 0 if cfg.grader.address else max(cfg.grader.replicas, cfg.grader.min_replicas or 0)
    cpu = grader_replicas * cfg.grader.num_cpus + cfg.rollout.replicas * cfg.rollout.num_cpus
    gpu = cfg.rollout.replicas * cfg.rollout.num_gpus
    if with_learner:
        cpu += cfg.learner.workers * cfg.learner.num_cpus_per_worker
        gpu += cfg.learner.workers * cfg.learner.gpus_per_worker if cfg.learner.use_gpu else 0
    return {"CPU": cpu, "GPU": gpu}


def learner_starts_beside_rollout(cfg: RunConfig) -> bool:
    """Whether the learner's workers may load the model while the rollout replicas start (a
    train run's start-up then costs the longer of the two, not their sum). Not where Ray may put
    a replica and a learner worker on one GPU, which happens only when both use GPUs and either
    reserves a fraction of one (Ray gives whole-GPU reservations their own devices): vLLM sizes
    its KV cache from what it measures of the card's memory while it profiles, which a learner
    loading its model at the same moment would change from one run to the next."""
    rollout_gpus = cfg.rollout.num_gpus
    learner_gpus = cfg.learner.gpus_per_worker if cfg.learner.use_gpu else 0.0
    return not (rollout_gpus > 0 and learner_gpus > 0 and (rollout_gpus < 1 or learner_gpus < 1))


def check_resources(cfg: RunConfig, with_learner: bool = True) -> None:
    """Fail before starting anything when the cluster cannot hold the run: otherwise Ray waits
    forever for a worker that can never be placed."""
    import ray

    have = ray.cluster_resources()
    need = required_resources(cfg, with_learner)
    short = {k: (v, have.get(k, 0.0)) for k, v in need.items() if v > have.get(k, 0.0) + 1e-9}
    if short:
        detail = "; ".join(f"{k}: the run reserves {n:g}, the cluster has {h:g}" for k, (n, h) in short.items())
        raise RuntimeError(
            f"the Ray cluster cannot hold this run ({detail}). Lower grader.num_cpus/replicas, "
            "rollout.num_cpus/replicas or learner.num_cpus_per_worker/workers, or add nodes.")


def start_grader(cfg: RunConfig, stack: ExitStack):
    """A client of the configured grader address, or of a grader started here as a Serve app."""
    from graders.client import GraderClient

    address = cfg.grader.address
    if address is None:
        from graders import serve_app

        # The front binds port 0 and reports the port it got: a port picked free here could be
        # taken by another process before the bind. Serve's gRPC proxy cannot report one, so it
        # gets a pick (and that race stays: proxy ingress only).
        front = cfg.grader.serve_ingress == "front"
        port = 0 if front else free_port()
        serve_app.start(cfg.grader, grpc_port=port, http_port=free_port(), liveness=cfg.liveness)
        if not _cluster_started_here:  # on a joined cluster the app would outlive the run, holding its CPUs
            stack.callback(_delete_app, cfg.grader.app_name)
        stack.callback(serve_app.stop_front, cfg.grader.app_name)  # the loopback front, if any
        if front:
            port = serve_app.front_port(cfg.grader.app_name)
        address = f"127.0.0.1:{port}"
    client = GraderClient.from_config(cfg.grader, address=address)
    stack.callback(client.close)
    return client


def _delete_app(app_name: str) -> None:
    from ray import serve

    serve.delete(app_name)


def watch_grader(cfg: RunConfig, stack: ExitStack, registry):
    """For a grader started here as a Serve app: read its replica count from Serve every
    grader.replica_poll_s and export it with the scale events on ``registry`` (the trainer's
    /metrics; graders/autoscale.py). None for an external grader (grader.address): its own
    cluster's process that deployed it knows its replicas, not this driver."""
    if cfg.grader.address is not None:
        return None
    from graders.autoscale import watch_app

    watch = watch_app(cfg.grader)
    stack.callback(watch.stop)
    registry.register(watch.collector())
    return watch


def start_rollout(cfg: RunConfig, stack: ExitStack, seed: int | None = None, env: dict[str, str] | None = None):
    """Deploy the rollout replicas; they are deleted when the stack closes. ``env``: variables the
    replicas get beside the run's defaults (services/mps.py)."""
    from rollout.deployment import deploy_rollout, stop_rollout

    client = deploy_rollout(cfg.model, cfg.rollout, seed=cfg.seed if seed is None else seed,
                            liveness=cfg.liveness, env=env)
    if not _cluster_started_here:  # a cluster started here deletes every app at once as it shuts down
        stack.callback(stop_rollout)
    return client


def stop_token_report(rollout) -> dict[str, Any]:
    """The stop set the replicas' engine uses and whether the template's end-of-turn and
    generation_config's eos disagree (the never-stopping-generation trap), for the receipt. Read
    from a live replica, which computed it when it loaded the tokenizer: the driver then never
    imports transformers, ~6 s of start-up it spent before the replicas could start."""
    import logging

    report = rollout.info()["stop_tokens"]
    if report.get("warning"):
        logging.getLogger("counterpoint").warning("stop tokens: %s", report["warning"])
    return report


def serve_adapter(rollout, adapter_dir) -> int:
    """Make a saved adapter dir live on every rollout replica (eval, probe); returns the version
    to sample with: the first adapter version, or the bare base model's when ``adapter_dir`` is None."""
    from model.adapter_dir import payload_from_dir
    from model.adapter import BASE_MODEL_VERSION, FIRST_ADAPTER_VERSION

    if adapter_dir is None:
        return BASE_MODEL_VERSION
    payload = payload_from_dir(adapter_dir, version=FIRST_ADAPTER_VERSION)
    rollout.publish(payload)
    rollout.sync(payload.version)
    return payload.version
