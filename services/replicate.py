"""`counterpoint replicate`: N training runs that differ only in seed, each evaluated on the same
held-out prompts before and after training, so `counterpoint compare` can put an interval over
runs; with `--grid`, the same for every cell of a grid over config keys, aggregated per cell
across seeds (evals/grid.py).

Each arm is one `counterpoint train` subprocess: a failed arm is reported (and recorded in the
replicate receipt), never hidden, and never takes the other arms down. A flat arm evaluates
inside its run (eval.before_and_after, the eval section's prompts and sampling, the eval seed the
arm's seed): the starting policy before the first step (heldout_before.jsonl) and the trained
adapter after the last (heldout_after.jsonl), on the replicas and grader the run already holds,
where a separate `counterpoint eval` paid a second start-up per arm and a third per seed for the
base model. With `--pin-init` every arm (of a cell) starts from the first arm's saved init
adapter, so the seed varies only sampling and data order; each arm's receipt says which init it
used. Arms run one after another on one box, or `--parallel K` at a time against a cluster
(`--address`), each arm's Ray driver joining it.

A grid (`--grid learner.lr=3e-5,1e-4 --grid learner.advantage=...`) is the cartesian product of
its axes; cell i is named c<i>_<key>-<value>... and its arms <cell>__seed<s>. Every cell's config
is loaded and checked for every seed, with the settings replicate adds, before anything runs.
Tree cells (trainer.rollout_mode "tree") get none of those eval settings: their held-out figures
are each round's honest_test_metric and, with eval.before_and_after in their config, the run's
own before/after drafts on the test rows.
"""

from __future__ import annotations

import itertools
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from evals.heldout import REPLICATE_OWNS  # the keys replicate sets itself for every arm


class GridSpecError(ValueError):
    """A --grid option that cannot define a grid; the message names it."""


@dataclass(frozen=True)
class Cell:
    name: str  # "" for a plain replicate (no grid)
    overrides: tuple[str, ...] = ()  # this cell's grid values as key=value, in axis order


@dataclass
class Arm:
    seed: int
    run_dir: Path
    eval_file: Path | None
    status: str = "pending"  # completed | failed
    error: str | None = None
    init_adapter: str | None = None
    cell: str = ""
    overrides: list[str] = field(default_factory=list)
    mode: str = "flat"  # the cell's trainer.rollout_mode
    before_file: Path | None = None

    @property
    def name(self) -> str:
        return self.run_dir.name


@dataclass
class ReplicatePlan:
    config: Path
    seeds: list[int]
    out_dir: Path
    overrides: list[str] = field(default_factory=list)
    pin_init: bool = False
    address: str | None = None
    parallel: int = 1
    eval_sets: list[str] = field(default_factory=list)  # eval.KEY=V every flat arm's in-run eval takes
    cells: list[Cell] = field(default_factory=lambda: [Cell("")])
    modes: dict[str, str] = field(default_factory=dict)  # cell name -> trainer.rollout_mode


# ------------------------------------------------------------------------------- grid spec (pure)


def _split_values(text: str) -> list[str]:
    """Split on commas outside brackets, so a YAML list value ([1,2]) stays one value."""
    out, depth, cur = [], 0, ""
    for ch in text:
        depth += ch in "[{"
        depth -= ch in "]}"
        if ch == "," and depth == 0:
            out.append(cur)
            cur = ""
        else:
            cur += ch
    return [*out, cur]


def parse_grid(specs: list[str], sets: list[str] = ()) -> list[tuple[str, list[str]]]:
    """--grid KEY=v1,v2 options as (key, values) axes. Refuses a malformed option, an empty or
    repeated value, a key given twice (or inside another axis' key), a key also given by --set,
    and the keys replicate sets itself, in --grid or in --set."""
    axes: list[tuple[str, list[str]]] = []
    set_keys = [s.partition("=")[0].strip() for s in sets]
    for key in set_keys:
        if key in REPLICATE_OWNS:
            raise GridSpecError(f"--set {key}: {REPLICATE_OWNS[key]}")
    for spec in specs:
        key, eq, raw = spec.partition("=")
        key = key.strip()
        if not eq or not key or not raw.strip():
            raise GridSpecError(f"--grid {spec!r}: expected KEY=v1,v2,...")
        values = [v.strip() for v in _split_values(raw)]
        if any(v == "" for v in values):
            raise GridSpecError(f"--grid {spec!r}: an empty value")
        if len(set(values)) != len(values):
            raise GridSpecError(f"--grid {spec!r}: a value is repeated")
        if key in REPLICATE_OWNS:
            raise GridSpecError(f"--grid {key}: {REPLICATE_OWNS[key]}, not a grid key")
        for other in [k for k, _ in axes]:
            if _overlap(key, other):
                raise GridSpecError(f"--grid {key}: overlaps --grid {other} (one axis per key)")
        for other in set_keys:
            if _overlap(key, other):
                raise GridSpecError(f"--grid {key}: also given by --set {other}=...; give it in one place")
        axes.append((key, values))
    return axes


