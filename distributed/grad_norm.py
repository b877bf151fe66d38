"""Global gradient norm (and clipping) of a possibly tensor-parallel model.

A parameter sharded over an axis contributes its local sum of squares, summed over that axis; a
replicated parameter contributes once. Parallel layers declare which of their parameters are sharded
(`sharded_params`, a tuple of parameter names, and `shard_axis`); everything else is replicated.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from utils.comm import Grid


def _squares(model: nn.Module) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Sum of squared gradients of replicated params, and of sharded params per shard axis."""
    replicated, sharded, seen = None, {}, set()
    for module in model.modules():
        names = getattr(module, "sharded_params", ())
        for name, p in module.named_parameters(recurse=False):
            if p.grad is None or id(p) in seen:
                continue
            seen.add(id(p))
            sq = p.grad.detach().float().pow(2).sum()
            if name in names:
                axis = str(module.shard_axis)
                sharded[axis] = sq if axis not in sharded else sharded[axis] + sq
            else:
                replicated = sq if replicated is None else replicated + sq
    return replicated, sharded


def grad_norm(model: nn.Module, *, grid: Grid) -> torch.Tensor:
    """The L2 norm of the full (unsharded) gradient, identical on every rank."""
    replicated, sharded = _squares(model)
    total = replicated if replicated is not None else torch.zeros((), device=grid.device)
    for axis, sq in sharded.items():
        group = grid.axis(axis)
        if group.size > 1:
            dist.all_reduce(sq, group=group.group)
        total = total + sq
    return total.sqrt()


def clip_grad_norm(model: nn.Module, *, grid: Grid, max_norm: float) -> torch.Tensor:
    """Scale gradients so the global norm is at most max_norm (0 = only measure); returns the norm."""
    norm = grad_norm(model, grid=grid)
    if max_norm > 0:
        scale = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        for p in model.parameters():
            if p.grad is not None:
                p.grad.mul_(scale)
    return norm
