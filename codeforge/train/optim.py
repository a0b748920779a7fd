"""Optimizers and learning-rate schedules. Schedules are pure functions of the step."""

from __future__ import annotations

import math

import torch


def lr_at(step: int, *, base_lr: float, warmup: int, total: int, schedule: str = "cosine",
          min_ratio: float = 0.1, decay_fraction: float = 0.2) -> float:
    """Learning rate for optimizer step `step` (0-based) of `total`.

    Linear warm-up from base_lr/warmup to base_lr over `warmup` steps, then
      cosine:   half-cosine from base_lr down to the floor min_ratio * base_lr at `total`;
      linear:   straight line down to the floor;
      constant: base_lr;
      wsd:      warmup-stable-decay (Hu et al. 2024, MiniCPM): flat, then linear to the floor over the last
                decay_fraction of the run.
    """
    floor = base_lr * min_ratio
    if warmup > 0 and step < warmup:
        return base_lr * (step + 1) / warmup
    if schedule == "constant" or total <= warmup:
        return base_lr
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    if schedule == "cosine":
        return floor + (base_lr - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
    if schedule == "linear":
        return base_lr - (base_lr - floor) * progress
    if schedule == "wsd":
        decay_start = 1.0 - decay_fraction
        if progress < decay_start:
            return base_lr
        return base_lr - (base_lr - floor) * (progress - decay_start) / max(decay_fraction, 1e-12)
    raise ValueError(f"unknown schedule {schedule!r}")


def set_lr(opt: torch.optim.Optimizer, lr: float) -> None:
    """Every group's lr is the schedule's `lr` times the group's "lr_scale" (1 when absent): a model with
    per-module rates (models/hrm.py) keeps their ratios through warm-up and decay."""
    for g in opt.param_groups:
        g["lr"] = lr * g.get("lr_scale", 1.0)


def build_optimizer(model, name: str, lr: float, weight_decay: float, betas: tuple[float, float],
                    device: torch.device) -> torch.optim.Optimizer:
    """AdamW over the model's decay/no-decay groups; fused kernel on CUDA and CPU (one launch per step instead
    of one per tensor). adamw8bit: bitsandbytes' 8-bit AdamW, CUDA only (Dettmers et al. 2022)."""
    groups = model.optim_groups(weight_decay)
    if name == "adamw8bit":
        if device.type != "cuda":
            raise ValueError("optimizer adamw8bit needs a CUDA device and bitsandbytes; use --set optimizer=adamw")
        try:
            import bitsandbytes as bnb
        except ImportError as e:
            raise ValueError("optimizer adamw8bit needs bitsandbytes: pip install bitsandbytes") from e
        return bnb.optim.AdamW8bit(groups, lr=lr, betas=betas)
    fused = device.type in ("cuda", "cpu")
    return torch.optim.AdamW(groups, lr=lr, betas=betas, fused=fused)
