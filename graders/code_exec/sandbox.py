"""Run one untrusted Python script in a fresh interpreter, isolated where the host allows it.

Design (issue 13):
- Never a fork of the caller: `subprocess.Popen` of a fresh interpreter, `start_new_session`
  (own session and process group), `close_fds`, a scrubbed environment, BLAS/OMP threads = 1,
  stdin from /dev/null, stdout+stderr through one pipe whose reader keeps only a bounded tail.
- rlimits set by util-linux `prlimit` right before the interpreter (no preexec_fn: callers are
  threaded): CPU seconds, address space = measured interpreter baseline + budget, file size,
  open files, processes, no core files.
- Wall-clock timeout enforced by the parent: SIGINT to the group, `grace_s`, then SIGKILL of the
  namespace's pid 1 (which takes every descendant, setsid or not) and of the group; always reaped.
- Ended with its grader: the wrapper gets SIGKILL as its parent-death signal (util-linux
  `setpriv --pdeathsig`, no preexec_fn), so a grader killed mid-run (SIGKILL, the OOM killer) takes
  its script with it instead of leaving it with nobody to enforce the wall clock; `unshare
  --kill-child` passes the kill on to the namespace's pid 1.
- Isolation level `namespaces`: `unshare --mount --net --pid --fork` (plus `--user
  --map-root-user` when the grader is not root). Inside, a small sh (pid 1 until it execs the
  script) builds a read-only tmpfs root holding only the interpreter, system libraries, a few
  /etc files, private /tmp and /dev/shm tmpfs, /proc of the new pid namespace and the workspace
  at /workspace (a tmpfs of `workspace_mb` / `workspace_files` holding a copy of the task's
  public files: the script's writes never reach the host's disk; see setup_script); then runs (as its child) chroot, drop every capability (bounding set too, no_new_privs) and, when
  root, switch to a dedicated unprivileged uid (locked per execution, so RLIMIT_NPROC counts this
  script only; leftover processes of that uid are killed after the run). The task directory is
  simply not in that tree: private/ is unreachable by any path; the network namespace has only a
  down loopback. Level `none`: process group, rlimits, scrubbed env only (a setsid'd grandchild
  can outlive the run there; measured as the bare-subprocess baseline in bench/code_exec.py).
"""

from __future__ import annotations

import collections
import fcntl
import logging
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import psutil

log = logging.getLogger(__name__)

LEVELS = ("none", "namespaces")
SETUP_FAIL = 111
SETUP_MARK = "cp-sandbox: setup failed"
_WORKSPACE = "/workspace"
_ETC_FILES = ("ld.so.cache", "ld.so.conf", "localtime", "passwd", "group", "nsswitch.conf", "hosts")
_DEVICES = ("null", "zero", "full", "random", "urandom")
_SYS_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
_BASELINE_PROBE = (
    "import numpy, pandas\ntry:\n import sklearn\nexcept ImportError:\n pass\n"
    "print([l.split()[1] for l in open('/proc/self/status') if l.startswith('VmPeak')][0])"
)


class ResourceExhausted(RuntimeError):
    """No execution slot freed up within the queue wait (gRPC: RESOURCE_EXHAUSTED).
    ``waited_s``: how long the request queued before giving up."""

    def __init__(self, message: str, waited_s: float = 0.0) -> None:
        super().__init__(message)
        self.waited_s = waited_s


class IsolationUnavailable(RuntimeError):
    """The host offers less isolation than the configured minimum."""


class SandboxError(RuntimeError):
    """The sandbox itself failed to set up (not the script's fault)."""


@dataclass(frozen=True)
class Limits:
    """Resource limits applied to one execution (reported with every result)."""

    wall_s: float
    grace_s: float
    cpu_s: int
    address_space_bytes: int
    baseline_bytes: int
    file_size_bytes: int
    open_files: int
    nproc: int
    tmp_bytes: int
    workspace_bytes: int
    workspace_files: int
    output_tail_bytes: int
    output_limit_bytes: int


