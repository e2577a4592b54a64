"""GPU memory of a GRPO run, per process and per phase: `counterpoint train` against TRL + vLLM
colocate, each at its lowest-memory setting, back to back on one GPU (issue 31, item 1).

    # on the device, one call per shape (bench/device/session.sh memory; 4B 1x8, both sides, ~6-8 min):
    python3 bench/memory.py run --shapes qwen3-4b:1 --out-dir $OUT [--set k=v ...] [--trl-arg=--vllm-sleep]
    # here, the committed table from the files the calls brought back:
    python3 bench/memory.py report OUT1/memory.json OUT2/memory.json --command '...'

Both sides are bench/gpu_vs_trl.py's (the same random-init Qwen3 shapes, LoRA r=32 on all
linear layers, G=8, 384 new tokens), each as a subprocess:
- ``trl_vllm``: ``gpu_vs_trl.py trl --vllm`` with vllm_gpu_memory_utilization 0.09, gradient
  checkpointing and one group per micro-step (``TRL_FLAGS``; ``--trl-arg`` adds more, e.g.
  ``--vllm-sleep``);
- ``counterpoint_train``: ``counterpoint train --config configs/gpu-bench.yaml`` in sync mode with
  ``COUNTERPOINT_SETS`` (rollout.gpu_memory_utilization 0.09, learner.gradient_checkpointing),
  then every ``--set`` given. Merged LoRA keeps W0 where rollout.merged_w0 says (host by
  default; ``--set rollout.merged_w0=device``), and the row's settings say which.

While a run lasts, a thread asks ``nvidia-smi --query-compute-apps=pid,used_memory`` and
``--query-gpu=memory.used`` every ``--interval`` seconds (0.2). Processes that were on the GPU
before the run started are left out; this process never touches CUDA. A row (``ROW_KEYS``):
- ``total_gib``: the peak over the samples of the summed memory of the run's processes;
- ``gpu_used_gib``: the peak of nvidia-smi's memory.used (adds the driver's own reservation);
- ``processes``: each process's peak, named by its title (Ray's actor title, a script's command,
  or "spawned by" its parent for a multiprocessing child such as vLLM's engine core);
- ``phases_gib``: the peak total in each phase (``PHASES``). TRL's run marks its phases itself
  (gpu_vs_trl.PhaseMarks: ``score`` holds its old log-probs pass, ``generate`` and ``sync`` nest
  in it). counterpoint's are laid out from timing.jsonl: a step ends when its line appears
  (seen within one interval), the next starts there, and its phases follow in the loop's order
  (gen, score + adv, the learner, update_weights, save_checkpoint). Samples within an interval
  of a boundary may fall on either side of it; torch's caching allocators rarely give memory
  back, so a phase's peak is mostly where the total grew.
- ``s_per_step``: the median of the timed steps (TRL: after 1 warm-up; counterpoint: after 1,
  the last left out, as gpu_vs_trl.py train does); ``settings``, ``command``, ``date`` (UTC),
  ``exit`` (the exit code, or "timeout") and ``error``.
memory.json: {"rows": [...], "command", "versions"}; memory.md: the table and each run's
processes. ``--samples`` keeps every sample of a run in a .jsonl beside them.
"""

from __future__ import annotations

import argparse
import bisect
import contextlib
import datetime as dt
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

if sys.path and Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from bench.gpu_vs_trl import (CONFIG_ONLY, CONFIG_ONLY_SETS, GROUP_SIZE, ROOT, TRAIN_CONFIG, read_jsonl,  # noqa: E402
                              train_figures, train_overrides)

SYSTEMS = ("trl_vllm", "counterpoint_train")
TRL_FLAGS = ("--vllm-gpu-util", "0.09", "--checkpointing", "--accumulate")
# merged_w0=host: configs/gpu-bench.yaml keeps W0 on the GPU for speed; the memory rows measure the default
COUNTERPOINT_SETS = ("rollout.gpu_memory_utilization=0.09", "learner.gradient_checkpointing=true", "rollout.merged_w0=host")
PHASES = ("start", "generate", "sync", "score", "update", "save", "end")
ROW_KEYS = ("model", "prompts", "group_size", "system", "settings", "total_gib", "s_per_step", "date",
            "gpu_used_gib", "processes", "phases_gib", "command", "exit", "error")
MIB_PER_GIB = 1024.0


