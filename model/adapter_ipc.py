"""The adapter handed from the learner to a rollout replica in device memory, where the two share
a device (issue 34): no trip through host memory and Ray's object store for its bytes.

Today's path (the host path) makes the adapter's safetensors file in host memory on the
learner (learner/lora.py ``safetensors_blob``), which crosses the object store to the replica:
0.16 s of the step's critical path at Qwen3-4B on an H200 when the two share the GPU. Here the
learner keeps the file's DATA SECTION in a buffer on its device, and what travels through Ray is
a small ``DeviceAdapterPayload``: the version, the adapter_config, the file's head (its 8-byte
length and JSON header: names, dtypes, shapes, byte ranges, exactly as the host path writes
them, ``blob_layout``), a handle to the buffer and the checksum. The head plus the buffer's
bytes ARE the host path's file, bit for bit, and the checksum is the same number
(model/adapter.py ``blob_checksum``), computed on the device (``word_sum``).

The handles are model/shared_base.py's (``tensor_handle``/``open_handle``: CUDA IPC on a GPU, a
shared-memory file on the CPU), the mechanism that already maps the replica's base weights into
the learner; this module adds no second one. It is used only where that one applies: the
learner maps the replica's base (run.json ``base_weights`` "shared"), so the two are on one
device of one host.

Double buffering. The learner owns two buffers; version v goes to buffer ``slot_of(v)`` = v % 2,
so while replicas still read v (or copy it) the learner can write v + 1 to the other. Buffer s
may be written again only once the replica no longer reads the version last written there:
``may_write(last_in_slot, acknowledged)`` = nothing written there yet, or the replica has
acknowledged a newer version. With versions in order that is "v may be written once v - 1 is
acknowledged" (v - 2's buffer is free). The acknowledgement is a word in shared host memory that
the learner owns and hands out with every device payload (``AckWord``): the replica writes the
version it holds after loading one (its sync of v IS the ack).

Why the step order always allows the write. Sync mode: the driver publishes v and waits for
every replica to hold v (update_weights) before it asks the learner for step v's update, which
exports v + 1 to buffer (v + 1) % 2, last written with v - 1: acknowledged v > v - 1. One step
off: generation for step t + 1 runs with v WHILE the learner trains and exports v + 1; v's
buffer is the other one, and v - 1's (the one written) is free because the sync of v finished in
the previous step's update_weights, before this step began. So the learner never waits; where
the rule does not hold (a replica that has not acknowledged: replaced and not yet loaded, or
answering a request for an older version), the learner exports that version on the host path
instead, and says why (``DeviceExporter.refusal``).

The replica copies the buffer into memory of its own (a device-to-device copy) and verifies the
checksum on ITS copy, so a read that overlapped a write can never pass as the adapter: the check
is on exactly the bytes it then uses. It maps each buffer once (cached by the buffer's id). An
engine takes the tensors as views of that copy (``ImportedAdapter.tensors``) or, where it needs
a file (peft's loader, vLLM's unmerged LoRA), the host path's bytes (``ImportedAdapter.payload``).

Torch only; no Ray, vLLM, peft or transformers import.
"""

from __future__ import annotations

import json
import os
import struct
import uuid as uuidlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from model.adapter import CHECKSUM_MOD, AdapterPayload
from model.shared_base import cuda_index_of, device_uuid, open_handle, tensor_handle

ST_NAMES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64"}
ST_DTYPES = {name: dtype for dtype, name in ST_NAMES.items()}


class TransportRefused(RuntimeError):
    """The adapter cannot travel in device memory here; the message is the one-line reason."""


class AdapterChecksumError(RuntimeError):
    """The adapter's bytes do not match the checksum its maker computed."""


# ------------------------------------------------------------------------------ the file's layout


@dataclass(frozen=True)
class BlobLayout:
    """A safetensors file's layout as the host path writes it: ``head`` is its first bytes (the
    8-byte header length and the JSON header, padded to 8 bytes); then the data section of
    ``data_nbytes``, one group per dtype (wider first), names sorted in each."""

    head: bytes
    groups: tuple[tuple[str, tuple[str, ...]], ...]  # (safetensors dtype name, names), in file order
    tensors: dict[str, tuple[str, tuple[int, ...], int, int]]  # name -> (dtype name, shape, begin, end) in the data
    data_nbytes: int

    def views(self, data: torch.Tensor) -> dict[str, torch.Tensor]:
        """Each tensor as a view of ``data`` (uint8, the data section)."""
        return {name: data[begin:end].view(ST_DTYPES[dt]).view(shape)
                for name, (dt, shape, begin, end) in self.tensors.items()}


