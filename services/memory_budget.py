"""One GPU's memory split between the rollout replica (vLLM) and the learner, from a budget the
user states (the run's ``gpu_memory_gib``, config/run.py).

The problem: where the replica and the learner share one card, each holds the whole base model
and each sizes itself on its own: vLLM takes a share of the card's total
(``rollout.gpu_memory_utilization``) and fills what its weights and activations leave with KV
cache; the learner's memory plan (learner/memory_plan.py) takes what the card has free when it
starts. A user with a 24 GB card can neither say "use 22 GiB" nor learn, before anything starts,
that the run does not fit.

The estimate, in bytes (b = bytes per element of model.dtype, L layers, kv = key-value heads x
head_dim; a sequence is at most rollout.max_model_len tokens, the bound vLLM enforces on prompt +
completion, rounded up to whole KV blocks):
- a CUDA context per process, ``CUDA_CONTEXT_GIB`` (stated, not measured here); two processes.
- The replica, inside vLLM's own budget (``rollout.gpu_memory_gib``; vLLM gives what the rest
  leaves to its KV cache): the weights, parameters x b (counted from config.json: embeddings,
  attention, the SwiGLU MLP, the RMSNorms, the head unless tied; biases and q/k norms, < 0.01 %,
  left out); the peak of vLLM's profiling forward, ``ROLLOUT_ACTIVATION_GIB`` (stated); unmerged
  LoRA's slots, max_loras x the LoRA parameters at max_lora_rank x b; and the KV cache, 2 x L x kv x
  b per token, for the step's sequences (prompts_per_step x group_size, or a tree round's siblings
  of one expansion), at least one sequence (vLLM refuses to start with less).
- The replica, outside vLLM's budget (allocated after vLLM sized its KV cache): CUDA graphs'
  memory pool, ``CUDA_GRAPHS_GIB`` (stated; none with enforce_eager); merged LoRA's adapter in
  float32 (LoRA parameters x 4) and one layer's merge tensors, (3b + 8) x the largest adapted
  linear's weights (its W0, the next layer's W0 on its way and the merged result in b, W0 and the
  sum in float32: rollout/engines/vllm_merge.py's arithmetic, W0 on the host), plus every adapted
  layer's W0 where ``rollout.merged_w0=device``.
- The learner (``learner.memory_budget_gib``): the smallest budget with which its memory plan fits
  one micro-batch (one longest row, a whole sequence, with micro_batch_tokens=auto), checkpointed
  unless gradient_checkpointing is false: weights, LoRA with its gradients and AdamW state, the
  log-prob slices, the checkpointed activations and the plan's own reserve.

The split: a budget below the sum of the minimums (both contexts, the replica with one
sequence's KV cache and what it holds outside vLLM's budget, the learner's minimum) is refused.
Above it the replica's KV cache grows towards the step's sequences, and the learner takes the
rest, which its plan turns into larger micro-batches and then into an update without
checkpointing. KV cache beyond one step's sequences would sit idle (generation never has more in
flight at once), so everything beyond goes to the learner.

Pure Python (no torch, no Ray): the driver computes it before any service starts. The stated
constants are estimates; bench/results/memory.md has what a GPU measured.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from config import RunConfig
from config.learner import CUDA_LOGPROB_CHUNK_TOKENS
from learner.memory_plan import (LINEAR_NAMES, RESERVE, ModelShape, fixed_bytes, lora_params, memory_plan,
                                 per_token_bytes)

GIB = 2**30
CUDA_CONTEXT_GIB = 0.5  # per process: CUDA's context with its lazily loaded kernels (stated)
ROLLOUT_ACTIVATION_GIB = 1.0  # the peak of vLLM's profiling forward of a full token batch (stated)
CUDA_GRAPHS_GIB = 0.25  # vLLM's captured decode graphs' pool, outside its budget (stated)
ADAPTER_BYTES_PER_PARAM = 4  # merged: the replica holds A and B in float32
VLLM_GPU_BLOCK_SIZE = 16  # vLLM's KV block on CUDA (rollout.block_size=None)
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def parameter_count(config: Mapping[str, Any]) -> int:
    """Parameters of a Llama/Qwen-style decoder from its config.json: embeddings, per layer the
    attention's four projections, the SwiGLU MLP's three and two RMSNorms, the final norm, and the
    output head unless ``tie_word_embeddings`` (absent = untied: counted, the safe side)."""
    h, layers, vocab, inter = (config["hidden_size"], config["num_hidden_layers"], config["vocab_size"],
                               config["intermediate_size"])
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or h // heads
    q, kv = heads * head_dim, (config.get("num_key_value_heads") or heads) * head_dim
    layer = 2 * h * q + 2 * h * kv + 3 * h * inter + 2 * h
    head = 0 if config.get("tie_word_embeddings") else vocab * h
    return layers * layer + vocab * h + head + h


def model_shape(config: Mapping[str, Any], dtype_bytes: int) -> ModelShape:
    """learner/memory_plan.py's shape of the model whose config.json is ``config``."""
    return ModelShape.from_hf_config(SimpleNamespace(**config), params=parameter_count(config),
                                     dtype_bytes=dtype_bytes)


