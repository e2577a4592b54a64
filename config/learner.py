"""Learner section of the run config. Pydantic only: keep this import-light."""

from __future__ import annotations

from typing import Annotated, Literal

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from config.placement import check_label_selector, check_resources, label_selector_field, resources_field

# The names the learner's registries implement (learner/advantages.py builds its estimator table
# from AdvantageEstimator: each *_valid_only name is its base estimator over valid members only).
AdvantageEstimator = Literal[
    "grpo", "dr_grpo", "rank", "rloo",
    "grpo_valid_only", "dr_grpo_valid_only", "rank_valid_only", "rloo_valid_only",
]
ScaleRewards = Literal["group", "batch", "none"]
LossType = Literal["grpo", "bnpo", "dr_grpo", "dapo"]
KLEstimator = Literal["k1", "k2", "k3", "low_var_kl"]

# learner.logprob_chunk_tokens=auto on CUDA workers. Measured on an H200 (bf16 logits [8, 585,
# 151936], forward + backward): 2.0-2.2 GiB peak with the logits' own gradient, against
# 10.6-13.2 GiB for the plain path; 256 to 2048 tokens all cost ~10 ms more per 4.7k tokens
# (the backward's recomputed log-softmax), so the smallest of them.
CUDA_LOGPROB_CHUNK_TOKENS = 256


class LoraConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    r: int = Field(16, ge=1, description="LoRA rank.")
    alpha: float = Field(32.0, gt=0, description="LoRA alpha (scale = alpha / r).")
    dropout: float = Field(0.0, ge=0, lt=1, description="LoRA dropout.")
    target_modules: list[str] | Literal["all-linear"] = Field(
        "all-linear", description="Modules that get adapters; 'all-linear' = every linear layer "
        "except the output head."
    )


LearnerStrategy = Literal["ddp", "deepspeed", "fsdp2"]


