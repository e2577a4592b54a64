"""One copy of the base (issue 31, item 4): a learner that maps a replica's weights trains exactly
like a learner with its own copy (model/shared_base.py).

The owner is a real separate process holding vLLM's own model class (fused qkv_proj and
gate_up_proj, loaded by vLLM's loader) with the worker extension a vLLM replica runs
(tests/shared_base_owner.py); the learner is a real PolicyLearner in this process that maps the
owner's memory (torch's handles over shared memory: on a GPU the same calls give CUDA IPC).
Checked against a PolicyLearner with its own copy, on the same batches:
- nothing merged (version 0, or vLLM's unmerged LoRA): float32 loss, grad norm and adapter
  BIT-EQUAL;
- an adapter merged into the owner's weights (vLLM's merged mode), the learner at that version
  (sync mode) and one step past it (one_step_off): loss, grad norm, ppl_ratio and kl equal to
  1e-5 relative in float32 (the served weights W0 + s B_v A_v are rounded once, and the
  correction takes s B_v A_v off again), 1e-2 in bfloat16 (measured: 0.44 % at most);
- without the correction the same comparison fails (the test can see a wrong answer);
- a write of the owner's weights during a learner step fails the step (the fence).
"""

from __future__ import annotations

import pytest
import torch

from config import RunConfig
from learner.lora import adapter_state_dict
from learner.policy import PolicyLearner
from model.shared_base import (BaseExport, FenceMoved, ShareRefused, base_views, owner_source)

pytestmark = [pytest.mark.slow, pytest.mark.subprocess]

# Relative tolerances where an adapter is merged: float32 rounds W0 + s B_v A_v once; bfloat16
# rounds it to 8 bits of mantissa (measured here: loss, grad norm, ppl_ratio and kl within 0.44 %)
RTOL = {"float32": 1e-5, "bfloat16": 1e-2}
KEYS = ("loss", "grad_norm", "ppl_ratio", "kl")


def batch(k: int):
    from tests.test_learner_memory import two_groups

    return two_groups(3 + k)


def tiny_dir():
    from config.rollout import ModelConfig
    from model.base import resolve_model

    return resolve_model(ModelConfig(name_or_path="tiny-random"))


def run_config(model_dir, dtype: str) -> RunConfig:
    return RunConfig.model_validate({
        "seed": 0, "model": {"name_or_path": str(model_dir), "dtype": dtype},
        "learner": {"lr": 5e-2, "micro_batch_size": 4, "lora": {"r": 4, "alpha": 8}, "beta": 0.05},
        "rollout": {"temperature": 0.7}, "trainer": {"steps": 8},
    })


DTYPES = ["float32", "bfloat16"]


@pytest.fixture(scope="module")
def owner_process():
    from tests.shared_base_owner import Owner

    proc = Owner(str(tiny_dir()), DTYPES)
    yield proc
    proc.stop()


@pytest.fixture(scope="module", params=DTYPES)
def owner(request, owner_process):
    return request.param, owner_process.view(request.param)


def learners(dtype: str, owner_proc):
    cfg = run_config(tiny_dir(), dtype)
    own = PolicyLearner.for_run(cfg)
    shared = PolicyLearner.for_run(cfg, shared_base=owner_proc.call("export"), share_required=True)
    return own, shared


def compare(own_m, shared_m, dtype: str, exact: bool) -> None:
    for key in KEYS:
        want, got = own_m[key], shared_m[key]
        if exact:
            assert got == want, (key, got, want)
        else:
            assert got == pytest.approx(want, rel=RTOL[dtype]), key


def adapters_equal(own, shared) -> None:
    a, b = adapter_state_dict(own.peft_model), adapter_state_dict(shared.peft_model)
    assert a.keys() == b.keys()
    for name, want in a.items():
        assert torch.equal(b[name], want), name


