"""Where each tensor this rank holds lies in the single-process model: the shared answer of the build
(initialising shards), the checkpoints (global shapes) and the Hugging Face import (reading slices).

Every parameter a rank holds is a box of its full tensor, one contiguous range per dim:
- tensor parallelism splits one dim over tp (`TensorParallelLayer.shard_dims`, the tensor_split convention:
  the first ranks get one more row when uneven); a parameter it replicates (norms, grouped K/V's fused
  projection) is whole;
- FSDP2 then splits dim 0 of that tp shard over the replica mesh (torch.chunk: chunks of ceil(n/size) rows,
  the last ranks' short or empty);
- a pipeline rank holds its stages' parameters whole under their global names; context parallelism
  replicates every weight.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from distributed.collectives import split_sizes
from utils.comm import AxisGroup


@dataclass(frozen=True)
class Piece:
    """This rank's part of the parameter `name`: local = full[offsets[d] : offsets[d] + local.shape[d], ...]."""

    name: str
    param: torch.Tensor  # the live parameter (a DTensor under FSDP)
    full_shape: tuple[int, ...]
    offsets: tuple[int, ...]

    @property
    def local(self) -> torch.Tensor:
        return self.param.to_local() if isinstance(self.param, DTensor) else self.param

    def slices(self) -> tuple[slice, ...]:
        """The box as slices of the full tensor."""
        return tuple(slice(o, o + n) for o, n in zip(self.offsets, self.local.shape, strict=True))


def parameter_names(model: nn.Module) -> dict[str, nn.Parameter]:
    """Every parameter under its state-dict name, the single-process name the model keys use: wrappers
    that add a level to `named_parameters()` (activation checkpointing's `_checkpoint_wrapped_module.`,
    compile's `_orig_mod.`) strip it from state-dict keys, so the optimizer state is named like the model
    whatever the wrappers (a checkpoint then resumes with them toggled and under any layout). Tied
    weights keep both names."""
    return {name: t for name, t in model.state_dict(keep_vars=True).items() if isinstance(t, nn.Parameter)}


def shard_layout(model: nn.Module) -> dict[int, tuple[AxisGroup, int, int]]:
    """id(parameter) -> (axis, split dim, full size of that dim) for every tensor-parallel parameter."""
    layout = {}
    for module in model.modules():
        for name in getattr(module, "sharded_params", ()):
            param, axis, dim = getattr(module, name), module.shard_axis, module.shard_dims[name]
            if axis.size > 1:
                full = getattr(module, "full_shapes", {}).get(name)
                layout[id(param)] = (axis, dim, full[dim] if full else param.shape[dim] * axis.size)
    return layout


def fsdp_rows(rows: int, size: int, rank: int) -> tuple[int, int]:
    """[start, stop) of FSDP2 rank `rank`'s chunk of `rows` rows over `size` ranks (torch.chunk)."""
    chunk = math.ceil(rows / size) if rows else 0
    start = min(rows, rank * chunk)
    return start, min(rows, start + chunk)


def local_pieces(model: nn.Module) -> list[Piece]:
    """One `Piece` per parameter this rank holds (a tied one once, under its first name)."""
    layout, pieces, seen = shard_layout(model), [], set()
    for name, param in parameter_names(model).items():
        if id(param) in seen:
            continue
        seen.add(id(param))
        shape, offsets = list(param.shape), [0] * param.dim()  # a DTensor's shape: the tp shard FSDP splits
        if isinstance(param, DTensor):
            assert tuple(param.placements) == (Shard(0),), f"{name}: placements {param.placements}"
            mesh = param.device_mesh  # its coordinate, not get_local_rank(): a flattened mesh's group is
            offsets[0] = fsdp_rows(shape[0], mesh.size(), mesh.get_coordinate()[0])[0]  # looked up by name there
        if id(param) in layout:
            axis, dim, full = layout[id(param)]
            offsets[dim] += sum(split_sizes(full, axis.size)[:axis.rank])
            shape[dim] = full
        pieces.append(Piece(name, param, tuple(shape), tuple(offsets)))
    return pieces