def _linear_sizes(shape: ModelShape) -> dict[str, tuple[int, int]]:
    h, q, kv, i = shape.hidden, shape.q_dim, shape.kv_dim, shape.intermediate
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}


def _targets(targets: Sequence[str] | str) -> list[str]:
    return list(LINEAR_NAMES) if targets == "all-linear" else [t for t in targets if t in LINEAR_NAMES]


@dataclass(frozen=True)
class ReplicaNeeds:
    """What the rollout replica must hold besides its weights."""

    sequences: int  # a step's sequences in flight at once
    sequence_tokens: int  # the most tokens of one (prompt + completion), in whole KV blocks
    merged: bool  # merged LoRA (rollout/engines/vllm_merge.py), else vLLM's LoRA slots
    cuda_graphs: bool
    w0_on_device: bool  # merged with rollout.merged_w0=device
    lora_slots: int  # unmerged: vLLM's max_loras
    lora_slot_rank: int  # unmerged: vLLM's max_lora_rank


@dataclass(frozen=True)
class LearnerNeeds:
    """What the learner's update must fit: the LoRA shape and one micro-batch."""

    rank: int
    targets: tuple[str, ...] | str
    micro_batch_tokens: int  # one micro-batch's padded tokens (learner/policy.py PolicyLearner.plan's need)
    logprob_chunk_tokens: int
    checkpointing: bool | None  # None = auto
    rows: int = 1  # one worker's rows of a step, which checkpointing=auto weighs (micro_batch_tokens=auto)
    max_rows: int | None = None  # learner.micro_batch_size, the most rows per micro-batch


@dataclass(frozen=True)
class MemorySplit:
    """What a budget resolves to, in GiB (rollout_gib and learner_gib rounded down to 0.01)."""

    budget_gib: float
    rollout_gib: float  # rollout.gpu_memory_gib: vLLM's weights, activations, LoRA slots and KV cache
    learner_gib: float  # learner.memory_budget_gib
    rollout_outside_gib: float  # the replica's CUDA graphs and merged-LoRA buffers, outside vLLM's budget
    contexts_gib: float  # both processes' CUDA contexts
    minimum_gib: float  # the smallest budget that holds the run, rounded up to 0.1
    weights_gib: float  # one copy of the base weights (each side holds one, unless the learner maps the replica's)
    kv_cache_gib: float
    kv_sequences: int  # whole sequences of sequence_tokens the KV cache holds
    step_sequences: int
    sequence_tokens: int
    learner_minimum_gib: float
    learner_checkpointing: bool  # what the learner's plan chooses for one micro-batch of micro_batch_tokens
    learner_micro_batch_tokens: int  # its token budget per micro-batch

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def summary(self) -> str:
        """One line for the console."""
        return (f"gpu_memory_gib={self.budget_gib:g}: vLLM {self.rollout_gib:.2f} GiB (weights {self.weights_gib:.2f}, "
                f"KV cache {self.kv_cache_gib:.2f} for {self.kv_sequences} of the step's {self.step_sequences} "
                f"sequences of {self.sequence_tokens} tokens) + {self.rollout_outside_gib:.2f} outside it, learner "
                f"{self.learner_gib:.2f} GiB ({'' if self.learner_checkpointing else 'no '}gradient checkpointing, "
                f"micro-batches of <= {self.learner_micro_batch_tokens} tokens), CUDA contexts "
                f"{self.contexts_gib:.2f}; the run needs >= {self.minimum_gib:.1f}")


