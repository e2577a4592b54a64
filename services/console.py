"""The console of `counterpoint train` is for people; everything else goes to the run's logs.

Without `--verbose` the terminal shows the start-up stages with their durations, one line per
step (or a live bar on a terminal), the before/after table, warnings and errors of our own code,
and where the run directory is. Everything else lands in `runs/<run>/logs/`:

- `driver.log`: the driver's own log (every logger at INFO, Ray/Serve/Train driver-side lines)
  and whatever the process writes to its stdout/stderr file descriptors (C++ core, libraries).
- `ray/`: Ray's session logs (`worker-*.out|err` of every Serve replica, vLLM engine, Ray Train
  worker and controller, `serve/`, `train/`, raylet, GCS). A symlink to Ray's session
  directory while the run is alive, a copy once the cluster this run started is shut down (the
  session directory is then removed from /tmp/ray).

How: the process's fds 1 and 2 point at driver.log; `sys.stdout` is a stream on a copy of the
terminal's fd (so `print`, `typer.echo` and rich tables reach people; other threads' stdout goes
to the log: `_MainThreadStdout`) and `sys.stderr` writes to the log; Ray is told
`log_to_driver=False` (services/launch.py). `--verbose` keeps today's behaviour (everything
streamed to the terminal) and still writes driver.log and links ray/.

An error anywhere (a replica constructor, a learner worker) reaches the driver as an exception;
`failure_lines` gives its first lines and the paths of the full logs.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, TextIO

OUR_LOGGERS = ("counterpoint", "services", "rollout", "graders", "learner")
FORMAT_FILE = "%(asctime)s %(name)s %(levelname)s %(message)s"
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


# ---------------------------------------------------------------- pure helpers
def console_wants(name: str, level: int) -> bool:
    """Whether a driver-side log record belongs on the console: our `counterpoint.*` loggers at
    INFO, our other modules at WARNING, third-party libraries (Ray, Serve, vLLM...) at ERROR."""
    ours = name.split(".")[0] in OUR_LOGGERS
    if name == "counterpoint" or name.startswith("counterpoint."):
        return level >= logging.INFO
    return level >= (logging.WARNING if ours else logging.ERROR)


def stage_line(name: str, seconds: float) -> str:
    return f"  {name:<18} {seconds:6.1f} s"


def first_lines(text: str, n: int = 8, width: int = 200) -> list[str]:
    """The first n non-empty lines of text (ANSI colours stripped, long lines cut)."""
    out = []
    for line in _ANSI.sub("", text).splitlines():
        if line.strip():
            out.append(line if len(line) <= width else line[: width - 1] + "…")
        if len(out) == n:
            break
    return out


def failing_logs(ray_logs: Path, limit: int = 3) -> list[Path]:
    """Worker logs (Serve replicas, Train workers) that hold a Python traceback, newest first."""
    if not ray_logs.is_dir():
        return []
    hits = []
    for path in ray_logs.glob("worker-*.err"):
        try:
            if "Traceback (most recent call last)" in path.read_text(errors="replace"):
                hits.append(path)
        except OSError:
            continue
    return sorted(hits, key=lambda p: p.stat().st_mtime, reverse=True)[:limit]


_EXC = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt)(\([\w.]*\))?(: |$)")


def traceback_cause(text: str, extra: int = 2) -> list[str]:
    """The innermost exception of the first Python traceback in text: its line and up to `extra`
    indented lines under it (pydantic's detail), or [] without a traceback."""
    lines = _ANSI.sub("", text).splitlines()
    start = next((i for i, line in enumerate(lines) if line.lstrip().startswith("Traceback (most recent")), None)
    if start is None:
        return []
    last = None
    for i in range(start + 1, len(lines)):
        line = lines[i]
        if _EXC.match(line):
            last = i
        elif line and not line[0].isspace() and last is not None and not line.startswith(
                ("Traceback", "During handling", "The above exception")):
            break  # the traceback is over: a log line follows
    if last is None:
        return []
    out = [lines[last]]
    for line in lines[last + 1:last + 1 + extra]:
        if not line[:1].isspace():
            break
        out.append(line)
    return [first_lines(line, 1, 300)[0] if line.strip() else line for line in out if line.strip()]


def failure_lines(err: BaseException, logs_dir: Path, n: int = 6) -> list[str]:
    """What the console says about a run that failed: the error's first lines, the cause found
    in a service's log (a replica's or worker's traceback), then where the full logs are."""
    message = str(err)
    head = first_lines(message, n)
    lines = [f"error: {type(err).__name__}: " + (head[0] if head else "")]
    cause = traceback_cause(message)
    if cause:
        lines += ["  " + line.strip() for line in cause]
    else:
        lines += ["  " + line for line in head[1:]]
    logs = failing_logs(logs_dir / "ray")
    for path in logs:
        found = traceback_cause(path.read_text(errors="replace"))
        if found and not cause:
            lines.append(f"cause, from {path.name}:")
            lines += ["  " + line.strip() for line in found]
            cause = found
    lines.append(f"full log: {logs_dir / 'driver.log'}")
    lines += [f"service log with a traceback: {path}" for path in logs]
    if not (logs_dir / "ray").exists():
        lines.append(f"service logs: {logs_dir / 'ray'} (not written: Ray did not start)")
    return lines


def copy_logs(src: Path, dest: Path) -> None:
    """Copy Ray's session logs (regular files only: sockets and fifos are skipped) to dest,
    replacing a symlink left there while the run was alive."""
    if dest.is_symlink():
        dest.unlink()
    for path in sorted(src.rglob("*")):
        if path.is_file() and not path.is_symlink():
            target = dest / path.relative_to(src)
            target.parent.mkdir(parents=True, exist_ok=True)
            try:
                shutil.copy2(path, target)
            except OSError:
                continue


# ---------------------------------------------------------------- the run's logs
RAY_PREFIXED = re.compile(r"(\x1b\[[0-9;]*m)?\((raylet|gcs_server|pid=\d+|[A-Za-z_][\w:.]* pid=\d+)[^)]*\)")


class _MainThreadStdout:
    """sys.stdout of a run: the main thread's writes (print, typer.echo, rich tables) reach the
    terminal; other threads' (Ray's error listener prints raylet notices such as "Task
    ServeController.graceful_shutdown failed ... retried" to sys.stdout) go to driver.log."""

    def __init__(self, console: TextIO, log: TextIO) -> None:
        self.console, self.log = console, log

    def _sink(self) -> TextIO:
        return self.console if threading.current_thread() is threading.main_thread() else self.log

    def write(self, text: str) -> int:
        # Ray also prints its processes' lines ("(raylet) Task ... failed", "(ServeReplica pid=..)")
        # from the main thread, e.g. while ray.shutdown() drains them: those go to the log too.
        if RAY_PREFIXED.match(text):
            return self.log.write(text)
        return self._sink().write(text)

    def flush(self) -> None:
        self.console.flush()
        self.log.flush()

    def isatty(self) -> bool:
        return self._sink().isatty()

    def fileno(self) -> int:
        return self._sink().fileno()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.console, name)