def blob_layout(shapes: Mapping[str, tuple[tuple[int, ...], torch.dtype]],
                metadata: Mapping[str, str] | None = None) -> BlobLayout:
    """The layout of the safetensors file of tensors name -> (shape, dtype): what
    safetensors.torch.save writes, every offset a multiple of its item size."""
    names = sorted(shapes)
    groups: dict[torch.dtype, list[str]] = {}
    for name in names:
        dtype = shapes[name][1]
        if dtype not in ST_NAMES:
            raise ValueError(f"{name}: dtype {dtype} has no safetensors name here")
        groups.setdefault(dtype, []).append(name)
    header: dict[str, object] = {"__metadata__": dict(metadata)} if metadata else {}
    order = sorted(groups, key=lambda d: -d.itemsize)  # wider first: every offset a multiple of its item size
    offset, tensors = 0, {}
    for d in order:
        for n in groups[d]:
            shape = tuple(int(x) for x in shapes[n][0])
            size = _numel(shape) * d.itemsize
            header[n] = {"dtype": ST_NAMES[d], "shape": list(shape), "data_offsets": [offset, offset + size]}
            tensors[n] = (ST_NAMES[d], shape, offset, offset + size)
            offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data section starts 8-byte aligned
    return BlobLayout(head=struct.pack("<Q", len(text)) + text,
                      groups=tuple((ST_NAMES[d], tuple(groups[d])) for d in order), tensors=tensors,
                      data_nbytes=offset)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for x in shape:
        n *= x
    return n


def fill_data(layout: BlobLayout, state: Mapping[str, torch.Tensor], data: torch.Tensor) -> None:
    """Write ``state``'s tensors into ``data`` (uint8, the data section, on any device): per
    dtype group one concatenation and cast where the tensors are, and one copy."""
    pos = 0
    for dt, names in layout.groups:
        d = ST_DTYPES[dt]
        flat = torch.cat([state[n].detach().reshape(-1) for n in names]).to(d)
        nbytes = flat.numel() * d.itemsize
        data[pos: pos + nbytes].view(d).copy_(flat)
        pos += nbytes