class BudgetTooSmall(ValueError):
    """A gpu_memory_gib that cannot hold the replica and the learner."""


def learner_minimum_bytes(shape: ModelShape, learner: LearnerNeeds, trainable: int) -> int:
    """The smallest budget with which learner/memory_plan.py's plan fits one micro-batch of
    ``learner.micro_batch_tokens`` (checkpointed unless checkpointing is False)."""
    ckpt = learner.checkpointing is not False
    per = per_token_bytes(shape, learner.rank, ckpt, learner.logprob_chunk_tokens)
    fixed = fixed_bytes(shape, trainable, 0, learner.logprob_chunk_tokens)  # without the reserve: RESERVE x budget
    return math.ceil((fixed + per * learner.micro_batch_tokens) / (1 - RESERVE)) + 1


def _floor2(gib: float) -> float:
    return math.floor(gib * 100 + 1e-9) / 100


def _ceil1(gib: float) -> float:
    return math.ceil(gib * 10 - 1e-9) / 10


def _ceil2(gib: float) -> float:
    return math.ceil(gib * 100 - 1e-9) / 100


def split_memory(budget_gib: float, model: str, shape: ModelShape, replica: ReplicaNeeds,
                 learner: LearnerNeeds, shared_weights: bool = False) -> MemorySplit:
    """The split of ``budget_gib`` (module docstring); ``BudgetTooSmall`` (one line naming
    gpu_memory_gib, the budget and what the run needs) when it cannot hold both sides.
    ``shared_weights``: the learner maps the replica's weights (share_base_weights), so its
    budget holds no copy of them (learner/policy.py adds them back for its plan)."""
    budget = int(budget_gib * GIB)
    b = shape.dtype_bytes
    weights = shape.params * b
    contexts = int(2 * CUDA_CONTEXT_GIB * GIB)
    trainable = lora_params(shape, learner.rank, learner.targets)
    sizes = _linear_sizes(shape)
    targets = _targets(learner.targets)
    # inside vLLM's budget: weights, the profiling peak, unmerged LoRA's slots
    inside = weights + int(ROLLOUT_ACTIVATION_GIB * GIB)
    if not replica.merged:
        inside += replica.lora_slots * lora_params(shape, replica.lora_slot_rank, "all-linear") * b
    # outside it: CUDA graphs' pool, merged LoRA's buffers
    outside = int(CUDA_GRAPHS_GIB * GIB) if replica.cuda_graphs else 0
    if replica.merged:
        largest = max((sizes[n][0] * sizes[n][1] for n in targets), default=0)
        outside += trainable * ADAPTER_BYTES_PER_PARAM + (3 * b + 8) * largest
        if replica.w0_on_device:
            outside += shape.layers * sum(sizes[n][0] * sizes[n][1] for n in targets) * b
    kv_token = 2 * shape.layers * shape.kv_dim * b
    kv_one = replica.sequence_tokens * kv_token
    kv_step = max(1, replica.sequences) * kv_one
    learner_min = learner_minimum_bytes(shape, learner, trainable) - (weights if shared_weights else 0)
    # + 0.01 GiB: rounding vLLM's and the learner's amounts down to 0.01 GiB never leaves the learner short
    minimum = contexts + inside + kv_one + outside + learner_min + GIB // 100
    if budget < minimum:
        gib = lambda n: n / GIB  # noqa: E731
        raise BudgetTooSmall(
            f"gpu_memory_gib={budget_gib:g} cannot hold {model} "
            f"{'once (one shared copy' if shared_weights else 'twice (two copies'} of {gib(weights):.2f} GiB weights: "
            f"vLLM {gib(inside + kv_one):.2f} GiB with the KV cache of one {replica.sequence_tokens}-token sequence "
            f"+ {gib(outside):.2f} outside it, the learner {_ceil2(gib(learner_min)):.2f} GiB for one micro-batch "
            f"of {learner.micro_batch_tokens} tokens, {gib(contexts):.2f} of CUDA contexts): needs >= "
            f"{_ceil1(minimum / GIB):.1f} GiB")
    kv = kv_one + min(kv_step - kv_one, budget - minimum)
    rollout_gib = _floor2((inside + kv) / GIB)
    learner_gib = _floor2((budget - contexts - outside) / GIB - rollout_gib)
    plan = memory_plan(shape, learner.rank, trainable, int(learner_gib * GIB) + (weights if shared_weights else 0),
                       learner.micro_batch_tokens,
                       learner.logprob_chunk_tokens, learner.checkpointing, rows=learner.rows,
                       max_rows=learner.max_rows)
    return MemorySplit(
        budget_gib=budget_gib, rollout_gib=rollout_gib, learner_gib=learner_gib,
        rollout_outside_gib=round(outside / GIB, 2), contexts_gib=round(contexts / GIB, 2),
        minimum_gib=_ceil1(minimum / GIB), weights_gib=round(weights / GIB, 2), kv_cache_gib=round(kv / GIB, 2),
        kv_sequences=kv // kv_one, step_sequences=replica.sequences, sequence_tokens=replica.sequence_tokens,
        learner_minimum_gib=_ceil2(learner_min / GIB), learner_checkpointing=plan.gradient_checkpointing,
        learner_micro_batch_tokens=plan.micro_batch_tokens)