class _ConsoleHandler(logging.Handler):
    def __init__(self, logs: "RunLogs") -> None:
        super().__init__(logging.INFO)
        self.logs = logs
        self.setFormatter(logging.Formatter("%(message)s"))

    def filter(self, record: logging.LogRecord) -> bool:  # type: ignore[override]
        return self.logs.verbose or console_wants(record.name, record.levelno)

    def emit(self, record: logging.LogRecord) -> None:
        try:
            msg = self.format(record)
            if record.levelno >= logging.WARNING:
                msg = f"{record.levelname.lower()}: {msg}"
            self.logs.echo(msg, to_file=False)
        except Exception:  # never let the console break a run
            self.handleError(record)


@dataclass
class RunLogs:
    """The run's log directory and the terminal stream (see the module docstring)."""

    dir: Path
    verbose: bool
    console: TextIO
    live: Any = None  # a rich Progress while the bar is shown
    _saved: list[Any] = field(default_factory=list)

    @property
    def ray_dir(self) -> Path:
        return self.dir / "ray"

    def echo(self, line: str, to_file: bool = True) -> None:
        """A line for people (also kept in driver.log unless it came from a log record)."""
        if to_file:
            self.to_file(line)
        if self.live is not None:
            self.live.console.print(line, markup=False, highlight=False, soft_wrap=True)
        else:
            self.console.write(line + "\n")
            self.console.flush()

    def to_file(self, text: str) -> None:
        """Write to driver.log only (a traceback the console summarises)."""
        self._saved[4].write(text if text.endswith("\n") else text + "\n")
        self._saved[4].flush()

    def link_ray_logs(self, session_logs: Path) -> None:
        """runs/<run>/logs/ray -> Ray's session logs while the run is alive."""
        if self.ray_dir.is_symlink() or self.ray_dir.exists():
            if self.ray_dir.is_dir() and not self.ray_dir.is_symlink():
                shutil.rmtree(self.ray_dir)  # a resumed run: the newest session's logs replace it
            else:
                self.ray_dir.unlink()
        self.ray_dir.symlink_to(session_logs, target_is_directory=True)

    def keep_ray_logs(self, session_logs: Path) -> bool:
        """Replace the symlink with a copy (Ray's /tmp session directory is removed next:
        services/launch.py); whether runs/<run>/logs/ray now holds the copy."""
        if not (self.ray_dir.is_symlink() and session_logs.is_dir()):
            return False
        copy_logs(session_logs, self.ray_dir)
        return self.ray_dir.is_dir() and not self.ray_dir.is_symlink()  # not made: no file to copy


