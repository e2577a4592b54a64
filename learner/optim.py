"""AdamW over the trainable (LoRA) parameters and the LR schedule, with an honest resume.

Schedule, as a factor of the configured peak ``lr`` for optimizer step k (0-based: k steps
already taken): warmup ``(k + 1) / warmup_steps`` for k < warmup_steps (the first step already
moves, unlike a warmup from exactly 0), then with p = (k - warmup) / max(1, total - warmup):
constant 1, linear 1 - p, cosine (1 + cos(pi p)) / 2 (both floored at 0).

Resume: a scheduler's state carries its own base LR. If that disagrees with the config, the
config wins (``rebase_lr``) and the caller says so, or the run is refused; never silently the
checkpoint's value.
"""

from __future__ import annotations

import math

import torch


def lr_factor(step: int, schedule: str, warmup_steps: int, total_steps: int) -> float:
    """Multiplier of the peak LR at optimizer step ``step`` (0-based)."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    if schedule == "linear":
        return max(0.0, 1.0 - progress)
    if schedule == "cosine":
        return max(0.0, 0.5 * (1.0 + math.cos(math.pi * progress)))
    raise ValueError(f"unknown lr_schedule {schedule!r}; one of constant, linear, cosine")


def build_optimizer(params, cfg) -> torch.optim.AdamW:
    """AdamW from a LearnerConfig over the given (trainable) parameters; its fused CUDA kernel
    when ``cfg.fused_optimizer`` and every parameter is on a GPU (build after moving the model)."""
    trainable = [p for p in params if p.requires_grad]
    if not trainable:
        raise ValueError("no trainable parameters: the LoRA adapter was not attached")
    fused = use_fused(trainable, cfg.fused_optimizer)
    return torch.optim.AdamW(
        trainable, lr=cfg.lr, betas=tuple(cfg.betas), weight_decay=cfg.weight_decay, fused=fused or None
    )


def use_fused(params, wanted: bool) -> bool:
    """Fused AdamW needs floating-point CUDA tensors throughout; elsewhere the default applies."""
    return wanted and all(p.is_cuda and p.is_floating_point() for p in params)


def build_scheduler(optimizer, cfg, total_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda k: lr_factor(k, cfg.lr_schedule, cfg.warmup_steps, total_steps),
    )


def scheduler_base_lr(scheduler: torch.optim.lr_scheduler.LRScheduler) -> float:
    return float(scheduler.base_lrs[0])


def rebase_lr(optimizer, scheduler, lr: float) -> None:
    """Make ``lr`` the peak LR of a (loaded) optimizer + scheduler, keeping the step count."""
    scheduler.base_lrs = [lr for _ in scheduler.base_lrs]
    for group in optimizer.param_groups:
        group["initial_lr"] = lr
    factors = [lam(scheduler.last_epoch) for lam in scheduler.lr_lambdas]
    for group, factor in zip(optimizer.param_groups, factors):
        group["lr"] = lr * factor
    scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]


def lr_mismatch_note(checkpoint_lr: float, config_lr: float) -> str:
    return f"checkpoint lr {checkpoint_lr:g}, config lr {config_lr:g}: re-based on config"


def lr_mismatch_refusal(checkpoint_lr: float, config_lr: float) -> str:
    return (
        f"checkpoint lr {checkpoint_lr:g} differs from config lr {config_lr:g} and "
        "learner.on_lr_mismatch='refuse': not resuming (set learner.lr to the checkpoint's value "
        "or on_lr_mismatch='rebase')"
    )