@dataclass
class SandboxRun:
    """How one process run in the sandbox ended. `outcome`: ok (exit 0), error (nonzero exit or
    signal), timeout (wall or CPU limit), output_limit. Not records/exec_result.py's ExecResult,
    the graded result of a script that the verifier builds from this run and the task's grading
    (the name of one said the other before)."""

    outcome: str
    returncode: int | None
    exec_time: float
    tail: str
    output_bytes: int
    exc_type: str | None
    isolation: str
    uid: int | None
    stragglers_killed: int
    limits: dict = field(default_factory=dict)
    queue_wait: float = 0.0  # seconds it waited for an execution slot

    def as_dict(self) -> dict:
        return asdict(self)


# ---------------------------------------------------------------- pure helpers

_EXC_LINE = re.compile(r"^([A-Za-z_][\w.]*(?:Error|Exception|Exit|Interrupt|Warning|[A-Z]\w*))(?::|$)")


def without_wrapper_lines(tail: str) -> str:
    """The script's output without what the namespace wrapper itself printed. Killed at the wall
    limit, `unshare` sometimes reports its own signal handling ("unshare: sigprocmask unblock
    failed: Invalid argument"), depending on when the signal lands: not the script's output, and
    a debug prompt shows the policy this tail (search/prompts.py), so it must not vary with it."""
    return "".join(line for line in tail.splitlines(keepends=True) if not line.startswith("unshare: "))


def exc_type_of(tail: str, returncode: int | None) -> str | None:
    """The exception class named by the last traceback in `tail`, else the killing signal."""
    if "Traceback (most recent call last)" in tail or "SyntaxError" in tail:
        for line in reversed(tail.splitlines()):
            m = _EXC_LINE.match(line.strip())
            if m and not line.startswith(" "):
                return m.group(1).rsplit(".", 1)[-1]
    if returncode is not None and returncode < 0:
        try:
            return signal.Signals(-returncode).name
        except ValueError:
            return f"signal {-returncode}"
    if returncode is not None and returncode > 128 + 0 and returncode - 128 in signal.valid_signals():
        return signal.Signals(returncode - 128).name
    return None


def scrubbed_env(home: str) -> dict[str, str]:
    """The whole environment a script gets: paths, locale, every thread pool pinned to 1."""
    env = {
        "PATH": _SYS_PATH,
        "HOME": home,
        "TMPDIR": "/tmp",
        "LANG": "C.UTF-8",
        "LC_ALL": "C.UTF-8",
        "PYTHONDONTWRITEBYTECODE": "1",
        "PYTHONUNBUFFERED": "1",
        "PYTHONHASHSEED": "0",
        "MPLBACKEND": "Agg",
        "LOKY_MAX_CPU_COUNT": "1",
    }
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS",
                "NUMEXPR_NUM_THREADS", "VECLIB_MAXIMUM_THREADS", "BLIS_NUM_THREADS"):
        env[var] = "1"
    for var in ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE"):  # host workarounds for old OpenBLAS
        if var in os.environ:
            env[var] = os.environ[var]
    return env


def _prlimit_args(lim: Limits) -> list[str]:
    return [
        "prlimit",
        f"--cpu={lim.cpu_s}:{lim.cpu_s + 1}",
        f"--as={lim.address_space_bytes}",
        f"--fsize={lim.file_size_bytes}",
        f"--nofile={lim.open_files}",
        f"--nproc={lim.nproc}",
        "--core=0",
        "--",
    ]


def _ro_paths() -> list[str]:
    """Host paths the chroot needs read-only: system dirs, the interpreter and its venv."""
    paths = ["/usr"]
    for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
        if os.path.isdir(top) and not os.path.islink(top):
            paths.append(top)
    for p in {sys.prefix, sys.base_prefix, os.path.realpath(sys.prefix),
              os.path.realpath(sys.base_prefix),
              os.path.dirname(os.path.dirname(os.path.realpath(sys.executable)))}:
        if not any(p == q or p.startswith(q + "/") for q in paths):
            paths.append(p)
    return sorted(set(paths))


