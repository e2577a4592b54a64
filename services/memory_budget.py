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
  layer's W0 where ``rollout.merged_w0=device``; over an fp8 base, each touched fused layer is
  written whole and vLLM's reload holds the largest one's shards, its rebuilt weight and its fp8
  result, (2b + 1) x its weights more.
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

On a cluster, where each part has GPUs of its own (``cluster_memory``, configs/mle-tree-qwen3-32b.yaml),
the same estimates say what one GPU of each role holds: a rollout replica's GPU (the weights / the
tensor x pipeline parallel size, vLLM's LoRA slots split as its tensor-parallel layers split them,
the profiling peak, and the KV cache that rollout.gpu_memory_utilization leaves) and a learner
worker's (learner/memory_plan.py's fixed part, item by item, under fsdp2 one rank's shard or, with
fsdp_cpu_offload, the shards in host memory; the activations of one micro-batch; the reserve).
``python -m services.memory_budget --config C [--model-config config.json]`` prints that table; a hub
model's config.json is read from configs/shapes/ when this host has no copy.

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
from learner.memory_plan import (GATHERED_LAYERS, LINEAR_NAMES, LOGPROB_SLICE_COPIES, RESERVE, ModelShape, Sharding,
                                 fixed_bytes, lora_params, memory_plan, per_token_bytes, weight_bytes)
from learner.microbatch import largest_micro_batch
from model.base import text_model_config

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
    """learner/memory_plan.py's shape of the model whose config.json is ``config`` (its language
    model's, for a multimodal wrapper; the vision tower is not counted)."""
    text = text_model_config(config)
    return ModelShape.from_hf_config(SimpleNamespace(**text), params=parameter_count(text),
                                     dtype_bytes=dtype_bytes)


def linear_sizes(shape: ModelShape) -> dict[str, tuple[int, int]]:
    h, q, kv, i = shape.hidden, shape.q_dim, shape.kv_dim, shape.intermediate
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}


def rollout_weight_bytes(shape: ModelShape, quantization: str | None = None) -> int:
    """What a replica's base weights take in all (before any split over GPUs). Under
    rollout.quantization=fp8 vLLM quantizes every decoder linear to one byte per weight (its
    online Fp8LinearMethod, a float32 scale per layer); embeddings, the output head and the
    norms stay in the model's dtype."""
    if quantization is None:
        return shape.params * shape.dtype_bytes
    if quantization != "fp8":
        raise ValueError(f"rollout.quantization={quantization!r}: the memory table knows null and 'fp8'")
    linear = shape.layers * sum(fan_in * fan_out for fan_in, fan_out in linear_sizes(shape).values())
    return linear + (shape.params - linear) * shape.dtype_bytes + shape.layers * 7 * 4


def _targets(targets: Sequence[str] | str) -> list[str]:
    return list(LINEAR_NAMES) if targets == "all-linear" else [t for t in targets if t in LINEAR_NAMES]


# vLLM's tensor-parallel layers: a column-parallel linear (q/k/v, gate/up) splits its output
# over the ranks, a row-parallel one (o, down) its input. Its LoRA (without fully_sharded_loras)
# follows the base layer: the column-parallel B [out, r] and the row-parallel A [r, in] are split,
# the other matrix of each is whole on every rank.
COLUMN_PARALLEL = frozenset({"q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"})