# ---------------------------------------------------------------- nvidia-smi, parsed
def parse_compute_apps(text: str) -> dict[int, float]:
    """``nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader,nounits`` as
    {pid: MiB}; a process on several GPUs is summed, and rows without a number ("[N/A]",
    "[Not Supported]", "No running processes found") are left out."""
    out: dict[int, float] = {}
    for line in text.splitlines():
        parts = [x.strip() for x in line.split(",")]
        if len(parts) != 2:
            continue
        try:
            pid, used = int(parts[0]), float(parts[1])
        except ValueError:
            continue
        out[pid] = out.get(pid, 0.0) + used
    return out


def parse_gpu_used(text: str) -> float | None:
    """``nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits``: MiB over all GPUs."""
    values = []
    for line in text.splitlines():
        try:
            values.append(float(line.strip()))
        except ValueError:
            continue
    return sum(values) if values else None


def fold_name(argv: list[str], parent: str = "") -> str:
    """A process's name from its command line: Ray's title without the method it is in
    (Ray retitles a worker per call), a multiprocessing child as spawned by its parent, else
    the program and its first arguments."""
    if not argv or not argv[0]:
        return ""
    if argv[0].startswith("ray::"):
        return argv[0].split(".")[0][:80]
    if argv[0].startswith("VLLM") or " " in argv[0]:  # a title set by setproctitle
        return argv[0][:80]
    if any("multiprocessing" in a for a in argv[1:4]):
        return f"spawned by {parent or 'an unknown parent'}"[:80]
    return " ".join([Path(argv[0]).name, *argv[1:4]])[:80]


def process_name(pid: int) -> str:
    def argv_of(p: int) -> list[str]:
        try:
            return Path(f"/proc/{p}/cmdline").read_bytes().decode(errors="replace").rstrip("\0").split("\0")
        except OSError:
            return []

    parent = ""
    try:
        ppid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        parent = fold_name(argv_of(ppid))
    except (OSError, IndexError, ValueError):
        pass
    return fold_name(argv_of(pid), parent)


def nvidia_smi(query: str) -> str:
    return subprocess.run(["nvidia-smi", f"--query-{query}", "--format=csv,noheader,nounits"],
                          capture_output=True, text=True, timeout=10).stdout


# ---------------------------------------------------------------- sampling
@dataclass
class Sample:
    t: float  # unix time
    apps: dict[int, float]  # pid -> MiB, the run's processes only
    gpu_used: float | None  # MiB, every process and the driver


@dataclass
class Sampler:
    """Samples the GPU every ``interval`` s in a thread until ``stop()``; ``watch(t)`` runs after
    each sample (counterpoint's timing.jsonl). Leaves out ``exclude`` (the pids already there)."""

    interval: float = 0.2
    exclude: set[int] = field(default_factory=set)
    watch: Callable[[float], None] | None = None
    query_apps: Callable[[], str] = lambda: nvidia_smi("compute-apps=pid,used_memory")
    query_gpu: Callable[[], str] = lambda: nvidia_smi("gpu=memory.used")
    name_of: Callable[[int], str] = process_name
    samples: list[Sample] = field(default_factory=list)
    names: dict[int, str] = field(default_factory=dict)
    error: str | None = None

    def __post_init__(self):
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> "Sampler":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=15)

    def sample_once(self) -> None:
        t = time.time()
        apps = {pid: mib for pid, mib in parse_compute_apps(self.query_apps()).items() if pid not in self.exclude}
        self.samples.append(Sample(t, apps, parse_gpu_used(self.query_gpu())))
        for pid in apps:
            known = self.names.get(pid, "")
            if not known or known.startswith("ray::IDLE"):
                self.names[pid] = self.name_of(pid) or known
        if self.watch is not None:
            self.watch(t)

    def _run(self) -> None:
        while not self._stop.is_set():
            t = time.monotonic()
            try:
                self.sample_once()
            except FileNotFoundError as err:  # no nvidia-smi: nothing to measure
                self.error = f"{type(err).__name__}: {err}"
                return
            except (subprocess.TimeoutExpired, OSError, ValueError) as err:
                self.error = f"{type(err).__name__}: {err}"  # one missed sample; go on
            self._stop.wait(max(0.0, self.interval - (time.monotonic() - t)))


