"""One learner worker: ``train_loop_per_worker``, the Ray Train loop that feeds a
``PolicyLearner`` (learner/policy.py, torch only) typed commands (learner/protocol.py) for the
whole run.

The Ray Train workers run ONE long-lived loop (a single ``fit()`` for the whole run): each
command comes from the driver's coordinator actor; every worker reads the same GLOBAL batch from
the object store and trains on its shard by rank; rank 0 answers with metrics, phase seconds and
the new adapter. No ``ray.train.report`` per step (~2 s each).

What a command answers is ``init_answer`` / ``step_answer`` / ``save_answer``, plain functions
of the PolicyLearner; ``export`` says how the adapter leaves (here: left in the object store,
``left_in_store``; services/inprocess.py's learner hands the payload itself).

No shared disk: a worker never opens the run directory (its node may not see it). What a command
writes (adapters/init, adapters/step_<N>, checkpoints/step_<N>) goes to a staging directory on
the worker's own node, laid out like the run directory, and leaves as bytes (learner/files.py)
that every rank posts to the coordinator; the driver writes them into the run directory. A
checkpoint to resume from and an --init-adapter arrive the same way, as a bundle the driver put
in the object store, unpacked into the staging directory.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from learner import checkpoint
from learner.files import pack, unpack
from learner.protocol import Answer, Command, Failed, Init, Save, Saved, Step, Stop
from learner.lora import save_adapter
from learner.policy import PolicyLearner, PolicySpec
from learner.types import InitInfo, StepResult, TrainBatch
from model.adapter import AdapterPayload, AdapterRef, adapter_version
from model.adapter_ipc import DeviceAdapterPayload
from model.scratch import dead_scratch, make_scratch

Export = Callable[[AdapterPayload], AdapterPayload | AdapterRef]
STAGE_PREFIX = "counterpoint-learner-"  # <tmp>/counterpoint-learner-<pid>-r<rank>-*: a worker's staged files


def left_in_store(payload) -> AdapterRef:
    """The payload put in Ray's object store by this worker; the driver gets only its ref.
    The worker owns the object (Ray 2.56 removed ray.put's `_owner`): it is fetchable while
    this worker lives, i.e. for the whole run; whoever needs it after fetches it first."""
    import ray

    return AdapterRef(version=payload.version, box=[ray.put(payload)], checksum=payload.checksum)


def init_answer(learner: PolicyLearner, run_dir: Path, export: Export) -> InitInfo | None:
    """Init: the adapter to sample the next step with (rank 0 answers; the others None)."""
    adapter = learner.full_adapter()  # FSDP2: every rank joins the gather before rank 0 publishes
    if learner.rank != 0:
        return None
    sha = learner.resumed_sha256
    if sha is None:  # fresh run (seeded init or --init-adapter): record what we start from
        sha = learner.save_init_adapter(run_dir / "adapters" / "init", adapter)
    return InitInfo(adapter_sha256=sha, init_payload=export(learner.payload(adapter_version(learner.step_count), adapter)),
                    step=learner.step_count, lr_rebase_note=learner.lr_rebase_note,
                    data_position=learner.data_position, init_is_identity=learner.init_is_identity,
                    base_weights=learner.base_weights, adapter_transport=learner.adapter_export.transport,
                    learner_layers=learner.layers)


def step_answer(learner: PolicyLearner, batch: TrainBatch, export: Export) -> StepResult | None:
    """Step: train this rank's shard; rank 0 answers with metrics, phases and the new adapter."""
    metrics, phases = learner.step(batch)
    t = time.perf_counter()
    full = learner.full_adapter()  # FSDP2: every rank joins the gather before rank 0 publishes
    if learner.rank != 0:
        return None
    payload = learner.payload(adapter_version(learner.step_count), full)
    adapter = export(payload)
    exported = time.perf_counter() - t
    phases["update_actor"] += exported  # exporting the adapter is part of it
    # 1 when the adapter stayed in the learner's device memory (model/adapter_ipc.py), 0 on the host path
    in_device = float(isinstance(payload, DeviceAdapterPayload))
    return StepResult(metrics={**metrics, "learner_export_s": exported, "adapter_in_device_memory": in_device},
                      phases_s=phases, adapter=adapter)


def save_answer(learner: PolicyLearner, cmd: Save, run_dir: Path) -> Saved | None:
    """Save: checkpoints/step_<N>/ (every rank its part) and adapters/step_<N>/ (rank 0), under
    ``run_dir`` (the Ray workers' staging directory; the driver maps ``path`` to its own)."""
    if cmd.step != learner.step_count:
        raise ValueError(f"save_checkpoint(step={cmd.step}) but the learner is at step {learner.step_count}")
    ckpt = checkpoint.checkpoint_dir(run_dir, learner.step_count)
    adapter = learner.full_adapter()  # FSDP2: gathered on every rank, written by rank 0
    sha = learner.save_checkpoint(ckpt, cmd.data_position, adapter)
    if learner.rank != 0:
        return None
    save_adapter(learner.peft_model, run_dir / "adapters" / f"step_{learner.step_count}", state=adapter)
    return Saved(path=str(ckpt.relative_to(run_dir)), adapter_sha256=sha)


def handle(learner: PolicyLearner, cmd: Command, run_dir: Path) -> Answer:
    """Run one command on this worker; rank 0's return value is the driver's answer."""
    import ray

    if isinstance(cmd, Init):
        return init_answer(learner, run_dir, left_in_store)
    if isinstance(cmd, Step):
        return step_answer(learner, ray.get(cmd.batch[0]), left_in_store)
    if isinstance(cmd, Save):
        return save_answer(learner, cmd, run_dir)
    raise ValueError(f"unknown learner command {cmd!r}")


class ProgressReport:
    """A micro-batch done, told to the coordinator without waiting for it (learner/progress.py),
    at most every ``every_s``: a frozen worker tells nothing, and the driver notices."""

    def __init__(self, coord, rank: int, index: Callable[[], int], every_s: float = 0.25) -> None:
        self.coord, self.rank, self.index, self.every_s = coord, rank, index, every_s
        self.last = 0.0

    def __call__(self) -> None:
        now = time.monotonic()
        if now - self.last >= self.every_s:
            self.last = now
            self.coord.progress.remote(self.rank, self.index())


def _unpacked(box: list | None, where: Path) -> Path | None:
    """A bundle the driver left in the object store (boxed in a list), written under ``where``."""
    import ray

    return None if not box else unpack(ray.get(box[0]), where)


def train_loop_per_worker(config: dict[str, Any]) -> None:
    """Entry point of every Ray Train worker; returns when the driver sends Stop."""
    import ray
    import ray.train
    import ray.train.torch

    from config.learner import LearnerConfig
    from config.rollout import ModelConfig

    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    coord = config["coordinator"]
    cfg = LearnerConfig.model_validate(config["learner"])
    model_cfg = ModelConfig.model_validate(config["model"])
    torch.set_num_threads(cfg.torch_threads or max(1, int(cfg.num_cpus_per_worker)))
    # This node's own scratch space: the run directory lives on the driver's node. A worker
    # killed with SIGKILL (the OOM killer, a test) never reaches the clean-up below, so each
    # worker first removes what dead ones left on this node (staged checkpoints can be large).
    for left in dead_scratch(Path(tempfile.gettempdir()), STAGE_PREFIX):
        shutil.rmtree(left, ignore_errors=True)
    stage = make_scratch(STAGE_PREFIX, tag=f"r{rank}-")
    out = stage / "out"
    index = 0
    try:
        ray.get(coord.hello.remote(rank, ray.get_runtime_context().get_node_id(), os.getpid(),
                                   ray.get_runtime_context().current_actor))
        device = ray.train.torch.get_device() if cfg.use_gpu else torch.device("cpu")
        init_adapter = _unpacked(config.get("init_adapter"), stage / "in" / "init_adapter")
        resume_from = _unpacked(config.get("resume_from"), stage / "in" / "checkpoint")
        learner = PolicyLearner(
            cfg, model_cfg, PolicySpec(**config["spec"]), rank=rank, world_size=world, device=device,
            init_adapter=init_adapter, resume_from=resume_from,
            shared_base=config.get("shared_base"), share_required=bool(config.get("share_required")),
            adapter_transport=config.get("adapter_transport", "host"),
        )
        learner.report_progress = ProgressReport(coord, rank, lambda: index)
        while True:
            cmd = ray.get(coord.next_command.remote(index, rank))
            if isinstance(cmd, Stop):
                return
            answer = handle(learner, cmd, out)
            if isinstance(cmd, (Init, Save)):  # every rank posts what it wrote (maybe nothing)
                files = pack(out)
                shutil.rmtree(out, ignore_errors=True)  # shipped: the driver writes the record
                ray.get(coord.put_files.remote(index, rank, [ray.put(files)]))
            if rank == 0:
                ray.get(coord.put_result.remote(index, answer))
            index += 1
    except BaseException:
        failed = Failed(where=f"learner rank {rank} (pid {os.getpid()})", traceback=traceback.format_exc())
        ray.get(coord.put_result.remote(index, failed))
        raise
    finally:
        shutil.rmtree(stage, ignore_errors=True)  # a copy: what it held went to the driver
