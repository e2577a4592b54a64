"""One learner worker: ``PolicyLearner`` (model, optimizer, schedule; torch only) and
``train_loop_per_worker``, the Ray Train loop that feeds it commands for the whole run.

The Ray Train workers run ONE long-lived loop (a single ``fit()`` for the whole run): each
command (init, step, save, stop) comes from the driver's coordinator actor; every worker reads
the same GLOBAL batch from the object store and trains on its shard by rank; rank 0 answers
with metrics, phase seconds and the new adapter. No ``ray.train.report`` per step (~2 s each).
"""

from __future__ import annotations

import os
import time
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from learner import checkpoint
from learner.advantages import frac_reward_zero_std
from learner.losses import LossNorm, ObjectiveParams, entropy_bonus_active
from learner.lora import adapter_payload, attach_lora, load_base_model, save_adapter
from learner.optim import build_optimizer, build_scheduler, rebase_lr
from learner.passes import GradSync, ddp_grad_sync, make_micro_batches, old_log_prob, ref_log_prob, update_actor
from learner.rollout_correction import finalize
from learner.shared_prefix import SharedPrefixLM
from learner.types import TrainBatch, shard_bounds
from rollout.types import AdapterPayload


def allreduce_sum(values: dict[str, float], device: torch.device) -> dict[str, float]:
    """Sum a dict of floats over workers (identity with one process). Keys must match."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return dict(values)
    keys = sorted(values)
    t = torch.tensor([values[k] for k in keys], dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return dict(zip(keys, t.tolist()))


def deepspeed_engine(peft_model, optimizer, cfg) -> tuple[Any, GradSync]:
    """ZeRO-2 over the LoRA parameters (learner.deepspeed, GPU only).

    Checked on an H200 by bench/learner_deepspeed.py (same update as the plain path: 5e-5
    relative in float32; resume from its checkpoint continues exactly). Our own micro-batch
    loop marks the accumulation boundary (gradient_accumulation_steps stays 1, so DeepSpeed does
    not rescale the loss, which losses.py already normalises); no bf16/fp16 block, so the fp32
    LoRA weights and the base dtype are left as loaded; our LambdaLR keeps driving the wrapped
    optimizer's param_groups.
    """
    import deepspeed

    ds_config = {
        "train_micro_batch_size_per_gpu": cfg.micro_batch_size,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": cfg.max_grad_norm,
        "zero_optimization": {"stage": 2},
    }
    engine, *_ = deepspeed.initialize(model=peft_model, optimizer=optimizer, config=ds_config, dist_init_required=False)

    def backward(loss: torch.Tensor, last: bool) -> None:
        engine.set_gradient_accumulation_boundary(last)
        engine.backward(loss)

    def step() -> float:
        engine.set_gradient_accumulation_boundary(True)
        engine.step()
        norm = engine.get_global_grad_norm()
        return float(norm) if norm is not None else float("nan")

    return engine, GradSync(backward=backward, step=step)


class PolicyLearner:
    """The policy, its optimizer and schedule on one worker; ``step`` runs the three phases."""

    def __init__(
        self,
        run_cfg,
        *,
        rank: int = 0,
        world_size: int = 1,
        device: torch.device | str = "cpu",
        init_adapter: Path | None = None,
        resume_from: Path | None = None,
    ):
        self.run_cfg, self.cfg = run_cfg, run_cfg.learner
        self.rank, self.world_size, self.device = rank, world_size, torch.device(device)
        self.init_is_identity = init_adapter is None and resume_from is None
        base = load_base_model(run_cfg.model, self.device)
        source = Path(resume_from) / "adapter" if resume_from is not None else init_adapter
        self.peft_model = attach_lora(base, self.cfg.lora, run_cfg.seed, source).to(self.device)
        self.optimizer = build_optimizer(self.peft_model.parameters(), self.cfg)
        self.scheduler = build_scheduler(self.optimizer, self.cfg, run_cfg.trainer.steps)
        self.lm = SharedPrefixLM(self.peft_model)  # the forward every phase runs
        self.model, self.grad_sync = self._wrap(self.lm)
        self.step_count = 0
        self.lr_rebase_note: str | None = None
        self.data_position: dict[str, Any] | None = None
        self.resumed_sha256: str | None = None
        if resume_from is not None:
            state = checkpoint.restore(resume_from, rank=rank, optimizer=self.optimizer, scheduler=self.scheduler,
                                       deepspeed_engine=self._deepspeed_engine)
            self.lr_rebase_note = checkpoint.lr_decision(state["lr"], self.cfg.lr, self.cfg.on_lr_mismatch)
            rebase_lr(self.optimizer, self.scheduler, self.cfg.lr)  # the configured LR, always
            self.step_count = int(state["step"])
            self.data_position = state.get("data_position")
            self.resumed_sha256 = state.get("adapter_sha256")

    @property
    def _deepspeed_engine(self):
        """The DeepSpeed engine (it owns the optimizer state under ZeRO), or None."""
        return self.model if self.cfg.deepspeed else None

    def _wrap(self, model):
        """The module the update runs through, and how its gradients are synchronised."""
        if self.cfg.deepspeed:
            return deepspeed_engine(model, self.optimizer, self.cfg)
        if self.world_size > 1 and dist.is_initialized():
            from torch.nn.parallel import DistributedDataParallel

            ids = [self.device.index] if self.device.type == "cuda" else None
            model = DistributedDataParallel(model, device_ids=ids)
        return model, ddp_grad_sync(model, self.optimizer, self.cfg.max_grad_norm)

    # ------------------------------------------------------------------ one GRPO step

    def step(self, batch: TrainBatch) -> tuple[dict[str, float], dict[str, float]]:
        """Train on this worker's shard of the global batch; returns (metrics, phases_s),
        metrics already reduced over workers."""
        cfg, temp = self.cfg, self.run_cfg.rollout.temperature
        lo, hi = shard_bounds(len(batch), self.world_size, self.rank)
        shard = batch.rows(lo, hi)
        mbs = make_micro_batches(shard, cfg.micro_batch_size, self.device, share_prefix=cfg.share_prompt_prefix)
        norm = LossNorm(
            loss_type=cfg.loss_type,
            global_tokens=float(batch.num_response_tokens()),
            global_sequences=len(batch),
            local_tokens=float(shard.num_response_tokens()),
            max_completion_length=cfg.max_completion_length or self.run_cfg.rollout.max_tokens,
            dp_size=self.world_size,
        )
        gate_needs_entropy = cfg.entropy_coef > 0 and cfg.entropy_floor is not None
        fold = cfg.fold_old_logprobs and cfg.epochs_per_step == 1 and cfg.lora.dropout == 0 and not gate_needs_entropy
        phases = {"old_log_prob": 0.0, "ref": 0.0}

        t = time.perf_counter()
        old, rollout_sums, ent_sum = None, {}, 0.0
        if not fold:
            self.peft_model.eval()
            old, rollout_sums, ent_sum = old_log_prob(self.lm, mbs, temp, gate_needs_entropy)
            phases["old_log_prob"] = time.perf_counter() - t
        bonus = cfg.entropy_coef > 0
        if gate_needs_entropy:
            g = allreduce_sum({"e": ent_sum, "n": float(sum(float(mb.mask.sum()) for mb in mbs))}, self.device)
            bonus = entropy_bonus_active(g["e"] / max(g["n"], 1.0), cfg.entropy_coef, cfg.entropy_floor)

        t = time.perf_counter()
        ref = None
        if cfg.beta > 0:
            self.peft_model.eval()
            ref = ref_log_prob(self.lm, self.peft_model, mbs, temp)
            phases["ref"] = time.perf_counter() - t

        t = time.perf_counter()
        self.peft_model.train()
        lr = float(self.optimizer.param_groups[0]["lr"])
        res = update_actor(
            self.model, mbs, self.grad_sync, norm, ObjectiveParams.from_config(cfg),
            temperature=temp, epochs=cfg.epochs_per_step, old=old, ref=ref, entropy_bonus=bonus,
        )
        self.scheduler.step()
        self.step_count += 1
        combined = {f"p|{k}": v for k, v in res.sums.items()}
        combined.update({f"r|{k}": v for k, v in (rollout_sums or res.rollout_sums).items()})
        combined["loss"] = res.loss
        reduced = allreduce_sum(combined, self.device)
        phases["update_actor"] = time.perf_counter() - t

        policy = finalize({k[2:]: v for k, v in reduced.items() if k.startswith("p|")})
        rollout = finalize({k[2:]: v for k, v in reduced.items() if k.startswith("r|")})
        metrics = {k: v for k, v in policy.items() if k not in ("tokens", "sequences")}
        metrics.update({k: rollout[k] for k in ("ppl_ratio", "rollout_kl", "rollout_k3_kl", "rollout_abs_diff")})
        metrics.update(
            loss=reduced["loss"] / self.world_size,
            grad_norm=res.grad_norm,
            learning_rate=lr,
            entropy_bonus_active=float(bonus),
            response_tokens=float(batch.num_response_tokens()),
            total_tokens=float(batch.num_total_tokens()),
            sequences=float(len(batch)),
        )
        if batch.rewards and batch.group_ids:
            metrics["frac_reward_zero_std"] = frac_reward_zero_std(
                torch.tensor(batch.rewards), torch.tensor(batch.group_ids)
            )
        return metrics, phases

    # ------------------------------------------------------------------ adapters, checkpoints

    def payload(self, version: int) -> AdapterPayload:
        return adapter_payload(self.peft_model, version)

    def save_init_adapter(self, out_dir: Path) -> str:
        return save_adapter(self.peft_model, out_dir)

    def save_checkpoint(self, ckpt: Path, data_position: dict[str, Any] | None) -> str | None:
        sha = checkpoint.save(
            ckpt, rank=self.rank, peft_model=self.peft_model, optimizer=self.optimizer,
            scheduler=self.scheduler, step=self.step_count, data_position=data_position,
            deepspeed_engine=self._deepspeed_engine,
        )
        if dist.is_available() and dist.is_initialized():
            dist.barrier()
        return sha


# ---------------------------------------------------------------------- the Ray Train loop


def _handle(learner: PolicyLearner, cmd: dict[str, Any], run_dir: Path) -> dict[str, Any] | None:
    """Run one command on this worker; rank 0's return value is the driver's answer."""
    import ray

    kind = cmd["kind"]
    if kind == "init":
        if learner.rank != 0:
            return None
        sha = learner.resumed_sha256
        if sha is None:  # fresh run (seeded init or --init-adapter): record what we start from
            sha = learner.save_init_adapter(run_dir / "adapters" / "init")
        return {
            "adapter_sha256": sha,
            "init_payload": learner.payload(learner.step_count),
            "step": learner.step_count,
            "lr_rebase_note": learner.lr_rebase_note,
            "data_position": learner.data_position,
            "init_is_identity": learner.init_is_identity,
        }
    if kind == "step":
        batch = ray.get(cmd["batch"][0])
        metrics, phases = learner.step(batch)
        if learner.rank != 0:
            return None
        t = time.perf_counter()
        adapter = learner.payload(learner.step_count)
        phases["update_actor"] += time.perf_counter() - t  # exporting the adapter is part of it
        return {"metrics": metrics, "phases_s": phases, "adapter": adapter}
    if kind == "save":
        if cmd["step"] != learner.step_count:
            raise ValueError(f"save_checkpoint(step={cmd['step']}) but the learner is at step {learner.step_count}")
        ckpt = checkpoint.checkpoint_dir(run_dir, learner.step_count)
        sha = learner.save_checkpoint(ckpt, cmd.get("data_position"))
        if learner.rank != 0:
            return None
        save_adapter(learner.peft_model, run_dir / "adapters" / f"step_{learner.step_count}")
        return {"path": str(ckpt), "adapter_sha256": sha}
    raise ValueError(f"unknown learner command {kind!r}")


def train_loop_per_worker(config: dict[str, Any]) -> None:
    """Entry point of every Ray Train worker; returns when the driver sends 'stop'."""
    import ray
    import ray.train
    import ray.train.torch

    from services.config import RunConfig

    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    coord = config["coordinator"]
    run_cfg = RunConfig.model_validate(config["run_cfg"])
    run_dir = Path(config["run_dir"])
    torch.set_num_threads(run_cfg.learner.torch_threads or max(1, int(run_cfg.learner.num_cpus_per_worker)))
    index = 0
    try:
        for key in ("run_dir", "init_adapter", "resume_from"):
            if config.get(key) and not Path(config[key]).is_absolute():
                # A relative path here resolves against Ray's session directory: the run's
                # adapters and checkpoints would vanish into /tmp. Fail loudly instead.
                raise ValueError(f"learner worker got a relative {key} {config[key]!r}; the driver must pass "
                                 f"absolute paths (this worker runs in {os.getcwd()})")
        device = ray.train.torch.get_device() if run_cfg.learner.use_gpu else torch.device("cpu")
        learner = PolicyLearner(
            run_cfg, rank=rank, world_size=world, device=device,
            init_adapter=Path(config["init_adapter"]) if config.get("init_adapter") else None,
            resume_from=Path(config["resume_from"]) if config.get("resume_from") else None,
        )
        while True:
            cmd = ray.get(coord.next_command.remote(index, rank))
            if cmd["kind"] == "stop":
                return
            answer = _handle(learner, cmd, run_dir)
            if rank == 0:
                ray.get(coord.put_result.remote(index, answer))
            index += 1
    except BaseException:
        ray.get(coord.put_result.remote(index, {"error": f"learner rank {rank} (pid {os.getpid()}):\n{traceback.format_exc()}"}))
        raise
