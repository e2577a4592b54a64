"""How much of the update fits in a device's memory: gradient checkpointing and the micro-batch
token budget, chosen from a memory budget (``learner.gradient_checkpointing=auto``,
``learner.micro_batch_tokens=auto`` on CUDA workers; CPU workers keep their configured path).

The problem: a micro-batch of a fixed number of rows either wastes a large GPU or does not fit a
small one, and checkpointing (recompute each decoder layer in the backward, ~1/3 more compute) is
only worth its cost where the update would not fit without it. The plan: estimate what the
update keeps on the device, as a fixed part plus a part per token of a micro-batch (its padded
size, rows x longest row, as learner/microbatch.py counts it; with learner.pack_sequences its
real tokens, the sum of its rows' lengths), and divide.

The estimate, in bytes (b = bytes per element of the base dtype, 2 for bf16; h hidden, I the
MLP's intermediate size, q / kv the query and key-value widths, r the LoRA rank, L layers, V the
vocabulary):
- fixed: the base weights (params x b); the LoRA matrices with their gradients and AdamW's two
  moments (trainable x 16, all float32); the log-prob slices' float32 copies
  (``LOGPROB_SLICE_COPIES`` x chunk x V x 4, learner/passes.py ``token_logprobs``); and a
  reserve, ``RESERVE`` of the budget, for CUDA workspaces and the allocator's fragmentation.
- per token, what one decoder layer keeps for the backward (``layer_activation_bytes``):
  b x (3h + 2q + 2kv + q + 7r + 4I) (the LoRA A inputs, attention's q, k, v and output, o_proj's
  input, the LoRA B inputs, the SwiGLU MLP's gate, up, activation and product) + 4 x (2h + q + kv)
  (the float32 copies inside the RMSNorms, Qwen3's q/k norms counted for every model).
  Without checkpointing: L such layers plus one more (the gradients in flight in the backward).
  With checkpointing: each layer's input (L x b x h) plus two layers (the one recomputed, its
  gradients). Compiled layers (learner.compile_layers, learner/compiled_layers.py) without
  checkpointing keep ``COMPILED_LAYER_SHARE`` of that: AOTAutograd's partitioner saves a fused
  chain's inputs and recomputes its cheap element-wise outputs (the RMSNorms' float32 copies, the
  SiLU and its product) in the backward instead of keeping them.
- per token, the logits: b x V and their gradient b x V; the plain log-prob path (chunk 0) adds
  ``PLAIN_LOGPROB_COPIES`` float32 copies of the logits (4 x V each).
Under learner.strategy=fsdp2 (``Sharding``) the fixed part is what one rank holds of it: its
shard of the base weights (params / world, rounded up: torch.chunk's first rank), the root's
weights gathered whole (embeddings, output head, final norm: FSDP2 keeps the root's parameters
gathered from the forward through the backward), ``GATHERED_LAYERS`` decoder layers' weights
gathered at a time (the running one and the one prefetched), the LoRA gradients whole (FSDP2 keeps
unsharded gradients between micro-batches until the pass's last backward reduce-scatters them)
and the LoRA weights, sharded gradients and AdamW moments (16 bytes a parameter) / world. With
``cpu_offload`` the shards (weights and LoRA state) live in host memory. Activations, logits and
the reserve are per micro-batch, the same as under DDP.
Both per-token parts count every token of the micro-batch, although the learner computes logits
only from the shortest prompt on (``logits_to_keep``): an overestimate, on the safe side.
Not counted: a packed micro-batch's block-diagonal attention mask (sdpa, eager: T x T booleans,
and their additive float copy, for T tokens; flash attention needs none), CUDA graphs' memory
pools (learner.cuda_graphs, off by default), peft's float32
input casts of a bf16 model without autocast, DeepSpeed's buffers.

The choice: no checkpointing only where it splits the update into no more micro-batches than
checkpointing does (``rows`` rows of the longest length, at most ``max_rows`` per micro-batch);
otherwise checkpointing, and the budget of that mode. Measured on an H200 (bench/results/memory.md,
2026-12-02, Qwen3-4B 1x8 rows of 584 tokens in 7.8 GiB): without checkpointing the plan's 4
micro-batches took 2.0-7.2 s a step, one checkpointed micro-batch of all 8 rows ~0.8 s. A
checkpointed micro-batch costs one more forward (~1/3 more compute); every further micro-batch
pays the whole pass's fixed costs again at a smaller, slower batch. With ``rows`` = 1 (the
default) this is the old rule: no checkpointing whenever one longest row fits without it. ``fits`` says
whether one longest row fits at all; a row longer than the budget runs alone anyway
(learner/microbatch.py), so a plan that does not fit is reported, not refused.

The constants were measured on an H200 at Qwen3-4B shapes (bf16, LoRA r=32 on all linear
layers; tests/test_learner_memory.py states the numbers): the estimate per token is 1.1x the
measured one without checkpointing and 1.6x with it; with compiled layers, 1.15x (one
micro-batch of 4,672 tokens peaked at 28.4 GiB compiled against 34.7 GiB eager, the same
session). Checked end to end there (PolicyLearner, 1x8 rows of 584 tokens): a 24 GiB budget
gave 3 rows per micro-batch without checkpointing and a peak of 19.0 GiB allocated; 14 GiB gave
checkpointing, 5 rows and a peak of 10.6 GiB.
Pure Python: no torch, no Ray.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

RESERVE = 0.10  # of the budget: CUDA workspaces, the caching allocator's fragmentation
LOGPROB_SLICE_COPIES = 6  # float32 copies of one [chunk, V] slice alive in the chunked backward (4.5-5.5 measured)
PLAIN_LOGPROB_COPIES = 5  # float32 copies of the [tokens, V] logits alive in the plain path
LORA_BYTES_PER_PARAM = 16  # float32 weight, gradient, AdamW exp_avg and exp_avg_sq
LORA_FULL_GRAD_BYTES = 4  # fsdp2: the float32 gradient kept unsharded between micro-batches
GATHERED_LAYERS = 2  # fsdp2: decoder layers whose weights are gathered at once (FSDP2's default prefetch)
# of the layers' per-token estimate that compiled layers keep without checkpointing: measured 0.64
# at Qwen3-4B (H200, 2026-12-06: a 4,672-token micro-batch peaked 6.3 GiB below eager's, 1.42 MB a
# token less of eager's measured 5.9), kept above it by eager's own margin (its estimate is 1.12x)
COMPILED_LAYER_SHARE = 0.75

LINEAR_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class ModelShape:
    """What the estimate needs of a decoder-only transformer (a Llama/Qwen-style config)."""

    params: int  # base parameters, embeddings included
    hidden: int
    intermediate: int
    layers: int
    vocab: int
    q_dim: int  # heads x head_dim
    kv_dim: int  # key-value heads x head_dim
    dtype_bytes: int  # of the base weights (and, under autocast, of the activations)

    @classmethod
    def from_hf_config(cls, config: Any, params: int, dtype_bytes: int) -> "ModelShape":
        """From a transformers config (attributes read; nothing imported)."""
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        return cls(params=params, hidden=config.hidden_size, intermediate=config.intermediate_size,
                   layers=config.num_hidden_layers, vocab=config.vocab_size, q_dim=heads * head_dim,
                   kv_dim=kv_heads * head_dim, dtype_bytes=dtype_bytes)


@dataclass(frozen=True)
class Sharding:
    """learner.strategy=fsdp2: the base weights and the LoRA state sharded over ``world_size``
    ranks (None in the plan's arguments: DDP, every rank holds all of it)."""

    world_size: int
    cpu_offload: bool = False  # learner.fsdp_cpu_offload: the shards live in host memory


def layer_params(shape: ModelShape) -> int:
    """Weights of one decoder layer: attention's four projections, the SwiGLU MLP's three, two
    RMSNorms (services/memory_budget.py ``parameter_count``'s layer)."""
    h = shape.hidden
    return 2 * h * shape.q_dim + 2 * h * shape.kv_dim + 3 * h * shape.intermediate + 2 * h


def weight_bytes(shape: ModelShape, trainable: int, sharding: Sharding | None = None) -> int:
    """The base weights and the LoRA state (weights, gradients, AdamW) one rank holds (module doc)."""
    b = shape.dtype_bytes
    if sharding is None:
        return shape.params * b + trainable * LORA_BYTES_PER_PARAM
    world = sharding.world_size
    layer = layer_params(shape)
    gathered = (shape.params - shape.layers * layer + GATHERED_LAYERS * layer) * b + trainable * LORA_FULL_GRAD_BYTES
    shards = 0 if sharding.cpu_offload else -(-shape.params // world) * b + -(-trainable * LORA_BYTES_PER_PARAM // world)
    return gathered + shards


def lora_params(shape: ModelShape, rank: int, targets: Sequence[str] | str = "all-linear") -> int:
    """Trainable parameters of LoRA rank ``rank`` on ``targets`` (module names, or 'all-linear':
    the seven linear layers of every decoder layer): r x (in + out) per adapted linear."""
    h, q, kv, i = shape.hidden, shape.q_dim, shape.kv_dim, shape.intermediate
    sizes = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
             "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}
    names = LINEAR_NAMES if targets == "all-linear" else [t for t in targets if t in sizes]
    return shape.layers * sum(rank * sum(sizes[n]) for n in names)


def layer_activation_bytes(shape: ModelShape, rank: int) -> int:
    """What one decoder layer keeps for the backward, per token (see the module docstring)."""
    h, q, kv, i, b = shape.hidden, shape.q_dim, shape.kv_dim, shape.intermediate, shape.dtype_bytes
    return b * (3 * h + 2 * q + 2 * kv + q + 7 * rank + 4 * i) + 4 * (2 * h + q + kv)


@dataclass(frozen=True)
class MemoryPlan:
    gradient_checkpointing: bool
    micro_batch_tokens: int  # padded tokens (rows x longest row) per micro-batch; >= 1
    fits: bool  # one longest row fits the budget in the chosen mode
    budget_bytes: int
    fixed_bytes: int
    per_token_bytes: int  # of the chosen mode

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def per_token_bytes(shape: ModelShape, rank: int, checkpointing: bool, logprob_chunk_tokens: int,
                    compiled: bool = False) -> int:
    """What the update keeps per token of a micro-batch (module docstring); ``compiled``: the
    decoder layers run compiled (learner.compile_layers), which only changes the plain mode's
    part: checkpointing keeps layer inputs, which compiling does not shrink."""
    act = layer_activation_bytes(shape, rank)
    if checkpointing:
        layers = shape.layers * shape.dtype_bytes * shape.hidden + 2 * act
    else:
        layers = (shape.layers + 1) * act
        if compiled:
            layers = int(layers * COMPILED_LAYER_SHARE)
    logits = 2 * shape.dtype_bytes * shape.vocab
    if logprob_chunk_tokens <= 0:
        logits += PLAIN_LOGPROB_COPIES * 4 * shape.vocab
    return layers + logits


def fixed_bytes(shape: ModelShape, trainable: int, budget_bytes: int, logprob_chunk_tokens: int,
                sharding: Sharding | None = None) -> int:
    slices = LOGPROB_SLICE_COPIES * max(0, logprob_chunk_tokens) * shape.vocab * 4
    return weight_bytes(shape, trainable, sharding) + slices + int(RESERVE * budget_bytes)


def memory_plan(shape: ModelShape, rank: int, trainable: int, budget_bytes: int, longest: int,
                logprob_chunk_tokens: int, checkpointing: bool | None = None, rows: int = 1,
                max_rows: int | None = None, sharding: Sharding | None = None,
                row_tokens: int | None = None, compiled: bool = False) -> MemoryPlan:
    """Checkpointing and the micro-batch token budget for a device of ``budget_bytes`` that holds
    the model ``shape`` with ``trainable`` LoRA parameters of rank ``rank``, for rows of at most
    ``longest`` tokens. ``checkpointing``: given (learner.gradient_checkpointing true/false), only
    the token budget is planned; None (auto) chooses it too, for an update of ``rows`` rows of
    which a micro-batch takes at most ``max_rows`` (None: no bound but the tokens). ``sharding``:
    learner.strategy=fsdp2's share of the weights and LoRA state per rank (None: DDP, all of it).
    ``row_tokens``: what one row adds to a micro-batch where auto weighs the micro-batch counts:
    None = ``longest`` (padded rows); packed rows (learner.pack_sequences) cost their own
    lengths, so the caller passes the rows' mean length. ``compiled``: the decoder layers run
    compiled (``per_token_bytes``)."""
    if budget_bytes <= 0 or longest < 1:
        raise ValueError(f"memory_plan needs a positive budget and row length, got {budget_bytes} and {longest}")
    fixed = fixed_bytes(shape, trainable, budget_bytes, logprob_chunk_tokens, sharding)

    def tokens(ckpt: bool) -> tuple[int, int]:
        per = per_token_bytes(shape, rank, ckpt, logprob_chunk_tokens, compiled)
        return max(0, (budget_bytes - fixed) // per), per

    def micro_batches(n: int) -> int:
        per_batch = max(1, min(max_rows or rows, n // (row_tokens or longest)))
        return -(-rows // per_batch)

    ckpt = checkpointing
    if ckpt is None:
        plain = tokens(False)[0]
        ckpt = plain < longest or micro_batches(tokens(True)[0]) < micro_batches(plain)
    n, per = tokens(ckpt)
    return MemoryPlan(gradient_checkpointing=ckpt, micro_batch_tokens=max(1, n), fits=n >= longest,
                      budget_bytes=budget_bytes, fixed_bytes=fixed, per_token_bytes=per)
