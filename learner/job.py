"""Driver side of the learner: ``LearnerJob`` runs one Ray Train ``TorchTrainer.fit()`` for the
whole run (in a background thread) and talks to its workers through a small coordinator actor.

Control flow: ``step(batch)`` puts the batch in the object store, appends a command holding its
ref to the coordinator; every worker takes the command in order, reads the batch, trains its
shard; rank 0 posts the answer (metrics, phase seconds, AdapterPayload) back to the coordinator,
where the driver picks it up. A worker that fails posts its traceback before dying, so the
driver raises it instead of waiting forever.

Files never cross a shared disk (learner/files.py): Init and Save answers come with what every
rank wrote, as bytes in the object store, and the driver writes them into the run directory; a
checkpoint to resume from (and an --init-adapter) goes to the workers the same way. The
coordinator runs on the driver's node, so a worker node that dies takes only the workers with it.

Every way the learner can be lost raises ``LearnerLost`` with a kind (services/recovery.py
LEARNER_FAILURES): "worker_error" (a worker posted a traceback), "train_run_ended" (the Train run
is over: a worker process or its node died), "coordinator_lost", "timeout". Whether to restore the
learner and go on is the caller's decision (services/learner_recovery.py).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import ray

from learner import checkpoint
from learner.protocol import Command, Failed, Init, Save, Saved, Step, Stop
from learner.files import pack, write_bundle
from learner.progress import ProgressBook
from learner.types import InitInfo, StepResult, TrainBatch
from config.runtime_env import apply_defaults

log = logging.getLogger(__name__)


@ray.remote(num_cpus=0)
class LearnerCoordinator:
    """Ordered command log (driver -> workers) and answers (rank 0 -> driver)."""

    def __init__(self, world_size: int):
        self.world_size = world_size
        self.commands: list[Command] = []
        self.taken: list[int] = []
        self.results: dict[int, Any] = {}
        self.files: dict[int, dict[int, list]] = {}  # command index -> rank -> [ref of its bundle]
        self.workers: dict[int, dict] = {}  # rank -> {"node_id", "pid"}
        self.actors: dict[int, Any] = {}  # rank -> the worker's actor handle (to kill a frozen one)
        self.progress_book = ProgressBook(world_size)
        self.changed = asyncio.Condition()

    async def hello(self, rank: int, node_id: str, pid: int, actor: Any = None) -> None:
        self.workers[rank] = {"rank": rank, "node_id": node_id, "pid": pid}
        if actor is not None:
            self.actors[rank] = actor

    async def where(self) -> list[dict]:
        return [self.workers[r] for r in sorted(self.workers)]

    async def worker_actors(self) -> dict[int, Any]:
        return dict(self.actors)

    async def progress(self, rank: int, index: int) -> None:
        """A worker finished a micro-batch of command ``index`` (sent without waiting)."""
        self.progress_book.heard(rank, index, time.monotonic())

    async def put_files(self, index: int, rank: int, box: list) -> None:
        async with self.changed:
            self.files.setdefault(index, {})[rank] = box
            self.changed.notify_all()

    async def submit(self, command: Command) -> int:
        async with self.changed:
            self.commands.append(command)
            self.taken.append(0)
            self.progress_book.sent(len(self.commands) - 1, time.monotonic(), judged=isinstance(command, Step))
            self.changed.notify_all()
            return len(self.commands) - 1

    async def next_command(self, index: int, rank: int) -> Command:
        self.progress_book.asked(rank, index, time.monotonic())
        async with self.changed:
            await self.changed.wait_for(lambda: len(self.commands) > index)
            cmd = self.commands[index]
            self.taken[index] += 1
            if self.taken[index] >= self.world_size and isinstance(cmd, Step):
                self.commands[index] = dataclasses.replace(cmd, batch=None)  # free the ref
            return cmd

    async def put_result(self, index: int, result: Any) -> None:
        async with self.changed:
            self.results.setdefault(index, result)  # a worker's error report wins if it came first
            self.changed.notify_all()

    async def get_result(self, index: int, timeout_s: float, with_files: bool = False) -> tuple[bool, Any, list, dict]:
        """(done, answer, [the ranks' bundle refs], progress); with ``with_files`` done waits for
        every rank's files too (a Failed answer ends the wait at once). ``progress``: how long the
        quietest rank still on the command has made none, and the run's slowest interval
        between two reports (learner/progress.py), measured on this actor's clock."""
        def ready() -> bool:
            if index not in self.results:
                return False
            return (not with_files or isinstance(self.results[index], Failed)
                    or len(self.files.get(index, {})) >= self.world_size)

        def progress() -> dict:
            quiet_s, ranks = self.progress_book.quiet(index, time.monotonic())
            return {"quiet_s": quiet_s, "quiet_ranks": ranks,
                    "slowest_interval_s": self.progress_book.slowest_interval_s}

        async with self.changed:
            try:
                await asyncio.wait_for(self.changed.wait_for(ready), timeout_s)
            except asyncio.TimeoutError:
                return False, None, [], progress()
            boxes = self.files.pop(index, {})
            return True, self.results.pop(index), [boxes[r] for r in sorted(boxes)], progress()


def _state_api_answers() -> bool:
    """Whether Ray's State API (served by the dashboard's HTTP server) answers. A local cluster
    started with include_dashboard=False has none (services/launch.py: the dashboard costs ~1 GiB
    and ~11 processes)."""
    from ray.util.state import list_actors

    try:
        list_actors(limit=1, timeout=5, raise_on_missing_output=False)
        return True
    except Exception:
        return False


def _trainer_class(torch_trainer):
    """TorchTrainer, less two of Ray Train V2's default callbacks: its DatasetsCallback, and its
    PlacementGroupCleaner where the State API is missing.

    The learner hands Ray Train no dataset, yet the DatasetsCallback starts a DatasetManager
    actor for each worker group (~2 CPU-s a start on the 2-core box, for nothing).

    The cleaner is a detached actor that asks the State API every second whether the Train
    controller is alive, to remove its placement group if the controller dies. Without the State
    API every query fails: it logs "Failed to query Ray Train Controller actor state" once a
    second for the whole fit() (our single fit() lasts the whole run: ~600 lines in its worker log,
    79 deduplicated lines on the console of a 10-minute run) and can never detect a death, so
    it cleans nothing. With the State API present (a cluster with a dashboard) it is kept."""
    from ray.train.v2._internal.callbacks import DatasetsCallback
    from ray.train.v2._internal.callbacks.placement_group_callback import PlacementGroupCleanerCallback

    dropped = (DatasetsCallback,) if _state_api_answers() else (DatasetsCallback, PlacementGroupCleanerCallback)

    class LearnerTrainer(torch_trainer):
        def _create_default_callbacks(self):
            return [c for c in super()._create_default_callbacks() if not isinstance(c, dropped)]

    return LearnerTrainer


class LearnerLost(RuntimeError):
    """The learner cannot answer: ``kind`` says how it was lost, ``detail`` (a traceback for
    "worker_error") says what was seen, ``quiet_s`` how long before it was seen the learner
    last made progress (0.0 when unknown: it was not in a step)."""

    def __init__(self, kind: str, message: str, detail: str = "", quiet_s: float = 0.0,
                 deadline_s: float | None = None) -> None:
        super().__init__(message)
        self.kind, self.detail, self.quiet_s = kind, detail or message, quiet_s
        self.deadline_s = deadline_s  # the stall deadline that ran out ("stalled" only)


def _bundle_ref(path: Path | None) -> list | None:
    """A directory's files put in the object store by the driver (which owns them: they outlive
    any worker), boxed so that Ray hands the workers the ref."""
    return None if path is None else [ray.put(pack(path))]


def _on_this_node() -> Any:
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return NodeAffinitySchedulingStrategy(node_id=ray.get_runtime_context().get_node_id(), soft=False)


class LearnerJob:
    """The learner as the orchestrator sees it: start, step, save_checkpoint, stop."""

    def __init__(self, run_cfg, run_dir: Path, init_adapter: Path | None = None, resume_from: Path | None = None,
                 shared_base=None, share_required: bool = False, env: dict[str, str] | None = None):
        """StepResult.adapter and InitInfo.init_payload come back as AdapterRefs: the payload
        stays in the object store, owned by the rank-0 worker (learner/worker.py), fetchable
        until ``stop()``. ``shared_base``: a rollout replica's weights for the worker to map
        (model/shared_base.py BaseExport), which it must (``share_required``) or may. ``env``:
        variables the workers get beside the run's defaults (services/mps.py: MPS's)."""
        self.env = dict(env or {})
        self.shared_base, self.share_required = shared_base, share_required
        self.run_cfg = run_cfg
        # The driver's run directory: what the workers write arrives here as bytes (_call).
        self.run_dir = Path(run_dir).resolve()
        self.init_adapter = Path(init_adapter).resolve() if init_adapter else None
        self.resume_from = Path(resume_from).resolve() if resume_from else None
        self.step_count = 0
        self._coord = None
        self._thread: threading.Thread | None = None
        self._fit_error: BaseException | None = None
        self._init: tuple[int, float] | None = None  # (Init's index in the log, when it was sent) until started()
        # The longest a step went quiet and then went on by itself past liveness.notice_s
        # (seconds, quiet ranks), for the caller to record; None when the last step did not.
        self.last_stall: tuple[float, list[int]] | None = None

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> InitInfo:
        self.begin()
        return self.started()

    def begin(self) -> None:
        """Start the workers and send them Init without waiting for its answer: the driver
        starts the rollout meanwhile (services/train.py), and ``started()`` collects it."""
        lcfg = self.run_cfg.learner
        if self.init_adapter is not None and self.resume_from is not None:
            raise ValueError("give init_adapter or resume_from, not both (a checkpoint carries its adapter)")
        if self.resume_from is not None:
            # Refuse early (before any worker starts) when the LR policy says so.
            state = checkpoint.read_state(self.resume_from)
            checkpoint.lr_decision(state["lr"], lcfg.lr, lcfg.on_lr_mismatch)
        from ray.train import FailureConfig, ScalingConfig
        from ray.train import RunConfig as TrainRunConfig
        from ray.train.torch import TorchConfig, TorchTrainer

        from learner.policy import PolicySpec
        from learner.worker import train_loop_per_worker

        # On the driver's node: the command log and the answers outlive any worker node.
        self._coord = LearnerCoordinator.options(name=f"learner-coordinator-{uuid.uuid4().hex[:8]}",
                                                 scheduling_strategy=_on_this_node()).remote(lcfg.workers)
        resources = {"CPU": lcfg.num_cpus_per_worker, **lcfg.resources_per_worker}
        if lcfg.use_gpu:
            resources["GPU"] = lcfg.gpus_per_worker
        trainer = _trainer_class(TorchTrainer)(
            train_loop_per_worker,
            train_loop_config={
                "coordinator": self._coord,
                # The slices the policy uses (learner/policy.py), not the whole run config.
                "learner": lcfg.model_dump(mode="json"),
                "model": self.run_cfg.model.model_dump(mode="json"),
                "spec": dataclasses.asdict(PolicySpec.for_run(self.run_cfg)),
                # Bytes, not paths: the workers' nodes need not see the driver's disk.
                "init_adapter": _bundle_ref(self.init_adapter),
                "resume_from": _bundle_ref(self.resume_from),
                "shared_base": self.shared_base,
                "share_required": self.share_required,
                "adapter_transport": self.run_cfg.adapter_transport,  # used where the base is shared
            },
            torch_config=TorchConfig(backend="nccl" if lcfg.use_gpu else "gloo"),
            scaling_config=ScalingConfig(
                num_workers=lcfg.workers, use_gpu=lcfg.use_gpu, resources_per_worker=resources,
                label_selector=dict(lcfg.label_selector) or None,
            ),
            run_config=TrainRunConfig(
                name=f"learner-{uuid.uuid4().hex[:8]}",
                # Written by Ray Train's controller, which Ray pins to the driver's node.
                storage_path=str(self.run_dir / ".ray_train"),
                worker_runtime_env={"env_vars": {**apply_defaults(), **self.env}},
                # Ray Train would restart the workers from the top of their loop, which would
                # replay a command log that no longer holds its batches; a lost learner is the
                # driver's to restore (services/learner_recovery.py, bounded by learner.max_restarts).
                failure_config=FailureConfig(max_failures=0, max_preemption_failures=0),
            ),
        )
        self._thread = threading.Thread(target=self._fit, args=(trainer,), name="learner-fit", daemon=True)
        self._thread.start()
        self._init = (self._submit(Init()), time.monotonic())

    def started(self) -> InitInfo:
        """Init's answer, once the workers have the model (learner.start_timeout_s counts from
        ``begin()``)."""
        if self._init is None:
            raise RuntimeError("LearnerJob.begin() was not called, or started() was already taken")
        (index, since), self._init = self._init, None
        info: InitInfo = self._answer(Init(), index, since, self.run_cfg.learner.start_timeout_s)
        self.step_count = info.step
        return info

    def _fit(self, trainer) -> None:
        try:
            trainer.fit()
        except BaseException as err:  # surfaced by the next _call
            self._fit_error = err

    def _call(self, command: Command, timeout_s: float) -> Any:
        return self._answer(command, self._submit(command), time.monotonic(), timeout_s)

    def _submit(self, command: Command) -> int:
        from ray.exceptions import RayActorError

        if self._coord is None:
            raise RuntimeError("LearnerJob.start() was not called (or the job was stopped)")
        try:
            return ray.get(self._coord.submit.remote(command))
        except RayActorError as err:
            raise LearnerLost("coordinator_lost", f"the learner's coordinator died during "
                              f"{type(command).__name__.lower()!r}: {err}") from None

    def _answer(self, command: Command, index: int, since: float, timeout_s: float) -> Any:
        """The answer to the command at ``index`` of the log, waited for until ``timeout_s`` after
        ``since`` (time.monotonic()); the files it wrote are written into the run directory."""
        from ray.exceptions import RayActorError

        if self._coord is None:
            raise RuntimeError("LearnerJob.start() was not called (or the job was stopped)")
        what = type(command).__name__.lower()
        with_files = isinstance(command, (Init, Save))
        liveness = self.run_cfg.liveness
        quiet_s, noticed = 0.0, 0.0
        self.last_stall = None
        try:
            while True:
                done, result, boxes, progress = ray.get(self._coord.get_result.remote(index, 1.0, with_files))
                if done:
                    break
                quiet_s, ranks = progress["quiet_s"], progress["quiet_ranks"]
                slowest = progress["slowest_interval_s"]
                deadline = liveness.deadline_s(slowest)
                if self._thread is not None and not self._thread.is_alive():
                    raise LearnerLost("train_run_ended", f"the learner's Ray Train run ended during {what!r}: "
                                      f"{self._fit_error!r}"[:2000], quiet_s=quiet_s)
                if quiet_s > deadline:
                    self._kill_workers()
                    raise LearnerLost("stalled", f"learner rank {ranks} made no progress in {what!r} for "
                                      f"{quiet_s:.0f} s (deadline {deadline:.0f} s: liveness.factor "
                                      f"{liveness.factor:g} x its slowest interval {slowest:.1f} s, floor "
                                      f"{liveness.floor_s:g} s); its workers were killed", quiet_s=quiet_s,
                                      deadline_s=deadline)
                if liveness.notice_due(quiet_s, slowest):
                    if not noticed:
                        log.warning("learner rank %s has made no progress in %r for %.0f s (stalled at %.0f s)",
                                    ranks, what, quiet_s, deadline)
                    noticed = max(noticed, quiet_s)
                    if liveness.worth_recording(noticed, slowest):
                        self.last_stall = (noticed, ranks)
                if time.monotonic() > since + timeout_s:
                    raise LearnerLost("timeout", f"learner command {what!r} took more than {timeout_s:.0f} s",
                                      quiet_s=quiet_s)
        except RayActorError as err:
            raise LearnerLost("coordinator_lost", f"the learner's coordinator died during {what!r}: {err}",
                              quiet_s=quiet_s) from None
        if isinstance(result, Failed):
            raise LearnerLost("worker_error", f"learner command {what!r} failed in {result.where}:\n{result.traceback}",
                              detail=result.traceback, quiet_s=quiet_s)
        if noticed:
            log.warning("learner went on in %r after %.0f s without progress", what, noticed)
        # Every rank's part of what the command wrote (rank 0 the adapter, each rank its shard of
        # the checkpoint), merged first: a checkpoint directory is written once, whole.
        merged: dict[str, bytes] = {}
        for box in boxes:
            for rel, data in ray.get(box[0]).items():
                if merged.setdefault(rel, data) != data:
                    raise RuntimeError(f"learner ranks wrote different bytes to {rel} during {what!r}")
        if merged:
            write_bundle(merged, self.run_dir)
        return result

    def _kill_workers(self) -> None:
        """Kill every worker of this job (a frozen process answers nothing, Stop included): the
        Train run then ends and the caller restores the learner as after a crash."""
        try:
            actors = ray.get(self._coord.worker_actors.remote(), timeout=30)
        except Exception as err:  # the coordinator is gone too: stop() cleans up what is left
            log.warning("could not reach the learner's coordinator to kill its workers: %s", err)
            return
        for rank, actor in sorted(actors.items()):
            try:
                ray.kill(actor, no_restart=True)
            except Exception as err:
                log.warning("killing learner rank %d failed: %s", rank, err)

    def workers(self) -> list[dict]:
        """Where the workers run: [{"rank", "node_id", "pid"}] (empty before they start)."""
        return [] if self._coord is None else ray.get(self._coord.where.remote(), timeout=30)

    def step(self, batch: TrainBatch) -> StepResult:
        if len(batch) < self.run_cfg.learner.workers:
            raise ValueError(f"a batch of {len(batch)} sequences cannot feed {self.run_cfg.learner.workers} workers")
        ref = ray.put(batch)
        out: StepResult = self._call(Step(step=self.step_count + 1, batch=[ref]), self.run_cfg.learner.step_timeout_s)
        self.step_count += 1
        return out

    def save_checkpoint(self, step: int, data_position: dict[str, Any] | None = None) -> Path:
        """checkpoints/step_<N>/ (resumable) and adapters/step_<N>/ (peft dir)."""
        out: Saved = self._call(Save(step=step, data_position=data_position), self.run_cfg.learner.save_timeout_s)
        return self.run_dir / out.path

    def stop(self) -> None:
        if self._coord is None:
            return
        try:
            ray.get(self._coord.submit.remote(Stop()), timeout=30)
            if self._thread is not None:
                self._thread.join(self.run_cfg.learner.stop_timeout_s)
        except Exception:  # a lost learner's coordinator or Train run: nothing left to stop
            pass
        finally:
            ray.kill(self._coord)
            self._coord = None