def setup_script(tmp_bytes: int, workspace_bytes: int, workspace_files: int) -> str:
    """The pid-1 shell of the namespace: build the read-only root, run the command in the chroot,
    then copy out the one file the parent collects.

    Arguments: $1 = new root mountpoint, $2 = host directory whose files start the workspace,
    $3 = host directory that receives the collected file, $4 = its name ('' = none), $5 = its
    size limit in bytes, $6 = uid owning the workspace ('' = the namespace's root), then the
    command to run inside.

    Why a tmpfs workspace: the host directory bind-mounted as /workspace let one script write
    2.9 GB to the host's disk in 8 s (RLIMIT_FSIZE bounds one file, not their number). We are
    already in a mount namespace, so a tmpfs with size= and nr_inodes= is the one quota that
    needs no privilege on the host (no loop device, no filesystem quotas, no cgroup io limits):
    the kernel answers ENOSPC past it, and it vanishes with the namespace. The parent never reads
    it: once the script is gone, this shell (outside the chroot) kills whatever of the script is
    left (kill -1 from pid 1 reaches exactly the namespace) and copies the collected entry to $3
    as what it is (cp -RP: a symlink stays a link, a FIFO a FIFO, never opened), a directory as
    an empty one, a file over the limit as a sparse file of its size; read_regular judges it.
    """
    q = shlex.quote
    lines = [
        "set -u",
        f'fail() {{ echo "{SETUP_MARK}: $*" >&2; exit {SETUP_FAIL}; }}',
        'R="$1"; W="$2"; O="$3"; C="$4"; M="$5"; U="$6"; shift 6',
        'own=""; [ -n "$U" ] && own=",uid=$U,gid=$U"',
        'mount -t tmpfs -o mode=0755,size=8m,nosuid,nodev cp-root "$R" || fail tmpfs root',
        # The private /tmp first: an interpreter or venv under the host's /tmp (a checkout in
        # /tmp, as CI's may be) is bound inside it below instead of being hidden by it.
        f'mkdir -p "$R/tmp" && mount -t tmpfs -o mode=1777,size={tmp_bytes},nosuid,nodev cp-tmp '
        '"$R/tmp" || fail tmp',
    ]
    for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
        if os.path.islink(top):
            lines.append(f'ln -s {q(os.readlink(top))} "$R"{q(top)} || fail link {top}')
    for p in _ro_paths():
        lines.append(f'mkdir -p "$R"{q(p)} && mount --bind -o ro,nosuid,nodev {q(p)} "$R"{q(p)} '
                     f"|| fail bind {q(p)}")
    lines.append('mkdir -p "$R/etc"')
    for name in _ETC_FILES:
        src = f"/etc/{name}"
        if os.path.isfile(src):
            lines.append(f'touch "$R{src}" && mount --bind -o ro {src} "$R{src}" || fail bind {src}')
    lines += [
        'mkdir -p "$R/dev" && mount -t tmpfs -o mode=0755,size=64k,nosuid cp-dev "$R/dev" '
        "|| fail dev",
    ]
    for d in _DEVICES:
        lines.append(f'touch "$R/dev/{d}" && mount --bind /dev/{d} "$R/dev/{d}" || fail dev {d}')
    lines += [
        'ln -s /proc/self/fd "$R/dev/fd"; ln -s /proc/self/fd/0 "$R/dev/stdin"',
        'ln -s /proc/self/fd/1 "$R/dev/stdout"; ln -s /proc/self/fd/2 "$R/dev/stderr"',
        f'mkdir -p "$R/dev/shm" && mount -t tmpfs -o mode=1777,size={tmp_bytes},nosuid,nodev '
        'cp-shm "$R/dev/shm" || fail shm',
        'mkdir -p "$R/proc" && mount -t proc -o nosuid,nodev,noexec proc "$R/proc" || fail proc',
        f'mkdir -p "$R{_WORKSPACE}" && mount -t tmpfs -o "mode=0755,size={workspace_bytes},'
        f'nr_inodes={workspace_files},nosuid,nodev$own" cp-workspace "$R{_WORKSPACE}" || fail workspace',
        f'cp -a "$W/." "$R{_WORKSPACE}/" || fail "workspace files (code_exec.workspace_mb, workspace_files)"',
        'mount -o remount,ro,nosuid,nodev "$R" || fail remount',
        # not exec: the script must not be the namespace's pid 1, which the kernel shields from
        # default-action signals (SIGXCPU of RLIMIT_CPU would be dropped); sh waits as pid 1.
        f'chroot "$R" /usr/bin/env -C {_WORKSPACE} "$@"',
        'rc=$?',
        'kill -KILL -1 2>/dev/null',
        f'S="$R{_WORKSPACE}/$C"',
        'if [ -z "$C" ]; then :',
        'elif [ -d "$S" ] && [ ! -L "$S" ]; then mkdir "$O/$C"',
        'elif [ -f "$S" ] && [ ! -L "$S" ] && [ "$(stat -c %s "$S")" -gt "$M" ]; then '
        'truncate -s "$(stat -c %s "$S")" "$O/$C"',
        'elif [ -e "$S" ] || [ -L "$S" ]; then cp -RP "$S" "$O/$C" 2>/dev/null',
        'fi',
        'exit $rc',
    ]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------- host probes

