"""Merged LoRA with W0 off the GPU (rollout/engines/vllm_merge.py, lora_weights.MergedWeights and
stream_to_device), on CPU: the per-layer merge from host W0 writes bit for bit what the merge
of the whole model from a resident W0 wrote, through a vLLM-like loader that fuses q/k/v and
gate/up, in bf16 and in float32; at most two layers' W0 are on the device at a time, and each
is loaded before the one after the next is copied; W0 read into one host buffer equals the
checkpoint's tensors; the GPU bytes a merged worker reports leave host W0 out."""

from __future__ import annotations

import weakref

import pytest
import torch
from safetensors.torch import save_file

from rollout.engines.lora_weights import LoraTensors, MergedWeights, stream_to_device
from rollout.engines.vllm_merge import read_checkpoint

HIDDEN, INTER, Q, KV = 32, 48, 32, 16  # a small decoder layer: q 32x32, k/v 16x32, gate/up 48x32, down 32x48
SHAPES = {"self_attn.q_proj": (Q, HIDDEN), "self_attn.k_proj": (KV, HIDDEN), "self_attn.v_proj": (KV, HIDDEN),
          "self_attn.o_proj": (HIDDEN, Q), "mlp.gate_proj": (INTER, HIDDEN), "mlp.up_proj": (INTER, HIDDEN),
          "mlp.down_proj": (HIDDEN, INTER)}
LAYERS = 3
# vLLM's Qwen2/Qwen3 load_weights: (fused param, checkpoint name, shard)
STACKED = (("qkv_proj", "q_proj", "q"), ("qkv_proj", "k_proj", "k"), ("qkv_proj", "v_proj", "v"),
           ("gate_up_proj", "gate_proj", 0), ("gate_up_proj", "up_proj", 1))


def base_weights(dtype: torch.dtype, seed: int = 0) -> dict[str, torch.Tensor]:
    """W0 by module name (checkpoint names without '.weight')."""
    g = torch.Generator().manual_seed(seed)
    return {f"model.layers.{i}.{m}": torch.randn(shape, generator=g).to(dtype)
            for i in range(LAYERS) for m, shape in SHAPES.items()}


def adapter(names, r: int = 4, scale: float = 2.0, seed: int = 1) -> dict[str, LoraTensors]:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for n in names:
        rows, cols = SHAPES[n.split(".", 3)[3]]
        out[n] = LoraTensors(a=torch.randn(r, cols, generator=g), b=torch.randn(rows, r, generator=g) * 0.05, scale=scale)
    return out


class VllmLikeModel:
    """What vLLM's model.load_weights does with checkpoint-named pairs: q/k/v into one qkv_proj and
    gate/up into one gate_up_proj (each shard copied into its rows), the rest as they are; it
    takes the pairs lazily, one at a time."""

    def __init__(self, w0: dict[str, torch.Tensor]):
        self.params: dict[str, torch.Tensor] = {}
        for i in range(LAYERS):
            p = f"model.layers.{i}"
            dtype = w0[f"{p}.self_attn.q_proj"].dtype
            self.params[f"{p}.self_attn.qkv_proj.weight"] = torch.zeros(Q + 2 * KV, HIDDEN, dtype=dtype)
            self.params[f"{p}.mlp.gate_up_proj.weight"] = torch.zeros(2 * INTER, HIDDEN, dtype=dtype)
            self.params[f"{p}.self_attn.o_proj.weight"] = torch.zeros(HIDDEN, Q, dtype=dtype)
            self.params[f"{p}.mlp.down_proj.weight"] = torch.zeros(HIDDEN, INTER, dtype=dtype)
        self.on_pair = None  # called with each pair's name as it is taken
        self.load_weights((f"{n}.weight", w) for n, w in w0.items())

    def load_weights(self, pairs) -> set[str]:
        offsets = {"q": 0, "k": Q, "v": Q + KV, 0: 0, 1: INTER}
        done = set()
        for name, tensor in pairs:
            if self.on_pair is not None:
                self.on_pair(name)
            for fused, part, shard in STACKED:
                if f".{part}." in name:
                    param = self.params[name.replace(part, fused)]
                    param[offsets[shard]: offsets[shard] + tensor.shape[0]].copy_(tensor)
                    break
            else:
                self.params[name].copy_(tensor)
            done.add(name)
        return done