def versions() -> dict[str, str]:
    """The packages of both sides and the GPU's name, without CUDA in this process (a CUDA
    context here would sit on the GPU beside the runs)."""
    import importlib.metadata as md

    out = {"python": sys.version.split()[0]}
    for name in ("torch", "transformers", "peft", "trl", "accelerate", "vllm", "ray"):
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            pass
    try:
        out["device"] = nvidia_smi("gpu=name,driver_version").strip()
    except (FileNotFoundError, subprocess.TimeoutExpired):
        pass
    return out


def gpu_pids() -> set[int]:
    try:
        return set(parse_compute_apps(nvidia_smi("compute-apps=pid,used_memory")))
    except (FileNotFoundError, subprocess.TimeoutExpired):
        return set()


# ---------------------------------------------------------------- phases
def parse_phase_log(text: str) -> list[tuple[float, str]]:
    """gpu_vs_trl.PhaseMarks' lines ("<unix time> <phase>") as sorted transitions."""
    out = []
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 2:
            try:
                out.append((float(parts[0]), parts[1]))
            except ValueError:
                continue
    return sorted(out, key=lambda x: x[0])


class TimingWatch:
    """New lines of a run's timing.jsonl, each with the time it was first seen."""

    def __init__(self, path: Path):
        self.path, self.offset, self.steps = path, 0, []
        self._partial = ""

    def __call__(self, t: float) -> None:
        try:
            with open(self.path) as fh:
                fh.seek(self.offset)
                text = fh.read()
                self.offset = fh.tell()
        except OSError:
            return
        text = self._partial + text
        lines = text.split("\n")
        self._partial = lines.pop()  # a line still being written
        for line in lines:
            if line.strip():
                self.steps.append((t, json.loads(line)))


def train_transitions(steps: list[tuple[float, dict[str, Any]]]) -> list[tuple[float, str]]:
    """counterpoint's phases from its timing lines, each seen at a time (the step's end): a
    step starts where the previous one ended (the first: its end less its seconds), then
    generate (gen), score (score + adv), update (the learner, up to what follows), sync
    (update_weights) and save (save_checkpoint) up to its end; after the last step, end."""
    out: list[tuple[float, str]] = []
    prev_end = None
    for seen, row in steps:
        ph = row.get("phases_s", {})
        save, sync = ph.get("save_checkpoint", 0.0), ph.get("update_weights", 0.0)
        begin = prev_end if prev_end is not None else seen - row.get("total_s", 0.0) - save
        sync_at = max(begin, seen - save - sync)
        score_at = min(begin + ph.get("gen", 0.0), sync_at)
        update_at = min(score_at + ph.get("score", 0.0) + ph.get("adv", 0.0), sync_at)
        out += [(begin, "generate"), (score_at, "score"), (update_at, "update"), (sync_at, "sync"),
                (max(sync_at, seen - save), "save")]
        prev_end = seen
    if prev_end is not None:
        out.append((prev_end, "end"))
    return out


def phase_at(transitions: list[tuple[float, str]], t: float) -> str:
    """The phase at time ``t``: the last transition at or before it ("start" before any)."""
    i = bisect.bisect_right([x for x, _ in transitions], t)
    return transitions[i - 1][1] if i else "start"


# ---------------------------------------------------------------- a run's figures
def summarize(samples: list[Sample], transitions: list[tuple[float, str]], names: dict[int, str]) -> dict[str, Any]:
    """Peaks in GiB: of the run's summed memory (``total_gib``), of nvidia-smi's memory.used
    (``gpu_used_gib``), per process (largest first) and per phase (in ``PHASES`` order)."""
    def gib(mib):
        return None if mib is None else round(mib / MIB_PER_GIB, 2)

    totals = [sum(s.apps.values()) for s in samples]
    used = [s.gpu_used for s in samples if s.gpu_used is not None]
    per_pid: dict[int, float] = {}
    per_phase: dict[str, float] = {}
    for s, total in zip(samples, totals):
        for pid, mib in s.apps.items():
            per_pid[pid] = max(per_pid.get(pid, 0.0), mib)
        phase = phase_at(transitions, s.t)
        per_phase[phase] = max(per_phase.get(phase, 0.0), total)
    order = {p: i for i, p in enumerate(PHASES)}
    return {
        "total_gib": gib(max(totals)) if samples else None,
        "gpu_used_gib": gib(max(used)) if used else None,
        "processes": [{"pid": pid, "name": names.get(pid) or f"pid {pid}", "peak_gib": gib(mib)}
                      for pid, mib in sorted(per_pid.items(), key=lambda kv: -kv[1])],
        "phases_gib": {p: gib(per_phase[p]) for p in sorted(per_phase, key=lambda p: order.get(p, len(order)))},
    }