def word_sum(words: torch.Tensor, first: int) -> torch.Tensor:
    """The part of ``blob_checksum`` that the 16-bit words ``words`` (int16) make when the first
    of them is word ``first`` of the blob, exactly, as an int64 scalar on their device.

    Weights repeat every 65521 words, so the words are summed per residue class (a reshape to
    rows of 65521 and one column sum): one pass over the words, int64 only in the 65521 sums,
    instead of int64 copies of every word (~1 s for 126 MiB on a CPU; a few ms on a GPU either
    way). Each word counts as its signed value + 32768, so a row's sum needs no unsigned type."""
    m, n, device = CHECKSUM_MOD, words.numel(), words.device

    def direct(part: torch.Tensor, at: int) -> torch.Tensor:  # fewer than 65521 words: plainly
        weight = torch.arange(at, at + part.numel(), device=device) % m + 1
        return ((part.to(torch.int64) + 32768) * weight).sum()

    head = min((-first) % m, n)  # up to the first word whose weight is 1
    rows = (n - head) // m
    total = direct(words[:head], first)
    if rows:
        columns = words[head: head + rows * m].view(rows, m).sum(0, dtype=torch.int64)
        weight = torch.arange(1, m + 1, device=device)
        total = total + (columns * weight).sum() + 32768 * rows * (m * (m + 1) // 2)
    return total + direct(words[head + rows * m:], first + head + rows * m)


def file_checksum(head: bytes, data: torch.Tensor) -> int:
    """``blob_checksum`` of the file ``head`` + ``data`` (uint8, on any device), computed where
    ``data`` lies."""
    head_words = torch.frombuffer(bytearray(head), dtype=torch.int16)
    return int(word_sum(head_words, 0)) + int(word_sum(data.view(torch.int16), len(head) // 2))


# ------------------------------------------------------------------------------ the buffer rule


def slot_of(version: int) -> int:
    """The learner's buffer that holds adapter ``version``."""
    return version % 2


def may_write(last_in_slot: int | None, acknowledged: int) -> bool:
    """Whether the learner may overwrite a buffer whose last version is ``last_in_slot`` (None:
    never written) when the replica has acknowledged (holds) version ``acknowledged``: only
    once the replica has moved past that version, so that it no longer reads it."""
    return last_in_slot is None or acknowledged > last_in_slot


# ------------------------------------------------------------------------------ what travels


@dataclass(frozen=True)
class DeviceAdapterPayload:
    """An adapter version whose bytes stay in the learner's device memory: what goes through
    Ray's object store, the registry and the replica's fetch instead of an AdapterPayload."""

    version: int
    config: dict[str, Any]
    checksum: int  # blob_checksum of layout.head + the buffer's data: the host path's number
    layout: BlobLayout
    buffer: tuple  # shared_base.tensor_handle of the learner's buffer (uint8, layout.data_nbytes)
    buffer_id: str  # the buffer's name, the same for every version written to it (the replica's cache key)
    device_uuid: str | None  # None: host memory (the CPU)
    ack: tuple  # tensor_handle of the learner's AckWord
    ack_id: str
    exporter_pid: int

    def nbytes(self) -> int:
        return len(self.layout.head) + self.layout.data_nbytes


class AckWord:
    """One int64 in shared host memory: the version the replica holds, written by the replica
    after each load of a device payload, read by the learner before it writes a buffer."""

    def __init__(self, word: torch.Tensor):
        self.word = word

    @classmethod
    def create(cls) -> "AckWord":
        return cls(torch.zeros(1, dtype=torch.int64))

    def read(self) -> int:
        return int(self.word[0])

    def write(self, version: int) -> None:
        self.word[0] = version


class DeviceExporter:
    """The learner's side: two buffers on its device, the ack word, and the rule between them."""

    def __init__(self, device: torch.device | str):
        self.device = torch.device(device)
        self.ack = AckWord.create()
        self.ack_handle = tensor_handle(self.ack.word)
        self.name = f"{os.getpid()}-{uuidlib.uuid4().hex[:8]}"
        self.buffers: list[tuple[torch.Tensor, tuple, str] | None] = [None, None]
        self.written: list[int | None] = [None, None]  # version last written to each buffer

    def refusal(self, version: int) -> str | None:
        """Why ``version`` cannot be written now (None: it can)."""
        slot = slot_of(version)
        acked = self.ack.read()
        if may_write(self.written[slot], acked):
            return None
        return (f"buffer {slot} still holds v{self.written[slot]} and the replica has acknowledged v{acked}, "
                f"not a newer one")

    def export(self, state: Mapping[str, torch.Tensor], version: int, config: dict[str, Any],
               metadata: Mapping[str, str] | None = None, dtype: torch.dtype | None = None) -> DeviceAdapterPayload:
        """Write ``state`` (cast to ``dtype`` when given) to buffer ``slot_of(version)`` and
        describe it; TransportRefused when the buffer rule forbids it."""
        why = self.refusal(version)
        if why is not None:
            raise TransportRefused(why)
        layout = blob_layout({n: (tuple(t.shape), dtype or t.dtype) for n, t in state.items()}, metadata)
        slot = slot_of(version)
        held = self.buffers[slot]
        if held is None or held[0].numel() != layout.data_nbytes:  # the first, or a new shape: a new buffer
            data = torch.empty(layout.data_nbytes, dtype=torch.uint8, device=self.device)
            held = self.buffers[slot] = (data, tensor_handle(data), f"{self.name}-{slot}-{version}")
        data, handle, buffer_id = held
        self.written[slot] = version  # before the write: a failed write leaves the rule conservative
        fill_data(layout, {n: t.to(self.device) for n, t in state.items()}, data)
        checksum = file_checksum(layout.head, data)  # on the device: a few kernels on a GPU
        return DeviceAdapterPayload(version=version, config=config, checksum=checksum, layout=layout, buffer=handle,
                                    buffer_id=buffer_id, device_uuid=device_uuid(self.device), ack=self.ack_handle,
                                    ack_id=self.name, exporter_pid=os.getpid())


# ------------------------------------------------------------------------------ the replica's side


@dataclass
class ImportedAdapter:
    """A device payload as the replica holds it after the check: the data section in memory of
    its own, on the learner's device."""

    version: int
    config: dict[str, Any]
    checksum: int
    layout: BlobLayout
    data: torch.Tensor  # uint8, the replica's copy

    def tensors(self) -> dict[str, torch.Tensor]:
        """The adapter's tensors (peft names) as views of the replica's copy."""
        return self.layout.views(self.data)

    def payload(self) -> AdapterPayload:
        """The host path's payload, the same bytes: for engines that load adapters from files."""
        import numpy as np

        blob = np.empty(len(self.layout.head) + self.layout.data_nbytes, dtype=np.uint8)
        blob[: len(self.layout.head)] = np.frombuffer(self.layout.head, dtype=np.uint8)
        blob[len(self.layout.head):] = self.data.cpu().numpy()
        return AdapterPayload(version=self.version, safetensors=blob, config=self.config, checksum=self.checksum)


@dataclass
class DeviceImporter:
    """The replica's side: the learner's buffers and ack words, each mapped once (by id)."""

    mapped: dict[str, torch.Tensor] = field(default_factory=dict)
    acks: dict[str, AckWord] = field(default_factory=dict)

    def where(self, payload: DeviceAdapterPayload) -> int | None:
        """This process's index of the payload's GPU (None: host memory); TransportRefused when
        it cannot reach it."""
        if payload.device_uuid is None:
            return None
        index = cuda_index_of(payload.device_uuid)
        if index is None:
            raise TransportRefused(f"adapter v{payload.version} is in GPU {payload.device_uuid}'s memory, which this "
                                   "process cannot see")
        return index

    def open(self, payload: DeviceAdapterPayload) -> ImportedAdapter:
        """Copy the learner's buffer and check it: AdapterChecksumError when the copy is not the
        adapter the learner described (overwritten meanwhile, or corrupt)."""
        index = self.where(payload)
        for stale in [k for k in self.mapped if not k.startswith(payload.ack_id)]:  # a learner that was replaced
            del self.mapped[stale]
        buffer = self.mapped.get(payload.buffer_id)
        if buffer is None:
            buffer = self.mapped[payload.buffer_id] = open_handle(payload.buffer, index)
        if buffer.numel() != payload.layout.data_nbytes:
            raise AdapterChecksumError(f"adapter v{payload.version}: the learner's buffer holds {buffer.numel()} bytes, "
                                       f"its layout {payload.layout.data_nbytes}")
        data = buffer.clone()  # ours: the check below is on exactly the bytes then used
        got = file_checksum(payload.layout.head, data)
        if got != payload.checksum:
            raise AdapterChecksumError(f"adapter v{payload.version}: checksum {got} of the copy from the learner's "
                                       f"buffer, {payload.checksum} when the learner wrote it (the buffer was "
                                       "rewritten or corrupted)")
        return ImportedAdapter(version=payload.version, config=payload.config, checksum=payload.checksum,
                               layout=payload.layout, data=data)

    def acknowledge(self, payload: DeviceAdapterPayload, version: int) -> None:
        """Tell the payload's learner that this replica now holds ``version``."""
        ack = self.acks.get(payload.ack_id)
        if ack is None:
            ack = self.acks[payload.ack_id] = AckWord(open_handle(payload.ack))
        ack.write(version)


# ------------------------------------------------------------------------------ which transport

def transport_choice(requested: str, base_weights: dict[str, Any], owner: str | None, on_gpu: bool) -> dict[str, str]:
    """How the learner hands its adapters to the replica: {"mode": "device"|"host", "reason"}.
    ``requested``: the run's adapter_transport (auto | host | device); ``base_weights``: the
    learner's (model/shared_base.py: "shared" means one device with the replica); ``owner``: the
    engine that lent the base. TransportRefused, in one line, where ``device`` cannot apply.

    ``auto`` takes ``device`` on a GPU for both engines that lend a base: the hf engine, and vLLM,
    whose merged-LoRA workers open the buffers themselves. vLLM's path ran on an H100 at Qwen3-4B
    4x8 (every step in device memory, versions and checksums checked per sample): the sync 0.12 s
    a step against 0.20 s through host memory (bench/results/gpu-2026-12-05-ec41379-h100)."""
    if requested == "host":
        return {"mode": "host", "reason": "adapter_transport=host"}
    if base_weights.get("mode") != "shared":
        why = f"the learner does not map the replica's base weights ({base_weights.get('reason', 'own copy')})"
        if requested == "device":
            raise TransportRefused(f"adapter_transport=device, but {why}")
        return {"mode": "host", "reason": why}
    if requested == "auto" and not on_gpu:
        return {"mode": "host", "reason": "adapter_transport=auto hands adapters over in GPU memory only (this run is "
                                          "on the CPU)"}
    return {"mode": "device", "reason": f"the learner maps the {owner} replica's base weights: one device"}