class WholeModelMerge:
    """The merge as it was before W0 left the GPU: W0 of every layer resident, every merged
    weight W0 + scale * B @ A in float32 (one addmm), cast once, written in one load."""

    def __init__(self, load_weights, w0):
        self.load_weights, self.base = load_weights, dict(w0)

    def write(self, lora):
        self.load_weights([(f"{n}.weight", torch.addmm(self.base[n].float(), t.b.float(), t.a.float(),
                                                         alpha=t.scale).to(self.base[n].dtype))
                           for n, t in sorted(lora.items())])

    def write_base(self, names):
        self.load_weights([(f"{n}.weight", self.base[n]) for n in sorted(names)])


class Transfers:
    """A stand-in for the host-to-device copy that counts the copies alive."""

    def __init__(self):
        self.alive, self.most, self.made = 0, 0, 0

    def __call__(self, tensor: torch.Tensor) -> torch.Tensor:
        moved = tensor.clone()
        self.alive += 1
        self.made += 1
        self.most = max(self.most, self.alive)
        weakref.finalize(moved, self._gone)
        return moved

    def _gone(self):
        self.alive -= 1


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_per_layer_merge_from_host_w0_writes_what_the_whole_model_merge_wrote(dtype):
    w0 = base_weights(dtype)
    ours, theirs = VllmLikeModel(w0), VllmLikeModel(w0)
    host = {n: w.clone() for n, w in w0.items()}  # W0 off the device: what the worker reads once
    merged = MergedWeights(ours.load_weights, lambda names: {n: host[n[: -len(".weight")]] for n in names},
                           copy=Transfers())
    reference = WholeModelMerge(theirs.load_weights, w0)

    def same():
        assert ours.params.keys() == theirs.params.keys()
        for name in ours.params:
            assert torch.equal(ours.params[name], theirs.params[name]), name

    first = adapter(w0, seed=1)
    merged.hold(first, 1)
    reference.write(first)
    same()
    assert not torch.equal(ours.params["model.layers.0.self_attn.qkv_proj.weight"],
                           VllmLikeModel(w0).params["model.layers.0.self_attn.qkv_proj.weight"])  # it moved
    # the next adapter leaves k/v and the MLP alone: those go back to W0, the rest merge anew
    narrow = adapter([n for n in w0 if n.endswith(("q_proj", "o_proj"))], seed=2, scale=0.5)
    merged.hold(narrow, 2)
    reference.write_base([n for n in first if n not in narrow])
    reference.write(narrow)
    same()
    merged.use(0)
    reference.write_base(list(narrow))
    same()
    assert all(torch.equal(a, b) for a, b in zip(ours.params.values(), VllmLikeModel(w0).params.values()))
    merged.use(2)
    reference.write(narrow)
    same()
    assert all(w.device.type == "cpu" for w in merged.base.values()) and merged.base["model.layers.0.mlp.up_proj"] is \
        host["model.layers.0.mlp.up_proj"]  # W0 kept where read_base put it, never copied into self.base


def test_a_merge_holds_at_most_two_layers_of_w0_on_the_device_and_loads_each_before_the_next_but_one():
    w0 = base_weights(torch.bfloat16)
    model, transfers = VllmLikeModel(w0), Transfers()
    merged = MergedWeights(model.load_weights, lambda names: {n: w0[n[: -len(".weight")]] for n in names},
                           copy=transfers)
    seen: list[tuple[str, int, int]] = []
    model.on_pair = lambda name: seen.append((name, transfers.alive, transfers.made))
    merged.hold(adapter(w0), 1)
    assert [name for name, _, _ in seen] == [f"{n}.weight" for n in sorted(w0)]  # every layer, in one load
    assert transfers.made == len(w0) and transfers.most <= 2
    # when the loader takes layer i, layers i and i+1 have been copied, no more
    assert all(made <= i + 2 and alive <= 2 for i, (_, alive, made) in enumerate(seen))
    assert transfers.alive == 0  # nothing left on the device after the merge