def _overlap(a: str, b: str) -> bool:
    return a == b or a.startswith(b + ".") or b.startswith(a + ".")


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._+-]+", "-", text).strip("-") or "x"


def grid_cells(axes: list[tuple[str, list[str]]]) -> list[Cell]:
    """The cartesian product of the axes, first axis slowest. Cell i is named
    c<i>_<leaf>-<value>_... (<leaf> the key's last part, or the whole key where two axes share
    a leaf); no axes gives the one unnamed cell of a plain replicate."""
    if not axes:
        return [Cell("")]
    leaves = [k.split(".")[-1] for k, _ in axes]
    names = [leaf if leaves.count(leaf) == 1 else key.replace(".", "-") for leaf, (key, _) in zip(leaves, axes)]
    cells = []
    for i, combo in enumerate(itertools.product(*(values for _, values in axes)), start=1):
        label = "_".join(f"{_slug(n)}-{_slug(v)}" for n, v in zip(names, combo))
        cells.append(Cell(f"c{i}_{label}", tuple(f"{k}={v}" for (k, _), v in zip(axes, combo))))
    return cells


def arm_name(cell: Cell, seed: int) -> str:
    return f"{cell.name}__seed{seed}" if cell.name else f"seed{seed}"


def flat_eval_sets(seed: int, eval_sets: list[str]) -> list[str]:
    """What a flat arm's run adds to its config: the in-run eval before and after training,
    sampled with the arm's seed and replicate's eval settings."""
    return ["eval.before_and_after=true", f"eval.seed={seed}", *eval_sets]


def one_line(err: Exception) -> str:
    """A (possibly multi-line) config error as one line."""
    text = ""
    for line in (x.strip() for x in str(err).splitlines() if x.strip()):
        text += (" " if text.endswith(":") else "; " if text else "") + line
    return text


def check_grid(config: Path, sets: list[str], specs: list[str], seeds: list[int], eval_sets: list[str] = ()
               ) -> tuple[list[Cell], dict[str, str]]:
    """Load every cell's config for every seed, as its arms will run it (a flat cell with the
    in-run eval settings), and run the checks that need no service, so bad grid input fails in
    one line before any arm runs. Returns the cells and each cell's trainer.rollout_mode."""
    from config import ConfigError, load_config
    from services.preflight import PreflightError, preflight

    cells = grid_cells(parse_grid(specs, sets))
    modes: dict[str, str] = {}
    for cell in cells:
        for seed in seeds:
            try:
                cfg = load_config(config, [*sets, *cell.overrides, f"seed={seed}"])
                if cfg.trainer.rollout_mode != "tree":
                    cfg = load_config(config, [*sets, *cell.overrides, f"seed={seed}",
                                               *flat_eval_sets(seed, list(eval_sets))])
                preflight(cfg, ports=False)
            except (ConfigError, PreflightError, ValueError) as err:
                where = f"grid cell {cell.name} ({' '.join(cell.overrides)})" if cell.name else "config"
                raise GridSpecError(f"{where}: {one_line(err)}") from None
        modes[cell.name] = cfg.trainer.rollout_mode
    return cells, modes


def grid_report(out_dir: Path, cells: list[Cell], arms: list[Arm], last_k: int | None = None) -> dict[str, str]:
    """Aggregate the arms per cell (evals/grid.py): grid.json and grid.png in out_dir."""
    from evals.grid import LAST_K, ArmFiles, aggregate, write_grid_json, write_grid_png

    files = [ArmFiles(a.cell, a.seed, a.status, a.run_dir, a.eval_file, a.before_file, a.mode, a.error) for a in arms]
    report = aggregate([{"cell": c.name, "overrides": list(c.overrides)} for c in cells], files, last_k or LAST_K)
    return {"grid_json": str(write_grid_json(report, out_dir / "grid.json")),
            "grid_png": str(write_grid_png(report, out_dir / "grid.png"))}


