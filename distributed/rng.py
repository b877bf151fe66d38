"""Dropout on sharded activations: one random stream per shard (Megatron's RNG tracker, reworked).

Every rank's default generator is seeded per part of the batch (`grid.batch`) and pipeline rank
(`utils.engine.build.build_model`), so the ranks of a tp or cp group draw the same numbers. That is right for an
activation replicated over the group (the embedding dropout, the dropout after a row-parallel linear
without sequence parallelism): every rank must apply the same mask, or the replicas drift apart. It
is wrong for a sharded one (attention heads split over tp, the sequence split under sequence
parallelism): there the ranks would reuse one mask on different heads or tokens, where the serial
model draws an independent mask for each.

`sharded_stream(axes)` gives each shard its own stream. It draws one number from the default stream
(the same number on every rank of the group, so the default stream stays in agreement), then runs the
block under a forked generator seeded from (that number, this rank's coordinate on `axes`). Megatron
keeps a separate tracked generator state instead; deriving the fork from the default stream means
that (a) activation checkpointing's recompute, which restores the default stream, draws the same
masks again, and (b) the RNG state a checkpoint already saves covers the forks: nothing more to save.

Cost: one CPU draw and a generator reseed per sharded dropout call (microseconds), only where
dropout > 0 and the activation is sharded. Under torch.compile the fork is a graph break.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from utils.comm import Axis, AxisGroup, Grid


def seed_default_stream(seed: int, grid: Grid, step: int = 0) -> int:
    """Seed the default stream (torch and Python's `random`) for dropout, distinct per rank of
    `grid.batch` (other samples) and pipeline rank and shared by the tp and cp ranks of a replica: at
    step 0 after setup, and at `step` when a checkpoint of another layout is resumed (its per-rank states
    do not map onto this one's). Returns the seed."""
    replica = grid.batch.rank + grid.batch.size * grid.rank(Axis.PP)
    value = seed * 1_000_003 + 1 + replica + step * 2**32
    torch.manual_seed(value)
    random.seed(value)
    return value


_KEY_SPAN = 2**48  # fork keys are drawn below this: key * shards + index fits a 64-bit seed up to 65536 shards


def coordinate(axes: tuple[AxisGroup, ...]) -> tuple[int, int]:
    """(this rank's index, count) in the product of `axes`: distinct for every shard of an activation."""
    index, count = 0, 1
    for axis in axes:
        index, count = index * axis.size + axis.rank, count * axis.size
    return index, count


@contextmanager
def sharded_stream(axes: tuple[AxisGroup, ...]) -> Iterator[None]:
    """Run the body on a generator private to this rank's shard over `axes`; the default stream advances
    by one draw, alike on every rank of the group."""
    key = int(torch.randint(_KEY_SPAN, ()))  # from the default CPU stream
    index, count = coordinate(axes)
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() and torch.cuda.is_initialized() else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(key * count + index)
        yield


class ShardedRandom(nn.Module):
    """Runs `inner` (an nn.Dropout, or an attention core with dropout) on a stream per shard over `axes`.

    Has no parameters or buffers of its own. In eval mode, or with `inner` free of randomness, it
    calls `inner` directly.
    """

    def __init__(self, inner: nn.Module, axes: tuple[AxisGroup, ...]):
        super().__init__()
        self.inner, self.axes = inner, axes

    def forward(self, *args):
        if not self.training:
            return self.inner(*args)
        with sharded_stream(self.axes):
            return self.inner(*args)


def dropout_probability(module: nn.Module) -> float:
    """The dropout probability of an nn.Dropout or of an attention core with a `dropout` attribute."""
    return float(module.p if isinstance(module, nn.Dropout) else getattr(module, "dropout", 0.0))


def per_shard(module: nn.Module, axes: tuple[AxisGroup, ...]) -> nn.Module:
    """`module` wrapped in ShardedRandom when it drops anything and `axes` shard it; else `module`."""
    if dropout_probability(module) == 0 or coordinate(axes)[1] == 1 or isinstance(module, ShardedRandom):
        return module
    return ShardedRandom(module, axes)


def rng_tensors(prefix: str) -> dict[str, torch.Tensor]:
    """This process's RNG states as tensors (torch, CUDA, Python's `random`) under `prefix`, for checkpoints."""
    version, state, gauss = random.getstate()
    tensors = {f"{prefix}torch": torch.get_rng_state(), f"{prefix}python": torch.tensor(state, dtype=torch.int64)}
    if torch.cuda.is_available():
        tensors[f"{prefix}cuda"] = torch.cuda.get_rng_state()
    return tensors


def set_rng_tensors(tensors: dict[str, torch.Tensor], prefix: str) -> None:
    torch.set_rng_state(tensors[f"{prefix}torch"])
    random.setstate((3, tuple(int(v) for v in tensors[f"{prefix}python"]), None))
    if f"{prefix}cuda" in tensors and torch.cuda.is_available():
        torch.cuda.set_rng_state(tensors[f"{prefix}cuda"])
