"""Optimizer and learning-rate schedule: the `optim=` schema and their builders."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from utils import require

OPTIMIZERS = ("adam", "adamw")
SCHEDULES = ("cosine", "constant")


@dataclass
class OptimConfig:
    """Schema of `optim=`: optimizer, learning rate and its schedule."""

    name: str = "adam"  # adam | adamw (decoupled weight decay)
    lr: float = 5e-4  # peak learning rate (after warmup)
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])  # Adam (beta1, beta2)
    eps: float = 1e-8  # Adam epsilon
    weight_decay: float = 0.0  # L2 (adam) or decoupled (adamw) weight decay
    schedule: str = "cosine"  # cosine | constant, after warmup
    warmup_steps: int = 0  # linear warmup from 0 to lr over this many steps
    min_lr_ratio: float = 0.0  # cosine floor as a fraction of lr
    grad_clip: float = 0.0  # clip the global gradient norm to this value; 0 = no clipping
    fused: bool = True  # fused Adam kernels (CPU and GPU; skips a non-finite step on the device), else foreach

    def __post_init__(self):
        require(self.name in OPTIMIZERS, f"unknown optimizer '{self.name}'", "optim.name",
                f"choose one of {OPTIMIZERS}")
        require(self.schedule in SCHEDULES, f"unknown schedule '{self.schedule}'", "optim.schedule",
                f"choose one of {SCHEDULES}")
        require(self.lr > 0, f"lr must be positive, got {self.lr}", "optim.lr", "set a positive learning rate")
        require(len(self.betas) == 2 and all(0 <= b < 1 for b in self.betas), f"bad betas {self.betas}",
                "optim.betas", "give two values in [0, 1), e.g. [0.9,0.95]")
        require(self.warmup_steps >= 0, "warmup_steps must be >= 0", "optim.warmup_steps", "set 0 or more")
        require(self.grad_clip >= 0, "grad_clip must be >= 0", "optim.grad_clip", "set 0 (off) or a positive norm")


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
