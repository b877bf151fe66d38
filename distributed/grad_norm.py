"""Global gradient norm (and clipping) of a possibly tensor-parallel model, with fused foreach kernels.

A parameter sharded over an axis contributes its local sum of squares, summed over that axis (one
counted all-reduce per axis); a replicated parameter contributes once. Under FSDP (distributed/fsdp.py)
a gradient is a DTensor sharded over dp x cp: its local squares are summed over that axis too. Parallel
layers declare which of their parameters are sharded (`sharded_params`, a tuple of parameter names, and
`shard_axis`, the AxisGroup they are split over); everything else is replicated.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from distributed.collectives import all_reduce
from distributed.data_parallel import local
from utils.comm import Axis, AxisGroup, Grid


def _sum_of_squares(grads: list[torch.Tensor]) -> torch.Tensor:
    """Sum of squares (fp32) of many tensors, with one fused foreach norm kernel per dtype (half-precision
    gradients accumulate in fp32)."""
    total = None
    for group in _by_dtype(grads):
        low = group[0].dtype in (torch.float16, torch.bfloat16)
        norms = torch._foreach_norm(group, 2, dtype=torch.float32 if low else None)
        sq = torch.stack(norms).float().pow(2).sum()
        total = sq if total is None else total + sq
    return total


def _squares(model: nn.Module, skip: set[int], fsdp: AxisGroup) -> tuple[torch.Tensor | None, dict]:
    """Sum of squared gradients of replicated params, and of sharded ones per tuple of axes they are
    sharded over (tensor-parallel, and FSDP's dp x cp for DTensor gradients)."""
    groups: dict[tuple[str, ...], tuple[tuple[AxisGroup, ...], list[torch.Tensor]]] = {}
    seen = set(skip)
    for module in model.modules():
        names = getattr(module, "sharded_params", ())
        for name, p in module.named_parameters(recurse=False):
            if p.grad is None or id(p) in seen:
                continue
            seen.add(id(p))
            # plant: fsdp_norm_skips_shard_sum (next line)
            axes = ((fsdp,) if isinstance(p.grad, DTensor) else ()) + ((module.shard_axis,) if name in names else ())
            groups.setdefault(tuple(a.name for a in axes), (axes, []))[1].append(local(p.grad).detach())
    sums = {key: (axes, _sum_of_squares(grads)) for key, (axes, grads) in groups.items()}
    replicated = sums.pop((), (None, None))[1]
    return replicated, sums


def grad_norm(model: nn.Module, *, grid: Grid, skip: set[int] = frozenset()) -> torch.Tensor:
    """The L2 norm of the full (unsharded) gradient, identical on every rank. Under pipeline parallelism
    each pp rank holds other parameters: their squares are summed over pp; `skip` (parameter ids)
    leaves out copies another pp rank counts (a tied embedding's second copy)."""
    replicated, sharded = _squares(model, skip, grid.replicas)
    total = replicated if replicated is not None else torch.zeros((), device=grid.device)
    for axes, sq in sharded.values():
        for axis in axes:
            sq = all_reduce(sq, axis)
        total = total + sq
    return all_reduce(total, grid.axis(Axis.PP)).sqrt()


def clip_grad_norm(model: nn.Module, *, grid: Grid, max_norm: float, skip: set[int] = frozenset()) -> torch.Tensor:
    """Scale gradients so the global norm is at most max_norm (0 = only measure); returns the norm."""
    norm = grad_norm(model, grid=grid, skip=skip)
    if max_norm > 0:
        scale = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        grads = [local(p.grad) for p in model.parameters() if p.grad is not None]
        for group in _by_dtype(grads):
            torch._foreach_mul_(group, scale)  # one fused kernel per dtype, no host sync
    return norm


def _by_dtype(tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    groups: dict[tuple, list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.dtype, t.device), []).append(t)
    return list(groups.values())