def align(shared, own) -> None:
    """The shared learner at the own learner's adapter and optimizer state, so that the next
    step of each is on the same policy and batch (bench/shared_base_gpu.py's, which the GPU check
    uses the same way). Their adapters after a step are not compared where the weights differ by
    rounding: AdamW divides by sqrt(v), so a gradient element near 0 that differs by 1e-7
    relative moves its update by up to 1e-4 here."""
    from bench.shared_base_gpu import align as copy_state

    copy_state(shared, own)


def test_a_learner_on_the_replicas_weights_trains_like_one_with_its_own_copy(owner):
    dtype, proc = owner
    own, shared = learners(dtype, proc)
    assert shared.base_weights["mode"] == "shared" and own.base_weights["mode"] == "own"
    # the shared learner's base is the owner's memory, not a copy
    base = [p for n, p in shared.peft_model.named_parameters() if not p.requires_grad]
    assert base and all(p.untyped_storage().is_shared() for p in base)
    assert not any(p.untyped_storage().is_shared() for n, p in own.peft_model.named_parameters() if not p.requires_grad)

    # 1. nothing merged (version 0; vLLM's unmerged LoRA never merges): bit for bit
    m_own, m_shared = own.step(batch(0))[0], shared.step(batch(0))[0]
    compare(m_own, m_shared, dtype, exact=True)
    adapters_equal(own, shared)
    assert m_own["grad_norm"] > 0

    # 2. the learner's adapter merged into the owner's weights (sync mode: served = trained)
    proc.hold(own.payload(2))
    q = proc.call("weight", "model.layers.0.self_attn.qkv_proj.weight")
    own_q = own.peft_model.base_model.model.model.layers[0].self_attn.q_proj.base_layer.weight
    assert not torch.equal(q[: own_q.shape[0]], own_q.detach())  # the owner now serves W0 + s B A
    m_own, m_shared = own.step(batch(1))[0], shared.step(batch(1))[0]
    compare(m_own, m_shared, dtype, exact=False)

    # 3. one_step_off: the owner still serves that version, the learner is one step past it
    align(shared, own)
    m_own, m_shared = own.step(batch(2))[0], shared.step(batch(2))[0]
    compare(m_own, m_shared, dtype, exact=False)

    # 4. the correction is what makes 2 and 3 right: without it the same step is off
    align(shared, own)
    shared.served.remove()
    m_own, bare = own.step(batch(3))[0], shared.step(batch(3))[0]
    off = [key for key in KEYS if bare[key] != pytest.approx(m_own[key], rel=RTOL[dtype])]
    assert len(off) >= 2, (off, bare, m_own)

    # 5. W0 written back (an eval of the base model): bit for bit again
    proc.call("use", 0)
    align(shared, own)
    m_own, m_shared = own.step(batch(4))[0], shared.step(batch(4))[0]
    compare(m_own, m_shared, dtype, exact=True)


def test_the_vllm_worker_merges_a_device_payload_as_it_merges_the_host_file(owner):
    """adapter_transport=device with vLLM's merged LoRA (model/adapter_ipc.py): the owner's
    worker (vLLM's model and worker extension, in another process) opens the learner's buffer
    itself (counterpoint_hold_device) and writes the same weights, bit for bit, as from the host
    path's file of the same adapter; a byte changed in the buffer after the learner wrote it is
    refused, naming the checksum, and the weights stay as they were."""
    import pickle

    from learner.lora import adapter_payload
    from model.adapter_ipc import DeviceAdapterPayload, slot_of

    dtype, proc = owner
    learner = PolicyLearner.for_run(run_config(tiny_dir(), dtype), shared_base=proc.call("export"),
                                    share_required=True, adapter_transport="device")
    assert learner.adapter_export.transport["mode"] == "device", learner.adapter_export.transport
    learner.step(batch(0))  # B leaves zero: an adapter that changes the weights
    device = learner.payload(2)
    assert isinstance(device, DeviceAdapterPayload)
    host = adapter_payload(learner.peft_model, 2, dtype=learner.payload_dtype)
    assert device.checksum == host.checksum
    name = "model.layers.0.self_attn.qkv_proj.weight"
    w0 = proc.call("weight", name)
    proc.hold(host)
    want = proc.call("weight", name)
    assert not torch.equal(want, w0)
    proc.call("use", 0)
    status, extra, read_s, merge_s = proc.call("hold_device", pickle.dumps(device))
    assert status == "held" and extra > 0 and read_s > 0 and merge_s > 0
    assert torch.equal(proc.call("weight", name), want)

    data = learner.adapter_export.exporter.buffers[slot_of(2)][0]
    data[-1] = data[-1] ^ 1  # the learner's buffer changed after the checksum was taken
    status, kind, why = proc.call("hold_device", pickle.dumps(device))
    assert (status, kind) == ("refused", "checksum") and "checksum" in why and "v2" in why, why
    assert torch.equal(proc.call("weight", name), want)


