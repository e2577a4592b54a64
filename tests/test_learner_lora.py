"""LoRA init pinning, adapter export and the adapter-disabled reference (tiny random model)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load, load_file

from config.learner import LoraConfig
from learner.lora import (
    adapter_payload,
    adapter_state_dict,
    attach_lora,
    load_base_model,
    save_adapter,
)
from model.adapter import blob_checksum
from model.adapter_dir import WEIGHTS_FILE
from config.rollout import ModelConfig

pytestmark = pytest.mark.slow

TINY = ModelConfig(name_or_path="tiny-random")


def build(seed: int, init_adapter=None, lora=LoraConfig(r=4, alpha=8)):
    return attach_lora(load_base_model(TINY), lora, seed, init_adapter)


def test_same_seed_same_bytes_different_seed_differs(tmp_path):
    a = save_adapter(build(7), tmp_path / "a")
    torch.rand(1000)  # unrelated RNG draws between builds must not matter: the seed is set first
    b = save_adapter(build(7), tmp_path / "b")
    c = save_adapter(build(8), tmp_path / "c")
    assert (tmp_path / "a" / WEIGHTS_FILE).read_bytes() == (tmp_path / "b" / WEIGHTS_FILE).read_bytes()
    assert a == b
    assert a != c
    # fresh init: LoRA B is zero (the adapter is the identity), A is not
    state = load_file(tmp_path / "a" / WEIGHTS_FILE)
    assert all(v.abs().sum() == 0 for k, v in state.items() if "lora_B" in k)
    assert any(v.abs().sum() > 0 for k, v in state.items() if "lora_A" in k)


def test_init_adapter_wins_over_the_seed(tmp_path):
    source = build(1)
    with torch.no_grad():
        for name, p in source.named_parameters():
            if "lora_B" in name:
                p.normal_()
    save_adapter(source, tmp_path / "src")
    reused = build(99, init_adapter=tmp_path / "src")
    want = load_file(tmp_path / "src" / WEIGHTS_FILE)
    got = adapter_state_dict(reused)
    assert set(got) == set(want)
    assert all(torch.equal(got[k], want[k]) for k in want)
    assert any(p.requires_grad for p in reused.parameters())  # trainable, not frozen
    with pytest.raises(FileNotFoundError, match="has no adapter_model.safetensors"):
        build(0, init_adapter=tmp_path / "missing")


def test_an_init_adapter_that_does_not_fit_the_model_is_refused_naming_the_gap(tmp_path):
    """peft loads an adapter non-strictly: one made for other modules would train from a fresh
    init instead, with a warning at most. Each way it can miss is refused, naming a tensor."""
    from safetensors.torch import save_file

    from model.adapter import AdapterMismatch

    save_adapter(build(1), tmp_path / "src")
    config = json.loads((tmp_path / "src" / "adapter_config.json").read_text())
    state = load_file(tmp_path / "src" / WEIGHTS_FILE)
    # other target modules: the file has tensors for layers peft does not build from this config
    fewer = tmp_path / "fewer-targets"
    fewer.mkdir()
    (fewer / "adapter_config.json").write_text(json.dumps({**config, "target_modules": ["q_proj", "v_proj", "o_proj"]}))
    save_file(state, str(fewer / WEIGHTS_FILE))
    with pytest.raises(AdapterMismatch, match=r"init adapter .*fewer-targets: 16 of its 28 tensors fit no LoRA layer of "
                                              r"this model \(first base_model\.model\.model\.layers\.0\.mlp\."
                                              r"down_proj\.lora_A\.weight\): it was made for another base"):
        build(0, init_adapter=fewer)
    # another base's module names: every tensor is dropped, every layer keeps its fresh init
    other = tmp_path / "other-base"
    other.mkdir()
    (other / "adapter_config.json").write_text(json.dumps(config))
    save_file({k.replace(".model.layers.", ".transformer.h."): v for k, v in state.items()}, str(other / WEIGHTS_FILE))
    with pytest.raises(AdapterMismatch, match=r"28 of the 28 LoRA tensors .* not in it .*; 28 of its 28 tensors fit "
                                              r"no LoRA layer of this model \(first base_model\.model\.transformer\.h\.0"):
        build(0, init_adapter=other)


def test_adapter_fit_problem_table():
    from model.adapter import adapter_fit_problem

    assert adapter_fit_problem({"a", "b"}, {"b", "a"}) is None
    assert adapter_fit_problem({"a"}, {"a", "b"}) == (
        "1 of the 2 LoRA tensors peft built on this model are not in it (first b): "
        "it was made for another base model or other target modules")
    assert adapter_fit_problem({"a", "c"}, {"a"}) == (
        "1 of its 2 tensors fit no LoRA layer of this model (first c): "
        "it was made for another base model or other target modules")


def test_payload_matches_saved_adapter_and_config(tmp_path):
    model = build(3)
    save_adapter(model, tmp_path / "d")
    payload = adapter_payload(model, version=5)
    assert payload.version == 5
    tensors = load(payload.data())
    saved = load_file(tmp_path / "d" / WEIGHTS_FILE)
    assert set(tensors) == set(saved) and all(torch.equal(tensors[k], saved[k]) for k in saved)
    on_disk = json.loads((tmp_path / "d" / "adapter_config.json").read_text())
    assert payload.config["r"] == on_disk["r"] == 4
    assert payload.config["lora_alpha"] == 8
    assert sorted(payload.config["target_modules"]) == sorted(on_disk["target_modules"])
    assert "lm_head" not in payload.config["target_modules"]  # all-linear skips the head
    json.dumps(payload.config)  # plain JSON for the rollout side


def test_disabled_adapter_is_the_base_model():
    base_only = load_base_model(TINY)
    model = build(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.5)
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    with torch.no_grad():
        want = base_only(input_ids=ids).logits
        with model.disable_adapter():
            ref = model(input_ids=ids).logits
        adapted = model(input_ids=ids).logits
    assert torch.allclose(ref, want, atol=1e-6)
    assert not torch.allclose(adapted, want, atol=1e-3)


SAVE_IN_A_FRESH_PROCESS = """
import json, sys
from pathlib import Path
from config.learner import LoraConfig
from learner.lora import adapter_payload, attach_lora, load_base_model, save_adapter
from model.adapter_dir import write_payload
from config.rollout import ModelConfig

