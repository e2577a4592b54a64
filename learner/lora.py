"""The trainable policy: a frozen base model with a peft LoRA adapter.

Init pinning: the LoRA A matrices are drawn from torch's global RNG inside get_peft_model, so
the seed is set RIGHT BEFORE it: the same seed gives a byte-identical adapter file (and sha256),
whatever was drawn earlier in the process. ``init_adapter`` (a saved adapter dir) replaces the
random init whatever the seed. The reference policy of the KL leash is the same model under
``model.disable_adapter()``: no second copy of the base weights.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch

from model.adapter_dir import CONFIG_FILE, WEIGHTS_FILE, canonical_config, check_adapter_fits
from model.adapter import AdapterPayload
from model.adapter_ipc import ST_DTYPES, blob_layout, word_sum  # noqa: F401 (word_sum: learner.lora's name too)



def load_base_model(model_cfg, device: torch.device | str = "cpu"):
    """The frozen base model from a config.rollout.ModelConfig (local dir via resolve_model)."""
    from model.base import load_causal_lm, resolve_model

    # model.load_format=dummy: the random weights an hf engine draws too (a run shares the
    # replica's instead: config/run.py; tests compare the two)
    model = load_causal_lm(resolve_model(model_cfg), model_cfg)
    model.config.use_cache = False
    for p in model.parameters():
        p.requires_grad_(False)
    return model.to(device)


def peft_lora_config(lora_cfg):
    """peft.LoraConfig from config.learner.LoraConfig ('all-linear' excludes the output head)."""
    from peft import LoraConfig as PeftLoraConfig

    targets = lora_cfg.target_modules
    return PeftLoraConfig(
        r=lora_cfg.r,
        lora_alpha=lora_cfg.alpha,
        lora_dropout=lora_cfg.dropout,
        target_modules=targets if isinstance(targets, str) else list(targets),
        bias="none",
        task_type="CAUSAL_LM",
    )


def attach_lora(base, lora_cfg, seed: int, init_adapter: Path | None = None):
    """Wrap ``base`` in a trainable PeftModel: seeded fresh init, or weights from ``init_adapter``
    (whose own adapter_config — rank, alpha, targets — then applies, not ``lora_cfg``)."""
    from peft import PeftModel, get_peft_model

    if init_adapter is not None:
        init_adapter = Path(init_adapter)
        if not (init_adapter / WEIGHTS_FILE).is_file():
            raise FileNotFoundError(f"init adapter {init_adapter} has no {WEIGHTS_FILE}")
        model = PeftModel.from_pretrained(base, str(init_adapter), is_trainable=True)
        check_adapter_fits(model, init_adapter / WEIGHTS_FILE, f"init adapter {init_adapter}")
        return model
    torch.manual_seed(seed)  # seed first, then build: the A init draws from this RNG
    return get_peft_model(base, peft_lora_config(lora_cfg))


def adapter_state_dict(peft_model, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """The adapter's tensors under peft's saved names (what save_pretrained writes), on CPU;
    cast to ``dtype`` (on their device, before the copy) when given."""
    from peft import get_peft_model_state_dict

    state = get_peft_model_state_dict(peft_model)
    if dtype is not None:
        state = {k: v.detach().to(dtype) for k, v in state.items()}
    return to_cpu_at_once(state)


def disable_lora_input_casts(peft_model) -> None:
    """Stop peft casting each LoRA layer's input to the adapter's float32. Under autocast the
    matmul casts it straight back to the autocast dtype, so the detour is two copies of every
    adapted layer's input and changes nothing (peft.helpers.disable_input_dtype_casting, kept)."""
    from peft.tuners.lora import LoraLayer

    for module in peft_model.modules():
        if isinstance(module, LoraLayer):
            module.cast_input_dtype_enabled = False