def test_stream_to_device_keeps_the_order_and_passes_tensors_already_there():
    items = [(f"t{i}", torch.full((3,), float(i))) for i in range(5)]
    out = list(stream_to_device(items, "cpu"))
    assert [n for n, _ in out] == [n for n, _ in items]
    assert all(got is want for (_, got), (_, want) in zip(out, items))  # on the device already: no copy
    assert list(stream_to_device([], "cpu")) == []


def test_stream_to_device_waits_for_the_callers_work_two_layers_back_before_each_copy():
    """The host may not queue copies far ahead of the GPU: a side-stream copy's block is reused
    only once the caller's work on it has run. Before layer j is copied, the fence made after
    the caller's turn on layer j-3 (and every earlier one) has been waited on, and none later."""
    log: list[tuple[str, int]] = []

    class Fence:
        def __init__(self, layer: int):
            self.layer = layer
            log.append(("fence", layer))

        def synchronize(self):
            log.append(("wait", self.layer))

    handed = []

    def copy(tensor):
        log.append(("copy", int(tensor[0])))
        return tensor.clone()

    items = [(f"t{i}", torch.full((2,), float(i))) for i in range(7)]
    out = []
    for name, tensor in stream_to_device(items, "cpu", copy=copy, fence=lambda: Fence(handed[-1])):
        handed.append(int(tensor[0]))
        out.append(name)
    assert out == [n for n, _ in items]
    for j in range(len(items)):
        before = log[: log.index(("copy", j))]
        waited = {layer for kind, layer in before if kind == "wait"}
        assert waited == set(range(j - 2)), (j, waited)  # layers 0 .. j-3
    assert [layer for kind, layer in log if kind == "fence"] == list(range(len(items)))


def test_w0_read_into_one_host_buffer_equals_the_checkpoints_tensors(tmp_path):
    g = torch.Generator().manual_seed(3)
    shard1 = {"a.weight": torch.randn(3, 5, generator=g).to(torch.bfloat16),  # 30 bytes: the next view is padded
              "b.weight": torch.randn(7, generator=g)}
    shard2 = {"c.weight": torch.randn(4, 4, generator=g).to(torch.float16),
              "d.weight": torch.randn(2, 3, generator=g).to(torch.bfloat16)}
    save_file(shard1, tmp_path / "model-1.safetensors")
    save_file(shard2, tmp_path / "model-2.safetensors")
    import json

    weight_map = {**dict.fromkeys(shard1, "model-1.safetensors"), **dict.fromkeys(shard2, "model-2.safetensors")}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    names = ["d.weight", "a.weight", "b.weight", "c.weight", "nowhere.weight"]
    got = read_checkpoint(tmp_path, names, "cpu", pin=True)  # no CUDA here: pin falls back to plain memory
    want = {**shard1, **shard2}
    assert set(got) == set(want)
    for name, tensor in got.items():
        assert tensor.dtype == want[name].dtype and torch.equal(tensor, want[name]), name
    storages = {t.untyped_storage().data_ptr() for t in got.values()}
    assert len(storages) == 1  # views into one buffer
    start = storages.pop()
    assert all((t.data_ptr() - start) % 64 == 0 for t in got.values())
    # and read straight onto a device, as the worker does with w0_on=device: the same values
    direct = read_checkpoint(tmp_path, names, "meta")
    assert set(direct) == set(want) and all(t.device.type == "meta" for t in direct.values())


def test_the_bytes_reported_as_held_on_the_device_leave_host_w0_out():
    merged = MergedWeights(lambda pairs: None, lambda names: {}, device="meta")
    merged.base = {"x": torch.zeros(8, 4, dtype=torch.bfloat16)}  # on the host
    merged.lora = {"x": LoraTensors(a=torch.zeros(2, 4, device="meta"), b=torch.zeros(8, 2, device="meta"), scale=1.0)}
    assert merged.extra_bytes() == (8 + 16) * 4  # the adapter's float32 A and B
    assert merged.host_bytes() == 8 * 4 * 2
    merged.base = {"x": torch.zeros(8, 4, dtype=torch.bfloat16, device="meta")}  # W0 kept on the device
    assert merged.extra_bytes() == (8 + 16) * 4 + 8 * 4 * 2 and merged.host_bytes() == 0
