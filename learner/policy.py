"""The policy on one worker: base model + LoRA, optimizer and schedule, and one GRPO step
(old_log_prob, ref, update_actor) over this worker's shard. Torch (and torch.distributed) only:
no Ray, so it is built and tested in-process (tests/test_learner_*.py); learner/worker.py runs it
inside Ray Train.

``PolicyLearner`` receives the config slices it uses, not the run config: the learner section,
the model section, the sampling temperature (both sides of ppl_ratio use it), the total steps
(the LR schedule's horizon), the seed (LoRA init) and the completion-length constant of dr_grpo.
``PolicyLearner.for_run(run_cfg)`` cuts them from a whole run config.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace
from pathlib import Path
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.profiler import record_function

from config.learner import CUDA_LOGPROB_CHUNK_TOKENS
from learner import checkpoint
from learner.losses import LossNorm, ObjectiveParams, entropy_bonus_active
from learner.compiled_layers import compile_decision, compile_layers
from learner.fused_lora import FusedLora
from learner.graphed import Capture, GraphedScorer, cuda_capture
from learner.lora import AdapterExport, attach_lora, disable_lora_input_casts, load_base_model, save_adapter
from learner.memory_plan import ModelShape, Sharding, memory_plan
from learner.microbatch import largest_micro_batch, mfu, model_flops
from learner.optim import build_optimizer, build_scheduler, rebase_lr
from learner.passes import (GradSync, ddp_grad_sync, make_micro_batches, old_log_prob, packing_refusal,
                            pad_micro_batches, ref_log_prob, refuse_nonfinite, update_actor)
from learner.rollout_correction import finalize
from learner.shared_prefix import SharedPrefixLM
from learner.types import TrainBatch, shard_bounds
from model.adapter import AdapterPayload
from model.adapter_ipc import transport_choice
from model.shared_base import BaseExport, Fence, ServedCorrection, ShareRefused, check_owner, shared_model

log = logging.getLogger(__name__)
GIB = 2**30


def cuda_budget_bytes(device: torch.device, gpus_per_worker: float) -> int:
    """The memory this worker's update may use (learner.memory_budget_gib=None): what the device
    has free plus what this process already holds (its weights), at most gpus_per_worker of it."""
    free, total = torch.cuda.mem_get_info(device)
    return int(min(free + torch.cuda.memory_reserved(device), gpus_per_worker * total))


def allreduce_sum(values: dict[str, float], device: torch.device) -> dict[str, float]:
    """Sum a dict of floats over workers (identity with one process). Keys must match."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return dict(values)
    keys = sorted(values)
    t = torch.tensor([values[k] for k in keys], dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return dict(zip(keys, t.tolist()))


def allreduce_sums(groups: dict[str, dict[str, float]], device: torch.device) -> dict[str, dict[str, float]]:
    """Several sum-dicts reduced in one all-reduce, each coming back under its own name."""
    flat = {(name, key): v for name, sums in groups.items() for key, v in sums.items()}
    order = sorted(flat)
    reduced = allreduce_sum({str(i): flat[k] for i, k in enumerate(order)}, device)
    out: dict[str, dict[str, float]] = {name: {} for name in groups}
    for i, (name, key) in enumerate(order):
        out[name][key] = reduced[str(i)]
    return out


def deepspeed_engine(peft_model, optimizer, cfg) -> tuple[Any, GradSync]:
    """ZeRO-2 over the LoRA parameters (learner.strategy=deepspeed, GPU only).

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
        norm = engine.get_global_grad_norm()  # None where the engine computed none: nothing to judge
        return refuse_nonfinite(float(norm), optimizer, stepped=True) if norm is not None else float("nan")

    return engine, GradSync(backward=backward, step=step)


@dataclass(frozen=True)
class PolicySpec:
    """What the policy needs from outside the learner section."""

    temperature: float  # sampling temperature: log_softmax(logits / T) on the trainer side too
    total_steps: int  # the LR schedule's horizon
    seed: int  # LoRA init
    max_completion_length: int  # dr_grpo's constant (learner.max_completion_length or rollout.max_tokens)

    @classmethod
    def for_run(cls, run_cfg) -> "PolicySpec":
        return cls(temperature=run_cfg.rollout.temperature, total_steps=run_cfg.trainer.steps, seed=run_cfg.seed,
                   max_completion_length=run_cfg.learner.max_completion_length or run_cfg.rollout.max_tokens)


class PolicyLearner:
    """The policy, its optimizer and schedule on one worker; ``step`` runs the three passes."""

    def __init__(
        self,
        cfg,
        model_cfg,
        spec: PolicySpec,
        *,
        rank: int = 0,
        world_size: int = 1,
        device: torch.device | str = "cpu",
        init_adapter: Path | None = None,
        resume_from: Path | None = None,
        graph_capture: Capture | None = None,
        shared_base: BaseExport | None = None,
        share_required: bool = False,
        adapter_transport: str = "host",
    ):
        """``graph_capture`` replaces CUDA graph capture (learner/graphed.py): tests pass a CPU
        stand-in with the same aliasing of gradients, so the graphed path runs without a GPU.
        ``shared_base``: a rollout replica's weights to map instead of loading a copy
        (model/shared_base.py); where they cannot be mapped the learner loads its own copy and
        says why (``base_weights``), or fails with that reason when ``share_required``.
        ``adapter_transport``: the run's (auto | host | device): adapters in device memory where
        the base is shared (model/adapter_ipc.py), else in host memory."""
        self.cfg, self.model_cfg, self.spec = cfg, model_cfg, spec
        self.rank, self.world_size, self.device = rank, world_size, torch.device(device)
        self.init_is_identity = init_adapter is None and resume_from is None
        source = Path(resume_from) / "adapter" if resume_from is not None else init_adapter
        self.sharded = cfg.strategy == "fsdp2"
        if self.sharded:  # built sharded: no whole copy of the base on any worker (learner/fsdp.py)
            self.peft_model, fence = self._fsdp_model(model_cfg, spec, source, shared_base), None
            base = self.peft_model.get_base_model()
        else:
            base, fence = self._base(model_cfg, shared_base, share_required)
            self.peft_model = attach_lora(base, cfg.lora, spec.seed, source).to(self.device)
        # What the replica's merged adapter adds to the shared weights, taken off again
        self.served = (ServedCorrection(self.peft_model, fence, self.device, merges=shared_base.merges)
                       if fence is not None else None)
        self.checkpointing = False
        self._set_checkpointing(cfg.gradient_checkpointing is True)  # memory for compute; no shared prefix then
        self.num_params = sum(p.numel() for p in self.peft_model.parameters())  # for MFU (6 N per token)
        base_dtype = next(base.parameters()).dtype
        on_cuda = self.device.type == "cuda"
        self.logprob_chunk = (cfg.logprob_chunk_tokens if cfg.logprob_chunk_tokens != "auto"
                              else CUDA_LOGPROB_CHUNK_TOKENS if on_cuda else 0)
        # The memory plan (learner/memory_plan.py) behind the 'auto' values on CUDA; CPU workers
        # run as configured (auto = no checkpointing, micro_batch_size rows).
        self.memory_shape: ModelShape | None = None
        self.memory_budget, self.last_plan = 0, None
        # fsdp2: the plan counts this rank's shard of the weights and LoRA state, not all of it
        self.memory_sharding = Sharding(world_size, cfg.fsdp_cpu_offload) if self.sharded else None
        if on_cuda and "auto" in (cfg.gradient_checkpointing, cfg.micro_batch_tokens):
            trainable = sum(p.numel() for p in self.peft_model.parameters() if p.requires_grad)
            self.lora_trainable = trainable
            self.memory_shape = ModelShape.from_hf_config(
                base.config, params=self.num_params - trainable, dtype_bytes=base_dtype.itemsize)
            self.memory_budget = (int(cfg.memory_budget_gib * GIB) if cfg.memory_budget_gib is not None
                                  else cuda_budget_bytes(self.device, cfg.gpus_per_worker))
            if self.base_weights["mode"] == "shared":  # the plan counts the weights; the replica holds them
                self.memory_budget += self.memory_shape.params * self.memory_shape.dtype_bytes
        self.amp_dtype = (base_dtype if cfg.autocast and on_cuda
                          and base_dtype in (torch.bfloat16, torch.float16) else None)
        if self.amp_dtype is not None:
            disable_lora_input_casts(self.peft_model)  # autocast casts to bf16 anyway: skip the fp32 detour
        # The adapter as the engines get it: under autocast, in the dtype the learner's own forward
        # multiplies it in (and half the bytes to move every step); else as trained (float32).
        self.payload_dtype = self.amp_dtype
        if self.sharded:  # FSDP2's mixed precision computes in the base dtype already (learner/fsdp.py)
            self.amp_dtype = None
        self.adapter_export = AdapterExport(transport_choice(
            adapter_transport, self.base_weights, shared_base.owner if shared_base is not None else None,
            self.device.type == "cuda"), self.device)
        self.optimizer = build_optimizer(self.peft_model.parameters(), cfg)
        self.scheduler = build_scheduler(self.optimizer, cfg, spec.total_steps)
        # learner.pack_sequences: each micro-batch one row without padding (learner/passes.py), where
        # the model's attention takes packed rows; else padded, said once
        refusal = packing_refusal(base) if cfg.pack_sequences else None
        if refusal is not None:
            log.warning("learner: learner.pack_sequences=true but %s; micro-batches stay padded", refusal)
        self.pack = cfg.pack_sequences and refusal is None
        self.pack_refusal = refusal
        # FSDP2 frees each layer's gathered weights after its forward: the prompt's forward, whose
        # KV cache the rows' forward reuses with gradients, would need them again in the backward.
        # learner.compile_layers: 'auto' where it was measured (learner/compiled_layers.py)
        self.compiled, compile_reason = compile_decision(cfg, on_cuda=on_cuda, world_size=world_size,
                                                         mapped_base=self.served is not None)
        self.share_prefix = ((not on_cuda and not self.sharded and not self.compiled) if cfg.share_prompt_prefix is None
                             else cfg.share_prompt_prefix) and cfg.gradient_checkpointing is not True and not self.pack
        graphs = (cfg.cuda_graphs and (on_cuda or graph_capture is not None) and world_size == 1
                  and cfg.strategy == "ddp" and cfg.gradient_checkpointing is not True and cfg.lora.dropout == 0
                  and not self.share_prefix and not self.pack)
        # Right-padded rows need no attention mask (learner/passes.py): on CUDA that is the plain
        # causal attention kernel; CPU keeps the mask, and with it its measured numerics.
        self.causal_only = on_cuda or graphs
        self.scorer = GraphedScorer(self.peft_model, cfg.max_graphs, graph_capture or cuda_capture) if graphs else None
        self.lm = SharedPrefixLM(self.peft_model)  # the forward every phase runs
        self.model, self.grad_sync = self._wrap(self.lm)
        self.fused: FusedLora | None = None  # learner.fused_lora, applied once the weights are final (below)
        self.step_count = 0
        # Called after every micro-batch of every pass: learner/worker.py reports it to the
        # driver, which tells a slow step from a frozen worker (config/liveness.py).
        self.report_progress: Callable[[], None] = lambda: None
        self.lr_rebase_note: str | None = None
        self.data_position: dict[str, Any] | None = None
        self.resumed_sha256: str | None = None
        if resume_from is not None:
            state = checkpoint.restore(resume_from, rank=rank, optimizer=self.optimizer, scheduler=self.scheduler,
                                       deepspeed_engine=self._deepspeed_engine, sharded=self.sharded)
            self.lr_rebase_note = checkpoint.lr_decision(state["lr"], self.cfg.lr, self.cfg.on_lr_mismatch)
            rebase_lr(self.optimizer, self.scheduler, self.cfg.lr)  # the configured LR, always
            self.step_count = int(state["step"])
            self.data_position = state.get("data_position")
            self.resumed_sha256 = state.get("adapter_sha256")
        # compiled layers fuse peft's LoRA term themselves, and the fused layers' cast cache (keyed by
        # parameter) would make dynamo compile a graph per layer: one or the other
        fused = (cfg.fused_lora if cfg.fused_lora != "auto"
                 else on_cuda and cfg.lora.dropout == 0 and cfg.strategy != "fsdp2" and not self.compiled)
        if fused:  # after the restore: its compute copies are made from the weights the first step uses
            self.fused = FusedLora(self.peft_model, compute_dtype=self.amp_dtype)
            self.grad_sync = self._refreshing(self.grad_sync, self.fused)
        self.compiled_layers = compile_layers(base) if self.compiled else 0
        self.compile_s = self._compile_now() if self.compiled_layers else 0.0  # nothing to warm where none compiled
        if self.compiled_layers:
            log.info("learner: %d decoder layers compiled in %.1f s", self.compiled_layers, self.compile_s)
        elif self.compiled:
            compile_reason += ", but torch.compile is disabled in this process: the layers run eagerly"
        # run.json's learner_layers: how the update's layers run, and why (learner/compiled_layers.py)
        self.layers = {"mode": "compiled" if self.compiled_layers else "eager", "fused_lora": self.fused is not None,
                       "reason": compile_reason}

    @staticmethod
    def _refreshing(sync: GradSync, fused: FusedLora) -> GradSync:
        """``sync`` whose optimizer step also refreshes the fused layers' compute copies of the
        LoRA weights: once per step, and after the step (DeepSpeed's included) has written them."""
        def step() -> float:
            norm = sync.step()
            fused.refresh()
            return norm

        return replace(sync, step=step)  # its backward and micro-batch context (DDP's no_sync) as they are

    def _base(self, model_cfg, shared_base: BaseExport | None, share_required: bool):
        """(the frozen base model, the owner's fence or None): mapped from ``shared_base`` where
        it lines up, else loaded; ``self.base_weights`` says which and why."""
        self.base_weights: dict[str, Any] = {"mode": "own", "reason": "no replica's weights were offered"}
        self.base_owner_pid: int | None = None
        if shared_base is not None:
            from model.base import resolve_model, torch_dtype

            try:
                base = shared_model(resolve_model(model_cfg), torch_dtype(model_cfg.dtype), shared_base, self.device)
            except ShareRefused as err:
                if share_required:
                    raise
                log.warning("learner: loading its own copy of the base model: %s", err)
                self.base_weights = {"mode": "own", "reason": str(err)}
            else:
                self.base_weights = {"mode": "shared", "owner": shared_base.describe()}
                self.base_owner_pid = shared_base.owner_pid
                return base, Fence.open(shared_base.fence) if shared_base.fence is not None else None
        return load_base_model(model_cfg, self.device), None

    def _fsdp_model(self, model_cfg, spec: PolicySpec, source: Path | None, shared_base: BaseExport | None):
        """The peft model sharded over the workers (learner.strategy=fsdp2): each loads only its
        slices of the base weights; a replica's mapped weights cannot be sharded (config/run.py
        refuses the combination; an offer here is declined and recorded)."""
        from learner.fsdp import build_fsdp_model
        from model.base import resolve_model

        why = "learner.strategy=fsdp2 shards its own copy of the base weights"
        self.base_weights = {"mode": "own", "reason": why if shared_base is not None else "no replica's weights were offered"}
        self.base_owner_pid = None
        return build_fsdp_model(resolve_model(model_cfg), model_cfg, self.cfg.lora, spec.seed, source, self.device,
                                cpu_offload=self.cfg.fsdp_cpu_offload)

    @classmethod
    def for_run(cls, run_cfg, **kwargs: Any) -> "PolicyLearner":
        """The policy of a whole run config (tests, benches, the Ray worker)."""
        return cls(run_cfg.learner, run_cfg.model, PolicySpec.for_run(run_cfg), **kwargs)

    def _set_checkpointing(self, on: bool) -> None:
        if on != self.checkpointing:
            if on:
                self.peft_model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            else:
                self.peft_model.gradient_checkpointing_disable()
            self.checkpointing = on

    def plan(self, batch: TrainBatch, rows: int) -> tuple[bool, int | None, int | None]:
        """(gradient checkpointing, micro-batch token budget, most rows per micro-batch) for this
        worker's ``rows`` of the step's global ``batch``: as configured, with the 'auto' values
        resolved (CPU: off and by count; CUDA: by learner/memory_plan.py for the batch's longest
        row, the same on every worker)."""
        cfg = self.cfg
        tokens = None if cfg.micro_batch_tokens == "auto" else cfg.micro_batch_tokens
        if self.memory_shape is None:
            return cfg.gradient_checkpointing is True, tokens, None
        longest = max(len(p) + len(r) for p, r in zip(batch.prompt_ids, batch.response_ids))
        if cfg.micro_batch_tokens == "auto":
            need = longest  # the plan chooses the budget: one row must fit
            # checkpointing=auto weighs the micro-batches of this worker's rows in either mode
            shape = dict(rows=max(1, rows), max_rows=cfg.micro_batch_size)
            if self.pack:  # a packed micro-batch costs its rows' real tokens (learner/microbatch.py)
                lengths = [len(p) + len(r) for p, r in zip(batch.prompt_ids, batch.response_ids)]
                shape["row_tokens"] = -(-sum(lengths) // len(lengths))
        elif tokens is not None:  # the largest micro-batch the cut builds on any worker, not the cap
            need = self._largest_micro_batch(batch, tokens)
            shape = {}
        else:
            need, shape = min(cfg.micro_batch_size, rows) * longest, {}
        plan = memory_plan(self.memory_shape, cfg.lora.r, self.lora_trainable, self.memory_budget, need,
                           self.logprob_chunk,
                           None if cfg.gradient_checkpointing == "auto" else cfg.gradient_checkpointing, **shape,
                           sharding=self.memory_sharding, compiled=self.compiled_layers > 0)
        if not plan.fits and (self.last_plan is None or self.last_plan.fits):
            log.warning("learner: by its memory plan one micro-batch of %d tokens does not fit %.1f GiB even "
                        "with gradient checkpointing (%s); the update may run out of memory", need,
                        self.memory_budget / GIB, plan.as_dict())
        self.last_plan = plan
        if cfg.micro_batch_tokens == "auto":
            return plan.gradient_checkpointing, plan.micro_batch_tokens, cfg.micro_batch_size
        return plan.gradient_checkpointing, tokens, None

    def _largest_micro_batch(self, batch: TrainBatch, tokens: int) -> int:
        """Tokens of the largest micro-batch that a token budget of ``tokens`` cuts any worker's
        shard of ``batch`` into (learner/microbatch.py): groups stay whole, so a cap of 8192 over
        groups of 8 x 584 tokens builds micro-batches of 4,672, and the plan sizes memory for
        those; the same on every worker."""
        lengths = [len(p) + len(r) for p, r in zip(batch.prompt_ids, batch.response_ids)]
        shards = (shard_bounds(len(batch), self.world_size, rank) for rank in range(self.world_size))
        return max(largest_micro_batch(lengths[lo:hi], tokens, batch.group_ids[lo:hi], packed=self.pack)
                   for lo, hi in shards)

    @property
    def _deepspeed_engine(self):
        """The DeepSpeed engine (it owns the optimizer state under ZeRO), or None."""
        return self.model if self.cfg.strategy == "deepspeed" else None

    def _wrap(self, model):
        """The module the update runs through, and how its gradients are synchronised."""
        if self.cfg.strategy == "deepspeed":
            return deepspeed_engine(model, self.optimizer, self.cfg)
        if self.sharded:  # fully_shard wrapped the peft model in place
            from learner.fsdp import fsdp_grad_sync

            return model, fsdp_grad_sync(self.peft_model, self.optimizer, self.cfg.max_grad_norm)
        if self.world_size > 1 and dist.is_initialized():
            from torch.nn.parallel import DistributedDataParallel

            ids = [self.device.index] if self.device.type == "cuda" else None
            model = DistributedDataParallel(model, device_ids=ids)
        return model, ddp_grad_sync(model, self.optimizer, self.cfg.max_grad_norm,
                                    keep_grads=self.scorer is not None)

    # ------------------------------------------------------------------ one GRPO step

    def _micro_batches(self, shard: TrainBatch, checkpointing: bool, token_budget: int | None,
                       max_rows: int | None, scorer) -> list:
        cfg = self.cfg
        with record_function("cp.micro_batches"):  # labels for torch.profiler (bench/learner_gpu.py --profile)
            return make_micro_batches(shard, cfg.micro_batch_size, self.device,
                                      share_prefix=self.share_prefix and not checkpointing,
                                      token_budget=token_budget, max_rows=max_rows,
                                      pad_multiple=cfg.graph_pad_tokens if scorer is not None else 1,
                                      causal_only=self.causal_only, logprob_chunk=self.logprob_chunk,
                                      pack=self.pack)

    def _folds_old_logprobs(self) -> bool:
        """Whether a step takes the pre-update log-probs from its own forward (detached) instead of
        a no-grad pass first: one epoch, no dropout, and no entropy gate that needs them first."""
        cfg = self.cfg
        gate_needs_entropy = cfg.entropy_coef > 0 and cfg.entropy_floor is not None
        return cfg.fold_old_logprobs and cfg.epochs_per_step == 1 and cfg.lora.dropout == 0 and not gate_needs_entropy

    def _compile_now(self) -> float:
        """learner.compile_layers: run the step's passes once on a two-row batch at start-up and drop
        the gradients (no optimizer step, the RNG restored), so that the compile, a minute or more,
        counts against learner.start_timeout_s instead of the first step's stall deadline
        (liveness.floor_s, a first micro-batch quiet that long is a stalled learner). Returns seconds."""
        t = time.perf_counter()
        vocab = int(getattr(self.peft_model.get_base_model().config, "vocab_size", 2) or 2)
        rows = TrainBatch(prompt_ids=[[(3 + i) % vocab for i in range(9)]] * 2,
                          response_ids=[[(5 + i) % vocab for i in range(7)]] * 2,
                          rollout_logprobs=[[-1.0] * 7] * 2, advantages=[1.0, -1.0], rewards=[1.0, 0.0],
                          group_ids=[0, 0])
        cfg, temp = self.cfg, self.spec.temperature
        mbs = self._micro_batches(rows, self.checkpointing, None, None, None)
        tokens = float(rows.num_response_tokens())
        norm = LossNorm(loss_type=cfg.loss_type, global_tokens=tokens, global_sequences=len(rows), local_tokens=tokens,
                        max_completion_length=self.spec.max_completion_length, dp_size=1)
        trainable = [p for p in self.peft_model.parameters() if p.requires_grad]

        def drop_grads() -> float:
            for p in trainable:
                p.grad = None
            return 0.0

        devices = [self.device] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            self.peft_model.eval()
            old = ref = None
            if not self._folds_old_logprobs():  # the step's no-grad pass, as step() decides it
                old = old_log_prob(self.lm, mbs, temp, False, self.amp_dtype)[0]
            if cfg.beta > 0:
                ref = ref_log_prob(self.lm, self.peft_model, mbs, temp, self.amp_dtype)
            self.peft_model.train()
            update_actor(self.model, mbs, replace(self.grad_sync, step=drop_grads), norm,
                         ObjectiveParams.from_config(cfg), temperature=temp, epochs=1, old=old, ref=ref,
                         entropy_bonus=False, amp_dtype=self.amp_dtype)
        drop_grads()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter() - t

    def step(self, batch: TrainBatch) -> tuple[dict[str, float], dict[str, float]]:
        """Train on this worker's shard of the global batch; returns (metrics, phases_s),
        metrics already reduced over workers."""
        cfg, temp = self.cfg, self.spec.temperature
        lo, hi = shard_bounds(len(batch), self.world_size, self.rank)
        shard = batch.rows(lo, hi)
        fence_before = self._fence_read()
        checkpointing, token_budget, max_rows = self.plan(batch, len(shard))
        self._set_checkpointing(checkpointing)
        scorer = None if checkpointing else self.scorer  # a checkpointed step runs eagerly
        mbs = self._micro_batches(shard, checkpointing, token_budget, max_rows, scorer)
        if self.world_size > 1 and dist.is_available() and dist.is_initialized():  # every rank runs as many
            # fsdp2: each forward all-gathers; ddp: each forward broadcasts buffers and each pass's
            # last backward all-reduces; deepspeed: ZeRO-2 reduces in every backward. A rank with
            # fewer micro-batches would leave the others waiting in a collective it never joins.
            count = torch.tensor([len(mbs)], dtype=torch.int64, device=self.device)  # NCCL: on the GPU
            dist.all_reduce(count, op=dist.ReduceOp.MAX)
            mbs = pad_micro_batches(mbs, int(count), self.device)  # zero-loss micro-batches (learner/passes.py)
        norm = LossNorm(
            loss_type=cfg.loss_type,
            global_tokens=float(batch.num_response_tokens()),
            global_sequences=len(batch),
            local_tokens=float(shard.num_response_tokens()),
            max_completion_length=self.spec.max_completion_length,
            dp_size=self.world_size,
        )
        gate_needs_entropy = cfg.entropy_coef > 0 and cfg.entropy_floor is not None
        fold = self._folds_old_logprobs()
        phases = {"old_log_prob": 0.0, "ref": 0.0}

        t = time.perf_counter()
        old, rollout_sums, ent_sum = None, {}, 0.0
        if not fold:
            self.peft_model.eval()
            old, rollout_sums, ent_sum = old_log_prob(self.lm, mbs, temp, gate_needs_entropy, self.amp_dtype,
                                                      self.report_progress)
            phases["old_log_prob"] = time.perf_counter() - t
        bonus = cfg.entropy_coef > 0
        if gate_needs_entropy:
            g = allreduce_sum({"e": ent_sum, "n": float(sum(float(mb.mask.sum()) for mb in mbs))}, self.device)
            bonus = entropy_bonus_active(g["e"] / max(g["n"], 1.0), cfg.entropy_coef, cfg.entropy_floor)

        t = time.perf_counter()
        ref = None
        if cfg.beta > 0:
            self.peft_model.eval()
            ref = ref_log_prob(self.lm, self.peft_model, mbs, temp, self.amp_dtype, self.report_progress)
            phases["ref"] = time.perf_counter() - t

        t = time.perf_counter()
        self.peft_model.train()
        lr = float(self.optimizer.param_groups[0]["lr"])
        res = update_actor(
            self.model, mbs, self.grad_sync, norm, ObjectiveParams.from_config(cfg),
            temperature=temp, epochs=cfg.epochs_per_step, old=old, ref=ref, entropy_bonus=bonus,
            amp_dtype=self.amp_dtype, scorer=scorer, report=self.report_progress,
        )
        self.scheduler.step()
        self.step_count += 1
        work = self._work(mbs, forward_passes=int(old is not None) + int(ref is not None))
        reduced = allreduce_sums({"policy": res.sums, "rollout": rollout_sums or res.rollout_sums,
                                  "loss": {"loss": res.loss}, "work": work}, self.device)
        phases["update_actor"] = time.perf_counter() - t

        self._fence_check(fence_before)
        policy, rollout = finalize(reduced["policy"]), finalize(reduced["rollout"])
        metrics = {k: v for k, v in policy.items() if k not in ("tokens", "sequences")}
        metrics.update({k: rollout[k] for k in ("ppl_ratio", "rollout_kl", "rollout_k3_kl", "rollout_abs_diff")})
        metrics.update(
            loss=reduced["loss"]["loss"] / self.world_size,
            grad_norm=res.grad_norm,
            learning_rate=lr,
            entropy_bonus_active=float(bonus),
            learner_cuda_graphs=float(scorer is not None and scorer.disabled is None),
            learner_graph_capture_s=self.scorer.capture_s if self.scorer is not None else 0.0,
            # what the memory plan chose for this step (it may change with the batch's lengths)
            learner_gradient_checkpointing=float(checkpointing),
            learner_micro_batches=float(len(mbs)),
            response_tokens=float(batch.num_response_tokens()),
            total_tokens=float(batch.num_total_tokens()),
            sequences=float(len(batch)),
        )
        seconds = phases["old_log_prob"] + phases["ref"] + phases["update_actor"]
        metrics.update(
            learner_tokens_per_s=reduced["work"]["tokens"] / seconds if seconds > 0 else 0.0,
            learner_mfu=mfu(reduced["work"]["flops"], seconds, cfg.peak_flops, self.world_size),
        )
        return metrics, phases

    def _fence_read(self) -> tuple[int, int] | None:
        """Where the shared weights' fence stands as a step starts (None: not shared, or never
        rewritten); maps the replica's served adapter when it has announced a new one."""
        if self.base_owner_pid is not None:
            check_owner(self.base_owner_pid)
        if self.served is None:
            return None
        before = self.served.fence.read()
        if self.served.refresh() and self.scorer is not None:
            self.scorer.graphs.clear()  # captured before the served adapter's tensors were mapped
        return before

    def _fence_check(self, before: tuple[int, int] | None) -> None:
        if before is not None:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)  # every kernel that read the weights has run
            self.served.fence.check(before, f"learner step {self.step_count}")

    def _work(self, mbs, forward_passes: int) -> dict[str, float]:
        """This worker's tokens run by the step's passes and their model FLOPs
        (learner/microbatch.py: 6 N per trained token, 2 N per forward-only token)."""
        tokens = sum(mb.tokens for mb in mbs)
        trained = tokens * self.cfg.epochs_per_step
        return {"tokens": float(trained + tokens * forward_passes),
                "flops": model_flops(self.num_params, trained, tokens * forward_passes)}

    # ------------------------------------------------------------------ adapters, checkpoints

    def full_adapter(self) -> dict[str, torch.Tensor] | None:
        """Under FSDP2 the adapter's full tensors, gathered (a collective: EVERY rank calls it
        before rank 0 publishes or saves); None otherwise (each rank holds the whole adapter)."""
        if not self.sharded:
            return None
        from peft import get_peft_model_state_dict

        from learner.fsdp import full_state

        with record_function("cp.gather_adapter"):
            return full_state(get_peft_model_state_dict(self.peft_model))

    def payload(self, version: int, adapter: dict[str, torch.Tensor] | None = None) -> AdapterPayload:
        """The adapter for the engines; ``adapter``: its full tensors (``full_adapter``, FSDP2)."""
        if self.sharded and adapter is None:  # the model's tensors are this rank's shards
            raise ValueError("PolicyLearner.payload under learner.strategy=fsdp2 needs the adapter gathered by "
                             "full_adapter() on every rank")
        with record_function("cp.export"):
            return self.adapter_export.payload(self.peft_model, version, dtype=self.payload_dtype, state=adapter)

    def stats(self) -> dict[str, Any]:
        """How the update ran, for the receipt: graphs captured and replayed, or why not."""
        return {"cuda_graphs": self.scorer.stats() if self.scorer is not None else None,
                "share_prompt_prefix": self.share_prefix, "autocast": str(self.amp_dtype),
                "pack_sequences": self.pack if self.pack_refusal is None else f"off: {self.pack_refusal}",
                "payload_dtype": str(self.payload_dtype or "float32"), "base_weights": self.base_weights,
                "adapter_transport": self.adapter_export.stats(),
                "gradient_checkpointing": self.checkpointing, "logprob_chunk_tokens": self.logprob_chunk,
                "memory_plan": self.last_plan.as_dict() if self.last_plan is not None else None,
                "fused_lora": self.fused.stats() if self.fused is not None else None,
                "compiled_layers": self.compiled_layers, "compile_s": round(self.compile_s, 1),
                "layers": self.layers}

    def save_init_adapter(self, out_dir: Path, adapter: dict[str, torch.Tensor] | None = None) -> str:
        return save_adapter(self.peft_model, out_dir, state=adapter)

    def save_checkpoint(self, ckpt: Path, data_position: dict[str, Any] | None,
                        adapter: dict[str, torch.Tensor] | None = None) -> str | None:
        """Every rank calls it. Under FSDP2 the adapter (``adapter``, else gathered here) and the
        optimizer state are gathered whole first, so rank 0 writes the plain learner's layout."""
        full_optimizer = None
        if self.sharded:
            from learner.fsdp import full_optimizer_state

            adapter = adapter if adapter is not None else self.full_adapter()
            full_optimizer = full_optimizer_state(self.optimizer)
        sha = checkpoint.save(
            ckpt, rank=self.rank, peft_model=self.peft_model, optimizer=self.optimizer,
            scheduler=self.scheduler, step=self.step_count, data_position=data_position,
            deepspeed_engine=self._deepspeed_engine, adapter_state=adapter, optimizer_state=full_optimizer,
        )
        if dist.is_available() and dist.is_initialized():
            dist.barrier()
        return sha
