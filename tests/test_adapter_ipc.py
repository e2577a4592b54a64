"""The adapter in device memory (issue 34, item 3; model/adapter_ipc.py), on the CPU: the same
calls over torch's shared-memory handles that give CUDA IPC on a GPU.

- the buffer rule: which buffer holds v, when it may be written, in the driver's sync and
  one_step_off orders and when the replica has not acknowledged;
- a learner (this process) exports, a replica (a spawned process) imports: the replica's tensors
  and file are bit-identical to the host path's payload of the same adapter, the checksum is the
  host path's number, and a byte changed in the learner's buffer is refused;
- double buffering across the two processes: v - 1 stays readable while v is written, and the
  write of v + 1 waits for the replica's acknowledgement of v.
"""

from __future__ import annotations

import multiprocessing

import pytest
import torch

from model.adapter import blob_checksum
from model.adapter_ipc import (AdapterChecksumError, DeviceExporter, DeviceImporter, TransportRefused, may_write,
                               slot_of)


# ------------------------------------------------------------------------------ the rule


def test_versions_alternate_between_two_buffers():
    assert [slot_of(v) for v in range(1, 7)] == [1, 0, 1, 0, 1, 0]


@pytest.mark.parametrize("last, acked, allowed", [
    (None, 0, True),   # never written: free
    (1, 0, False),     # the replica has not moved past v1 (still loading it, or on the base)
    (1, 1, False),     # the replica holds v1: it may still read its buffer
    (1, 2, True),      # the replica holds v2: v1's buffer is free (v3 goes there)
    (3, 2, False),     # v3 written, the replica on v2 (one_step_off: v4 waits for v3's sync)
    (3, 7, True),
])
def test_a_buffer_is_written_only_once_the_replica_has_moved_past_its_version(last, acked, allowed):
    assert may_write(last, acked) is allowed


def small_state(dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    return {f"base_model.model.layers.{i}.{m}.lora_{ab}.weight": torch.randn(shape, generator=g, dtype=dtype)
            for i in range(2) for m in ("q_proj", "v_proj")
            for ab, shape in (("A", (4, 16)), ("B", (16, 4)))}


def test_the_drivers_step_orders_never_make_the_learner_wait():
    """sync: publish v, every replica holds v (ack), then the update exports v + 1. one_step_off:
    generation with v overlaps the export of v + 1, but v's sync finished a step earlier."""
    for order in ("sync", "one_step_off"):
        exporter, state = DeviceExporter("cpu"), small_state()
        exporter.export(state, 1, {})  # the init adapter
        exporter.ack.write(1)  # start_rollout_and_learner: publish, sync
        for v in range(2, 8):
            assert exporter.refusal(v) is None, (order, v)
            exporter.export(state, v, {})
            exporter.ack.write(v)  # update_weights: publish v, sync v, before the next update
        # a replica that has not acknowledged the last version: the next export refuses (host path then)
        exporter.ack.write(6)
        assert exporter.refusal(8) is not None
        with pytest.raises(TransportRefused, match="buffer 0 still holds v6"):
            exporter.export(state, 8, {})


# ------------------------------------------------------------------------------ two processes


def replica(conn) -> None:
    """The replica's side in its own process: import payloads, answer with copies of what it got."""
    torch.set_num_threads(1)
    importer = DeviceImporter()
    while True:
        cmd, *args = conn.recv()
        if cmd == "stop":
            conn.send(("ok", None))
            return
        try:
            if cmd == "import":
                (payload,) = args
                imported = importer.open(payload)
                tensors = {k: v.clone() for k, v in imported.tensors().items()}
                conn.send(("ok", (tensors, imported.payload().data(), len(importer.mapped))))
            elif cmd == "ack":
                payload, version = args
                importer.acknowledge(payload, version)
                conn.send(("ok", None))
        except Exception as err:  # noqa: BLE001 - the test reads it
            conn.send(("error", f"{type(err).__name__}: {err}"))


class Replica:
    def __init__(self):
        ctx = multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=replica, args=(child,), daemon=True)
        self.proc.start()

    def call(self, *msg):
        self.conn.send(msg)
        assert self.conn.poll(120), "the replica process did not answer"
        status, out = self.conn.recv()
        if status == "error":
            raise RuntimeError(out)
        return out

    def stop(self):
        try:
            self.call("stop")
        finally:
            self.proc.join(30)
            if self.proc.is_alive():
                self.proc.kill()


@pytest.fixture(scope="module")
def other_process():
    r = Replica()
    yield r
    r.stop()