_probe_cache: dict[tuple, object] = {}
_probe_lock = threading.Lock()


def baseline_bytes(python: str = sys.executable) -> int:
    """Peak virtual memory of the interpreter with numpy/pandas/scikit-learn imported (cached)."""
    key = ("baseline", python)
    with _probe_lock:
        if key not in _probe_cache:
            out = subprocess.run([python, "-s", "-c", _BASELINE_PROBE], capture_output=True,
                                 text=True, env=scrubbed_env("/tmp"), timeout=120, check=True)
            _probe_cache[key] = int(out.stdout.strip()) * 1024
        return _probe_cache[key]  # type: ignore[return-value]


def parent_death_prefix() -> list[str]:
    """The wrapper that gives a script's process tree SIGKILL when its grader dies:
    ``setpriv --pdeathsig KILL`` where this util-linux has it (2.33+, cached), else [] (the next
    sandbox's sweep, ``kill_orphaned_scripts``, is then the only net)."""
    with _probe_lock:
        if "pdeathsig" not in _probe_cache:
            has = False
            if shutil.which("setpriv"):
                try:
                    has = subprocess.run(["setpriv", "--pdeathsig", "KILL", "true"], capture_output=True,
                                         timeout=30).returncode == 0
                except (OSError, subprocess.SubprocessError):
                    has = False
            _probe_cache["pdeathsig"] = ["setpriv", "--pdeathsig", "KILL"] if has else []
        return list(_probe_cache["pdeathsig"])  # type: ignore[arg-type]


def _ns_prefix(as_root: bool) -> list[str]:
    args = ["unshare", "--mount", "--net", "--pid", "--fork", "--kill-child=SIGKILL",
            "--propagation=private"]
    if not as_root:
        args[1:1] = ["--user", "--map-root-user"]
    return args


def detect_isolation() -> tuple[str, str]:
    """(best level the host offers, why). Runs the real namespace pipeline once (cached)."""
    with _probe_lock:
        if "detect" in _probe_cache:
            return _probe_cache["detect"]  # type: ignore[return-value]
    level, why = "none", ""
    missing = [b for b in ("unshare", "prlimit", "setpriv", "chroot", "mount") if not shutil.which(b)]
    if missing:
        why = f"missing tools: {missing}"
    else:
        run_dir = tempfile.mkdtemp(prefix="cp-probe-")
        try:
            ws, root = os.path.join(run_dir, "w"), os.path.join(run_dir, "r")
            os.mkdir(ws), os.mkdir(root)
            as_root = os.geteuid() == 0
            inner = ["setpriv", "--inh-caps=-all", "--bounding-set=-all", "--no-new-privs"]
            if as_root:
                os.chown(ws, 65534, 65534)
                inner[1:1] = ["--reuid=65534", "--regid=65534", "--clear-groups"]
            code = ("import socket,os;print(sorted(n for _,n in socket.if_nameindex()),"
                    "os.getppid(),os.path.exists(%r))" % run_dir)
            cmd = [*_ns_prefix(as_root), "sh", "-c", setup_script(1 << 20, 1 << 20, 16), "sh", root, ws,
                   ws, "", "0", "65534" if as_root else "", *inner, sys.executable, "-s", "-c", code]
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=60,
                               env=scrubbed_env(_WORKSPACE), start_new_session=True)
            if p.returncode == 0 and p.stdout.strip() == "['lo'] 1 False":
                level, why = "namespaces", "user/mount/net/pid namespaces + chroot"
                if as_root:
                    why += " + dedicated uid"
            else:
                why = f"namespace probe failed (rc {p.returncode}): {(p.stderr or p.stdout).strip()[-300:]}"
        except (OSError, subprocess.SubprocessError) as e:
            why = f"namespace probe failed: {e}"
        finally:
            shutil.rmtree(run_dir, ignore_errors=True)
    with _probe_lock:
        _probe_cache["detect"] = (level, why)
    return level, why