class LearnerConfig(BaseModel):
    """The GRPO objective and the optimiser."""

    model_config = ConfigDict(extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _deepspeed_is_a_strategy(cls, data: Any) -> Any:
        # Before extra="forbid", which would only say "extra inputs are not permitted".
        if isinstance(data, dict) and "deepspeed" in data:
            raise ValueError("learner.deepspeed is now learner.strategy (ddp | deepspeed | fsdp2): set "
                             "learner.strategy=deepspeed for ZeRO-2, or drop the key for DDP")
        return data

    workers: int = Field(1, ge=1, description="Ray Train workers (one torch.distributed rank each).")
    num_cpus_per_worker: float = Field(1.0, gt=0, description="CPUs per worker (Ray's accounting).")
    torch_threads: int | None = Field(
        None, ge=1, description="Intra-op threads of each worker; None = int(num_cpus_per_worker). "
        "In synchronous mode generation and update never overlap, so a worker may use the cores "
        "Ray books for the rollout replica while that replica waits."
    )
    use_gpu: bool = Field(False, description="Place workers on GPUs (NCCL).")
    gpus_per_worker: float = Field(
        1.0, gt=0, le=1, description="GPUs each worker reserves in Ray when use_gpu. A fraction lets "
        "rollout replicas share a learner's GPU (e.g. 0.6 here with rollout.num_gpus=0.4): a replica "
        "holding part of a GPU otherwise keeps whole-GPU workers waiting forever. Above 0.5, so that "
        "two workers (NCCL ranks) never land on one GPU. At most 1: a worker is one rank on one GPU; a model "
        "larger than one GPU is spread by more workers under strategy=fsdp2 (each holds 1/workers of the base)."
    )
    strategy: LearnerStrategy = Field(
        "ddp", description="How the workers split the update. 'ddp': every worker holds the whole base and "
        "LoRA, gradients all-reduced (DistributedDataParallel; one worker runs unwrapped). 'deepspeed': "
        "ZeRO-2 over the LoRA parameters (GPU only). 'fsdp2': torch's fully_shard over each decoder layer "
        "and the root, so each worker holds 1/workers of the base weights, loaded slice by slice onto a "
        "model built on the meta device (learner/fsdp.py); LoRA trains in float32 (bfloat16 compute on "
        "CUDA with a bf16 base); the adapter is gathered on every rank before rank 0 publishes it."
    )
    fsdp_cpu_offload: bool = Field(
        False, description="With strategy=fsdp2 on CUDA workers: FSDP2's CPUOffloadPolicy keeps the sharded "
        "parameters, gradients and AdamW state in host memory (copied to the GPU layer by layer; the optimizer "
        "step runs on the CPU). Less GPU memory, slower steps."
    )
    lora: LoraConfig = Field(default_factory=LoraConfig, description="The adapter's shape.")
    lr: float = Field(1e-4, gt=0, description="Peak learning rate.")
    lr_schedule: Literal["constant", "linear", "cosine"] = Field(
        "constant", description="Schedule after warmup."
    )
    warmup_steps: int = Field(0, ge=0, description="Linear warmup steps.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    betas: tuple[float, float] = Field((0.9, 0.999), description="AdamW betas.")
    max_grad_norm: float = Field(1.0, gt=0, description="Gradient clipping norm.")
    micro_batch_size: int = Field(
        8, ge=1, description="Sequences per forward/backward when micro_batch_tokens is None; with "
        "micro_batch_tokens=auto on a CUDA worker, the most sequences per forward/backward."
    )
    micro_batch_tokens: Annotated[int, Field(ge=1)] | Literal["auto"] | None = Field(
        "auto", description="Micro-batches by token budget instead of by count: consecutive rows "
        "while rows x longest row stays within this many tokens, a group kept whole where it fits, a "
        "longer row alone (learner/microbatch.py). Same loss and gradients as any other cut. None = "
        "micro_batch_size sequences each. 'auto' = None on CPU workers; on CUDA workers "
        "micro_batch_size sequences each, cut further where they would exceed the token budget that "
        "the worker's memory allows (learner/memory_plan.py, from memory_budget_gib)."
    )
    gradient_checkpointing: Literal["auto"] | bool = Field(
        "auto", description="Recompute each layer's activations in the backward instead of keeping "
        "them: less memory, ~1/3 more compute. It runs without share_prompt_prefix (the prompt's KV "
        "cache cannot cross a checkpoint). 'auto' = off on CPU workers; on CUDA workers on for a step "
        "only when its micro-batches (one longest row, with micro_batch_tokens=auto; with a number, "
        "the largest micro-batch that budget cuts the step into) would not fit the memory budget "
        "without it, by the estimate of compiled layers where compile_layers runs "
        "(learner/memory_plan.py). Each step's choice is its learner_gradient_checkpointing metric."
    )
    memory_budget_gib: float | None = Field(
        None, gt=0, description="Device memory (GiB) one CUDA worker's update may use, for the 'auto' "
        "values of gradient_checkpointing and micro_batch_tokens: weights, LoRA and its AdamW state "
        "included. None = what the device has free when the worker has loaded the model (plus what "
        "it holds itself), at most gpus_per_worker of the device's total (a replica sharing the GPU "
        "may not have taken its share yet)."
    )
    logprob_chunk_tokens: Annotated[int, Field(ge=0)] | Literal["auto"] = Field(
        "auto", description="Log-probs and entropies computed over slices of about this many tokens "
        "of the logits, each slice recomputed in the backward, so that no float32 copy of the whole "
        "[rows, positions, vocabulary] logits exists (learner/passes.py token_logprobs): same values "
        "and gradients, one more log-softmax pass. 0 = the plain path (several float32 copies of the "
        f"logits). 'auto' = {CUDA_LOGPROB_CHUNK_TOKENS} on CUDA workers, 0 on CPU workers."
    )
    autocast: bool = Field(
        True, description="On CUDA with a bfloat16/float16 base, run the learner's forward under "
        "torch.autocast in the base dtype, so peft's float32 LoRA matrices multiply in bf16 like the "
        "base weights (master weights and optimizer state stay float32). Ignored on CPU."
    )
    fused_lora: Literal["auto"] | bool = Field(
        "auto", description="Run each of peft's LoRA linear layers as one autograd function "
        "(learner/fused_lora.py): the base GEMM, then x A^T and an addmm into its output whose alpha "
        "is the LoRA scale, with a hand-written backward; under autocast the float32 A and B are cast "
        "to the compute dtype once per optimizer step instead of on every forward. Same loss and "
        "gradients as peft's path (float32: exact where alpha/r is a power of two, else to rounding; "
        "bf16: to rounding). The modules stay peft's (save, export, disable_adapter); the reference "
        "pass and anything fusing does not cover (dropout, several adapters) run peft's forward. "
        "'auto' = on for CUDA workers, off for CPU workers, under strategy=fsdp2 (its sharded LoRA "
        "parameters are gathered per forward; the cast copies are kept per parameter) and where "
        "compile_layers applies (faster: its inductor kernels fuse peft's scale and add). true needs "
        "lora.dropout=0, strategy ddp or deepspeed and compile_layers not true."
    )
    compile_layers: Literal["auto"] | bool = Field(
        "auto", description="Compile each decoder layer with torch.compile (learner/compiled_layers.py): "
        "inductor fuses the element-wise work between the GEMMs (norms, RoPE, SiLU and gate, residual adds, "
        "and their backwards) into few kernels. Same loss and gradients up to float rounding "
        "(tests/test_learner_compile.py). Measured on an H200, Qwen3-4B, the learner alone: 0.947 s against "
        "1.371 s eager at 4x8 and 0.245 against 0.360 s at 1x8, peak 28.4 against 41.8 GiB (README). The learner "
        "compiles at start-up, running its passes once on two rows (within start_timeout_s, so that liveness "
        "does not take the compile for a stalled first step): 50-75 s for the learner alone on that host; "
        "a Ray run that compiled in its first step took 263 s for it under MPS, 64 s with inductor's on-disk "
        "cache warm. 'auto' = on for a single CUDA worker under strategy ddp, unless cuda_graphs, pack_sequences or share_prompt_prefix is set or the "
        "base is mapped from a replica (model/shared_base.py); off on CPU workers. It replaces fused_lora "
        "there (fused_lora=auto is off where layers compile). true also compiles under ddp over several "
        "workers, under fsdp2 (the same step to rounding over 2 gloo ranks) and on a base mapped from the "
        "replica (its correction inside the compiled layers, as one graph for every layer, traced with it "
        "from the start where the replica merges); not yet timed on GPUs. "
        "true needs strategy ddp or fsdp2 (without fsdp_cpu_offload), cuda_graphs=false, "
        "fused_lora not true and share_prompt_prefix not true (its KV cache would make a graph per layer); "
        "with true the shared prefix defaults to off on CPU workers too."
    )
    fused_optimizer: bool = Field(
        True, description="AdamW's fused CUDA kernel (one launch for every LoRA tensor) when the "
        "parameters are on a GPU; the for-each implementation on CPU."
    )
    peak_flops: float = Field(
        989e12, gt=0, description="Peak FLOP/s of one device for the learner's MFU metric: the "
        "H100/H200 SXM dense bf16 datasheet rate by default (MFU = model FLOPs / seconds / this)."
    )
    share_prompt_prefix: bool | None = Field(
        None, description="Run the tokens all rows of a micro-batch share (a group's prompt) once "
        "and reuse their KV cache with gradients, instead of once per row (learner/shared_prefix.py). "
        "Same loss and gradients; with micro_batch_size = group_size, one prompt pass per group. "
        "None = on for CPU workers (the default run's update: 42.8 s -> 13.7 s), off on CUDA workers, "
        "where the update is bound by kernel launches, not FLOPs: two passes launch twice, and a "
        "shared prefix cannot be captured as a CUDA graph (cuda_graphs); off under strategy=fsdp2, which "
        "frees each layer's gathered weights after the prompt's forward (true is refused there), and off "
        "with pack_sequences."
    )
    pack_sequences: bool = Field(
        False, description="Concatenate each micro-batch's rows into ONE row without padding, the "
        "position ids restarting at 0 for every row and no attention mask, so that transformers builds "
        "a block-diagonal causal mask (sdpa, eager, flex) or runs flash attention's varlen kernel from the "
        "position ids (learner/passes.py make_micro_batches); the token budget (micro_batch_tokens) then "
        "counts a micro-batch's real tokens, not rows x longest row, so more rows fit. Same loss and "
        "gradients as the padded micro-batches up to float rounding (tests/test_learner_pack.py). Off by "
        "default: measured on an H200 (4B 4x8, responses of 64-384 tokens), sdpa with the block-diagonal mask "
        "lost to the padded causal kernel, 1.92 s against 1.67 s a step and 58.9 GiB against 34.7 (the T x T "
        "mask); flash_attention_2's varlen path is not measured. A model whose "
        "attention implementation cannot take packed rows runs padded, with one warning. Not with "
        "share_prompt_prefix=true (another layout of the same rows) or cuda_graphs=true (fixed shapes)."
    )
    cuda_graphs: bool = Field(
        False, description="On a CUDA worker, capture the update's forward and backward as CUDA graphs, "
        "one per micro-batch shape, and replay them (learner/graphed.py), so Python's kernel launches "
        "stop pacing the GPU. Off by default, by measurement: on the H200 at Qwen3-4B shapes the update "
        "was already device-bound once its host syncs were gone (1x8: 0.711 s with graphs, 0.719 s "
        "without; 4x8: 1.645 vs 1.507 s; bench/results/gpu-learner.md); smaller models may gain. Applies "
        "with one worker, strategy ddp, no gradient checkpointing, LoRA dropout 0 and no shared prompt "
        "prefix; a capture that fails is reported once and the update runs eagerly (metric "
        "learner_cuda_graphs)."
    )
    graph_pad_tokens: int = Field(
        64, ge=1, description="With cuda_graphs: micro-batch widths are padded up, and their first "
        "scored position down, to multiples of this many tokens, so that steps of similar lengths "
        "replay one graph; the padding is masked out of the loss."
    )
    max_graphs: int = Field(
        4, ge=1, description="With cuda_graphs: captured shapes kept (the least recently used is "
        "dropped first); each holds the memory of its activations."
    )
    epochs_per_step: int = Field(1, ge=1, description="Optimizer passes over each step's batch.")
    advantage: AdvantageEstimator = Field("grpo", description="Advantage estimator (see learner/advantages.py).")
    scale_rewards: ScaleRewards = Field(
        "group", description="Std used to scale advantages (grpo estimators)."
    )
    invalid_advantage: float = Field(
        -1.0, description="Advantage of failed members in the *_valid_only estimators."
    )
    loss_type: LossType = Field(
        "dapo", description="Token/sequence aggregation of the policy loss (as TRL documents)."
    )
    epsilon_low: float = Field(0.2, ge=0, description="Lower clip range of the ratio.")
    epsilon_high: float = Field(0.28, ge=0, description="Upper clip range of the ratio.")
    beta: float = Field(0.0, ge=0, description="KL leash coefficient against the base model.")
    kl_estimator: KLEstimator = Field("k3", description="KL estimator.")
    entropy_coef: float = Field(0.0, ge=0, description="Entropy bonus coefficient.")
    entropy_floor: float | None = Field(
        None, ge=0, description="Apply the entropy bonus only while entropy is below this."
    )
    tis_cap: float | None = Field(
        2.0, gt=0, description="Truncated importance sampling cap on exp(old - rollout); None = off."
    )
    max_completion_length: int | None = Field(
        None, ge=1, description="dr_grpo's constant normaliser; None = rollout.max_tokens."
    )
    fold_old_logprobs: bool = Field(
        True,
        description="With epochs_per_step=1, lora.dropout=0 and no entropy floor, take the "
        "pre-update log-probs from the update's own forward (detached: no optimizer step has "
        "happened yet) instead of a separate no-grad pass; phase old_log_prob then reports 0 s.",
    )
    on_lr_mismatch: Literal["rebase", "refuse"] = Field(
        "rebase",
        description="When a resumed checkpoint's scheduler disagrees with the configured LR: "
        "'rebase' on the config (and say so in the receipt) or 'refuse' to start.",
    )
    start_timeout_s: float = Field(
        900.0, gt=0, description="How long the driver waits for the Ray Train workers to start and "
        "answer Init (model load, LoRA init or checkpoint restore) before it fails the run.",
    )
    step_timeout_s: float = Field(
        1800.0, gt=0, description="How long the driver waits for one step's update (old_log_prob, ref, "
        "update_actor and the adapter export) before it fails the run.",
    )
    save_timeout_s: float = Field(
        600.0, gt=0, description="How long the driver waits for a checkpoint and adapter save.",
    )
    stop_timeout_s: float = Field(
        120.0, gt=0, description="How long stopping the learner waits for the Train run to end before "
        "its coordinator is killed.",
    )
    resources_per_worker: dict[str, float] = resources_field("learner worker", '{"learner_slot": 1}')
    label_selector: dict[str, str] = label_selector_field("learner worker", '{"counterpoint-role": "learner"}')
    max_restarts: int = Field(
        2, ge=0, description="In-run restores of the learner after a worker (or its node) dies: the "
        "driver restarts the Ray Train workers from the last checkpoint this run saved (or its start "
        "point) and re-feeds the batches it kept since, so the run goes on with the data order and LR "
        "of an uninterrupted one (README, 'What survives what'). 0 = the run stops at the first death "
        "(`--resume` continues it). A worker that raises an error of its own is never restarted.",
    )

    @model_validator(mode="after")
    def _gpu_fraction_one_rank_per_gpu(self) -> "LearnerConfig":
        if self.use_gpu and self.workers > 1 and self.gpus_per_worker <= 0.5:
            raise ValueError(f"learner.gpus_per_worker={self.gpus_per_worker:g} with {self.workers} workers lets Ray "
                             "put two NCCL ranks on one GPU; use more than 0.5")
        return self

    @model_validator(mode="after")
    def _placement(self) -> "LearnerConfig":
        check_resources("learner.resources_per_worker", self.resources_per_worker)
        check_label_selector("learner.label_selector", self.label_selector)
        return self

    @model_validator(mode="after")
    def _fused_lora_needs_no_dropout(self) -> "LearnerConfig":
        if self.fused_lora is True and self.lora.dropout > 0:
            raise ValueError(f"learner.fused_lora=true needs learner.lora.dropout=0 (got {self.lora.dropout:g}): "
                             "the fused layer has no dropout; set fused_lora to auto or false")
        if self.fused_lora is True and self.strategy == "fsdp2":
            raise ValueError("learner.fused_lora=true with learner.strategy=fsdp2: the fused layer keeps cast copies "
                             "of whole LoRA parameters, which FSDP2 shards and gathers per forward; set fused_lora "
                             "to auto or false")
        return self

    @model_validator(mode="after")
    def _compiled_layers_run_where_measured(self) -> "LearnerConfig":
        if self.compile_layers is not True:
            return self
        if self.strategy == "deepspeed":
            raise ValueError("learner.compile_layers=true with learner.strategy=deepspeed: compiled layers are built "
                             "and tested for ddp and fsdp2; set compile_layers to auto or false")
        if self.fsdp_cpu_offload:
            raise ValueError("learner.compile_layers=true with learner.fsdp_cpu_offload=true: compiled layers over "
                             "host-resident shards are not built or tested; set one of them to false")
        if self.cuda_graphs:
            raise ValueError("learner.compile_layers=true with learner.cuda_graphs=true: two ways to take the "
                             "launches out of the update; set one of them to false")
        if self.share_prompt_prefix:
            raise ValueError("learner.compile_layers=true with learner.share_prompt_prefix=true: the prompt's KV "
                             "cache makes every layer a graph of its own; set share_prompt_prefix to false or unset")
        if self.fused_lora is True:
            raise ValueError("learner.compile_layers=true with learner.fused_lora=true: the fused layers' cast cache "
                             "makes torch.compile build a graph per layer (slower than either alone, measured); "
                             "compiled layers fuse peft's LoRA term themselves; set fused_lora to auto or false")
        return self

    @model_validator(mode="after")
    def _packing_has_its_own_layout(self) -> "LearnerConfig":
        if self.pack_sequences and self.share_prompt_prefix:
            raise ValueError("learner.pack_sequences=true with learner.share_prompt_prefix=true: a packed micro-batch "
                             "is one row without a shared prompt to run once; set one of them to false")
        if self.pack_sequences and self.cuda_graphs:
            raise ValueError("learner.pack_sequences=true with learner.cuda_graphs=true: a graph replays fixed shapes "
                             "and a packed row's length and boundaries change every micro-batch; set one to false")
        return self

    @model_validator(mode="after")
    def _strategy_can_serve(self) -> "LearnerConfig":
        if self.strategy == "deepspeed" and not self.use_gpu:
            raise ValueError("learner.strategy=deepspeed needs learner.use_gpu=true (DeepSpeed is GPU-only here)")
        if self.strategy == "fsdp2" and self.cuda_graphs:
            raise ValueError("learner.cuda_graphs=true with learner.strategy=fsdp2: a graph replays one unwrapped "
                             "model on one worker, and FSDP2 gathers each layer's weights with collectives")
        if self.strategy == "fsdp2" and self.share_prompt_prefix:
            raise ValueError("learner.share_prompt_prefix=true with learner.strategy=fsdp2: FSDP2 frees each layer's "
                             "gathered weights after the prompt's forward, whose KV cache the rows' backward reuses")
        if self.fsdp_cpu_offload and not (self.strategy == "fsdp2" and self.use_gpu):
            raise ValueError("learner.fsdp_cpu_offload=true needs learner.strategy=fsdp2 and learner.use_gpu=true "
                             "(it moves a GPU worker's shards to the host)")
        return self