def lora_slot_bytes(shape: ModelShape, slots: int, rank: int, tensor_parallel: int = 1,
                    pipeline_parallel: int = 1) -> int:
    """What unmerged LoRA's slots take on one GPU of a replica: vLLM allocates ``slots``
    (max_loras) adapters of ``rank`` (max_lora_rank) on every linear layer, in the model's dtype,
    split over tensor-parallel ranks as above and over pipeline stages by layers (rounded up).
    With one rank it is ``slots x lora_params(shape, rank) x dtype bytes``."""
    tp = tensor_parallel
    per_layer = sum(rank * (fan_in + -(-fan_out // tp)) if name in COLUMN_PARALLEL
                    else rank * (-(-fan_in // tp) + fan_out)
                    for name, (fan_in, fan_out) in linear_sizes(shape).items())
    layers = -(-shape.layers // pipeline_parallel)
    return slots * layers * per_layer * shape.dtype_bytes


# vLLM's fused linear layers (its models' packed_modules_mapping): a re-quantizing merge writes
# each one whole (rollout/engines/vllm_merge.py OnlineQuantizedReload)
FUSED_LINEARS = ({"q_proj", "k_proj", "v_proj"}, {"gate_proj", "up_proj"}, {"o_proj"}, {"down_proj"})


def merged_lora_bytes(shape: ModelShape, trainable: int, targets: Sequence[str] | str, w0_on_device: bool,
                      quantized: bool = False) -> int:
    """What merged LoRA (rollout/engines/vllm_merge.py, one GPU per replica) holds outside vLLM's
    budget: the adapter in float32, one layer's merge tensors ((3b + 8) x the largest adapted
    linear: its W0, the next layer's W0 on its way and the merged result in b, W0 and the sum in
    float32), and every adapted layer's W0 where ``w0_on_device`` (rollout.merged_w0=device).
    Over an fp8 base (``quantized``) a write takes each touched fused layer whole, W0 of its
    unadapted shards included, and vLLM's reload holds, for the largest such layer, its written
    shards until the last arrives, the layer rebuilt in b and its fp8 result: (2b + 1) x it more."""
    sizes, names, b = linear_sizes(shape), _targets(targets), shape.dtype_bytes
    largest = max((sizes[n][0] * sizes[n][1] for n in names), default=0)
    held = trainable * ADAPTER_BYTES_PER_PARAM + (3 * b + 8) * largest
    touched = [group for group in FUSED_LINEARS if group & set(names)]
    written = sorted({n for group in touched for n in group}) if quantized else names
    if w0_on_device:
        held += shape.layers * sum(sizes[n][0] * sizes[n][1] for n in written) * b
    if quantized:
        held += (2 * b + 1) * max((sum(sizes[n][0] * sizes[n][1] for n in g) for g in touched), default=0)
    return held


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
    quantization: str | None = None  # rollout.quantization: fp8 holds the linears in one byte each


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
    # inside vLLM's budget: weights, the profiling peak, unmerged LoRA's slots
    inside = rollout_weight_bytes(shape, replica.quantization) + int(ROLLOUT_ACTIVATION_GIB * GIB)
    if not replica.merged:
        inside += lora_slot_bytes(shape, replica.lora_slots, replica.lora_slot_rank)
    # outside it: CUDA graphs' pool, merged LoRA's buffers
    outside = int(CUDA_GRAPHS_GIB * GIB) if replica.cuda_graphs else 0
    if replica.merged:
        outside += merged_lora_bytes(shape, trainable, learner.targets, replica.w0_on_device,
                                     quantized=replica.quantization is not None)
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


def fixed_micro_batch_tokens(micro_batch_tokens: int | None, row: int, rows: int, micro_batch_size: int) -> int:
    """The largest micro-batch a configured cut builds from ``rows`` rows of ``row`` tokens, the
    longest a replica returns (learner/policy.py PolicyLearner.plan sizes memory for the one the
    step really builds, never larger than this): by token budget, as many whole rows as it holds
    (at least one; groups kept whole only make it smaller), else ``micro_batch_size`` rows."""
    if micro_batch_tokens is None:
        return min(micro_batch_size, rows) * row
    return largest_micro_batch([row] * rows, micro_batch_tokens)


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
    need = row if mbt == "auto" else fixed_micro_batch_tokens(mbt, row, sequences, lc.micro_batch_size)
    replica = ReplicaNeeds(sequences=sequences, sequence_tokens=math.ceil(row / block) * block,
                           merged=settings.lora == "merged", cuda_graphs=not settings.enforce_eager,
                           w0_on_device=w0_on_device, lora_slots=r.max_loras, lora_slot_rank=r.max_lora_rank,
                           quantization=r.quantization)
    learner = LearnerNeeds(
        rank=lc.lora.r, targets=lc.lora.target_modules if isinstance(lc.lora.target_modules, str)
        else tuple(lc.lora.target_modules), micro_batch_tokens=need,
        logprob_chunk_tokens=CUDA_LOGPROB_CHUNK_TOKENS if lc.logprob_chunk_tokens == "auto" else lc.logprob_chunk_tokens,
        checkpointing=None if lc.gradient_checkpointing == "auto" else lc.gradient_checkpointing,
        **(dict(rows=math.ceil(sequences / lc.workers), max_rows=lc.micro_batch_size) if mbt == "auto" else {}))
    shape = model_shape(model_config, DTYPE_BYTES[cfg.model.dtype])
    return split_memory(cfg.gpu_memory_gib, Path(cfg.model.name_or_path).name, shape, replica, learner,
                        shared_weights=cfg.shares_base_weights()[0])


# ---------------------------------------------------------------------------------------------
# What each GPU of a cluster holds: one row per item, for a GPU of a rollout replica and a GPU of
# a learner worker, each on GPUs of its own (configs/mle-tree-qwen3-32b.yaml). Same estimates as
# the split above and learner/memory_plan.py, per GPU instead of per run.

# nvidia-smi's total of an H100 80GB HBM3 (81559 MiB): the smaller card of the clusters the
# 27-70B configs are written for (an H200 has 141 GB); the CLI's --gpu-gib changes it.
H100_80GB_GIB = 81559 / 1024
VLLM_DEFAULT_MAX_NUM_SEQS = 256  # vLLM's own on GPU (rollout.max_num_seqs=None)
ROLLOUT, LEARNER = "rollout", "learner"


@dataclass(frozen=True)
class MemoryRow:
    """One item one GPU of a role holds (``on_host``: held in host memory instead, listed so the
    table says where it went; not counted against the GPU)."""

    role: str  # ROLLOUT (one GPU of a replica) or LEARNER (one worker's GPU)
    item: str
    gib: float
    note: str = ""
    on_host: bool = False


def step_rows(cfg: RunConfig) -> int:
    """Rows one step trains on: a flat step's prompts x group_size, a tree round's nodes."""
    t = cfg.trainer
    return cfg.search.nodes_per_round if t.rollout_mode == "tree" else t.prompts_per_step * t.group_size


def _rollout_rows(cfg: RunConfig, model_config: Mapping[str, Any], shape: ModelShape, gpu_gib: float) -> list[MemoryRow]:
    r, b = cfg.rollout, shape.dtype_bytes
    from rollout.engines.vllm_engine import vllm_settings  # pure: the engine's own resolution of 'auto'

    settings = vllm_settings(r, cuda=True)
    tp, pp = r.tensor_parallel_size, r.pipeline_parallel_size
    world = tp * pp
    budget = (r.gpu_memory_gib if r.gpu_memory_gib is not None else r.gpu_memory_utilization * gpu_gib) * GIB
    # vLLM splits every weight over the TP ranks (the vocabulary too) and the layers over the stages
    weights = -(-rollout_weight_bytes(shape, r.quantization) // world)
    slots = 0 if settings.lora == "merged" else lora_slot_bytes(shape, r.max_loras, r.max_lora_rank, tp, pp)
    activation = ROLLOUT_ACTIVATION_GIB * GIB
    kv = budget - weights - slots - activation
    # each rank holds its key-value heads (a head copied to tp / kv ranks when there are fewer) of its stage's layers
    kv_heads = model_config.get("num_key_value_heads") or model_config["num_attention_heads"]
    head_dim = shape.kv_dim // kv_heads
    kv_token = 2 * -(-shape.layers // pp) * max(1, kv_heads // tp) * head_dim * b
    block = r.block_size or VLLM_GPU_BLOCK_SIZE
    sequence = math.ceil(r.max_model_len / block) * block * kv_token
    in_flight = r.max_num_seqs or VLLM_DEFAULT_MAX_NUM_SEQS
    held = max(0, int(kv // sequence))
    where = f"TP={tp}" + (f" x PP={pp}" if pp > 1 else "")
    rows = [
        MemoryRow(ROLLOUT, "CUDA context", CUDA_CONTEXT_GIB, "stated"),
        MemoryRow(ROLLOUT, f"base weights, 1/{world} ({where})", weights / GIB,
                  f"{rollout_weight_bytes(shape, r.quantization) / GIB:.2f} GiB in all"
                  + (" (fp8 linears)" if r.quantization == "fp8" else "")),
    ]
    if slots:
        rows.append(MemoryRow(ROLLOUT, f"LoRA slots: {r.max_loras} x rank {r.max_lora_rank}, unmerged", slots / GIB,
                              "A or B of each layer split over TP" if tp > 1 else ""))
    rows += [
        MemoryRow(ROLLOUT, "vLLM's profiling peak", ROLLOUT_ACTIVATION_GIB, "stated"),
        MemoryRow(ROLLOUT, "KV cache: what the budget leaves", kv / GIB,
                  f"{held} sequences of {r.max_model_len} tokens; max_num_seqs={in_flight} needs "
                  f"{in_flight * sequence / GIB:.2f}"),
    ]
    if not settings.enforce_eager:
        rows.append(MemoryRow(ROLLOUT, "CUDA graphs (outside vLLM's budget)", CUDA_GRAPHS_GIB, "stated"))
    if settings.lora == "merged":
        lc = cfg.learner
        trainable = lora_params(shape, lc.lora.r, lc.lora.target_modules)
        rows.append(MemoryRow(ROLLOUT, "merged LoRA's buffers (outside vLLM's budget)",
                              merged_lora_bytes(shape, trainable, lc.lora.target_modules, r.merged_w0 == "device",
                                                quantized=r.quantization is not None) / GIB))
    return rows


def _learner_rows(cfg: RunConfig, shape: ModelShape, gpu_gib: float) -> list[MemoryRow]:
    lc = cfg.learner
    rank, targets = lc.lora.r, lc.lora.target_modules
    trainable = lora_params(shape, rank, targets)
    chunk = CUDA_LOGPROB_CHUNK_TOKENS if lc.logprob_chunk_tokens == "auto" else lc.logprob_chunk_tokens
    budget = int(lc.memory_budget_gib * GIB if lc.memory_budget_gib is not None
                 else min(lc.gpus_per_worker * gpu_gib, gpu_gib - CUDA_CONTEXT_GIB) * GIB)
    fsdp = lc.strategy == "fsdp2"
    sharding = Sharding(lc.workers, lc.fsdp_cpu_offload) if fsdp else None
    # the micro-batch one worker's update holds at once (learner/microbatch.py): rows of the
    # longest length a replica may return (max_model_len), at most micro_batch_size of them
    longest, rows = cfg.rollout.max_model_len, math.ceil(step_rows(cfg) / lc.workers)
    mbt = lc.micro_batch_tokens
    ckpt = None if lc.gradient_checkpointing == "auto" else lc.gradient_checkpointing
    if mbt == "auto":
        plan = memory_plan(shape, rank, trainable, budget, longest, chunk, ckpt, rows=rows,
                           max_rows=lc.micro_batch_size, sharding=sharding)
        tokens = min(plan.micro_batch_tokens, min(lc.micro_batch_size, rows) * longest)
    else:
        tokens = fixed_micro_batch_tokens(mbt, longest, rows, lc.micro_batch_size)
        plan = memory_plan(shape, rank, trainable, budget, tokens, chunk, ckpt, sharding=sharding)
    ckpt = plan.gradient_checkpointing
    per_token = per_token_bytes(shape, rank, ckpt, chunk)
    out = [MemoryRow(LEARNER, "CUDA context", CUDA_CONTEXT_GIB, "stated")]
    lora_what = f"LoRA r={rank}: weights, gradients, AdamW moments (float32)"
    if sharding is None:
        # learner/memory_plan.py weight_bytes: the whole base and the whole LoRA state on every rank
        base = weight_bytes(shape, 0)
        out += [MemoryRow(LEARNER, "base weights, whole", base / GIB, lc.strategy),
                MemoryRow(LEARNER, lora_what, (weight_bytes(shape, trainable) - base) / GIB)]
    else:
        # weight_bytes's parts, each read as the difference of two of its sums (so that the rows
        # add up to what the memory plan counts): what stays on the GPU under offload is the
        # gathered part; trainable=0 leaves the LoRA state out
        world, offload = lc.workers, lc.fsdp_cpu_offload
        gathered = weight_bytes(shape, 0, Sharding(world, cpu_offload=True))
        full_grads = weight_bytes(shape, trainable, Sharding(world, cpu_offload=True)) - gathered
        base_shard = weight_bytes(shape, 0, Sharding(world)) - gathered
        lora_shard = weight_bytes(shape, trainable, Sharding(world)) - gathered - full_grads - base_shard
        host = " (fsdp_cpu_offload: in host memory)" if offload else ""
        out += [
            MemoryRow(LEARNER, f"base weights, this rank's shard (1/{world}){host}", base_shard / GIB,
                      f"fsdp2 over {world} workers", on_host=offload),
            MemoryRow(LEARNER, f"base weights gathered: embeddings, head, final norm, {GATHERED_LAYERS} layers",
                      gathered / GIB, "FSDP2 keeps the root gathered; one layer running, one prefetched"),
            MemoryRow(LEARNER, f"{lora_what}, 1/{world}{host}", lora_shard / GIB, on_host=offload),
            MemoryRow(LEARNER, "LoRA gradients, unsharded between micro-batches (float32)", full_grads / GIB),
        ]
    if chunk > 0:
        out.append(MemoryRow(LEARNER, f"log-prob slices: {LOGPROB_SLICE_COPIES} float32 copies of {chunk} x vocab",
                             (fixed_bytes(shape, 0, 0, chunk) - weight_bytes(shape, 0)) / GIB))
    out += [
        MemoryRow(LEARNER, f"activations: {tokens} tokens x {per_token / 2**20:.2f} MiB "
                  f"({'' if ckpt else 'no '}gradient checkpointing)", tokens * per_token / GIB,
                  "a micro-batch: one longest row, or shorter rows packed"),
        MemoryRow(LEARNER, f"reserve: {RESERVE:.0%} of the budget", RESERVE * budget / GIB,
                  "CUDA workspaces, the allocator's fragmentation"),
    ]
    return out


def cluster_memory(cfg: RunConfig, model_config: Mapping[str, Any], gpu_gib: float = H100_80GB_GIB) -> list[MemoryRow]:
    """What one GPU of each role holds, in GiB per item, for the model whose config.json is
    ``model_config`` on GPUs of ``gpu_gib``: a rollout replica's GPU (rollout.num_gpus > 0) and a
    learner worker's (learner.use_gpu). Each role is taken on GPUs of its own; a replica that
    shares a learner's GPU is the one-GPU split above (gpu_memory_gib). ValueError (one line)
    when no part runs on a GPU."""
    if gpu_gib <= 0:
        raise ValueError(f"gpu_gib must be positive, got {gpu_gib:g}")
    if cfg.rollout.num_gpus == 0 and not cfg.learner.use_gpu:
        raise ValueError("no part of this config runs on a GPU (rollout.num_gpus=0, learner.use_gpu=false)")
    shape = model_shape(model_config, DTYPE_BYTES[cfg.model.dtype])
    rows = _rollout_rows(cfg, model_config, shape, gpu_gib) if cfg.rollout.num_gpus > 0 else []
    return rows + (_learner_rows(cfg, shape, gpu_gib) if cfg.learner.use_gpu else [])


def gpu_totals(rows: Sequence[MemoryRow]) -> dict[str, float]:
    """GiB each role's GPU holds (host-memory rows left out), in the rows' order of roles."""
    totals: dict[str, float] = {}
    for row in rows:
        totals[row.role] = totals.get(row.role, 0.0) + (0.0 if row.on_host else row.gib)
    return totals


def layout_lines(cfg: RunConfig) -> list[str]:
    """Which GPUs the run's parts reserve, one line a GPU role."""
    r, lc = cfg.rollout, cfg.learner
    lines = []
    if r.num_gpus > 0:
        lines.append(f"rollout: {r.replicas} replicas x {r.num_gpus:g} GPUs (tensor_parallel_size="
                     f"{r.tensor_parallel_size}, pipeline_parallel_size={r.pipeline_parallel_size}) = "
                     f"{r.replicas * r.num_gpus:g} GPUs")
    if lc.use_gpu:
        lines.append(f"learner: {lc.workers} workers x {lc.gpus_per_worker:g} GPU ({lc.strategy}"
                     f"{', fsdp_cpu_offload' if lc.fsdp_cpu_offload else ''}) = {lc.workers * lc.gpus_per_worker:g} GPUs")
    return lines


def format_cluster_memory(cfg: RunConfig, model_config: Mapping[str, Any], rows: Sequence[MemoryRow],
                          gpu_gib: float) -> str:
    """The table the CLI prints: a header (model, layout), one markdown row per item, each role's
    total against the GPU's memory."""
    shape = model_shape(model_config, DTYPE_BYTES[cfg.model.dtype])
    name = Path(cfg.model.name_or_path).name
    lines = [f"{name}: {shape.params / 1e9:.2f}B parameters in {cfg.model.dtype} "
             f"({shape.params * shape.dtype_bytes / GIB:.2f} GiB), GPUs of {gpu_gib:.2f} GiB",
             *layout_lines(cfg), "",
             "| GPU | item | GiB per GPU | note |", "|---|---|---:|---|"]
    totals = gpu_totals(rows)
    for role in totals:
        for row in (x for x in rows if x.role == role):
            amount = f"({row.gib:.2f} host)" if row.on_host else f"{row.gib:.2f}"
            lines.append(f"| {role} | {row.item} | {amount} | {row.note} |")
        total = totals[role]
        verdict = f"fits, {gpu_gib - total:.2f} free" if total <= gpu_gib else f"DOES NOT FIT by {total - gpu_gib:.2f}"
        lines.append(f"| {role} | **total** | **{total:.2f}** | of {gpu_gib:.2f}: {verdict} |")
    return "\n".join(lines)


def shipped_shape(name_or_path: str) -> Path:
    """configs/shapes/<model name, lower case>.json: the config.json of a hub model this
    repository ships, for hosts that cannot download it."""
    return Path(__file__).resolve().parents[1] / "configs" / "shapes" / f"{Path(name_or_path).name.lower()}.json"


def find_model_config(cfg: RunConfig, model_config_path: str | None) -> dict[str, Any]:
    """The model's config.json without a download (``model_config_file`` says where from)."""
    import json

    path = model_config_file(cfg, model_config_path)
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}: not JSON ({err})") from None


def model_config_file(cfg: RunConfig, model_config_path: str | None) -> Path:
    """Where the model's config.json is on this host: ``model_config_path`` if given, else the
    model's local directory's, the shipped shape of its name, or a hub id's in the local hub
    cache. ValueError (one line) when none is there (a built-in model's is built with its weights:
    pass it as ``model_config_path``)."""
    name = cfg.model.name_or_path
    if model_config_path:
        candidates = [Path(model_config_path)]
    else:
        from huggingface_hub import try_to_load_from_cache  # reads the local cache only

        cached = try_to_load_from_cache(name, "config.json") if name.count("/") == 1 else None
        candidates = [Path(name).expanduser() / "config.json", shipped_shape(name),
                      *([Path(cached)] if isinstance(cached, str) else [])]
    for path in candidates:
        if path.is_file():
            return path
    if model_config_path:
        raise ValueError(f"--model-config {model_config_path}: no such file")
    raise ValueError(f"no config.json for model.name_or_path={name} on this host (nor {shipped_shape(name)}): "
                     "pass --model-config PATH")


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m services.memory_budget --config C [--model-config J] [--gpu-gib G] [--set k=v]``:
    print what each GPU of the run holds. Exit 0 when every role fits its GPU, 1 when one does
    not, 2 on bad input (one line)."""
    import argparse
    import sys

    from config import ConfigError, load_config

    parser = argparse.ArgumentParser(prog="python -m services.memory_budget", description=main.__doc__)
    parser.add_argument("--config", required=True, help="a run config (YAML)")
    parser.add_argument("--model-config", help="the model's config.json (default: the model's directory, "
                        "configs/shapes/<name>.json, or the local hub cache)")
    parser.add_argument("--gpu-gib", type=float, default=H100_80GB_GIB,
                        help=f"memory of one GPU in GiB (default {H100_80GB_GIB:.2f}: an H100 80GB)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="a dotted config override, as `counterpoint train --set`")
    args = parser.parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
        model_config = find_model_config(cfg, args.model_config)
        rows = cluster_memory(cfg, model_config, args.gpu_gib)
    except (ConfigError, ValueError, KeyError) as err:
        what = f"config.json lacks {err}" if isinstance(err, KeyError) else "; ".join(
            line.strip() for line in str(err).splitlines() if line.strip())
        print(f"error: {what}", file=sys.stderr)
        return 2
    print(format_cluster_memory(cfg, model_config, rows, args.gpu_gib))
    return 0 if all(total <= args.gpu_gib for total in gpu_totals(rows).values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