# ---------------------------------------------------------------- uid leases


def _lock_uid(uid: int) -> int | None:
    """The flock of one sandbox uid, held by whoever runs a script under it (None: someone
    does). The kernel drops it when its holder dies, however it dies."""
    lock_dir = Path(tempfile.gettempdir()) / "counterpoint-sandbox-uids"
    lock_dir.mkdir(mode=0o700, exist_ok=True)
    fd = os.open(lock_dir / f"{uid}.lock", os.O_CREAT | os.O_RDWR, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


class _UidLease:
    """An exclusive lock on one uid of [base, base+count) across processes (flock files)."""

    def __init__(self, base: int, count: int):
        start = (os.getpid() * 7919) % count
        for i in range(count):
            uid = base + (start + i) % count
            fd = _lock_uid(uid)
            if fd is not None:
                self.uid, self._fd = uid, fd
                return
        raise ResourceExhausted(f"all {count} sandbox uids from {base} are in use")

    def release(self) -> None:
        os.close(self._fd)


def _pids_of_uid(uid: int) -> list[int]:
    pids = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                if os.stat(f"/proc/{d}").st_uid == uid:
                    pids.append(int(d))
            except FileNotFoundError:
                pass
    return pids


def kill_uid(uid: int, rounds: int = 5) -> int:
    """SIGKILL every process owned by `uid` (a dedicated sandbox uid); returns how many."""
    killed = 0
    for _ in range(rounds):
        pids = _pids_of_uid(uid)
        if not pids:
            break
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
                killed += 1
            except ProcessLookupError:
                pass
        time.sleep(0.01)
    return killed


def kill_orphaned_scripts(base: int, count: int) -> int:
    """SIGKILL what still runs under a sandbox uid of [base, base+count) that no live sandbox
    leases: a grader killed mid-run (SIGKILL, the OOM killer) leaves its script running, and
    nothing enforces its wall-clock limit any more. Returns how many processes it killed."""
    uids = set()
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                uid = os.stat(f"/proc/{d}").st_uid
            except FileNotFoundError:
                continue
            if base <= uid < base + count:
                uids.add(uid)
    killed = 0
    for uid in sorted(uids):
        fd = _lock_uid(uid)
        if fd is None:  # a live sandbox's script
            continue
        try:
            killed += kill_uid(uid)
        finally:
            os.close(fd)
    return killed


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(x) for x in f.read().split()]
    except OSError:
        return []


# ---------------------------------------------------------------- the sandbox


class _TailReader(threading.Thread):
    def __init__(self, pipe, keep: int, limit: int, on_limit):
        super().__init__(daemon=True)
        self.pipe, self.keep, self.limit, self.on_limit = pipe, keep, limit, on_limit
        self.buf: collections.deque[bytes] = collections.deque()
        self.held = 0
        self.total = 0
        self.over = False

    def run(self) -> None:
        while True:
            chunk = self.pipe.read1(65536) if hasattr(self.pipe, "read1") else self.pipe.read(65536)
            if not chunk:
                break
            self.total += len(chunk)
            self.buf.append(chunk)
            self.held += len(chunk)
            while self.held - len(self.buf[0]) >= self.keep:
                self.held -= len(self.buf.popleft())
            if self.total > self.limit and not self.over:
                self.over = True
                self.on_limit()
        self.pipe.close()

    def tail(self) -> str:
        return b"".join(self.buf)[-self.keep:].decode("utf-8", "replace")