def peft_adapter():
    """A real peft LoRA adapter (B nonzero) on a small module."""
    from peft import LoraConfig, get_peft_model

    class Tiny(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.q_proj, self.v_proj, self.o = (torch.nn.Linear(16, 16), torch.nn.Linear(16, 8),
                                                torch.nn.Linear(8, 4))

    torch.manual_seed(0)
    model = get_peft_model(Tiny(), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    for name, p in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p)
    return model


@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
def test_a_replica_process_gets_the_host_paths_adapter_bit_for_bit(other_process, dtype):
    from safetensors.torch import load

    from learner.lora import adapter_device_payload, adapter_payload

    model = peft_adapter()
    host = adapter_payload(model, 3, dtype=dtype)
    exporter = DeviceExporter("cpu")
    device = adapter_device_payload(model, 3, exporter, dtype=dtype)
    assert device.checksum == host.checksum == blob_checksum(host.view())
    assert device.config == host.config and device.version == host.version == 3
    tensors, blob, _ = other_process.call("import", device)
    assert blob == host.data()  # the replica's file is the host path's, byte for byte
    want = load(host.data())
    assert tensors.keys() == want.keys()
    for name in want:
        assert tensors[name].dtype == want[name].dtype and torch.equal(tensors[name], want[name]), name


def test_a_changed_byte_in_the_learners_buffer_is_refused(other_process):
    exporter = DeviceExporter("cpu")
    payload = exporter.export(small_state(), 1, {"r": 4})
    other_process.call("import", payload)  # intact: accepted
    data = exporter.buffers[slot_of(1)][0]
    data[123] ^= 1
    with pytest.raises(RuntimeError, match="AdapterChecksumError: adapter v1: checksum"):
        other_process.call("import", payload)
    data[123] ^= 1
    other_process.call("import", payload)


def test_two_buffers_across_processes_and_the_replicas_acknowledgement(other_process):
    exporter = DeviceExporter("cpu")
    state = small_state()
    bumped = {k: v + 1 for k, v in state.items()}
    v1 = exporter.export(state, 1, {})
    other_process.call("ack", v1, 1)
    v2 = exporter.export(bumped, 2, {})  # the other buffer: v1 is intact while v2 is written
    got1, _, _ = other_process.call("import", v1)
    got2, _, mapped = other_process.call("import", v2)
    assert all(torch.equal(got1[k], state[k]) and torch.equal(got2[k], bumped[k]) for k in state)
    # v3 goes to v1's buffer: refused until the replica, in its own process, acknowledges v2
    with pytest.raises(TransportRefused):
        exporter.export(state, 3, {})
    other_process.call("ack", v2, 2)
    assert exporter.ack.read() == 2
    v3 = exporter.export({k: v * 2 for k, v in state.items()}, 3, {})
    assert v3.buffer_id == v1.buffer_id  # the same buffer, mapped once by the replica
    _, _, mapped_after = other_process.call("import", v3)
    assert mapped_after == mapped
    with pytest.raises(RuntimeError, match="AdapterChecksumError"):  # v1's bytes are gone: said so, not served
        other_process.call("import", v1)


def test_replacement_replicas_each_open_the_same_buffer():
    """A buffer's handle travels once and is opened by every replica that serves the learner: the
    replacements of a replica that died, in processes of their own. torch's rebuild spent the
    handle's one reference, so the third process found the file gone (model/shared_base.py
    open_handle takes a reference of its own per open)."""
    exporter = DeviceExporter("cpu")
    state = small_state()
    payload = exporter.export(state, 1, {})
    for _ in range(3):
        r = Replica()
        try:
            got, _, _ = r.call("import", payload)
        finally:
            r.stop()
        assert all(torch.equal(got[k], state[k]) for k in state)


def test_a_payload_on_a_gpu_this_process_cannot_see_is_refused_in_one_line():
    from dataclasses import replace

    payload = replace(DeviceExporter("cpu").export(small_state(), 1, {}), device_uuid="GPU-not-here")
    with pytest.raises(TransportRefused, match="GPU-not-here's memory, which this process cannot see"):
        DeviceImporter().open(payload)


# ------------------------------------------------------------------------------ which transport

SHARED = {"mode": "shared", "owner": "hf replica (pid 1), 3 tensors in host memory"}
OWN = {"mode": "own", "reason": "share_base_weights=false"}


@pytest.mark.parametrize("requested, base, owner, on_gpu, mode, says", [
    ("host", SHARED, "hf", True, "host", "adapter_transport=host"),
    ("auto", OWN, None, True, "host", "does not map the replica's base weights (share_base_weights=false)"),
    ("auto", SHARED, "hf", False, "host", "GPU memory only"),
    # vLLM's merged workers open the buffers themselves: ran on an H100 (bench/results/gpu-2026-12-05-ec41379-h100)
    ("auto", SHARED, "vllm", True, "device", "one device"),
    ("auto", SHARED, "hf", True, "device", "one device"),
    ("device", SHARED, "hf", False, "device", "one device"),  # the CPU tests' path
    ("device", SHARED, "vllm", True, "device", "one device"),
])
def test_the_transport_follows_the_shared_base(requested, base, owner, on_gpu, mode, says):
    from model.adapter_ipc import transport_choice

    got = transport_choice(requested, base, owner, on_gpu)
    assert got["mode"] == mode and says in got["reason"], got


def test_device_transport_without_a_shared_base_is_refused_in_one_line():
    from config import RunConfig
    from model.adapter_ipc import transport_choice

    with pytest.raises(TransportRefused, match="adapter_transport=device, but the learner does not map"):
        transport_choice("device", OWN, None, True)
    with pytest.raises(ValueError, match="adapter_transport=device hands adapters over where the learner maps the "
                                         "rollout replica's base weights, but the base is not shared: "
                                         "share_base_weights=false"):
        RunConfig.model_validate({"adapter_transport": "device", "share_base_weights": False,
                                  "rollout": {"engine": "hf"}})
    cfg = RunConfig.model_validate({"adapter_transport": "device", "share_base_weights": True,
                                    "rollout": {"engine": "hf"}})
    assert cfg.adapter_transport == "device"
    assert RunConfig.model_validate({}).adapter_transport == "auto"  # the CPU default run: host (auto on a CPU)