out = Path(sys.argv[1])
model = attach_lora(load_base_model(ModelConfig(name_or_path="tiny-random")), LoraConfig(r=4, alpha=8), 7)
save_adapter(model, out / "saved")
write_payload(adapter_payload(model, 1), out / "published")
print(json.dumps(list(model.peft_config["default"].target_modules)))  # peft's own (set) order
"""


def test_same_adapter_same_bytes_whatever_the_hash_seed(tmp_path):
    """peft keeps target_modules as a set, whose order follows PYTHONHASHSEED: the saved and the
    published adapter directories must not."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    orders = {}
    for seed in ("1", "2"):
        done = subprocess.run([sys.executable, "-c", SAVE_IN_A_FRESH_PROCESS, str(tmp_path / seed)], cwd=repo,
                              capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONHASHSEED": seed})
        assert done.returncode == 0, done.stderr[-3000:]
        orders[seed] = json.loads(done.stdout.strip().splitlines()[-1])
    assert orders["1"] != orders["2"], "the two hash seeds gave one set order: the check below would prove nothing"
    for kind in ("saved", "published"):
        one, two = tmp_path / "1" / kind, tmp_path / "2" / kind
        files = sorted(p.name for p in one.iterdir())
        assert files == sorted(p.name for p in two.iterdir()) and "adapter_config.json" in files
        for name in files:
            assert (one / name).read_bytes() == (two / name).read_bytes(), f"{kind}/{name} differs"
        config = json.loads((one / "adapter_config.json").read_text())
        assert config["target_modules"] == sorted(orders["1"])


def test_flat_copy_gives_the_same_payload_bytes():
    """The learner exports its adapter through one flat buffer per dtype (one device-to-host
    transfer instead of one per tensor): the safetensors bytes are those of the tensors as they were."""
    from safetensors.torch import save

    from learner.lora import copy_flat

    g = torch.Generator().manual_seed(0)
    tensors = {f"layer.{i}.lora_{ab}.weight": torch.randn(shape, generator=g)
               for i, shape in enumerate([(8, 64), (64, 8), (8, 96)]) for ab in "AB"}
    tensors["scale"] = torch.tensor([1.5, 2.0], dtype=torch.float64)  # a second dtype, its own buffer
    copied = copy_flat(tensors, "cpu")
    assert set(copied) == set(tensors)
    assert all(copied[k].dtype == v.dtype and copied[k].shape == v.shape for k, v in tensors.items())
    assert save(copied, metadata={"format": "pt"}) == save(tensors, metadata={"format": "pt"})
    assert copied["layer.0.lora_A.weight"].untyped_storage().data_ptr() != \
        copied["layer.0.lora_B.weight"].untyped_storage().data_ptr()  # no shared storage


def test_safetensors_bytes_are_read_back_by_safetensors_itself(tmp_path):
    """The payload's own writer (one flat buffer per dtype, no per-tensor clone) writes files
    safetensors reads: every tensor back bit for bit, odd sizes and mixed dtypes included, the
    metadata kept, each tensor's offset a multiple of its item size."""
    import struct

    from safetensors import safe_open
    from safetensors.torch import save

    from learner.lora import safetensors_bytes
    from rollout.engines.lora_weights import load_safetensors_bytes

    g = torch.Generator().manual_seed(0)
    state = {"b.half": torch.randn(3, 5, generator=g).to(torch.bfloat16), "a.odd": torch.randn(7, generator=g),
             "c.f16": torch.randn(1, 3, generator=g).to(torch.float16), "d.big": torch.randn(4, 33, generator=g),
             "e.view": torch.randn(6, 6, generator=g)[:, :2]}  # not contiguous
    data = safetensors_bytes(state, metadata={"format": "pt"})
    back = load(data)
    assert set(back) == set(state)
    for name, want in state.items():
        assert back[name].dtype == want.dtype and torch.equal(back[name], want), name
    assert set(load(save({k: v.contiguous() for k, v in state.items()}))) == set(back)
    path = tmp_path / "x.safetensors"
    path.write_bytes(data)
    with safe_open(str(path), framework="pt") as fh:
        assert fh.metadata() == {"format": "pt"}
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    assert n % 8 == 0
    for name, info in header.items():
        if name != "__metadata__":
            assert info["data_offsets"][0] % state[name].element_size() == 0, name
    ours = load_safetensors_bytes(data)
    assert all(torch.equal(ours[k], state[k]) for k in state)


def test_the_blob_casts_on_the_tensors_device_and_matches_safetensors_of_the_cast_tensors():
    """``safetensors_blob(dtype=...)`` casts each dtype's concatenation once where the tensors
    live; the file is byte for byte what safetensors writes for the tensors cast one by one, and
    it comes back as one contiguous uint8 array (what the payload carries through Ray)."""
    import numpy as np
    from safetensors.torch import save

    from learner.lora import safetensors_blob

    g = torch.Generator().manual_seed(1)
    state = {f"m.{i}.lora_{ab}.weight": torch.randn(shape, generator=g)
             for i, shape in enumerate([(4, 24), (24, 4), (4, 10)]) for ab in "AB"}
    state["m.odd.lora_A.weight"] = torch.randn(3, 3, generator=g, dtype=torch.float64)  # a second source dtype
    blob, checksum = safetensors_blob(state, metadata={"format": "pt"}, dtype=torch.bfloat16)
    assert isinstance(blob, np.ndarray) and blob.dtype == np.uint8 and blob.ndim == 1 and blob.flags.c_contiguous
    want = save({k: v.to(torch.bfloat16) for k, v in state.items()}, metadata={"format": "pt"})
    back, ref = load(blob.tobytes()), load(want)
    assert set(back) == set(ref) and all(torch.equal(back[k], ref[k]) for k in ref)
    assert blob.nbytes == len(want)
    assert checksum == blob_checksum(blob)  # the per-part sums where the tensors are = the host reference


def test_the_checksum_tells_one_changed_or_moved_word_and_nothing_else():
    import numpy as np

    g = np.random.default_rng(0)
    data = g.integers(0, 256, 4096, dtype=np.uint8)
    same = blob_checksum(data)
    assert blob_checksum(data.copy()) == same and blob_checksum(data.tobytes()) == same
    flipped = data.copy()
    flipped[1000] ^= 1
    swapped = data.copy()
    swapped[[10, 11, 12, 13]] = swapped[[12, 13, 10, 11]]  # two words trade places
    assert blob_checksum(flipped) != same and blob_checksum(swapped) != same
    # little-endian words 1 and 256, each + 32768, weighing 1 and 2; then all-zero words
    assert blob_checksum(np.array([1, 0, 0, 1], np.uint8)) == (32768 + 1) * 1 + (32768 + 256) * 2
    assert blob_checksum(np.zeros(8, np.uint8)) == 32768 * (1 + 2 + 3 + 4)


@pytest.mark.parametrize("n, first", [(0, 5), (10, 0), (10, 65515), (65521 * 3 + 17, 0), (65521 * 2 + 5, 65520),
                                      (200_000, 123_457)])
def test_the_learners_word_sums_add_up_to_the_reference_checksum(n, first):
    """word_sum's residue-class sums equal the plain formula on words placed at ``first``, across
    the 65521-word period's boundaries (the learner sums each part of the blob where it lies)."""
    import numpy as np

    from learner.lora import word_sum

    g = np.random.default_rng(n)
    blob = g.integers(0, 256, 2 * (first + n), dtype=np.uint8)
    words = torch.from_numpy(blob[2 * first :].copy()).view(torch.int16) if n else torch.zeros(0, dtype=torch.int16)
    rest = blob_checksum(blob[: 2 * first]) if first else 0
    assert int(word_sum(words, first)) + rest == blob_checksum(blob)


def test_the_learners_payload_carries_the_checksum_of_its_bytes():
    payload = adapter_payload(build(3), version=2)
    assert payload.checksum == blob_checksum(payload.view())