RUN_DIR_PREFIX = "cp-exec-"


def run_dir_prefix(host: str, pid: int) -> str:
    """An execution's directory names its host and process: ``cp-exec-<host>_<pid>_<random>`` (a
    host name has no underscore, so no host's prefix is another's)."""
    return f"{RUN_DIR_PREFIX}{host}_{pid}_"


def orphaned_run_dirs(names: list[str], host: str, pid_exists) -> list[str]:
    """The execution directories of this host whose process is gone: a grader killed mid-run
    (SIGKILL, a node's OOM killer) leaves its run's workspace, with the task's data copied into
    it. Another host's (a shared work_root) and unreadable names are never chosen."""
    mine = f"{RUN_DIR_PREFIX}{host}_"
    out = []
    for name in names:
        pid = name[len(mine):].partition("_")[0] if name.startswith(mine) else ""
        if pid.isdigit() and not pid_exists(int(pid)):
            out.append(name)
    return out


class Sandbox:
    """Runs scripts under the configured limits; at most `max_concurrent` at once per instance.
    A script dies with its grader (``parent_death_prefix``); a new sandbox also ends what still
    runs under an unleased sandbox uid (``kill_orphaned_scripts``, the net where the wrapper has
    no parent-death signal) and removes dead graders' run directories from its work_root
    (``orphaned_run_dirs``)."""

    def __init__(self, cfg):
        self.cfg = cfg
        best, self.isolation_reason = detect_isolation()
        want = cfg.isolation or best
        if LEVELS.index(want) > LEVELS.index(best):
            raise IsolationUnavailable(f"isolation {want!r} requested but the host offers "
                                       f"{best!r}: {self.isolation_reason}")
        if LEVELS.index(want) < LEVELS.index(cfg.min_isolation):
            raise IsolationUnavailable(
                f"sandbox isolation {want!r} is below min_isolation={cfg.min_isolation!r} "
                f"({self.isolation_reason or 'forced'}); set code_exec.min_isolation=none to run anyway"
            )
        self.isolation = want
        self.as_root = os.geteuid() == 0
        self._slots = threading.BoundedSemaphore(cfg.max_concurrent)
        self.work_root = cfg.work_root or tempfile.gettempdir()
        self._host = socket.gethostname()
        if self.isolation == "namespaces" and self.as_root:  # scripts run under leased uids
            orphans = kill_orphaned_scripts(cfg.uid_base, cfg.uid_count)
            if orphans:
                log.warning("code-exec: killed %d process(es) of scripts whose grader had died", orphans)
        present = os.listdir(self.work_root) if os.path.isdir(self.work_root) else []
        for name in orphaned_run_dirs(present, self._host, psutil.pid_exists):
            shutil.rmtree(os.path.join(self.work_root, name), ignore_errors=True)
        base = baseline_bytes()
        self.limits = Limits(
            wall_s=cfg.timeout_s, grace_s=cfg.grace_s, cpu_s=cfg.cpu_s,
            address_space_bytes=base + cfg.memory_mb * 2**20, baseline_bytes=base,
            file_size_bytes=cfg.file_size_mb * 2**20, open_files=cfg.open_files,
            nproc=cfg.nproc, tmp_bytes=cfg.tmp_mb * 2**20, workspace_bytes=cfg.workspace_mb * 2**20,
            workspace_files=cfg.workspace_files,
            output_tail_bytes=cfg.output_tail_bytes, output_limit_bytes=cfg.output_limit_bytes,
        )
        self._setup = setup_script(self.limits.tmp_bytes, self.limits.workspace_bytes,
                                   self.limits.workspace_files)

    # one slot per execution; beyond max_concurrent callers wait at most queue_wait_s
    def run(self, script: str, files_dir: str | os.PathLike | None,
            collect: str | None = "submission.csv", collect_max_bytes: int = 64 * 2**20):
        """Run `script` in a fresh workspace holding a copy of `files_dir`'s files.

        Returns (SandboxRun, bytes of the file `collect` or None, why it is None). The file is
        read without following links and only when it is a regular file of at most
        `collect_max_bytes`; the workspace is deleted before returning.
        """
        t_wait = time.monotonic()
        if not self._slots.acquire(timeout=self.cfg.queue_wait_s):
            waited = time.monotonic() - t_wait
            raise ResourceExhausted(
                f"code-exec: all {self.cfg.max_concurrent} execution slots busy for "
                f"{self.cfg.queue_wait_s:.1f}s (waited {waited:.1f}s)", waited
            )
        waited = time.monotonic() - t_wait
        try:
            res, data, why = self._run(script, files_dir, collect, collect_max_bytes)
        finally:
            self._slots.release()
        res.queue_wait = waited
        return res, data, why

    def _run(self, script, files_dir, collect, collect_max_bytes):
        lease = None
        run_dir = tempfile.mkdtemp(prefix=run_dir_prefix(self._host, os.getpid()), dir=self.work_root)
        try:
            ws = os.path.join(run_dir, "workspace")
            os.mkdir(ws, 0o755)
            if files_dir is not None:
                for entry in sorted(os.listdir(files_dir)):
                    src = os.path.join(files_dir, entry)
                    if os.path.isfile(src):
                        shutil.copyfile(src, os.path.join(ws, entry))
            with open(os.path.join(run_dir, "script.py"), "w") as f:
                f.write(script)
            ns = self.isolation == "namespaces"
            uid = None
            if ns:
                shutil.copyfile(os.path.join(run_dir, "script.py"), os.path.join(ws, ".script.py"))
                if self.as_root:
                    lease = _UidLease(self.cfg.uid_base, self.cfg.uid_count)
                    uid = lease.uid
                    kill_uid(uid)  # nothing of a previous holder may survive
                    for p in [ws, *(os.path.join(ws, e) for e in os.listdir(ws))]:
                        os.chown(p, uid, uid)
                root = os.path.join(run_dir, "root")
                os.mkdir(root, 0o755)
                inner = ["setpriv", "--inh-caps=-all", "--bounding-set=-all", "--no-new-privs"]
                if uid is not None:
                    inner[1:1] = [f"--reuid={uid}", f"--regid={uid}", "--clear-groups"]
                out = os.path.join(run_dir, "out")  # where the shell copies the collected file
                os.mkdir(out, 0o700)
                cmd = [*_ns_prefix(self.as_root), "sh", "-c", self._setup, "sh", root, ws, out, collect or "",
                       str(collect_max_bytes), "" if uid is None else str(uid),
                       *inner, *_prlimit_args(self.limits), sys.executable, "-s", ".script.py"]
                env, cwd = scrubbed_env(_WORKSPACE), run_dir
            else:
                cmd = [*_prlimit_args(self.limits), sys.executable, "-s",
                       os.path.join(run_dir, "script.py")]
                env, cwd = scrubbed_env(ws), ws
            res = self._execute(cmd, env, cwd, ns, uid)
            data, why = (None, None)
            if collect is not None:
                data, why = read_regular(os.path.join(out if ns else ws, collect), collect_max_bytes)
            return res, data, why
        finally:
            shutil.rmtree(run_dir, ignore_errors=True)
            if lease is not None:
                lease.release()

    def _execute(self, cmd, env, cwd, ns: bool, uid: int | None) -> SandboxRun:
        lim = self.limits
        killed_for = []
        t0 = time.monotonic()
        # The parent-death signal follows the thread that forks, which is this one: it waits
        # here until the script has ended, so only the process's death sends it.
        proc = subprocess.Popen([*parent_death_prefix(), *cmd], env=env, cwd=cwd, stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
                                close_fds=True)
        init_pid: list[int] = []

        def find_init():
            if ns and not init_pid:
                kids = _children(proc.pid)
                if kids:
                    init_pid.append(kids[0])

        def hard_kill():
            find_init()
            for pid in init_pid:  # pid 1 of the namespace: its death takes every descendant
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

        reader = _TailReader(proc.stdout, lim.output_tail_bytes, lim.output_limit_bytes,
                             lambda: (killed_for.append("output_limit"), hard_kill()))
        reader.start()
        try:
            deadline = t0 + lim.wall_s
            while True:
                find_init()
                try:
                    proc.wait(timeout=min(0.05 if not init_pid and ns else 0.5,
                                          max(0.0, deadline - time.monotonic())))
                    break
                except subprocess.TimeoutExpired:
                    if time.monotonic() >= deadline:
                        killed_for.append("timeout")
                        find_init()
                        try:
                            os.killpg(proc.pid, signal.SIGINT)
                        except ProcessLookupError:
                            pass
                        try:
                            proc.wait(timeout=lim.grace_s)
                        except subprocess.TimeoutExpired:
                            pass
                        hard_kill()
                        proc.wait()
                        break
        finally:
            if proc.poll() is None:  # an exception on our side: never leave it running
                hard_kill()
                proc.wait()
            elapsed = time.monotonic() - t0
            if not ns:  # level none: children left in the group (a setsid'd one escapes)
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            reader.join(timeout=5)
        stragglers = kill_uid(uid) if uid is not None else 0
        tail = reader.tail()
        rc = proc.returncode
        if ns and rc == SETUP_FAIL and SETUP_MARK in tail:
            raise SandboxError(tail.strip().splitlines()[-1])
        if ns:
            tail = without_wrapper_lines(tail)
        cpu_hit = rc in (-signal.SIGXCPU, 128 + signal.SIGXCPU)
        if killed_for and killed_for[0] == "output_limit":
            outcome, exc = "output_limit", "OutputLimitExceeded"
        elif killed_for or cpu_hit:
            outcome, exc = "timeout", ("CPUTimeLimit" if cpu_hit else "WallTimeout")
        elif rc == 0:
            outcome, exc = "ok", None
        else:
            outcome, exc = "error", exc_type_of(tail, rc)
        return SandboxRun(outcome=outcome, returncode=rc, exec_time=elapsed, tail=tail,
                          output_bytes=reader.total, exc_type=exc, isolation=self.isolation,
                          uid=uid, stragglers_killed=stragglers, limits=asdict(lim))