_current: RunLogs | None = None


def current() -> RunLogs | None:
    """The active run logs (set by `run_logs`), or None outside `counterpoint train`."""
    return _current


def echo(line: str) -> None:
    """A line for people: the console of a run, or stdout outside one."""
    if _current is not None:
        _current.echo(line)
    else:
        print(line, flush=True)


class run_logs:
    """Context manager: route the process's output as the module docstring says."""

    def __init__(self, logs_dir: Path, verbose: bool = False) -> None:
        self.dir, self.verbose = Path(logs_dir).resolve(), verbose
        self.logs: RunLogs | None = None

    def __enter__(self) -> RunLogs:
        global _current
        self.dir.mkdir(parents=True, exist_ok=True)
        sys.stdout.flush()
        sys.stderr.flush()
        logfile = open(self.dir / "driver.log", "a", buffering=1, encoding="utf-8", errors="replace")
        logfile.write(f"==== counterpoint train, pid {os.getpid()}, {time.strftime('%Y-%m-%d %H:%M:%S')}: "
                      f"{' '.join(sys.argv)}\n")
        saved: list[Any] = [sys.stdout, sys.stderr, None, None, logfile]
        if self.verbose:
            console: TextIO = sys.stdout
        else:
            saved[2], saved[3] = os.dup(1), os.dup(2)
            console = open(os.dup(1), "w", buffering=1, encoding="utf-8", errors="replace")
            os.dup2(logfile.fileno(), 1)
            os.dup2(logfile.fileno(), 2)
            sys.stdout, sys.stderr = _MainThreadStdout(console, logfile), logfile
        logs = RunLogs(self.dir, self.verbose, console, _saved=saved)
        root = logging.getLogger()
        for h in list(root.handlers):
            root.removeHandler(h)
        root.setLevel(logging.INFO)
        file_handler = logging.StreamHandler(logfile)
        file_handler.setFormatter(logging.Formatter(FORMAT_FILE))
        root.addHandler(file_handler)
        root.addHandler(_ConsoleHandler(logs))
        self.logs = logs
        _current = logs
        return logs

    def __exit__(self, *exc: Any) -> None:
        global _current
        logs, _current = self.logs, None
        if logs is None:
            return
        out, err, fd1, fd2, logfile = logs._saved
        sys.stdout.flush()
        sys.stderr.flush()
        if fd1 is not None:
            os.dup2(fd1, 1)
            os.dup2(fd2, 2)
            os.close(fd1)
            os.close(fd2)
            logs.console.close()
        sys.stdout, sys.stderr = out, err
        root = logging.getLogger()
        for h in list(root.handlers):
            root.removeHandler(h)
        logging.basicConfig(level=logging.INFO, format=FORMAT_FILE)
        logfile.close()


# ---------------------------------------------------------------- start-up stages
class StageClock:
    """Times the start-up stages: `done(name)` prints the seconds since the previous mark."""

    def __init__(self) -> None:
        self.last = time.perf_counter()
        self.seconds: dict[str, float] = {}
        echo("starting:")

    def done(self, name: str) -> float:
        now = time.perf_counter()
        self.seconds[name], self.last = now - self.last, now
        echo(stage_line(name, self.seconds[name]))
        return self.seconds[name]


def iter_phases(phases: dict[str, float]) -> Iterator[tuple[str, float]]:
    order = ["gen", "score", "old_log_prob", "ref", "adv", "update_actor", "update_weights", "save_checkpoint"]
    for name in order + sorted(set(phases) - set(order)):
        if name in phases:
            yield name, phases[name]
