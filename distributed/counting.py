"""Byte accounting of collectives: `record(axis, num_bytes)`, counted in eager code and compiled graphs alike.

Every collective in `distributed/` calls `record` with the bytes this rank sends, and the trainer logs
the per-axis totals as `comm/<axis>_bytes`. An `AxisGroup` (utils/comm/__init__.py) owns its counter: an int64
scalar tensor on the CPU. Kept on the CPU (not the device) so counting never syncs the device nor
launches a kernel, and inductor's CUDA graphs, which would replay on a copy of the input, skip graphs
that take a CPU tensor.

Eager code adds to the counter directly. Inside torch.compile the increment goes through the custom op
`dlscale::add_bytes`, so compiled blocks are counted as eager ones are, forward and compiled backward:

- The op declares no mutation on purpose: AOTAutograd would functionalize a declared one and compute a
  backward's increment from the counter value saved at forward time, then copy it back, losing what
  other blocks added in between. Compiled graphs save the counter for backward (with a version check
  under activation checkpointing), so every write goes through `.data` and leaves its version unchanged.
- An ORDERED effect threads the op through effect tokens: it is never dead-code-eliminated nor
  reordered, and the copy traced in an autograd.Function's backward runs in the compiled backward
  graph. The registration hook is private torch API (`torch._higher_order_ops.effects`, present in
  torch 2.13). Without it eager counting is unchanged, but compiled graphs may drop the op and
  undercount comm/<axis>_bytes under precision.compile=true; tests/test_comm_compile.py checks it.
"""

from __future__ import annotations

import torch

from utils.comm import AxisGroup


@torch.library.custom_op("dlscale::add_bytes", mutates_args=())
def _add_bytes(counter: torch.Tensor, num_bytes: int) -> None:
    """counter += num_bytes, leaving the counter's version alone (see the module docstring)."""
    counter.data.add_(num_bytes)


@_add_bytes.register_fake
def _(counter: torch.Tensor, num_bytes: int) -> None:
    return None


try:  # private API: see the module docstring for what is lost without it
    from torch._higher_order_ops.effects import _EffectType, _register_effectful_op

    _register_effectful_op(torch.ops.dlscale.add_bytes.default, _EffectType.ORDERED)
except ImportError:  # pragma: no cover - a torch without the hook
    pass


_count_compiled = True  # whether graphs compiled from now on count (see `count_compiled`)


def count_compiled(enabled: bool) -> None:
    """Whether compiled graphs count their collectives. The custom op costs tens of microseconds per call
    inside a graph (its effect token keeps it ordered), so the trainer counts only the steps whose
    comm/<axis>_bytes it logs. torch.compile guards on this flag: each setting gets its own graph,
    compiled once, and switching between them costs a guard check. Eager code always counts (a plain
    add of a few microseconds)."""
    global _count_compiled
    _count_compiled = enabled


def record(axis: AxisGroup, num_bytes: int) -> None:
    """Add `num_bytes` (an int, or a SymInt under dynamic shapes) to `axis`'s counter; traceable."""
    if torch.compiler.is_compiling():
        if _count_compiled:
            _add_bytes(axis.counter, num_bytes)
    else:
        axis.counter.data.add_(num_bytes)  # eager: a plain add, no custom-op dispatch per call