def compiled_on_the_owners_weights() -> dict:
    """A learner with learner.compile_layers=true on the owner's weights (its correction a forward
    hook inside each compiled layer) against an eager learner with its own copy, float32, on the
    same batches: nothing merged, merged (sync) and one step past the merge (one_step_off). Run
    in a fresh process (``test_compiled_layers_on_the_owners_weights``): the learner compiles in
    one of its own, and a pytest worker's earlier tests leave dynamo's state behind. Plain numbers."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    from tests.shared_base_owner import Owner

    torch._dynamo.config.disable = False  # TORCH_COMPILE_DISABLE may come with the environment
    owner = Owner(str(tiny_dir()), ["float32"])
    try:
        proc = owner.view("float32")
        cfg = run_config(tiny_dir(), "float32")
        own = PolicyLearner.for_run(cfg)
        compiled = cfg.model_copy(update={"learner": cfg.learner.model_copy(update={"compile_layers": True})})
        shared = PolicyLearner.for_run(compiled, shared_base=proc.call("export"), share_required=True)
        out: dict = {"mode": shared.base_weights["mode"], "compiled_layers": shared.stats()["compiled_layers"]}
        out["v0"] = (own.step(batch(0))[0], shared.step(batch(0))[0])
        proc.hold(own.payload(2))
        out["merged"] = (own.step(batch(1))[0], shared.step(batch(1))[0])
        align(shared, own)
        out["one_step_off"] = (own.step(batch(2))[0], shared.step(batch(2))[0])
        out["graph_breaks"] = dict(counters["graph_break"])
        return {k: v if k in ("mode", "compiled_layers", "graph_breaks") else [{key: m[key] for key in KEYS} for m in v]
                for k, v in out.items()}
    finally:
        owner.stop()


def test_compiled_layers_on_the_owners_weights():
    """compile_layers=true where the learner maps the replica's base (its 'auto' leaves it off
    there until it is timed on a GPU): the served adapter's correction runs inside the compiled
    layers, and the step is the own-copy eager learner's to 1e-5 relative (float32), before a
    merge, on the merged weights and one step past them. Without the correction the merged
    steps are off by more (test above), so the compiled layers did apply it."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    code = ("import json, sys\nsys.path[:0] = [sys.argv[1], sys.argv[1] + '/tests']\n"
            "from tests.test_shared_base import compiled_on_the_owners_weights\n"
            "print('RESULT' + json.dumps(compiled_on_the_owners_weights()))\n")
    done = subprocess.run([sys.executable, "-c", code, str(repo)], cwd=repo, capture_output=True, text=True,
                          timeout=600)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT")]
    assert done.returncode == 0 and lines, done.stderr[-3000:]
    got = json.loads(lines[-1][len("RESULT"):])
    assert got["mode"] == "shared" and got["compiled_layers"] == 2 and not got["graph_breaks"], got
    for phase in ("v0", "merged", "one_step_off"):
        own, shared = got[phase]
        for key in KEYS:
            assert shared[key] == pytest.approx(own[key], rel=RTOL["float32"]), (phase, key)
    assert got["merged"][0]["kl"] > 0  # the reference pass ran on an adapter that moved