def make_row(model: str, prompts: int, system: str, settings: str, figures: dict[str, Any],
             s_per_step: float | None, command: str, exit_code: int | str | None, error: str | None,
             when: dt.datetime | None = None) -> dict[str, Any]:
    row = {"model": model, "prompts": prompts, "group_size": GROUP_SIZE, "system": system, "settings": settings,
           "total_gib": figures.get("total_gib"), "s_per_step": None if s_per_step is None else round(s_per_step, 3),
           "date": (when or dt.datetime.now(dt.timezone.utc)).strftime("%Y-%m-%d"),
           "gpu_used_gib": figures.get("gpu_used_gib"), "processes": figures.get("processes", []),
           "phases_gib": figures.get("phases_gib", {}), "command": command, "exit": exit_code, "error": error}
    validate_row(row)
    return row


def validate_row(row: dict[str, Any]) -> None:
    """A row has exactly ``ROW_KEYS``, with their types; raises ValueError naming what is off."""
    if set(row) != set(ROW_KEYS):
        raise ValueError(f"row keys {sorted(row)}, want {sorted(ROW_KEYS)}")
    if row["system"] not in SYSTEMS:
        raise ValueError(f"system {row['system']!r}: want one of {SYSTEMS}")
    for k in ("prompts", "group_size"):
        if not isinstance(row[k], int) or isinstance(row[k], bool):
            raise ValueError(f"{k} must be an integer, got {row[k]!r}")
    for k in ("total_gib", "gpu_used_gib", "s_per_step"):
        if row[k] is not None and (not isinstance(row[k], (int, float)) or isinstance(row[k], bool)):
            raise ValueError(f"{k} must be a number or null, got {row[k]!r}")
    for k in ("model", "settings", "date", "command"):
        if not isinstance(row[k], str):
            raise ValueError(f"{k} must be a string, got {row[k]!r}")
    dt.date.fromisoformat(row["date"])
    if not isinstance(row["phases_gib"], dict) or not all(p in PHASES for p in row["phases_gib"]):
        raise ValueError(f"phases_gib must map phases of {PHASES} to GiB, got {row['phases_gib']!r}")
    if not isinstance(row["processes"], list) or not all(set(p) == {"pid", "name", "peak_gib"} for p in row["processes"]):
        raise ValueError("processes must be a list of {pid, name, peak_gib}")


# ---------------------------------------------------------------- running both sides
def build_models(shapes: list[tuple[str, int]], args) -> None:
    """The models, built in a process of their own before anything is sampled (built on the
    GPU, its memory goes with the process)."""
    wanted = sorted({m for m, _ in shapes if not (args.models / m / "config.json").is_file()})
    for model in wanted:
        code = ("import sys; from pathlib import Path; sys.path.insert(0, '.'); from bench.gpu_vs_trl import build_model; "
                f"build_model({model!r}, Path({str(args.tokenizer)!r}), Path({str(args.models / model)!r}), "
                "'cuda')")
        t = time.monotonic()
        subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)
        print(f"[memory] built {model} in {time.monotonic() - t:.0f} s", flush=True)


