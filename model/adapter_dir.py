"""AdapterPayload <-> peft adapter directory. Pure file handling (safetensors + json), no torch.

The learner publishes a payload per step; engines write it to a private temp dir and load it
from there (vLLM and peft both load adapters from a directory).
"""

from __future__ import annotations

import json
from pathlib import Path

from model.adapter import AdapterMismatch, AdapterPayload, adapter_fit_problem

WEIGHTS_FILE = "adapter_model.safetensors"
CONFIG_FILE = "adapter_config.json"


# peft holds these as sets and writes them in set order, which changes with PYTHONHASHSEED:
# identical adapters would get different adapter_config.json bytes. Their order means nothing
# (peft turns a list into a set), so they are written sorted.
SET_VALUED_KEYS = ("target_modules", "exclude_modules")


class AdapterError(ValueError):
    """A payload or adapter directory that cannot be served."""


def canonical_config(config: dict) -> dict:
    """adapter_config with the module-name sets as sorted lists (same adapter, same bytes)."""
    return {k: sorted(v) if k in SET_VALUED_KEYS and isinstance(v, (list, set, tuple)) else v
            for k, v in config.items()}


def payload_from_dir(adapter_dir: Path | str, version: int) -> AdapterPayload:
    """Read a peft adapter directory (adapter_model.safetensors + adapter_config.json)."""
    adapter_dir = Path(adapter_dir)
    weights, config = adapter_dir / WEIGHTS_FILE, adapter_dir / CONFIG_FILE
    for f in (weights, config):
        if not f.is_file():
            raise AdapterError(f"adapter directory {adapter_dir} has no {f.name}")
    return AdapterPayload(
        version=version, safetensors=weights.read_bytes(),
        config=canonical_config(json.loads(config.read_text())),
    )


def write_payload(payload: AdapterPayload, adapter_dir: Path | str) -> Path:
    """Write a payload as a peft adapter directory; returns the directory."""
    validate_payload(payload)
    adapter_dir = Path(adapter_dir)
    adapter_dir.mkdir(parents=True, exist_ok=True)
    (adapter_dir / WEIGHTS_FILE).write_bytes(payload.view())
    (adapter_dir / CONFIG_FILE).write_text(json.dumps(canonical_config(payload.config), indent=1))
    return adapter_dir


def validate_payload(payload: AdapterPayload, max_rank: int | None = None) -> None:
    """Fail early, naming the problem, instead of deep inside an engine."""
    if payload.version < 1:
        raise AdapterError(f"adapter version must be >= 1 (0 is the base model), got {payload.version}")
    if payload.nbytes() == 0:
        raise AdapterError(f"adapter v{payload.version} has empty safetensors bytes")
    cfg = payload.config
    if cfg.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"adapter v{payload.version}: peft_type {cfg.get('peft_type')!r} is not LORA")
    if "r" not in cfg or "target_modules" not in cfg:
        raise AdapterError(f"adapter v{payload.version}: adapter_config lacks 'r' or 'target_modules'")
    if max_rank is not None and int(cfg["r"]) > max_rank:
        raise AdapterError(
            f"adapter v{payload.version} has rank {cfg['r']} > rollout.max_lora_rank {max_rank}"
        )


def check_adapter_fits(peft_model, weights: Path, what: str) -> None:
    """AdapterMismatch, naming ``what``, where the safetensors file ``weights`` did not fill the
    LoRA layers peft just built from it (model/adapter.py adapter_fit_problem: peft drops what does
    not match and keeps a fresh init instead, with a warning at most). Only the file's header is
    read; peft is imported by the caller already, which holds ``peft_model``."""
    from peft import get_peft_model_state_dict
    from safetensors import safe_open

    with safe_open(str(weights), framework="numpy") as f:
        given = set(f.keys())
    problem = adapter_fit_problem(given, get_peft_model_state_dict(peft_model).keys())
    if problem is not None:
        raise AdapterMismatch(f"{what}: {problem}")