def step_sequences(cfg: RunConfig) -> int:
    """Sequences one generate call of a step has in flight: a flat step's prompts x group_size, a
    tree round's siblings of one expansion (its expansions run one after another)."""
    t = cfg.trainer
    if t.rollout_mode == "tree":
        return math.ceil(cfg.search.nodes_per_round / cfg.search.expansions_per_round)
    return t.prompts_per_step * t.group_size


def split_for_run(cfg: RunConfig, model_config: Mapping[str, Any], w0_on_device: bool) -> MemorySplit:
    """The split of ``cfg.gpu_memory_gib`` for the model whose config.json is ``model_config``."""
    from rollout.engines.vllm_engine import vllm_settings  # pure: the engine's own resolution of 'auto'

    r, lc = cfg.rollout, cfg.learner
    settings = vllm_settings(r, cuda=True)
    block = r.block_size or VLLM_GPU_BLOCK_SIZE
    sequences = step_sequences(cfg)
    row = r.max_model_len
    mbt = lc.micro_batch_tokens
    # what PolicyLearner.plan asks one micro-batch to hold, for rows of the longest length
    need = row if mbt == "auto" else max(mbt, row) if mbt is not None else min(lc.micro_batch_size, sequences) * row
    replica = ReplicaNeeds(sequences=sequences, sequence_tokens=math.ceil(row / block) * block,
                           merged=settings.lora == "merged", cuda_graphs=not settings.enforce_eager,
                           w0_on_device=w0_on_device, lora_slots=r.max_loras, lora_slot_rank=r.max_lora_rank)
    learner = LearnerNeeds(
        rank=lc.lora.r, targets=lc.lora.target_modules if isinstance(lc.lora.target_modules, str)
        else tuple(lc.lora.target_modules), micro_batch_tokens=need,
        logprob_chunk_tokens=CUDA_LOGPROB_CHUNK_TOKENS if lc.logprob_chunk_tokens == "auto" else lc.logprob_chunk_tokens,
        checkpointing=None if lc.gradient_checkpointing == "auto" else lc.gradient_checkpointing,
        **(dict(rows=math.ceil(sequences / lc.workers), max_rows=lc.micro_batch_size) if mbt == "auto" else {}))
    shape = model_shape(model_config, DTYPE_BYTES[cfg.model.dtype])
    return split_memory(cfg.gpu_memory_gib, Path(cfg.model.name_or_path).name, shape, replica, learner,
                        shared_weights=cfg.shares_base_weights()[0])