def to_cpu_at_once(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The tensors on CPU, with ONE device-to-host copy per dtype for those on a GPU: a copy per
    tensor is a synchronising transfer each (hundreds per adapter: 2 per adapted layer)."""
    out = {k: v.detach() for k, v in state.items()}
    out.update(copy_flat({k: v for k, v in out.items() if v.device.type != "cpu"}, "cpu"))
    return {k: v.contiguous() for k, v in out.items()}


def copy_flat(tensors: dict[str, torch.Tensor], device: str) -> dict[str, torch.Tensor]:
    """`tensors` copied to `device` through one flat buffer per dtype (one transfer each); the
    slices are cloned there, since safetensors refuses tensors that share storage."""
    by_dtype: dict[torch.dtype, list[str]] = {}
    for k, v in tensors.items():
        by_dtype.setdefault(v.dtype, []).append(k)
    out = {}
    for keys in by_dtype.values():
        flat = torch.cat([tensors[k].reshape(-1) for k in keys]).to(device)
        for k, part in zip(keys, flat.split([tensors[k].numel() for k in keys])):
            out[k] = part.view(tensors[k].shape).clone()
    return out


def adapter_config_dict(peft_model) -> dict:
    """adapter_config.json content, JSON-safe (peft keeps target_modules as a set)."""
    cfg = peft_model.peft_config["default"].to_dict()
    return json.loads(json.dumps(cfg, default=lambda o: sorted(o) if isinstance(o, set) else str(o)))


def safetensors_blob(state: dict[str, torch.Tensor], metadata: dict[str, str] | None = None,
                     dtype: torch.dtype | None = None):
    """The safetensors file of ``state`` (cast to ``dtype`` when given) as ONE contiguous uint8
    numpy array, laid out as safetensors.torch.save writes it: an 8-byte header length, a JSON
    header of dtype, shape and byte range per tensor, then the raw data (model/adapter_ipc.py
    ``blob_layout``, which the device transport shares); and the file's checksum
    (model/adapter.py ``blob_checksum``), computed where the data lies. Read back by safetensors
    itself (tests/test_learner_lora.py).

    Why not safetensors' own save: it clones every tensor on the host and refuses views of one
    buffer. Here, per dtype, the tensors are concatenated where they live and cast there in one
    kernel each (not one cast per tensor: 504 for the 4B r=32 adapter), and the data crosses to
    the host in ONE copy straight into the array, which is page-locked when the tensors are on
    a GPU (a pageable copy of 126 MiB goes through a bounce buffer at a fraction of the speed).
    The array is what the payload carries: Ray's object store takes it without pickling copies.
    """
    layout = blob_layout({n: (tuple(t.shape), dtype or t.dtype) for n, t in state.items()}, metadata)
    devices = {t.device for t in state.values()}
    pin = any(d.type == "cuda" for d in devices) and torch.cuda.is_available()
    out = torch.empty(len(layout.head) + layout.data_nbytes, dtype=torch.uint8, pin_memory=pin)
    head = torch.frombuffer(bytearray(layout.head), dtype=torch.uint8)
    out[: len(layout.head)] = head
    sums = [word_sum(head.view(torch.int16), 0)]
    pos = len(layout.head)
    for dt, names in layout.groups:
        d = ST_DTYPES[dt]
        flat = torch.cat([state[n].detach().reshape(-1) for n in names]).to(d)
        nbytes = flat.numel() * d.itemsize
        sums.append(word_sum(flat.view(torch.int16), pos // 2))  # where the tensors are: a few kernels on a GPU
        out[pos : pos + nbytes].view(d).copy_(flat)
        pos += nbytes
    return out.numpy(), int(sum(int(x) for x in sums))


def safetensors_bytes(state: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> bytes:
    """``safetensors_blob`` as a ``bytes`` object (what safetensors.torch.load takes)."""
    return safetensors_blob(state, metadata)[0].tobytes()


def adapter_payload(peft_model, version: int, dtype: torch.dtype | None = None,
                    state: dict[str, torch.Tensor] | None = None) -> AdapterPayload:
    """The adapter as the engines get it; ``dtype`` casts it on its device first (the payload's
    bytes: ``safetensors_blob``). ``state``: its tensors when the model holds only shards of
    them (learner/fsdp.py gathers them whole), else read from the model."""
    from peft import get_peft_model_state_dict

    if state is None:
        state = get_peft_model_state_dict(peft_model)
    blob, checksum = safetensors_blob(state, metadata={"format": "pt"}, dtype=dtype)
    return AdapterPayload(version=version, safetensors=blob, config=adapter_config_dict(peft_model),
                          checksum=checksum)


def adapter_device_payload(peft_model, version: int, exporter, dtype: torch.dtype | None = None):
    """The adapter left in ``exporter``'s device buffer (model/adapter_ipc.py DeviceExporter): the
    same file as ``adapter_payload`` makes, described by a DeviceAdapterPayload. TransportRefused
    when the buffer rule forbids writing ``version`` now."""
    from peft import get_peft_model_state_dict

    state = get_peft_model_state_dict(peft_model)
    return exporter.export(state, version, adapter_config_dict(peft_model), metadata={"format": "pt"}, dtype=dtype)


class AdapterExport:
    """How this learner hands its adapters over: in host memory (``adapter_payload``) or in its
    device memory (``adapter_device_payload``) where ``transport`` (model/adapter_ipc.py
    ``transport_choice``) says so. A version the buffer rule refuses goes the host way, and the
    reason is kept (``fallbacks``, ``last_fallback``)."""

    def __init__(self, transport: dict[str, str], device: torch.device | str):
        from model.adapter_ipc import DeviceExporter

        self.transport = transport
        self.exporter = DeviceExporter(device) if transport["mode"] == "device" else None
        self.fallbacks, self.last_fallback = 0, None

    def payload(self, peft_model, version: int, dtype: torch.dtype | None = None,
                state: dict[str, torch.Tensor] | None = None):
        """``state``: the adapter's full tensors when the model holds only shards (learner/fsdp.py);
        the device transport never applies then (it needs the base shared, which FSDP2 is not)."""
        from model.adapter_ipc import TransportRefused

        if self.exporter is not None and state is None:
            try:
                return adapter_device_payload(peft_model, version, self.exporter, dtype)
            except TransportRefused as err:
                self.fallbacks, self.last_fallback = self.fallbacks + 1, f"v{version}: {err}"
        return adapter_payload(peft_model, version, dtype=dtype, state=state)

    def stats(self) -> dict:
        return {**self.transport, "host_fallbacks": self.fallbacks, "last_fallback": self.last_fallback}


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def save_adapter(peft_model, out_dir: Path, state: dict[str, torch.Tensor] | None = None) -> str:
    """peft save_pretrained (safetensors) into out_dir; returns the sha256 of the weights file.

    adapter_config.json is rewritten with its module-name sets sorted (peft writes them in set
    order, which changes with PYTHONHASHSEED), in peft's own layout: the same adapter gives the
    same bytes in every process. ``state``: the adapter's full tensors under peft's saved names
    when the model holds only shards of them (learner/fsdp.py).
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if state is None:
        peft_model.save_pretrained(str(out_dir), safe_serialization=True)
    else:  # peft's own file, written from the tensors given (no second gather)
        peft_model.save_pretrained(str(out_dir), safe_serialization=True, state_dict=state)
    config_file = out_dir / CONFIG_FILE
    config = canonical_config(json.loads(config_file.read_text()))
    config_file.write_text(json.dumps(config, indent=2, sort_keys=True))
    return sha256_file(out_dir / WEIGHTS_FILE)