def test_a_write_during_a_learner_step_fails_that_step(owner):
    dtype, proc = owner
    shared = PolicyLearner.for_run(run_config(tiny_dir(), dtype), shared_base=proc.call("export"), share_required=True)
    proc.hold(shared.payload(2))
    before = shared._fence_read()
    shared._fence_check(before)  # nothing written: fine
    proc.call("use", 0)
    with pytest.raises(FenceMoved, match="rewrote the shared base weights during"):
        shared._fence_check(before)
    shared.step(batch(0))  # the next step starts from the new state and runs


# ------------------------------------------------------------------ the layout, without processes


def test_fused_rows_map_to_the_transformers_modules():
    packed = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
    assert owner_source("model.layers.3.self_attn.k_proj.weight", packed) == ("model.layers.3.self_attn.qkv_proj.weight", "k_proj")
    assert owner_source("model.norm.weight", packed) == ("model.norm.weight", None)
    qkv = torch.arange(12 * 2, dtype=torch.float32).view(12, 2)
    embed = torch.zeros(10, 2)
    expected = {"l.self_attn.q_proj.weight": ((8, 2), torch.float32), "l.self_attn.k_proj.weight": ((2, 2), torch.float32),
                "l.self_attn.v_proj.weight": ((2, 2), torch.float32), "embed.weight": ((7, 2), torch.float32)}
    views = base_views(expected, {"l.self_attn.qkv_proj.weight": qkv, "embed.weight": embed}, packed)
    assert torch.equal(views["l.self_attn.q_proj.weight"], qkv[:8]) and torch.equal(views["l.self_attn.v_proj.weight"], qkv[10:])
    assert views["l.self_attn.k_proj.weight"].data_ptr() == qkv[8:].data_ptr()  # a view, not a copy
    assert views["embed.weight"].shape == (7, 2)  # a padded vocabulary's leading rows
    with pytest.raises(ShareRefused, match="is torch.float32 in the replica, the learner wants torch.bfloat16"):
        base_views({"embed.weight": ((7, 2), torch.bfloat16)}, {"embed.weight": embed}, packed)
    with pytest.raises(ShareRefused, match="have no l.mlp.gate_up_proj.weight"):
        base_views({"l.mlp.up_proj.weight": ((3, 2), torch.float32)}, {}, packed)
    with pytest.raises(ShareRefused, match="shape"):
        base_views({"embed.weight": ((7, 3), torch.float32)}, {"embed.weight": embed}, packed)


def test_an_unmerged_lora_replicas_wrapped_layers_are_exported_under_the_modules_names():
    """vLLM with unmerged LoRA wraps each layer it may adapt and holds the original as
    `base_layer` (the 14B bench's first run: 'no model.embed_tokens.weight'): the export names each
    weight as the module's own, so the learner finds it."""
    from model.shared_base import export_base, open_export

    qkv, embed = torch.ones(12, 2), torch.zeros(10, 2)
    export = export_base("vllm", [("model.layers.0.self_attn.qkv_proj.base_layer.weight", qkv),
                                  ("model.embed_tokens.base_layer.weight", embed)], {}, None)
    assert set(export.tensors) == {"model.layers.0.self_attn.qkv_proj.weight", "model.embed_tokens.weight"}
    owned = open_export(export, "cpu")
    with pytest.raises(ShareRefused, match=r"no lm_head.weight for the learner's lm_head.weight \(2 tensors, e.g. "):
        base_views({"lm_head.weight": ((10, 2), torch.float32)}, owned, {})