def stop_group(proc: subprocess.Popen) -> None:
    """Ends a run that outlived its time: SIGINT (the CLI shuts Ray down), then SIGTERM, then
    SIGKILL, to the process group it leads (started with a session of its own)."""
    for sig, wait in ((signal.SIGINT, 30), (signal.SIGTERM, 10), (signal.SIGKILL, 5)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def _default_sigint() -> None:
    """In the run's process, before it execs: SIGINT back to its default. A bench started in the
    background of a non-interactive shell (`nohup ... &`, session.sh) has SIGINT ignored, and
    the run would inherit that and never hear stop_group's SIGINT (its clean shutdown)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def measure(cmd: list[str], env: dict[str, str], log: Path, timeout: float, interval: float,
            watch: Callable[[float], None] | None) -> tuple[Sampler, int | str]:
    """Runs ``cmd`` with the GPU sampled; returns the sampler and the exit code ("timeout")."""
    sampler = Sampler(interval=interval, exclude=gpu_pids() | {os.getpid()}, watch=watch).start()
    with open(log, "w") as fh:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True,
                                preexec_fn=_default_sigint)
        try:
            rc: int | str = proc.wait(timeout=max(timeout, 1))
        except subprocess.TimeoutExpired:
            stop_group(proc)
            rc = "timeout"
    sampler.stop()
    return sampler, rc


def show_tail(log: Path, title: str, lines: int = 40) -> None:
    """The end of a failed run's log on the console (each line tagged, so session.sh shows it)."""
    try:
        text = log.read_text(errors="replace").splitlines()
    except OSError:
        text = [f"({log} is not there)"]
    print(f"[memory] --- {title}:", *(f"[memory] | {x[:400]}" for x in text[-lines:]), sep="\n", flush=True)


def wait_for_gpu_free(before: set[int], limit_s: float = 60.0) -> set[int]:
    """Waits until no process but ``before`` holds GPU memory; returns what is left after."""
    end = time.monotonic() + limit_s
    left = gpu_pids() - before
    while left and time.monotonic() < end:
        time.sleep(1.0)
        left = gpu_pids() - before
    return left


def run_trl(model: str, prompts: int, args, out: Path, timeout: float) -> dict[str, Any]:
    tag = f"trl_vllm-{model}-{prompts}x{GROUP_SIZE}"
    phase_log, result = out / f"{tag}.phases", out / f"{tag}.json"
    phase_log.unlink(missing_ok=True)
    flags = [*TRL_FLAGS, *args.trl_arg]
    cmd = [sys.executable, str(ROOT / "bench" / "gpu_vs_trl.py"), "trl", "--vllm", "--shapes", f"{model}:{prompts}",
           "--steps", str(args.steps), "--trl-steps-4x8", str(args.steps), *flags, "--out", str(result),
           "--tokenizer", str(args.tokenizer), "--models", str(args.models), "--runs", str(args.runs),
           "--deadline-s", str(max(timeout - 60, 1)), "--stop-s", str(max(timeout - 30, 1))]
    env = {**os.environ, "CP_PHASE_LOG": str(phase_log)}
    sampler, rc = measure(cmd, env, out / f"{tag}.log", timeout, args.interval, None)
    shapes = json.loads(result.read_text()).get("shapes", []) if result.is_file() else []
    got = shapes[0] if shapes else {}
    transitions = parse_phase_log(phase_log.read_text()) if phase_log.is_file() else []
    settings = trl_settings(flags, prompts)
    if rc != 0 or got.get("error"):
        show_tail(out / f"{tag}.log", f"{tag} exit {rc}")
    error = got.get("error") or sampler.error or (None if rc == 0 else f"exit {rc}")
    return finish(model, prompts, "trl_vllm", settings, sampler, transitions, got.get("s_per_step"),
                  cmd, rc, error, out / f"{tag}.samples.jsonl" if args.samples else None)


def trl_settings(flags: list[str], prompts: int) -> str:
    """TRL's flags as the settings they make."""
    words = {"--checkpointing": "gradient_checkpointing", "--no-checkpointing": "no gradient checkpointing",
             "--vllm-sleep": "vllm_enable_sleep_mode"}
    out, i = [], 0
    while i < len(flags):
        if flags[i] == "--vllm-gpu-util" and i + 1 < len(flags):
            out.append(f"vllm_gpu_memory_utilization={flags[i + 1]}")
            i += 2
            continue
        if flags[i] == "--accumulate":
            out.append(f"batch {GROUP_SIZE} x accumulation {prompts}")
        else:
            out.append(words.get(flags[i], flags[i]))
        i += 1
    return ", ".join(["colocate", *out])


def run_counterpoint(model: str, prompts: int, args, out: Path, timeout: float) -> dict[str, Any]:
    tag = f"counterpoint_train-{model}-{prompts}x{GROUP_SIZE}"
    name = f"memory-{model}-{prompts}x{GROUP_SIZE}-{args.mode}-{int(time.time())}"
    # a shape without a checkpoint (14B, 32B): the replica draws the weights, the learner maps them
    shape_sets = CONFIG_ONLY_SETS if model in CONFIG_ONLY else ()
    sets = [*train_overrides(args.models / model, prompts, args.mode, args.steps + 2, args.runs),
            *COUNTERPOINT_SETS, *shape_sets, *args.set]
    cmd = [sys.executable, "-m", "services.cli", "train", "--config", str(args.config), "--run-name", name,
           *sum((["--set", x] for x in sets), [])]
    run = args.runs / name
    watch = TimingWatch(run / "timing.jsonl")
    sampler, rc = measure(cmd, dict(os.environ), out / f"{tag}.log", timeout, args.interval, watch)
    watch(time.time())  # a last line written after the last sample
    s_step, error = None, sampler.error or (None if rc == 0 else f"exit {rc}")
    if (run / "timing.jsonl").is_file():
        s_step = train_figures(run, 1, args.mode).get("s_per_step")
    elif error is None:
        error = "no timing.jsonl"
    if rc != 0:  # where the cause is: the end of the driver's log
        driver = run / "logs" / "driver.log"
        show_tail(driver if driver.is_file() else out / f"{tag}.log", f"{name} exit {rc}")
    replica_memory(run, out / f"{tag}.replica-memory.json")
    settings = ", ".join([f"{Path(args.config).name}", f"trainer.mode={args.mode}", *COUNTERPOINT_SETS, *shape_sets,
                          *args.set,
                          f"merged W0 on {merged_w0_of(run)}", base_weights_of(run)])
    return finish(model, prompts, "counterpoint_train", settings, sampler, train_transitions(watch.steps), s_step,
                  ["counterpoint", *cmd[3:]], rc, error, out / f"{tag}.samples.jsonl" if args.samples else None)


# vLLM's own account of its memory, from the replica's log: the weights it loaded, the KV cache
# it sized from gpu_memory_utilization, and the CUDA graphs it captured after
# vLLM's own memory lines (its worker's log), not Ray's state dumps or the graph-capture progress bars
VLLM_MEMORY_LINES = re.compile(r"Model loading took|Available KV cache memory|GPU KV cache size|Graph capturing finished|"
                               r"Actual usage is|memory profiling|non-torch memory")


def replica_memory(run: Path, dest: Path) -> dict[str, Any]:
    """Where the replica's GPU memory went, beside nvidia-smi's figure for its process: torch's
    view (run.json rollout_engine.stats.device_memory_gib, after start-up and after the last
    adapter) and vLLM's own lines from the run's logs. Written to ``dest`` and printed."""
    found: dict[str, Any] = {"torch": None, "vllm_log": []}
    try:
        found["torch"] = json.loads((run / "run.json").read_text())["rollout_engine"]["stats"].get("device_memory_gib")
    except (OSError, ValueError, KeyError, TypeError):
        pass
    logs = run / "logs"
    if logs.is_dir():
        files = [Path(d) / f for d, _, names in os.walk(logs, followlinks=True) for f in names]  # logs/ray: a link
        for path in sorted(files):
            if path.is_file() and path.suffix in (".log", ".out", ".err"):
                with contextlib.suppress(OSError):
                    found["vllm_log"] += [line.strip()[:300] for line in path.read_text(errors="replace").splitlines()
                                          if VLLM_MEMORY_LINES.search(line)]
    found["vllm_log"] = list(dict.fromkeys(found["vllm_log"]))[:40]
    dest.write_text(json.dumps(found, indent=1) + "\n")
    print(f"[memory]   replica, torch's view (GiB): {json.dumps(found['torch'])}", flush=True)
    for line in found["vllm_log"]:
        print(f"[memory]   vllm: {line}", flush=True)
    return found


def merged_w0_of(run: Path) -> str:
    """Where the run's merged LoRA kept W0 (its recorded rollout.merged_w0)."""
    try:
        return json.loads((run / "run.json").read_text())["config"]["rollout"].get("merged_w0", "host")
    except (OSError, ValueError, KeyError):
        return "unknown (no run.json)"


def base_weights_of(run: Path) -> str:
    """What run.json says of the learner's base: one shared copy or its own (share_base_weights)."""
    try:
        base = json.loads((run / "run.json").read_text()).get("base_weights") or {}
    except (OSError, ValueError):
        return "base weights: unknown (no run.json)"
    return "base weights shared with the replica" if base.get("mode") == "shared" else \
        f"learner's own base copy ({base.get('reason', 'no reason recorded')})"


def finish(model, prompts, system, settings, sampler: Sampler, transitions, s_step, cmd, rc, error,
           samples_out: Path | None) -> dict[str, Any]:
    if samples_out is not None:
        with open(samples_out, "w") as fh:
            for s in sampler.samples:
                fh.write(json.dumps({"t": round(s.t, 3), "phase": phase_at(transitions, s.t), "apps": s.apps,
                                     "gpu_used": s.gpu_used}) + "\n")
    row = make_row(model, prompts, system, settings, summarize(sampler.samples, transitions, sampler.names),
                   s_step, shlex.join(str(c) for c in cmd), rc, error)
    print(f"[memory] {json.dumps({k: row[k] for k in ('model', 'prompts', 'system', 'total_gib', 'gpu_used_gib', 's_per_step', 'phases_gib', 'exit', 'error')})}",
          flush=True)
    print(f"[memory]   processes: {json.dumps([(p['name'], p['peak_gib']) for p in row['processes']])}", flush=True)
    return row


# Seconds a run takes at 4B 1x8 on the H200, start-up included (bench/results/gpu-2026-12-01*):
# kept for the runs after the one that starts, so that one slow run cannot take the call.
RESERVE_S = {"trl_vllm": 180.0, "counterpoint_train": 200.0}


def earlier_rows(out: Path) -> list[dict[str, Any]]:
    """Rows an earlier invocation wrote into the same --out-dir: they stay when this one writes
    (a device call that runs several shapes one after another lost its first row that way)."""
    path = out / "memory.json"
    return json.loads(path.read_text())["rows"] if path.is_file() else []


def run(args) -> int:
    out: Path = args.out_dir.resolve()
    out.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + args.budget_s
    shapes = [(m, int(p)) for m, p in (s.split(":") for s in args.shapes.split(","))]
    build_models(shapes, args)
    found = versions()
    command = args.command or shlex.join(["python3", "bench/memory.py", *sys.argv[1:]])
    plan = [(m, p, system) for m, p in shapes for system in args.systems]
    before = gpu_pids()
    if before:
        print(f"[memory] already on the GPU, left out of every run: {sorted(before)}", flush=True)
    earlier = earlier_rows(out)
    rows = []
    for i, (model, prompts, system) in enumerate(plan):
        left = deadline - time.monotonic() - sum(RESERVE_S[s] for _, _, s in plan[i + 1:])
        if left < 60:
            print(f"[memory] {model} {prompts}x{GROUP_SIZE} {system}: skipped, the call's budget is spent", flush=True)
            continue
        if system == "trl_vllm" and model in CONFIG_ONLY:
            print(f"[memory] {model} {prompts}x{GROUP_SIZE} trl_vllm: skipped, TRL loads a checkpoint and this shape "
                  "has none (bench/gpu_vs_trl.py CONFIG_ONLY)", flush=True)
            continue
        runner = run_trl if system == "trl_vllm" else run_counterpoint
        rows.append(runner(model, prompts, args, out, left))
        stray = wait_for_gpu_free(before)
        if stray:
            print(f"[memory] still on the GPU after the run: {sorted(stray)}", flush=True)
        write([*earlier, *rows], command, out, found)
    return 0 if rows and all(r["exit"] == 0 and not r["error"] for r in rows) else 1


# ---------------------------------------------------------------- results
def write(rows: list[dict[str, Any]], command: str, out: Path, versions: dict[str, str]) -> None:
    for row in rows:
        validate_row(row)
    doc = {"rows": rows, "command": command, "versions": versions}
    (out / "memory.json").write_text(json.dumps(doc, indent=1) + "\n")
    (out / "memory.md").write_text(markdown(doc))


def fmt(x, spec=".1f") -> str:
    return "–" if x is None else format(x, spec)


def markdown(doc: dict[str, Any]) -> str:
    lines = ["# GPU memory of a GRPO run: `counterpoint train` against TRL + vLLM colocate", "",
             "Random-init Qwen3 shapes (bf16), LoRA r=32 on all linear layers, G=8, 384 new tokens "
             "(bench/gpu_vs_trl.py). Each side at its lowest-memory setting; nvidia-smi sampled while the run "
             "lasts (bench/memory.py says how). GiB = 2^30 bytes.", "", "## Command", "", "```", doc["command"], "```",
             "", "## Peaks", "",
             "| model | completions | system | settings | total GiB (its processes) | GPU used GiB | s/step | "
             + " | ".join(PHASES) + " | exit | date |",
             "|---|---|---|---|---|---|---|" + "---|" * len(PHASES) + "---|---|"]
    for r in doc["rows"]:
        lines.append(f"| {r['model']} | {r['prompts']}x{r['group_size']} | {r['system']} | {r['settings']} | "
                     f"**{fmt(r['total_gib'])}** | {fmt(r['gpu_used_gib'])} | {fmt(r['s_per_step'], '.2f')} | "
                     + " | ".join(fmt(r["phases_gib"].get(p)) for p in PHASES)
                     + f" | {r['exit']}{' (' + r['error'] + ')' if r['error'] else ''} | {r['date']} |")
    lines += ["", "## Processes (peak GiB each)", "", "| model | completions | system | process | pid | peak GiB |",
              "|---|---|---|---|---|---|"]
    for r in doc["rows"]:
        for p in r["processes"]:
            lines.append(f"| {r['model']} | {r['prompts']}x{r['group_size']} | {r['system']} | {p['name']} | "
                         f"{p['pid']} | {fmt(p['peak_gib'], '.2f')} |")
    lines += ["", "## Runs", ""] + [f"- {r['system']} {r['model']} {r['prompts']}x{r['group_size']}: `{r['command']}`"
                                    for r in doc["rows"]]
    lines += ["", "## Versions", "", "```", json.dumps(doc["versions"], indent=1), "```"]
    return "\n".join(lines) + "\n"


def report(args) -> int:
    """The committed memory.json / memory.md from one or more calls' memory.json."""
    docs = [json.loads(Path(p).read_text()) for p in args.inputs]
    rows = [r for d in docs for r in d["rows"]]
    args.out_dir.mkdir(parents=True, exist_ok=True)
    write(rows, args.command, args.out_dir, docs[0].get("versions", {}) if docs else {})
    print(f"wrote {args.out_dir / 'memory.json'} and {args.out_dir / 'memory.md'} ({len(rows)} rows)")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="part", required=True)
    p = sub.add_parser("run", help="both sides on the given shapes, sampled; memory.json/.md into --out-dir")
    p.add_argument("--shapes", default="qwen3-4b:1", help="model:prompts,...")
    p.add_argument("--systems", type=lambda x: [s for s in x.split(",") if s], default=list(SYSTEMS),
                   help=f"which sides, in order ({','.join(SYSTEMS)})")
    p.add_argument("--steps", type=int, default=3, help="timed steps per run (each side adds its warm-up)")
    p.add_argument("--mode", default="sync", help="counterpoint's trainer.mode (phases are laid out for sync)")
    p.add_argument("--set", action="append", default=[], help="more overrides for counterpoint train (after ours)")
    p.add_argument("--trl-arg", action="append", default=[], help="more flags for gpu_vs_trl.py trl (after ours)")
    p.add_argument("--config", type=Path, default=TRAIN_CONFIG)
    p.add_argument("--interval", type=float, default=0.2, help="seconds between samples")
    p.add_argument("--budget-s", type=float, default=540.0, help="the call's time: no run starts that cannot end by then")
    p.add_argument("--samples", action="store_true", help="keep every sample in <run>.samples.jsonl")
    p.add_argument("--command", default="", help="recorded as the report's command (default: this one)")
    p.add_argument("--out-dir", type=Path, required=True)
    p.add_argument("--tokenizer", type=Path, default=ROOT / ".devcache" / "tokenizer")
    p.add_argument("--models", type=Path, default=Path("/tmp/gpu-vs-trl/models"))
    p.add_argument("--runs", type=Path, default=Path("/tmp/gpu-vs-trl/runs"))
    p = sub.add_parser("report", help="the committed table from calls' memory.json files")
    p.add_argument("inputs", nargs="+", type=Path)
    p.add_argument("--command", required=True, help="the device command(s) that produced the inputs")
    p.add_argument("--out-dir", type=Path, default=ROOT / "bench" / "results")
    args = ap.parse_args(argv)
    if args.part == "report":
        return report(args)
    unknown = sorted(set(args.systems) - set(SYSTEMS))
    if unknown or not args.systems:
        ap.error(f"--systems: unknown {unknown or args.systems}; use {','.join(SYSTEMS)}")
    args.tokenizer, args.models, args.runs = args.tokenizer.resolve(), args.models.resolve(), args.runs.resolve()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    return run(args)


if __name__ == "__main__":
    raise SystemExit(main())
