"""What each GPU of a cluster holds (services/memory_budget.py cluster_memory, pure): a table of
a small shape computed by hand, the Qwen3-32B config's rows against an 80 GB card, how tensor
parallelism, FSDP2's world size and CPU offload move bytes, and the CLI that prints the table."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from config import RunConfig, load_config
from learner.memory_plan import Sharding, fixed_bytes, lora_params, per_token_bytes
from services.memory_budget import (GIB, H100_80GB_GIB, LEARNER, ROLLOUT, cluster_memory, find_model_config,
                                    gpu_totals, lora_slot_bytes, model_shape, parameter_count, shipped_shape)

REPO = Path(__file__).resolve().parents[1]
CONFIG_32B = REPO / "configs" / "mle-tree-qwen3-32b.yaml"
SHAPE_32B = REPO / "configs" / "shapes" / "qwen3-32b.json"

# A shape small enough to count by hand: h=64, 4 heads x 16 (q=64), 2 key-value heads (kv=32),
# I=128, 4 layers, a vocabulary of 100, untied.
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, vocab_size=100, tie_word_embeddings=False)
TINY_RUN = {
    "model": {"dtype": "bfloat16"},
    "rollout": {"engine": "vllm", "replicas": 1, "num_gpus": 2, "tensor_parallel_size": 2, "max_model_len": 64,
                "max_lora_rank": 4, "max_loras": 2, "gpu_memory_gib": 2.0, "max_num_seqs": 4},
    "learner": {"use_gpu": True, "workers": 2, "strategy": "fsdp2", "gradient_checkpointing": True,
                "micro_batch_tokens": 128, "logprob_chunk_tokens": 8, "memory_budget_gib": 1.0,
                "lora": {"r": 4, "alpha": 8}},
}


def _row(rows, role: str, starts: str):
    (row,) = [r for r in rows if r.role == role and r.item.startswith(starts)]
    return row


def _by_prefix(rows, role: str, expected: dict[str, float]) -> dict[str, float]:
    """The bytes of the one row of ``role`` whose item starts with each key of ``expected``; the
    role has no other rows."""
    assert len([r for r in rows if r.role == role]) == len(expected), [r.item for r in rows if r.role == role]
    return {prefix: _row(rows, role, prefix).gib * GIB for prefix in expected}


def test_a_small_shape_by_hand():
    rows = cluster_memory(RunConfig.model_validate(TINY_RUN), TINY, gpu_gib=4.0)
    # per layer 2 x 64 x 64 (q, o) + 2 x 64 x 32 (k, v) + 3 x 64 x 128 (MLP) + 2 x 64 (norms) = 36,992;
    # 4 layers + embeddings and head 2 x 100 x 64 + final norm 64 = 160,832 parameters, 321,664 bytes
    assert parameter_count(TINY) == 160_832
    rollout = {
        "CUDA context": GIB / 2,
        "base weights, 1/2 (TP=2)": 160_832,  # 321,664 bytes over TP=2
        # r=4, TP=2: column-parallel q/k/v/gate/up keep A [r, in] whole and split B [out, r]; row-parallel
        # o/down split A and keep B: q 4 x (64 + 32) + k, v 4 x (64 + 16) each + o 4 x (32 + 64) + gate, up
        # 4 x (64 + 64) each + down 4 x (64 + 64) = 2,944 per layer x 4 layers x 2 slots x 2 bytes
        "LoRA slots": 47_104,
        "vLLM's profiling peak": GIB,
        "KV cache": 2 * GIB - 160_832 - 47_104 - GIB,  # rollout.gpu_memory_gib=2 less the above
        "CUDA graphs": GIB / 4,
    }
    assert _by_prefix(rows, ROLLOUT, rollout) == rollout
    (kv,) = [r for r in rows if r.item.startswith("KV cache")]
    # one rank's key-value head (2 over TP=2) x 16 x 4 layers x K and V x 2 bytes = 256 bytes a token, 64 tokens
    assert kv.note == f"{int((GIB - 160_832 - 47_104) // (256 * 64))} sequences of 64 tokens; max_num_seqs=4 needs 0.00"
    trainable = 4 * 4 * 1024  # r=4 x (in + out summed over the 7 linears: 1,024) x 4 layers
    learner = {
        "CUDA context": GIB / 2,
        "base weights, this rank's shard": 160_832,  # 160,832 parameters / 2 ranks x 2 bytes
        "base weights gathered": (160_832 - 2 * 36_992) * 2,  # the root and 2 of the 4 layers
        "LoRA r=4": trainable * 16 / 2,  # float32 weight, gradient and two moments, / 2 ranks
        "LoRA gradients": trainable * 4,  # float32, whole
        "log-prob slices": 6 * 8 * 100 * 4,  # 6 float32 copies of a [8, 100] slice
        # per token, checkpointed: each layer's input 4 x 2 x 64 + two layers' activations 2 x 2,872
        # (2 x (3h + 2q + 2kv + q + 7r + 4I) + 4 x (2h + q + kv)) + logits and their gradient 2 x 2 x 100
        "activations": 128 * (512 + 2 * 2_872 + 400),
        "reserve": GIB / 10,  # of learner.memory_budget_gib=1
    }
    assert _by_prefix(rows, LEARNER, learner) == learner
    totals = gpu_totals(rows)
    assert totals[ROLLOUT] == pytest.approx(0.5 + 2.0 + 0.25)  # vLLM's budget is all given out
    assert totals[LEARNER] * GIB == pytest.approx(sum(learner.values()))


def test_lora_slots_at_one_rank_are_the_split_s_slots():
    shape = model_shape(TINY, 2)
    assert lora_slot_bytes(shape, 2, 4) == 2 * lora_params(shape, 4, "all-linear") * 2
    assert lora_slot_bytes(shape, 2, 4, pipeline_parallel=2) == lora_slot_bytes(shape, 2, 4) // 2


def _cfg_32b(*overrides: str):
    return load_config(CONFIG_32B, list(overrides))


@pytest.fixture(scope="module")
def shape_32b() -> dict:
    return json.loads(SHAPE_32B.read_text())


def test_the_32b_config_fits_an_80gb_card(shape_32b):
    cfg = _cfg_32b()
    rows = cluster_memory(cfg, shape_32b)
    totals = gpu_totals(rows)
    assert set(totals) == {ROLLOUT, LEARNER}
    assert all(total <= H100_80GB_GIB for total in totals.values()), totals
    # the replica: the whole of vLLM's budget (0.9 of the card) is given out, KV cache for more
    # than max_num_seqs sequences of max_model_len, a quarter of the 61 GiB weights a GPU
    assert totals[ROLLOUT] == pytest.approx(0.5 + 0.9 * H100_80GB_GIB + 0.25)
    assert _row(rows, ROLLOUT, "base weights").gib == pytest.approx(parameter_count(shape_32b) * 2 / 4 / GIB)
    kv = _row(rows, ROLLOUT, "KV cache")
    assert int(kv.note.split()[0]) >= cfg.rollout.max_num_seqs
    # the learner: its rows add up to the memory plan's fixed part and its micro-batch
    shape = model_shape(shape_32b, 2)
    trainable = lora_params(shape, 32, "all-linear")
    budget = int((H100_80GB_GIB - 0.5) * GIB)
    tokens = cfg.learner.micro_batch_tokens
    planned = fixed_bytes(shape, trainable, budget, 256, Sharding(8)) + tokens * per_token_bytes(shape, 32, True, 256)
    assert totals[LEARNER] * GIB == pytest.approx(0.5 * GIB + planned, rel=1e-9)
    assert 40 < totals[LEARNER] < 70 and 70 < totals[ROLLOUT] < H100_80GB_GIB


@pytest.mark.parametrize("narrow, wide", [(2, 4), (4, 8)])
def test_tensor_parallel_halves_the_weights_per_gpu(shape_32b, narrow, wide):
    def weights(tp: int) -> float:
        rows = cluster_memory(_cfg_32b(f"rollout.tensor_parallel_size={tp}", f"rollout.num_gpus={tp}"), shape_32b)
        return _row(rows, ROLLOUT, "base weights").gib

    assert weights(wide) == pytest.approx(weights(narrow) / 2)


def test_fp8_rollout_holds_the_linears_in_one_byte(shape_32b):
    """rollout.quantization=fp8: the decoder linears at one byte a weight (and a float32 scale per
    linear), the embeddings, head and norms still bf16; the KV cache gets what that frees."""
    bf16 = cluster_memory(_cfg_32b(), shape_32b)
    fp8 = cluster_memory(_cfg_32b("rollout.quantization=fp8"), shape_32b)
    h, i, layers = 5120, 25600, 64
    q, kv = 64 * 128, 8 * 128
    linear = layers * (2 * h * q + 2 * h * kv + 3 * h * i)
    total = parameter_count(shape_32b)
    expected = (linear + (total - linear) * 2 + layers * 7 * 4) / 4  # TP=4
    assert _row(fp8, ROLLOUT, "base weights").gib * GIB == pytest.approx(expected, abs=1)
    freed = _row(bf16, ROLLOUT, "base weights").gib - _row(fp8, ROLLOUT, "base weights").gib
    assert freed == pytest.approx(linear / 4 / GIB, rel=1e-6)
    assert _row(fp8, ROLLOUT, "KV cache").gib == pytest.approx(_row(bf16, ROLLOUT, "KV cache").gib + freed)
    assert gpu_totals(fp8)[LEARNER] == gpu_totals(bf16)[LEARNER]  # the learner trains the bf16 weights


@pytest.mark.parametrize("workers", [2, 4, 8, 16])
def test_fsdp2_world_size_divides_the_shard(shape_32b, workers):
    rows = cluster_memory(_cfg_32b(f"learner.workers={workers}"), shape_32b)
    whole = parameter_count(shape_32b) * 2
    shard = _row(rows, LEARNER, "base weights, this rank's shard").gib * GIB
    assert whole / workers <= shard < whole / workers + 2  # torch.chunk's first rank: rounded up
    gathered = _row(rows, LEARNER, "base weights gathered").gib
    assert gathered == _row(cluster_memory(_cfg_32b(), shape_32b), LEARNER, "base weights gathered").gib


def test_cpu_offload_moves_the_shards_to_the_host(shape_32b):
    on_gpu = cluster_memory(_cfg_32b(), shape_32b)
    offloaded = cluster_memory(_cfg_32b("learner.fsdp_cpu_offload=true"), shape_32b)
    moved = [r for r in offloaded if r.on_host]
    assert {r.item.split(",")[0].split(":")[0] for r in moved} == {"base weights", "LoRA r=32"}
    assert all(r.role == LEARNER and "fsdp_cpu_offload" in r.item for r in moved)
    held = sum(r.gib for r in moved)
    assert gpu_totals(offloaded)[LEARNER] == pytest.approx(gpu_totals(on_gpu)[LEARNER] - held)
    assert held == pytest.approx(_row(on_gpu, LEARNER, "base weights, this rank's shard").gib
                                 + _row(on_gpu, LEARNER, "LoRA r=32").gib)


def test_ddp_and_merged_lora_at_one_gpu_per_replica(shape_32b):
    """One GPU per replica resolves vllm_lora=auto to merged (its buffers outside vLLM's budget,
    no slots), and a DDP learner holds the whole base: a 32B model does not fit that way."""
    rows = cluster_memory(_cfg_32b("rollout.tensor_parallel_size=1", "rollout.num_gpus=1", "rollout.vllm_lora=auto",
                                   "learner.strategy=ddp"), shape_32b)
    assert not [r for r in rows if r.item.startswith("LoRA slots")]
    assert _row(rows, ROLLOUT, "merged LoRA").gib > 0
    assert _row(rows, LEARNER, "base weights, whole").gib == pytest.approx(parameter_count(shape_32b) * 2 / GIB)
    assert gpu_totals(rows)[LEARNER] > H100_80GB_GIB


def test_bad_input_is_one_line():
    with pytest.raises(ValueError, match=r"^no part of this config runs on a GPU"):
        cluster_memory(RunConfig(), TINY)
    with pytest.raises(ValueError, match="gpu_gib must be positive"):
        cluster_memory(RunConfig.model_validate(TINY_RUN), TINY, gpu_gib=0)


def test_the_shipped_shape_is_qwen3_32b_and_is_found_by_name(shape_32b):
    # Hugging Face's 32.8B: 32,762,123,264 with Qwen3's q/k norms (2 x 128 per layer), which the count leaves out
    assert parameter_count(shape_32b) == 32_762_123_264 - 64 * 256
    assert shipped_shape("Qwen/Qwen3-32B") == SHAPE_32B
    assert find_model_config(_cfg_32b(), None) == shape_32b


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "services.memory_budget", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=120)


def test_the_cli_prints_the_table_of_the_shipped_config():
    done = _cli("--config", "configs/mle-tree-qwen3-32b.yaml")
    assert done.returncode == 0, done.stderr[-2000:]
    out = done.stdout
    assert out.startswith("Qwen3-32B: 32.76B parameters in bfloat16 (61.02 GiB), GPUs of 79.65 GiB\n")
    assert "rollout: 2 replicas x 4 GPUs (tensor_parallel_size=4, pipeline_parallel_size=1) = 8 GPUs" in out
    assert "learner: 8 workers x 1 GPU (fsdp2) = 8 GPUs" in out
    assert "| rollout | base weights, 1/4 (TP=4) | 15.26 |" in out
    assert "| learner | base weights, this rank's shard (1/8) | 7.63 |" in out
    totals = [line for line in out.splitlines() if "**total**" in line]
    assert len(totals) == 2 and all("fits" in line for line in totals), totals
    # the same with the shape given, on a smaller card: it says what does not fit, exit 1
    done = _cli("--config", "configs/mle-tree-qwen3-32b.yaml", "--model-config", str(SHAPE_32B), "--gpu-gib", "40")
    assert done.returncode == 1 and "DOES NOT FIT" in done.stdout


@pytest.mark.parametrize("args, message", [
    (["--config", "configs/nope.yaml"], "config file configs/nope.yaml does not exist"),
    (["--config", "configs/mle-tree-qwen3-32b.yaml", "--model-config", "nope.json"], "--model-config nope.json: no such file"),
    (["--config", "configs/mle-tree-qwen3-32b.yaml", "--set", "model.name_or_path=org/unknown-model"],
     "no config.json for model.name_or_path=org/unknown-model"),
    (["--config", "configs/smoke.yaml"], "no config.json for model.name_or_path=tiny-random"),  # a built-in
    (["--config", "configs/smoke.yaml", "--model-config", "configs/shapes/qwen3-32b.json"],
     "no part of this config runs on a GPU"),
])
def test_the_cli_refuses_bad_input_in_one_line(args, message):
    done = _cli(*args)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and done.stdout == "" and len(lines) == 1, done.stderr[-2000:]
    assert lines[0].startswith("error: ") and message in lines[0]


def test_the_readme_shows_what_the_cli_prints(shape_32b):
    """README "Training a 27-70B model on a cluster" pastes the table: it must be today's."""
    from services.memory_budget import format_cluster_memory

    cfg = _cfg_32b()
    table = format_cluster_memory(cfg, shape_32b, cluster_memory(cfg, shape_32b), H100_80GB_GIB)
    readme = (REPO / "README.md").read_text()
    missing = [line for line in table.splitlines() if line and line not in readme]
    assert not missing, "README's table is stale; paste `python -m services.memory_budget --config " \
                        "configs/mle-tree-qwen3-32b.yaml`:\n" + "\n".join(missing)
