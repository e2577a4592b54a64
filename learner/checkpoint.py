"""Resumable learner state: ``checkpoints/step_<N>/``.

Layout: ``adapter/`` (peft dir), ``optimizer.pt``, ``scheduler.pt``, ``rng_rank<r>.pt`` (torch,
python, numpy; one per worker), ``state.json`` (step, the scheduler's peak LR, the adapter's
sha256, the orchestrator's opaque data position). Rank 0 writes everything but the other
ranks' RNG files; DDP keeps the adapter and optimizer identical on every rank. Under DeepSpeed
ZeRO-2 each rank holds only its partition of the optimizer state: ``deepspeed/`` then replaces
``optimizer.pt`` (DeepSpeed's own per-rank files, trainable parameters only), written and read
by the engine on every rank (``save``/``restore`` with ``deepspeed_engine``). Resuming with the
other learner than the one that saved is refused with a message naming what is missing. Under
FSDP2 (learner/fsdp.py) the adapter and the optimizer state are gathered whole on every rank
first (``adapter_state``, ``optimizer_state``) and rank 0 writes them in the plain layout, so an
FSDP2 checkpoint and a DDP one are the same files: either resumes under the other strategy or
another world size (each FSDP2 rank cuts its shards from the full ``optimizer.pt``).

The LR applied after a resume is the CONFIGURED one (``lr_decision``): a checkpoint whose peak
LR disagrees is re-based on the config with a note for the receipt, or refused.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch

from learner.lora import save_adapter
from learner.optim import lr_mismatch_note, lr_mismatch_refusal, scheduler_base_lr

STATE_FILE = "state.json"
OPTIMIZER_FILE = "optimizer.pt"
DEEPSPEED_DIR, DEEPSPEED_TAG = "deepspeed", "zero"


def checkpoint_dir(run_dir: Path, step: int) -> Path:
    return Path(run_dir) / "checkpoints" / f"step_{step}"


def read_state(ckpt: Path) -> dict[str, Any]:
    path = Path(ckpt) / STATE_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{ckpt} is not a learner checkpoint (no {STATE_FILE})")
    return json.loads(path.read_text())


def lr_decision(checkpoint_lr: float, config_lr: float, on_mismatch: str) -> str | None:
    """None when they agree; the rebase note when they differ; ValueError under 'refuse'."""
    if abs(checkpoint_lr - config_lr) <= 1e-12 * max(abs(config_lr), 1.0):
        return None
    if on_mismatch == "refuse":
        raise ValueError(lr_mismatch_refusal(checkpoint_lr, config_lr))
    return lr_mismatch_note(checkpoint_lr, config_lr)


def _rng_state() -> dict[str, Any]:
    return {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])


def save(
    ckpt: Path,
    *,
    rank: int,
    peft_model,
    optimizer,
    scheduler,
    step: int,
    data_position: dict[str, Any] | None,
    deepspeed_engine=None,
    adapter_state: dict[str, torch.Tensor] | None = None,
    optimizer_state: dict | None = None,
) -> str | None:
    """Write this rank's part; rank 0 returns the adapter sha256. With `deepspeed_engine` (a
    collective call: every rank must make it) the engine writes the optimizer partitions.
    ``adapter_state`` / ``optimizer_state``: what to write instead of reading the model and the
    optimizer (their gathered full tensors under FSDP2)."""
    ckpt = Path(ckpt)
    ckpt.mkdir(parents=True, exist_ok=True)
    if deepspeed_engine is not None:
        deepspeed_engine.save_checkpoint(str(ckpt / DEEPSPEED_DIR), tag=DEEPSPEED_TAG, exclude_frozen_parameters=True)
    torch.save(_rng_state(), ckpt / f"rng_rank{rank}.pt")
    if rank != 0:
        return None
    sha = save_adapter(peft_model, ckpt / "adapter", state=adapter_state)
    if deepspeed_engine is None:
        torch.save(optimizer_state if optimizer_state is not None else optimizer.state_dict(), ckpt / OPTIMIZER_FILE)
    torch.save(scheduler.state_dict(), ckpt / "scheduler.pt")
    state = {
        "step": step,
        "lr": scheduler_base_lr(scheduler),
        "adapter_sha256": sha,
        "data_position": data_position,
    }
    (ckpt / STATE_FILE).write_text(json.dumps(state, indent=2))
    return sha


def restore(ckpt: Path, *, rank: int, optimizer, scheduler, deepspeed_engine=None,
            sharded: bool = False) -> dict[str, Any]:
    """Load optimizer (with `deepspeed_engine`: the engine loads its partitions; ``sharded``:
    FSDP2, each rank its shards of the full state), scheduler and this rank's RNG (the adapter
    is loaded when the model is built). Returns state.json. The caller re-bases the LR on the
    config afterwards."""
    ckpt = Path(ckpt)
    state = read_state(ckpt)
    if deepspeed_engine is not None:
        if not (ckpt / DEEPSPEED_DIR / DEEPSPEED_TAG).is_dir():
            raise FileNotFoundError(f"{ckpt} holds no {DEEPSPEED_DIR}/{DEEPSPEED_TAG}/ optimizer partitions "
                                    "(a checkpoint of the plain learner? set learner.strategy=ddp)")
        loaded, _ = deepspeed_engine.load_checkpoint(str(ckpt / DEEPSPEED_DIR), tag=DEEPSPEED_TAG,
                                                     load_module_strict=False, load_optimizer_states=True,
                                                     load_lr_scheduler_states=False)
        if loaded is None:  # DeepSpeed only warns when it loads nothing
            raise RuntimeError(f"DeepSpeed loaded nothing from {ckpt / DEEPSPEED_DIR} (tag {DEEPSPEED_TAG})")
    elif not (ckpt / OPTIMIZER_FILE).is_file():
        raise FileNotFoundError(f"{ckpt} holds no {OPTIMIZER_FILE} (a DeepSpeed checkpoint? set learner.strategy=deepspeed)")
    elif sharded:
        from learner.fsdp import load_full_optimizer_state

        load_full_optimizer_state(optimizer, torch.load(ckpt / OPTIMIZER_FILE, weights_only=False))
    else:
        optimizer.load_state_dict(torch.load(ckpt / OPTIMIZER_FILE, weights_only=False))
    scheduler.load_state_dict(torch.load(ckpt / "scheduler.pt", weights_only=False))
    rng = ckpt / f"rng_rank{rank}.pt"
    if not rng.is_file():  # resumed with more workers than saved: seed-derived fallback
        rng = ckpt / "rng_rank0.pt"
    _set_rng_state(torch.load(rng, weights_only=False))
    return state
