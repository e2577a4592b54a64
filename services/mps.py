"""CUDA MPS for a run whose rollout replica and learner share a GPU (config/gpu_sharing.py).

``plan_mps`` is the rule (a pure function, table-tested in tests/test_mps.py): time-slice and do
nothing (also mode=auto where RunConfig.gpu_sharing_auto_blocker names a reason, or the GPU is
not one where MPS was measured to pay, ``unmeasured_gpu_reason``); join a daemon
that already answers; or start one of the run's own, with its pipe and log directories under
the run directory (a short directory under /tmp when that path would exceed a Unix socket's
length limit). ``GpuSharing`` carries the plan out: it starts the daemon
before any GPU client exists, hands each role its variables (``env``: Ray's runtime_env of the
replicas and the learner's workers; vLLM's engine core is the replica's child and inherits
them), and quits a daemon it started when the run's ExitStack closes, after Ray has stopped the
clients. It never touches the GPU's compute mode (MPS works in the Default mode).

No Ray import: the daemon is a host process, driven through its control binary.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

log = logging.getLogger(__name__)

CONTROL_BINARY = "nvidia-cuda-mps-control"
# Where NVIDIA's container toolkit mounts the driver's binaries when they are not on PATH.
DRIVER_BIN_DIRS = ("/usr/local/nvidia/bin", "/usr/bin", "/usr/local/bin")
DEFAULT_PIPE_DIR = "/tmp/nvidia-mps"  # the daemon's own default, when CUDA_MPS_PIPE_DIRECTORY is unset
# sockaddr_un.sun_path holds 108 bytes; the daemon's longest name in its pipe directory is
# "control" plus a few server-side suffixes: leave room for them.
MAX_PIPE_DIR_CHARS = 80
ROLES = ("rollout", "learner")
CONTROL_TIMEOUT_S = 30.0  # the control client answers in milliseconds; quit waits for the servers to exit
# mode=auto's check that a CUDA client comes up under the daemon: the control daemon starts on any
# GPU, but its server starts with the first client, and NVIDIA documents MPS for data-center and
# workstation GPUs only. A client that cannot connect would fail the replica after Ray started it;
# this throwaway process fails first, while time-slicing is still open.
PROBE_COMMAND = (sys.executable, "-c", "import torch; torch.zeros(1, device='cuda'); torch.cuda.synchronize()")
PROBE_TIMEOUT_S = 180.0
CLIENT_PRIORITY = {"normal": "0", "below_normal": "1"}  # CUDA_MPS_CLIENT_PRIORITY's two levels
# The GPU models where mode=auto's MPS (the learner at 50% of the SMs beside generation) was measured
# to beat time-slicing, as nvidia-smi names them (a substring):
# - the H200: Qwen3-4B one_step_off, -5% at 1x8 and -15% at 4x8 (bench/results/gpu-vs-trl.md);
# - the H100 80GB HBM3: -7% at 1x8 on one machine, 2.394 s against 2.564 s, TRL + vLLM 2.477 s
#   (bench/results/gpu-2026-12-06-h100); at 4x8 a wash across two leases (MPS 1.11-1.13x TRL, time-
#   slicing 1.14-1.18x), and with fp8 rollouts MPS 0.65x, time-slicing 0.755x (gpu-vs-trl-h100*.md).
# A GPU not listed time-slices under auto; mode=mps asks for MPS anywhere.
MPS_MEASURED_GPUS = ("H200", "H100 80GB HBM3")
# A capped client can compute wrong numbers: on an H100 and an H200 (driver 580.159.04) the learner's
# bf16 LoRA GEMMs came out nan or wrong at most shares from 15 to 85% of the SMs (60, 75 and 80 among
# them), right at 5, 10, 25, 50 and 90-95% on both, 27, 48 and 96-99% on the H100 (model/gemm_check.py;
# bench/results/gpu-2026-12-06-h100, gpu-2026-12-06-h200).
# Every role capped below 100% runs that check as a throwaway client with its own variables before
# any GPU process of the run exists.
NUMERICS_TIMEOUT_S = 300.0
NVIDIA_SMI_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class MpsPlan:
    """What a run does about MPS, and why (run.json ``gpu_sharing``)."""

    action: Literal["none", "join", "start"]
    reason: str
    pipe_dir: str | None = None
    log_dir: str | None = None
    sm_percent: Mapping[str, int] = field(default_factory=dict)
    priority: Mapping[str, str] = field(default_factory=dict)  # role -> "normal" | "below_normal"

    def env(self, role: str) -> dict[str, str]:
        """The variables a process of ``role`` needs to be a client of this plan's daemon."""
        if self.action == "none":
            return {}
        out = {"CUDA_MPS_PIPE_DIRECTORY": str(self.pipe_dir)}  # clients need only the pipe; the log is the daemon's
        if self.sm_percent.get(role, 100) < 100:
            out["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = str(self.sm_percent[role])
        if self.priority.get(role, "normal") != "normal":
            out["CUDA_MPS_CLIENT_PRIORITY"] = CLIENT_PRIORITY[self.priority[role]]
        return out


def auto_timeslice_reason(auto_blocker: str | None, control_binary: str | None) -> str | None:
    """run.json's reason where gpu_sharing.mode=auto time-slices before any daemon is asked (None:
    it goes on to MPS)."""
    why = auto_blocker or (None if control_binary else f"{CONTROL_BINARY} is not on this host")
    return None if why is None else f"gpu_sharing.mode=auto: time-sliced, as {why}"


def visible_gpus(rows: list[tuple[str, str, str]], cuda_visible: str | None) -> list[str]:
    """The names of the GPUs this host's CUDA processes see: ``rows`` are nvidia-smi's (index, uuid,
    name), ``cuda_visible`` is CUDA_VISIBLE_DEVICES (indices or UUIDs, comma-separated; unset: all)."""
    if cuda_visible is None:
        return [name for _, _, name in rows]
    wanted = [w.strip() for w in cuda_visible.split(",") if w.strip()]
    by_key = {key: name for index, uuid, name in rows for key in (index, uuid)}
    return [by_key[w] for w in wanted if w in by_key]


def unmeasured_gpu_reason(names: list[str]) -> str | None:
    """Why mode=auto time-slices on these GPUs (None: every one is a model where MPS was measured
    to pay, MPS_MEASURED_GPUS)."""
    if not names:
        return "no GPU's model could be read on this host (nvidia-smi), so MPS's measured gain cannot be assumed"
    other = sorted({n for n in names if not any(m in n for m in MPS_MEASURED_GPUS)})
    if not other:
        return None
    return (f"the GPU is {', '.join(other)}: MPS was measured to pay only on {', '.join(MPS_MEASURED_GPUS)} "
            "(services/mps.py MPS_MEASURED_GPUS); gpu_sharing.mode=mps chooses it")


def read_visible_gpus(environ: Mapping[str, str]) -> list[str]:
    """visible_gpus from nvidia-smi on this host; [] where it is missing or fails. It opens no CUDA
    context, so it runs before the run's GPU processes without touching the GPU."""
    smi = find_driver_binary("nvidia-smi")
    if smi is None:
        return []
    try:
        done = subprocess.run([smi, "--query-gpu=index,uuid,name", "--format=csv,noheader"], text=True,
                              capture_output=True, timeout=NVIDIA_SMI_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired):
        return []
    if done.returncode != 0:
        return []
    rows = [tuple(c.strip() for c in line.split(",", 2)) for line in done.stdout.splitlines() if line.count(",") >= 2]
    return visible_gpus(rows, environ.get("CUDA_VISIBLE_DEVICES"))


def plan_mps(mode: str, sm_percent: Mapping[str, int], environ: Mapping[str, str], run_dir: Path,
             daemon_answers: Callable[[str], bool], control_binary: str | None,
             auto_blocker: str | None = None, priority: Mapping[str, str] | None = None) -> MpsPlan:
    """The rule. ``sm_percent`` and ``priority``: each role's SM share and client priority (a role
    left out of ``priority`` is normal). ``environ``: the driver's environment (a CUDA_MPS_PIPE_DIRECTORY there names the
    daemon the user runs, or wants); ``daemon_answers(pipe_dir)``: whether a daemon answers there;
    ``control_binary``: the control binary's path, None when none is found; ``auto_blocker``: why
    mode=auto time-slices this run (RunConfig.gpu_sharing_auto_blocker), None where it would take
    MPS. ValueError (one line) when MPS is asked for and cannot be had; auto never raises."""
    if mode == "auto":
        why = auto_timeslice_reason(auto_blocker, control_binary)
        if why is not None:
            return MpsPlan("none", why)
        chosen = plan_mps("mps", sm_percent, environ, run_dir, daemon_answers, control_binary, priority=priority)
        return replace(chosen, reason="gpu_sharing.mode=auto: MPS (one replica and one learner worker share a GPU, "
                                      f"one_step_off); {chosen.reason}")
    if mode != "mps":
        return MpsPlan("none", f"gpu_sharing.mode={mode}")
    shares = {role: int(sm_percent[role]) for role in ROLES}
    levels = {role: (priority or {}).get(role, "normal") for role in ROLES}
    if control_binary is None:
        raise ValueError(f"gpu_sharing.mode=mps, but {CONTROL_BINARY} is neither on PATH nor in "
                         f"{', '.join(DRIVER_BIN_DIRS)} (it ships with the NVIDIA driver)")
    named = environ.get("CUDA_MPS_PIPE_DIRECTORY")
    looked_at = named or DEFAULT_PIPE_DIR
    if daemon_answers(looked_at):
        return MpsPlan("join", f"an MPS daemon already answers at {looked_at}: the run joins it and leaves it running",
                       looked_at, environ.get("CUDA_MPS_LOG_DIRECTORY"), shares, levels)
    if named:  # the user named the directory: start there rather than beside it
        pipe_dir, where = named, "CUDA_MPS_PIPE_DIRECTORY"
    else:
        pipe_dir, where = str(Path(run_dir).resolve() / "mps" / "pipe"), "the run directory"
        if len(pipe_dir) > MAX_PIPE_DIR_CHARS:
            pipe_dir, where = "", f"a directory under /tmp (the run directory's path is over {MAX_PIPE_DIR_CHARS} characters, too long for the daemon's socket)"
    log_dir = environ.get("CUDA_MPS_LOG_DIRECTORY") or str(Path(run_dir).resolve() / "mps" / "log")
    return MpsPlan("start", f"no MPS daemon answered at {looked_at}: the run starts one in {where} and quits it at exit",
                   pipe_dir, log_dir, shares, levels)


def numerics_specs(cfg) -> dict[str, dict]:
    """model/gemm_check.py's spec per role: one adapted layer of the run's model at the LoRA rank,
    at token counts of the role's GEMMs: the learner's full micro-batch and three odd counts below
    it (a micro-batch's rows x its longest row vary by step, and cuBLAS picks kernels by shape),
    the replica's decode batches. The widths are the model's linears (services/memory_budget.py
    reads its config.json without a download), else Qwen3-4B's."""
    from model.gemm_check import FALLBACK_WIDTHS
    from services.memory_budget import DTYPE_BYTES, linear_sizes, model_config_file, model_shape

    try:
        path = model_config_file(cfg, None)
        config = json.loads(path.read_text())
        shape = model_shape(config, DTYPE_BYTES[cfg.model.dtype])
        widths, source = tuple(dict.fromkeys(linear_sizes(shape).values())), str(path)
    except (ValueError, KeyError, TypeError) as err:
        widths, source = FALLBACK_WIDTHS, f"Qwen3-4B's widths (no config.json readable for {cfg.model.name_or_path}: {err})"
    learner, rollout = cfg.learner, cfg.rollout
    mb = learner.micro_batch_tokens if isinstance(learner.micro_batch_tokens, int) else \
        learner.micro_batch_size * (rollout.max_tokens + 256)
    mb = min(mb, 16384)
    base = {"widths": [list(w) for w in widths], "widths_from": source, "rank": learner.lora.r,
            "dtype": cfg.model.dtype}
    return {"learner": {**base, "tokens": [mb, mb * 3 // 4 + 1, mb // 3 + 1, 257]},
            "rollout": {**base, "tokens": [8, rollout.max_num_seqs or 256]}}


def numerics_command(spec: Mapping[str, Any]) -> tuple[str, ...]:
    """The throwaway client that runs model/gemm_check.py on ``spec`` (one JSON line on stdout)."""
    return (sys.executable, "-m", "model.gemm_check", json.dumps({k: v for k, v in spec.items() if k != "widths_from"}))


def numerics_fail(command: tuple[str, ...] | list[str], env: Mapping[str, str], timeout: float = NUMERICS_TIMEOUT_S
                  ) -> tuple[str | None, dict[str, Any]]:
    """(None, the check's result) when the GEMM check passes as a client with ``env``, else (why in
    one line, what is known of the result)."""
    done, why = run_client(command, env, timeout)
    if done is None:
        return f"its GEMM check did not finish ({why})", {}
    lines = [line for line in (done.stdout or "").splitlines() if line.startswith("{")]
    try:
        result = json.loads(lines[-1]) if lines else {}
    except ValueError:
        result = {}
    if done.returncode == 0 and result.get("ok"):
        return None, result
    if result.get("off"):
        worst = result.get("worst") or {}
        return (f"{len(result['off'])} of {result.get('checked')} of an adapted layer's GEMMs came out wrong under it "
                f"(worst: {worst.get('name')}, off by {worst.get('error'):.3g} of the result's scale; "
                "model/gemm_check.py against fp32 on the CPU)"), result
    return f"its GEMM check {exit_line(done)}", result


def preview(cfg, control_binary: str | None) -> dict[str, Any]:
    """run.json's ``gpu_sharing`` as ``--dry-run`` shows it: the mode the run would take and why,
    without asking or starting a daemon (the start-up checks of mode=auto are named, not run)."""
    g = cfg.gpu_sharing
    if g.mode != "auto":
        return {"requested": g.mode, "mode": g.mode, "reason": f"gpu_sharing.mode={g.mode}"}
    why = auto_timeslice_reason(cfg.gpu_sharing_auto_blocker(), control_binary)
    if why is not None:
        return {"requested": "auto", "mode": "timeslice", "reason": why}
    return {"requested": "auto", "mode": "mps", "reason": "gpu_sharing.mode=auto: MPS (one replica and one learner "
            f"worker share a GPU, one_step_off), if the GPU is one where it was measured to pay "
            f"({', '.join(MPS_MEASURED_GPUS)}), the daemon comes up and a CUDA client connects under it at "
            "start-up; else time-sliced"}


def find_driver_binary(name: str, path: str | None = None) -> str | None:
    """One of the driver's binaries (the MPS control, nvidia-smi): on PATH, else in the driver's
    usual bin directories."""
    found = shutil.which(name, path=path)
    if found:
        return found
    for d in DRIVER_BIN_DIRS:
        candidate = Path(d) / name
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    return None


def find_control_binary(path: str | None = None) -> str | None:
    """The MPS control binary (find_driver_binary)."""
    return find_driver_binary(CONTROL_BINARY, path)


def _control(binary: str, pipe_dir: str, log_dir: str | None, command: str | None, timeout: float
             ) -> subprocess.CompletedProcess:
    env = dict(os.environ, CUDA_MPS_PIPE_DIRECTORY=pipe_dir)
    if log_dir:
        env["CUDA_MPS_LOG_DIRECTORY"] = log_dir
    args = [binary] if command is not None else [binary, "-d"]
    return subprocess.run(args, input=(command + "\n") if command is not None else None, env=env, text=True,
                          capture_output=True, timeout=timeout)


def daemon_answers(binary: str | None, pipe_dir: str, timeout: float = CONTROL_TIMEOUT_S) -> bool:
    """Whether a control daemon answers at ``pipe_dir`` (the client exits non-zero when none does)."""
    if binary is None or not (Path(pipe_dir) / "control").exists():
        return False
    try:
        return _control(binary, pipe_dir, None, "get_server_list", timeout).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def run_client(command: tuple[str, ...] | list[str], env: Mapping[str, str], timeout: float
               ) -> tuple[subprocess.CompletedProcess | None, str]:
    """(the finished process, "") or (None, why it did not finish); ``env`` on top of ours."""
    try:
        return subprocess.run(list(command), env=dict(os.environ, **env), text=True, capture_output=True,
                              timeout=timeout), ""
    except (OSError, subprocess.TimeoutExpired) as err:
        return None, f"{type(err).__name__}: {err}"


def exit_line(done: subprocess.CompletedProcess) -> str:
    """'exited N' and the process's last line of output."""
    detail = (done.stderr or done.stdout or "").strip().splitlines()
    return f"exited {done.returncode}" + (f": {detail[-1]}" if detail else "")


def client_fails(command: tuple[str, ...] | list[str], pipe_dir: str, timeout: float = PROBE_TIMEOUT_S) -> str | None:
    """None when ``command`` (a CUDA client) runs to exit 0 under the daemon at ``pipe_dir``, else why
    not in one line."""
    done, why = run_client(command, {"CUDA_MPS_PIPE_DIRECTORY": pipe_dir}, timeout)
    if done is None:
        return f"a CUDA client under it did not come up ({why})"
    return None if done.returncode == 0 else f"a CUDA client under it {exit_line(done)}"


class GpuSharing:
    """The run's MPS plan carried out. ``start`` before Ray creates any GPU client; ``stop`` (an
    ExitStack callback registered before Ray's shutdown, so it runs after it) quits a daemon this
    run started. ``record`` is run.json's ``gpu_sharing``."""

    def __init__(self, plan: MpsPlan, binary: str | None, requested: str = "mps",
                 numerics: Mapping[str, Mapping[str, Any]] | None = None):
        self.plan, self.binary, self.requested, self.timeout_s = plan, binary, requested, CONTROL_TIMEOUT_S
        self.probe_command = PROBE_COMMAND
        self.numerics_specs = dict(numerics or {})  # role -> model/gemm_check.py spec; a role without one is not checked
        self.numerics: dict[str, Any] = {}  # run.json gpu_sharing.numerics: role -> the check's result
        self.started = False
        self.quit: str | None = None

    @classmethod
    def for_run(cls, cfg, run_dir: Path) -> "GpuSharing":
        g = cfg.gpu_sharing
        blocker = cfg.gpu_sharing_auto_blocker() if g.mode == "auto" else None
        if g.mode == "auto" and blocker is None:  # the config allows it: is this GPU one where it was measured?
            blocker = unmeasured_gpu_reason(read_visible_gpus(os.environ))
        binary = find_control_binary() if g.mode == "mps" or (g.mode == "auto" and blocker is None) else None
        plan = plan_mps(g.mode, {"rollout": g.rollout_sm_percent, "learner": g.learner_sm_percent}, os.environ,
                        run_dir, lambda pipe_dir: daemon_answers(binary, pipe_dir), binary, blocker,
                        priority={"learner": g.learner_priority})
        capped = plan.action != "none" and min(plan.sm_percent.values()) < 100
        return cls(plan, binary, g.mode, numerics_specs(cfg) if capped else None)  # config.json read only then

    def env(self, role: str) -> dict[str, str]:
        return self.plan.env(role)

    def start(self) -> None:
        self._start_daemon()
        if self.plan.action == "none":
            return
        if self.requested == "auto":
            why = client_fails(self.probe_command, str(self.plan.pipe_dir))
            if why is not None:  # still before any GPU process of the run: time-slice instead
                self._time_slice_instead(f"MPS at {self.plan.pipe_dir} was up but {why}")
                return
        self._check_numerics()

    def _check_numerics(self) -> None:
        """model/gemm_check.py as a client of each role capped below 100% of the SMs: auto
        time-slices where one is wrong, mps refuses in one line; both before any GPU process of
        the run exists."""
        for role in ROLES:
            share = self.plan.sm_percent.get(role, 100)
            if share >= 100 or role not in self.numerics_specs:
                continue
            why, result = numerics_fail(numerics_command(self.numerics_specs[role]), self.plan.env(role))
            self.numerics[role] = {"sm_percent": share, "ok": why is None, **({"why": why} if why else {}),
                                   **{k: result[k] for k in ("sm_count", "checked", "worst") if k in result}}
            if why is None:
                continue
            what = f"under MPS with {role}_sm_percent={share} (CUDA_MPS_ACTIVE_THREAD_PERCENTAGE) {why}"
            if self.requested == "auto":
                self._time_slice_instead(what)
                return
            self.stop()
            raise RuntimeError(f"gpu_sharing.mode=mps: {what}; choose another gpu_sharing.{role}_sm_percent "
                               "(on an H100 and an H200 50 was right, most shares from 15 to 85 wrong) or gpu_sharing.mode=timeslice")

    def _time_slice_instead(self, why: str) -> None:
        log.warning("gpu_sharing.mode=auto: %s; the run time-slices the GPU", why)
        self.stop()
        self.plan = MpsPlan("none", f"gpu_sharing.mode=auto: time-sliced, as {why}")

    def _start_daemon(self) -> None:
        plan = self.plan
        if plan.action != "start":
            return
        if not plan.pipe_dir:
            plan = self.plan = replace(plan, pipe_dir=tempfile.mkdtemp(prefix="cp-mps-"))
        Path(plan.pipe_dir).mkdir(parents=True, exist_ok=True)
        Path(plan.log_dir).mkdir(parents=True, exist_ok=True)
        done = _control(self.binary, plan.pipe_dir, plan.log_dir, None, self.timeout_s)
        if done.returncode != 0 or not daemon_answers(self.binary, plan.pipe_dir, self.timeout_s):
            detail = (done.stderr or done.stdout or "").strip().splitlines()
            why = (f"{self.binary} -d did not start a daemon at {plan.pipe_dir} "
                   f"(exit {done.returncode}{': ' + detail[-1] if detail else ''}; its log: {plan.log_dir})")
            if self.requested == "auto":  # no GPU process exists yet: time-slicing is still open
                log.warning("gpu_sharing.mode=auto: %s; the run time-slices the GPU", why)
                self.plan = MpsPlan("none", f"gpu_sharing.mode=auto: time-sliced, as {why}")
                return
            raise RuntimeError(f"gpu_sharing.mode=mps: {why}")
        self.started = True
        log.info("MPS daemon started: pipe %s, log %s", plan.pipe_dir, plan.log_dir)

    def stop(self) -> None:
        if not self.started:
            return
        try:
            done = _control(self.binary, self.plan.pipe_dir, self.plan.log_dir, "quit", self.timeout_s)
            self.quit = "ok" if done.returncode == 0 else f"exit {done.returncode}: {(done.stderr or '').strip()}"
        except (OSError, subprocess.TimeoutExpired) as err:
            self.quit = f"failed: {err}"
        self.started = False
        if self.quit != "ok":
            log.warning("MPS daemon at %s did not quit cleanly (%s)", self.plan.pipe_dir, self.quit)

    def record(self) -> dict[str, Any]:
        p = self.plan
        out: dict[str, Any] = {"mode": "mps" if p.action != "none" else "timeslice", "requested": self.requested,
                               "daemon": p.action, "reason": p.reason}
        if p.action != "none":
            out.update(pipe_dir=p.pipe_dir, log_dir=p.log_dir, sm_percent=dict(p.sm_percent),
                       priority=dict(p.priority), control_binary=self.binary)
            if p.action == "start":
                out["quit"] = self.quit
        if self.numerics:
            out["numerics"] = dict(self.numerics)
        return out