def test_a_tied_head_is_exported_under_its_name_and_a_meta_parameter_only_refused_if_needed():
    """The 14B/32B benches on vLLM 0.26 (2026-12-03): the learner found no lm_head.weight among the
    replica's 322 tensors, and another export failed pickling a parameter with no memory
    ('_share_filename_: only available on CPU', a meta tensor's). A head that is the embedding is
    exported under both names (named_parameters(remove_duplicate=False)), so the learner's head maps
    what the owner computes the logits with; a meta parameter is listed, not mapped."""
    from model.shared_base import export_base, open_export

    model = torch.nn.Module()
    model.embed = torch.nn.Embedding(10, 2)
    model.head = torch.nn.Linear(2, 10, bias=False)
    model.head.weight = model.embed.weight  # tied
    model.spare = torch.nn.Linear(2, 2, bias=False, device="meta")
    assert [n for n, _ in model.named_parameters()] == ["embed.weight", "spare.weight"]
    export = export_base("vllm", model.named_parameters(remove_duplicate=False), {}, None)
    assert set(export.tensors) == {"embed.weight", "head.weight"} and export.elsewhere == {"spare.weight": "meta"}
    owned = open_export(export, "cpu")
    views = base_views({"head.weight": ((10, 2), torch.float32)}, owned, {}, export.elsewhere)
    assert views["head.weight"].data_ptr() == model.embed.weight.data_ptr()  # the owner's memory, mapped
    with pytest.raises(ShareRefused, match=r"^the replica holds spare.weight on the meta device, with no memory for "
                                           r"the learner's spare.weight to map$"):
        base_views({"spare.weight": ((2, 2), torch.float32)}, owned, {}, export.elsewhere)


def test_an_offer_that_does_not_fit_falls_back_to_an_own_copy_with_the_reason(tmp_path):
    cfg = run_config(tiny_dir(), "float32")
    bad = BaseExport(owner="vllm", owner_pid=1, device_uuid="GPU-0000", dtype="float32", tensors={})
    learner = PolicyLearner.for_run(cfg, shared_base=bad)
    assert learner.base_weights == {"mode": "own", "reason": "the vllm replica's weights are on GPU GPU-0000, the learner on cpu"}
    with pytest.raises(ShareRefused, match="GPU-0000"):
        PolicyLearner.for_run(cfg, shared_base=bad, share_required=True)


def test_random_weights_an_hf_replica_draws_are_lent_to_the_learner(tmp_path):
    """model.load_format=dummy (the 14B/32B benches' way to a shape without a checkpoint): the
    directory holds config.json and the tokenizer only; an hf engine draws the random weights
    (model/base.py load_causal_lm: vLLM's dummy range and seed), and a learner that maps them
    trains bit for bit like a learner that drew the same weights itself."""
    import shutil

    from config.rollout import RolloutConfig
    from rollout.engines.hf import HFEngine

    shape = tmp_path / "tiny-shape"
    shutil.copytree(tiny_dir(), shape, ignore=shutil.ignore_patterns("*.safetensors", "*.bin", ".counterpoint-build.json"))
    assert not list(shape.glob("*.safetensors"))  # no checkpoint to read
    cfg = RunConfig.model_validate({
        **run_config(shape, "float32").model_dump(),
        "model": {"name_or_path": str(shape), "dtype": "float32", "load_format": "dummy"},
        "rollout": {"engine": "hf", "temperature": 0.7}, "share_base_weights": True})
    engine = HFEngine(shape, cfg.model, RolloutConfig(engine="hf", temperature=0.7))
    weights = [p for p in engine.model.parameters()]
    assert all(float(p.abs().max()) <= 1.001e-3 for p in weights) and float(weights[1].abs().max()) > 0  # vLLM's range
    shared = PolicyLearner.for_run(cfg, shared_base=engine.export_base(), share_required=True)
    own = PolicyLearner.for_run(cfg)  # the same draw, held itself
    assert shared.base_weights["mode"] == "shared" and own.base_weights["mode"] == "own"
    for k in range(2):
        m_own, m_shared = own.step(batch(k))[0], shared.step(batch(k))[0]
        compare(m_own, m_shared, "float32", exact=True)
        assert m_own["grad_norm"] > 0
    adapters_equal(own, shared)
