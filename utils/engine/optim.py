"""Optimizer and learning-rate schedule built from the `optim=` schema (utils/schema.py `OptimConfig`)."""

from __future__ import annotations

import math

import torch

from utils.schema import OptimConfig


def build_optimizer(cfg: OptimConfig, params) -> torch.optim.Optimizer:
    """Adam/AdamW over `params`: fused kernels (one per dtype and device; on the CPU too, faster
    than foreach there: docs/measurements.md), or foreach with optim.fused=false. Fused Adam also takes the
    trainer's non-finite verdict on the device (`Trainer.step_optimizer`), so a step never waits to decide
    whether to update."""
    cls = torch.optim.AdamW if cfg.name == "adamw" else torch.optim.Adam
    kernel = {"fused": True} if cfg.fused else {"foreach": True}
    return cls(params, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, weight_decay=cfg.weight_decay, **kernel)


def lr_factor(step: int, cfg: OptimConfig, max_steps: int) -> float:
    """Multiplier of the peak lr at `step`: linear warmup, then cosine (or constant) decay."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    if cfg.schedule == "constant":
        return 1.0
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, max_steps - cfg.warmup_steps))
    return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def build_scheduler(cfg: OptimConfig, optimizer, max_steps: int, step: int = 0) -> torch.optim.lr_scheduler.LambdaLR:
    """The lr schedule positioned at `step`. The schedule is a function of the step alone (and of the optim
    settings a resume must keep), so a resumed run builds it at its step instead of loading its state:
    torch's `last_epoch` argument, with each group's `initial_lr` the peak lr (set by the first build)."""
    for group in optimizer.param_groups:
        group.setdefault("initial_lr", cfg.lr)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, cfg, max_steps), last_epoch=step - 1)