# ------------------------------------------------------------------------------- running arms


def _cli() -> list[str]:
    return [sys.executable, "-m", "services.cli"]


def _run(cmd: list[str], log: Path) -> None:
    with open(log, "a") as fh:
        fh.write("$ " + " ".join(cmd) + "\n")
        fh.flush()
        done = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT)
    if done.returncode != 0:
        raise RuntimeError(f"`{' '.join(cmd[2:5])} ...` exited {done.returncode} (log: {log})")


def _common(plan: ReplicatePlan, seed: int, overrides: list[str]) -> list[str]:
    common = ["--set", f"seed={seed}", *sum((["--set", o] for o in [*plan.overrides, *overrides]), [])]
    if plan.address:
        common += ["--set", f"trainer.ray_address={plan.address}"]
    return common


def run_arm(plan: ReplicatePlan, arm: Arm, init_adapter: Path | None) -> Arm:
    log = plan.out_dir / f"{arm.name}.log"
    common = _common(plan, arm.seed, arm.overrides)
    if arm.mode != "tree":
        common += sum((["--set", s] for s in flat_eval_sets(arm.seed, plan.eval_sets)), [])
    train = [*_cli(), "train", "--config", str(plan.config), "--run-name", arm.run_dir.name,
             "--set", f"trainer.runs_dir={arm.run_dir.parent}", "--set", "trainer.metrics_port=0", *common]
    if init_adapter is not None:
        train += ["--init-adapter", str(init_adapter)]
        arm.init_adapter = str(init_adapter)
    else:
        arm.init_adapter = "seeded"
    try:
        _run(train, log)
        arm.status = "completed"
    except Exception as err:  # one failed arm is reported, the others go on
        arm.status, arm.error = "failed", str(err)
    return arm


def plan_arms(plan: ReplicatePlan) -> list[Arm]:
    """Every arm, cells × seeds, cell-major; a flat arm's eval files are its run's own."""
    from records.run_dir import RunDir

    arms: list[Arm] = []
    for cell in plan.cells:
        mode = plan.modes.get(cell.name, "flat")
        for s in plan.seeds:
            run = RunDir(plan.out_dir / "runs" / arm_name(cell, s))
            flat = mode != "tree"
            arms.append(Arm(s, run.root, run.heldout_path("after") if flat else None, cell=cell.name,
                            overrides=list(cell.overrides), mode=mode,
                            before_file=run.heldout_path("before") if flat else None))
    return arms


def _cell_arms(plan: ReplicatePlan, arms: list[Arm]) -> list[tuple[Arm, Path]]:
    """The arms of one cell, pinned: the first runs now and saves adapters/init, the rest start
    from it. Returns the (arm, init) still to run."""
    first = run_arm(plan, arms[0], None)
    init = first.run_dir / "adapters" / "init"
    if not (init / "adapter_config.json").exists():
        for arm in arms[1:]:
            arm.status, arm.error = "failed", f"no pinned init: the first arm (seed {first.seed}) failed"
        return []
    first.init_adapter = f"{init} (saved by this arm)"
    return [(arm, init) for arm in arms[1:]]


def replicate(plan: ReplicatePlan) -> list[Arm]:
    plan.out_dir.mkdir(parents=True, exist_ok=True)
    arms = plan_arms(plan)
    jobs: list[tuple[Arm, Path | None]] = [(arm, None) for arm in arms]
    if plan.pin_init:
        jobs = []
        for cell in plan.cells:  # an init adapter is pinned per cell (a cell may change the LoRA shape)
            jobs += _cell_arms(plan, [a for a in arms if a.cell == cell.name])
    with ThreadPoolExecutor(max_workers=max(1, plan.parallel)) as pool:
        list(pool.map(lambda job: run_arm(plan, *job), jobs))
    return arms


def arms_table(arms: list[Arm]):
    from rich.table import Table

    table = Table(title="replicates")
    grid = any(a.cell for a in arms)
    for col in (*(["cell"] if grid else []), "seed", "status", "init", "run", "eval", "error"):
        table.add_column(col, overflow="fold")
    for a in arms:
        table.add_row(*([a.cell] if grid else []), str(a.seed), a.status, a.init_adapter or "", str(a.run_dir),
                      str(a.eval_file or "(tree: round summaries)"), a.error or "")
    return table


def as_records(items: list[Any]) -> list[dict]:
    return [{k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(a).items()} for a in items]
