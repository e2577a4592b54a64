"""`counterpoint replicate`: N training runs that differ only in seed, each followed by the same
held-out eval, so `counterpoint compare` can put an interval over runs.

Each arm is its own `counterpoint train` + `counterpoint eval --run` subprocess: a failed arm
is reported (and recorded in the replicate receipt), never hidden, and never takes the other
arms down. With `--pin-init` every arm starts from the first arm's saved init adapter, so the
seed varies only sampling and data order; each arm's receipt says which init it used.
Arms run one after another on one box, or `--parallel K` at a time against a cluster
(`--address`), each arm's Ray driver joining it.
"""

from __future__ import annotations

import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path


@dataclass
class Arm:
    seed: int
    run_dir: Path
    eval_file: Path
    status: str = "pending"  # completed | failed
    error: str | None = None
    init_adapter: str | None = None


@dataclass
class ReplicatePlan:
    config: Path
    seeds: list[int]
    out_dir: Path
    overrides: list[str] = field(default_factory=list)
    pin_init: bool = False
    address: str | None = None
    parallel: int = 1
    eval_args: list[str] = field(default_factory=list)


def _cli() -> list[str]:
    return [sys.executable, "-m", "services.cli"]


def _run(cmd: list[str], log: Path) -> None:
    with open(log, "a") as fh:
        fh.write("$ " + " ".join(cmd) + "\n")
        fh.flush()
        done = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT)
    if done.returncode != 0:
        raise RuntimeError(f"`{' '.join(cmd[2:5])} ...` exited {done.returncode} (log: {log})")


def run_arm(plan: ReplicatePlan, arm: Arm, init_adapter: Path | None) -> Arm:
    log = plan.out_dir / f"seed{arm.seed}.log"
    common = ["--set", f"seed={arm.seed}", *sum((["--set", o] for o in plan.overrides), [])]
    if plan.address:
        common += ["--set", f"trainer.ray_address={plan.address}"]
    train = [*_cli(), "train", "--config", str(plan.config), "--run-name", arm.run_dir.name,
             "--set", f"trainer.runs_dir={arm.run_dir.parent}", "--set", "trainer.metrics_port=0", *common]
    if init_adapter is not None:
        train += ["--init-adapter", str(init_adapter)]
        arm.init_adapter = str(init_adapter)
    else:
        arm.init_adapter = "seeded"
    try:
        _run(train, log)
        _run([*_cli(), "eval", "--config", str(plan.config), *common, "--run", str(arm.run_dir),
              "--seed", str(arm.seed), "--out", str(arm.eval_file), *plan.eval_args], log)
        arm.status = "completed"
    except Exception as err:  # one failed arm is reported, the others go on
        arm.status, arm.error = "failed", str(err)
    return arm


def replicate(plan: ReplicatePlan) -> list[Arm]:
    plan.out_dir.mkdir(parents=True, exist_ok=True)
    arms = [Arm(s, plan.out_dir / "runs" / f"seed{s}", plan.out_dir / f"eval_seed{s}.jsonl") for s in plan.seeds]
    init: Path | None = None
    rest = arms
    if plan.pin_init:
        # The first arm saves adapters/init; every other arm starts from exactly that file.
        first = run_arm(plan, arms[0], None)
        init = first.run_dir / "adapters" / "init"
        if not (init / "adapter_config.json").exists():
            for arm in arms[1:]:
                arm.status, arm.error = "failed", f"no pinned init: the first arm (seed {first.seed}) failed"
            return arms
        first.init_adapter = f"{init} (saved by this arm)"
        rest = arms[1:]
    with ThreadPoolExecutor(max_workers=max(1, plan.parallel)) as pool:
        list(pool.map(lambda arm: run_arm(plan, arm, init), rest))
    return arms


def arms_table(arms: list[Arm]):
    from rich.table import Table

    table = Table(title="replicates")
    for col in ("seed", "status", "init", "run", "eval", "error"):
        table.add_column(col)
    for a in arms:
        table.add_row(str(a.seed), a.status, a.init_adapter or "", str(a.run_dir), str(a.eval_file), a.error or "")
    return table


def as_records(arms: list[Arm]) -> list[dict]:
    return [{k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(a).items()} for a in arms]
