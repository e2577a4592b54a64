"""Driver side of the learner: ``LearnerJob`` runs one Ray Train ``TorchTrainer.fit()`` for the
whole run (in a background thread) and talks to its workers through a small coordinator actor.

Control flow: ``step(batch)`` puts the batch in the object store, appends a command holding its
ref to the coordinator; every worker takes the command in order, reads the batch, trains its
shard; rank 0 posts the answer (metrics, phase seconds, AdapterPayload) back to the coordinator,
where the driver picks it up. A worker that fails posts its traceback before dying, so the
driver raises it instead of waiting forever.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import ray

from learner import checkpoint
from learner.commands import Command, Failed, Init, Save, Saved, Step, Stop
from learner.types import InitInfo, StepResult, TrainBatch
from config.runtime_env import apply_defaults


@ray.remote(num_cpus=0)
class LearnerCoordinator:
    """Ordered command log (driver -> workers) and answers (rank 0 -> driver)."""

    def __init__(self, world_size: int):
        self.world_size = world_size
        self.commands: list[Command] = []
        self.taken: list[int] = []
        self.results: dict[int, Any] = {}
        self.changed = asyncio.Condition()

    async def submit(self, command: Command) -> int:
        async with self.changed:
            self.commands.append(command)
            self.taken.append(0)
            self.changed.notify_all()
            return len(self.commands) - 1

    async def next_command(self, index: int, rank: int) -> Command:
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

    async def get_result(self, index: int, timeout_s: float) -> tuple[bool, Any]:
        async with self.changed:
            try:
                await asyncio.wait_for(self.changed.wait_for(lambda: index in self.results), timeout_s)
            except asyncio.TimeoutError:
                return False, None
            return True, self.results.pop(index)


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
    """TorchTrainer, less Ray Train V2's PlacementGroupCleaner where the State API is missing.

    The cleaner is a detached actor that asks the State API every second whether the Train
    controller is alive, to remove its placement group if the controller dies. Without the State
    API every query fails: it logs "Failed to query Ray Train Controller actor state" once a
    second for the whole fit() (our single fit() lasts the whole run: ~600 lines in its worker log,
    79 deduplicated lines on the console of a 10-minute run) and can never detect a death, so
    it cleans nothing. With the State API present (a cluster with a dashboard) it is kept."""
    if _state_api_answers():
        return torch_trainer
    from ray.train.v2._internal.callbacks.placement_group_callback import PlacementGroupCleanerCallback

    class LearnerTrainer(torch_trainer):
        def _create_default_callbacks(self):
            return [c for c in super()._create_default_callbacks()
                    if not isinstance(c, PlacementGroupCleanerCallback)]

    return LearnerTrainer


class LearnerJob:
    """The learner as the orchestrator sees it: start, step, save_checkpoint, stop."""

    def __init__(self, run_cfg, run_dir: Path, init_adapter: Path | None = None, resume_from: Path | None = None):
        """StepResult.adapter and InitInfo.init_payload come back as AdapterRefs: the payload
        stays in the object store, owned by the rank-0 worker (learner/worker.py), fetchable
        until ``stop()``."""
        self.run_cfg = run_cfg
        # Absolute: the Train workers run in their own working directory (Ray's session dir).
        self.run_dir = Path(run_dir).resolve()
        self.init_adapter = Path(init_adapter).resolve() if init_adapter else None
        self.resume_from = Path(resume_from).resolve() if resume_from else None
        self.step_count = 0
        self._coord = None
        self._thread: threading.Thread | None = None
        self._fit_error: BaseException | None = None

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> InitInfo:
        lcfg = self.run_cfg.learner
        if self.init_adapter is not None and self.resume_from is not None:
            raise ValueError("give init_adapter or resume_from, not both (a checkpoint carries its adapter)")
        if self.resume_from is not None:
            # Refuse early (before any worker starts) when the LR policy says so.
            state = checkpoint.read_state(self.resume_from)
            checkpoint.lr_decision(state["lr"], lcfg.lr, lcfg.on_lr_mismatch)
        from ray.train import RunConfig as TrainRunConfig
        from ray.train import ScalingConfig
        from ray.train.torch import TorchConfig, TorchTrainer

        from learner.policy import PolicySpec
        from learner.worker import train_loop_per_worker

        self._coord = LearnerCoordinator.options(name=f"learner-coordinator-{uuid.uuid4().hex[:8]}").remote(lcfg.workers)
        resources = {"CPU": lcfg.num_cpus_per_worker}
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
                "run_dir": str(self.run_dir),
                "init_adapter": str(self.init_adapter) if self.init_adapter else None,
                "resume_from": str(self.resume_from) if self.resume_from else None,
            },
            torch_config=TorchConfig(backend="nccl" if lcfg.use_gpu else "gloo"),
            scaling_config=ScalingConfig(
                num_workers=lcfg.workers, use_gpu=lcfg.use_gpu, resources_per_worker=resources
            ),
            run_config=TrainRunConfig(
                name=f"learner-{uuid.uuid4().hex[:8]}",
                storage_path=str(self.run_dir / ".ray_train"),
                worker_runtime_env={"env_vars": apply_defaults()},
            ),
        )
        self._thread = threading.Thread(target=self._fit, args=(trainer,), name="learner-fit", daemon=True)
        self._thread.start()
        info: InitInfo = self._call(Init(), lcfg.start_timeout_s)
        self.step_count = info.step
        return info

    def _fit(self, trainer) -> None:
        try:
            trainer.fit()
        except BaseException as err:  # surfaced by the next _call
            self._fit_error = err

    def _call(self, command: Command, timeout_s: float) -> Any:
        if self._coord is None:
            raise RuntimeError("LearnerJob.start() was not called (or the job was stopped)")
        index = ray.get(self._coord.submit.remote(command))
        deadline = time.monotonic() + timeout_s
        while True:
            done, result = ray.get(self._coord.get_result.remote(index, 1.0))
            if done:
                if isinstance(result, Failed):
                    raise RuntimeError(f"learner command {type(command).__name__.lower()!r} failed in {result.where}:\n"
                                       f"{result.traceback}")
                return result
            if self._thread is not None and not self._thread.is_alive():
                raise RuntimeError(f"the learner's Ray Train run ended unexpectedly: {self._fit_error!r}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"learner command {type(command).__name__.lower()!r} took more than {timeout_s:.0f} s")

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
        return Path(out.path)

    def stop(self) -> None:
        if self._coord is None:
            return
        try:
            ray.get(self._coord.submit.remote(Stop()))
            if self._thread is not None:
                self._thread.join(self.run_cfg.learner.stop_timeout_s)
        finally:
            ray.kill(self._coord)
            self._coord = None
