"""What FSDP2 (`parallel.dp_mode=fsdp`, distributed/fsdp.py) adds to a planned step: its collectives' bytes
and the units it gathers.

Bytes: FSDP2's all-gathers and reduce-scatters are torch's own (`dist.all_gather_into_tensor`,
`dist.reduce_scatter_tensor`), not the counted collectives of distributed/, so a run's comm/<axis>_bytes
leaves them out. The planner's shapes-only step sees them as the dispatcher ops `c10d._allgather_base_` and
`c10d._reduce_scatter_base_` (the counted collectives' own eager calls of these ops are told apart and left
out: `distributed.collectives.issuing`) with their real buffers: the padded shards of each unit's
parameters, and the gradients in the reduce dtype (fp32). So
`collective_bytes` counts exactly the collectives the step issued, with ring_bytes' convention (what one rank
sends): every unit gathered in forward and again in backward under `fsdp_reshard_after_forward`, the root
included (torch keeps the root gathered only when that setting is left to torch), once per micro-batch,
and its gradient reduce-scattered once per step, in the last micro-batch's backward (`no_sync` around the
others' forward and backward; under pp the stages' own switch, distributed/pipeline/torch_stages.py).

Memory: a rank holds its shards of the weights, gradients and Adam state (the planner's held bytes) plus
the units FSDP has gathered at the moment: `Unit`s, their gathered bytes from the sharded parameters
(a DTensor's numel is its size over the replica mesh: the gathered size, the tp shard under tp). The peak
(`gathered_peak`) is taken in backward, when a unit's unsharded gradient exists beside its gathered weights:
the unit being differentiated (weights and gradient), the next one, already prefetched by FSDP2, and the
root (weights and gradient, both alive from the head's backward to the embedding's). With
`fsdp_reshard_after_forward=false` every unit not yet differentiated is still gathered. With several micro-batches
per step every unit's unsharded gradient lives from the first backward to the last: the price of one
reduce-scatter per step instead of one per micro-batch. The reduce-scatter's copy of one unit's gradient and
allocator slack are not modelled.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported where it is used: `python -m utils.plan --help` runs without it
    import torch
    from torch import nn


@dataclass(frozen=True)
class Unit:
    """One FSDP unit's gathered weights: their bytes, and whether the unit is a transformer block."""

    gathered_bytes: int
    block: bool


def units_of(model: nn.Module) -> tuple[list[nn.Module], nn.Module | None]:
    """(the FSDP units below the root, the root unit or None): every FSDPModule of `model`."""
    from torch.distributed.fsdp import FSDPModule

    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    root = model if units and units[0] is model else None
    return [u for u in units if u is not root], root


def gathered_bytes(unit: nn.Module) -> int:
    """Bytes of the unit's own parameters once gathered (those of units nested in it are theirs)."""
    from torch.distributed.fsdp import FSDPModule

    nested = {id(p) for m in unit.modules() if m is not unit and isinstance(m, FSDPModule) for p in m.parameters()}
    return sum(p.numel() * p.element_size() for p in unit.parameters() if id(p) not in nested)


def gathered_params(model: nn.Module) -> list[torch.Tensor]:
    """Every unit's gathered parameters: each unit gathered and freed once, so that its gathered storage
    exists (FSDP2 frees it by resizing, keeps the storage, and gathers into it again in every step): the
    tensors that stand for the weights when the step counts what it saves for backward."""
    units, root = units_of(model)
    gathered = []
    for unit in units + ([root] if root is not None else []):
        unit.unshard()
        gathered += list(unit.parameters())
        unit.reshard()
    return gathered


def record_forward_order(model: nn.Module) -> tuple[list[nn.Module], list]:
    """(the units below the root in the order their forward first runs, as the step fills it; the hooks'
    handles, to remove after the step)."""
    units, _ = units_of(model)
    order: list[nn.Module] = []

    def seen(module, args):
        if module not in order:
            order.append(module)

    return order, [u.register_forward_pre_hook(seen) for u in units]


def describe_units(model: nn.Module, order: list[nn.Module]) -> tuple[tuple[Unit, ...], int]:
    """(the units below the root in forward order, the root's gathered bytes; 0 without a root)."""
    blocks = {id(b) for b in model.blocks.children()} if hasattr(model, "blocks") else set()
    _, root = units_of(model)
    units = tuple(Unit(gathered_bytes(u), id(u) in blocks) for u in order)
    return units, gathered_bytes(root) if root is not None else 0


def collective_bytes(func, args) -> int:
    """Bytes this rank sends in FSDP2's collective `func` on `args` (0 for any other op)."""
    import torch

    from distributed.collectives import nbytes, ring_bytes

    c10d = torch.ops.c10d
    if func is c10d._allgather_base_.default:  # (output: n shards, input: this rank's shard, group, ...)
        out, shard = args[0], args[1]
        return ring_bytes("all_gather", nbytes(out), out.numel() // shard.numel())
    if func is c10d._reduce_scatter_base_.default:  # (output: this rank's shard, input: n shards, group, ...)
        shard, full = args[0], args[1]
        return ring_bytes("reduce_scatter", nbytes(full), full.numel() // shard.numel())
    return 0


def extend_units(units: tuple[Unit, ...], depth: int) -> tuple[Unit, ...]:
    """The units of the same model at `depth` blocks: its run of (identical) blocks repeated to `depth`,
    the ends where they were (utils/plan/probe.py: the blocks are copies of one module)."""
    blocks = [i for i, u in enumerate(units) if u.block]
    if not blocks:
        return units
    first, last = blocks[0], blocks[-1]
    assert blocks == list(range(first, last + 1)), "FSDP's blocks run in one stretch"
    return units[:first] + (units[last],) * depth + units[last + 1:]


def gathered_peak(units: tuple[Unit, ...], root_bytes: int, reshard_after_forward: bool,
                  accumulating: bool = False) -> int:
    """Peak bytes FSDP holds gathered beyond the shards, in backward (see the module docstring): the root's
    weights and gradient, the unit being differentiated (weights and gradient) and what else is gathered
    then (the next unit, prefetched; without resharding, every unit not yet differentiated). `accumulating`:
    a step of several micro-batches, whose gradients are reduce-scattered in the last backward only, so every
    unit keeps its unsharded gradient from the first backward to the last (distributed/data_parallel.py `no_sync`)."""
    backward = [u.gathered_bytes for u in reversed(units)]
    peak = 0
    for i, current in enumerate(backward):
        alive = backward[i:i + 2] if reshard_after_forward else backward[i:]
        peak = max(peak, sum(alive) + (0 if accumulating else current))
    return 2 * root_bytes + peak + (sum(backward) if accumulating else 0)