def read_regular(path: str, max_bytes: int) -> tuple[bytes | None, str | None]:
    """Bytes of a file the script left: (data, None) or (None, why), never an exception.

    Whatever the script put at `path` (a directory, FIFO, socket, device node, symlink, a file
    it keeps growing or truncating, one it made unreadable) is that script's invalid submission,
    not the grader's failure: every OSError becomes a reason. Links are never followed
    (O_NOFOLLOW), a FIFO never blocks the open (O_NONBLOCK), the type is checked on the open
    descriptor (fstat: no race with a rename), at most max_bytes + 1 bytes are read, and a size
    that differs before, during or after the read is refused rather than half-read."""
    import stat

    name = os.path.basename(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return None, f"no {name} written"
    except OSError as e:
        return None, f"{name} cannot be opened safely ({e.strerror})"
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return None, f"{name} is not a regular file"
        if st.st_size > max_bytes:
            return None, f"{name} is {st.st_size} bytes (limit {max_bytes})"
        chunks, got = [], 0
        while got <= max_bytes:
            chunk = os.read(fd, min(1 << 20, max_bytes + 1 - got))
            if not chunk:
                break
            chunks.append(chunk)
            got += len(chunk)
        after = os.fstat(fd)
    except OSError as e:
        return None, f"{name} cannot be read ({e.strerror})"
    finally:
        os.close(fd)
    if got > max_bytes:
        return None, f"{name} grew past {max_bytes} bytes while it was read"
    if got != st.st_size or (after.st_size, after.st_mtime_ns) != (st.st_size, st.st_mtime_ns):
        return None, f"{name} changed while it was read ({st.st_size} bytes, then {got} read, then {after.st_size})"
    return b"".join(chunks), None
