"""Tensor-parallel layers (Megatron-LM) with optional sequence parallelism, built from serial layers.

Every layer receives the `AxisGroup` it is split over in its constructor and declares its layout:
- `shard_dims`: parameter name -> tensor dim split contiguously over `axis` (torch.tensor_split
  convention: the first ranks get one more row when the split is uneven). Parameters not listed are
  replicated over `axis`. `sharded_params` and `shard_axis` (the AxisGroup itself) are what the
  gradient norm reads.
- `partial_grad_axes`: the AxisGroups over which the gradients of `partial_grad_params()` (replicated
  weights) are partial sums; `distributed.data_parallel.sync_partial_grads` sums them. That is the
  LayerNorm under sequence parallelism and the row-parallel bias under sequence parallelism: each rank
  only sees its own tokens.

`from_serial(module, axis, ...)` copies this rank's shard of the full serial weights, so the initial
full weights do not depend on the layout. Shapes: B batch, N sequence, N_local = N split over tp.
The vocabulary-parallel embedding and loss are in `distributed/tensor/vocab.py`.
"""

from __future__ import annotations

import math
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from distributed.collectives import own_chunk, split_sizes
from distributed.mappings import (
    all_gather_linear,
    all_gather_region,
    copy_to_region,
    gather_from_region,
    reduce_from_region,
    reduce_scatter_region,
    scatter_to_region,
)
from utils.comm import AxisGroup


def to_matmul_dtype(x: torch.Tensor) -> torch.Tensor:
    """`x` in the dtype autocast gives it at the next matmul (itself with autocast off). Cast before a
    collective that feeds a matmul, it moves half the bytes under bf16/fp16 and the values are unchanged."""
    device = x.device.type
    if x.is_floating_point() and torch.is_autocast_enabled(device):
        return x.to(torch.get_autocast_dtype(device))
    return x


def shard(tensor: torch.Tensor, axis: AxisGroup, dim: int) -> torch.Tensor:
    """This rank's contiguous chunk (tensor_split convention) of a full tensor, as a new tensor."""
    return own_chunk(tensor.detach(), axis, dim).clone()


class SequenceShards:
    """Per-rank sequence lengths inside one sequence-parallel region, shared by its layers.

    An all-gather along the sequence cannot infer the other ranks' lengths when N is not divisible
    by tp (e.g. 4050 ViT patches over 4 ranks), so the region's entry records the full length here
    and every sequence-parallel layer of the region reads it. Without a recorded length, the split is
    assumed even.
    """

    def __init__(self, axis: AxisGroup):
        self.axis = axis
        self.sizes: list[int] | None = None

    def enter(self, length: int) -> None:
        self.sizes = split_sizes(length, self.axis.size)


class TensorParallelLayer(nn.Module):
    """Base of the parallel layers: the axis they are split over and their layout declarations.

    Subclasses set `self.axis` in their constructor. `sharded_params`/`shard_axis` are what
    `distributed.grad_norm` reads; `shard_dims` says which dim of each sharded parameter is split.
    """

    axis: AxisGroup
    shard_dims: ClassVar[dict[str, int]] = {}  # parameter name -> dim split over `axis`; never mutated
    partial_grad_axes: tuple[AxisGroup, ...] = ()  # axes over which partial_grad_params() grads are partial

    @property
    def sharded_params(self) -> tuple[str, ...]:
        return tuple(name for name in self.shard_dims if getattr(self, name, None) is not None)

    @property
    def shard_axis(self) -> AxisGroup:
        return self.axis

    def partial_grad_params(self) -> list[nn.Parameter]:
        """Replicated parameters whose gradients are partial sums over `partial_grad_axes`."""
        return []

    @torch.no_grad()
    def copy_shards_from(self, serial: nn.Module) -> None:
        """Fill each parameter from the same-named FULL parameter of `serial`: this rank's chunk along
        its `shard_dims` entry, or the whole tensor when it is replicated. Records the full shapes
        (`full_shapes`: checkpoints save sharded tensors under them)."""
        self.full_shapes = {name: tuple(getattr(serial, name).shape) for name in self.sharded_params}
        for name, param in self.named_parameters(recurse=False):
            full = getattr(serial, name)
            param.copy_(shard(full, self.axis, self.shard_dims[name]) if name in self.shard_dims else full)


def _init_uniform(weight: torch.Tensor, bias: torch.Tensor | None, fan_in: int) -> None:
    """nn.Linear's default init with the FULL fan-in (for standalone use; from_serial overwrites it)."""
    bound = 1.0 / math.sqrt(fan_in) if fan_in > 0 else 0.0
    nn.init.uniform_(weight, -bound, bound)
    if bias is not None:
        nn.init.uniform_(bias, -bound, bound)


class ParallelLinear(TensorParallelLayer):
    """Base of the column- and row-parallel linears: built from a serial nn.Linear."""

    @classmethod
    def from_serial(cls, linear: nn.Linear, axis: AxisGroup, **kwargs) -> ParallelLinear:
        """This rank's shard of `linear` (rows for column-, columns for row-parallel; see shard_dims);
        kwargs go to the constructor (gather_output, input_is_parallel, sequence_parallel, seq_dim, shards,
        keep_gathered)."""
        w = linear.weight
        layer = cls(linear.in_features, linear.out_features, axis, bias=linear.bias is not None,
                    device=w.device, dtype=w.dtype, **kwargs)
        layer.copy_shards_from(linear)
        return layer


class ColumnParallelLinear(ParallelLinear):
    """Linear with OUT features split over `axis` (Megatron column parallelism, Shoeybi et al. fig. 3).

    Weight (out_local, in) = rows of the serial weight; bias (out_local) likewise.
    In: (B, N, in) replicated, or (B, N_local, in) sequence shards when `sequence_parallel`.
    Out: (B, N, out_local); (B, N, out) replicated when `gather_output`.
    Fwd: identity, or all-gather(seq_dim) under SP; then all-gather(features) if `gather_output`.
    Bwd: all-reduce of the input gradient, or reduce-scatter(seq_dim) under SP; under SP the input is
    saved as its shard and all-gathered again for the weight gradient, unless `keep_gathered` (saves
    the gathered input: t times the activation memory, one all-gather less per backward).
    The input is cast to the autocast dtype first, so every collective moves the matmul's dtype.
    """

    shard_dims = {"weight": 0, "bias": 0}

    def __init__(self, in_features: int, out_features: int, axis: AxisGroup, *, bias: bool = True,
                 gather_output: bool = False, sequence_parallel: bool = False, seq_dim: int = 1,
                 shards: SequenceShards | None = None, keep_gathered: bool = False, device=None, dtype=None):
        super().__init__()
        self.axis = axis
        self.in_features, self.out_features = in_features, out_features
        self.gather_output, self.sequence_parallel, self.keep_gathered = gather_output, sequence_parallel, keep_gathered
        self.seq_dim, self.shards = seq_dim, shards
        self.out_sizes = split_sizes(out_features, axis.size)
        local = self.out_sizes[axis.rank]
        self.weight = nn.Parameter(torch.empty(local, in_features, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(local, device=device, dtype=dtype)) if bias else None
        _init_uniform(self.weight, self.bias, in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = to_matmul_dtype(x)
        sizes = self.shards.sizes if self.shards is not None else None
        if self.sequence_parallel and not self.keep_gathered:
            y = all_gather_linear(x, self.weight, self.bias, self.axis, self.seq_dim, sizes)  # (B, N, out_local)
        else:
            x = all_gather_region(x, self.axis, self.seq_dim, sizes) if self.sequence_parallel else \
                copy_to_region(x, self.axis)  # (B, N, in)
            y = F.linear(x, self.weight, self.bias)  # (B, N, out_local)
        return gather_from_region(y, self.axis, -1, self.out_sizes) if self.gather_output else y

    def extra_repr(self) -> str:
        return (f"in={self.in_features}, out={self.out_features} split over {self.axis.name}={self.axis.size}, "
                f"sequence_parallel={self.sequence_parallel}, gather_output={self.gather_output}, "
                f"keep_gathered={self.keep_gathered}")


class RowParallelLinear(ParallelLinear):
    """Linear with IN features split over `axis` (Megatron row parallelism, Shoeybi et al. fig. 3).

    Weight (out, in_local) = columns of the serial weight; bias (out) replicated, added once after
    the reduction. In: (B, N, in_local) (`input_is_parallel`), else (B, N, in) replicated and split here.
    Out: (B, N, out) replicated, or (B, N_local, out) sequence shards under SP.
    Fwd: all-reduce, or reduce-scatter(seq_dim) under SP. Bwd: identity, or all-gather(seq_dim) under SP.
    Under SP the bias sees only local tokens: its gradient is partial over `axis` (declared).
    """

    shard_dims = {"weight": 1}

    def __init__(self, in_features: int, out_features: int, axis: AxisGroup, *, bias: bool = True,
                 input_is_parallel: bool = True, sequence_parallel: bool = False, seq_dim: int = 1,
                 device=None, dtype=None):
        super().__init__()
        self.axis = axis
        self.in_features, self.out_features = in_features, out_features
        self.input_is_parallel, self.sequence_parallel, self.seq_dim = input_is_parallel, sequence_parallel, seq_dim
        self.partial_grad_axes = (axis,) if sequence_parallel and bias else ()
        local = split_sizes(in_features, axis.size)[axis.rank]
        self.weight = nn.Parameter(torch.empty(out_features, local, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(out_features, device=device, dtype=dtype)) if bias else None
        _init_uniform(self.weight, self.bias, in_features)

    def partial_grad_params(self) -> list[nn.Parameter]:
        return [self.bias] if self.partial_grad_axes else []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = scatter_to_region(x, self.axis, -1)  # (B, N, in_local)
        y = F.linear(x, self.weight)  # (B, N, out) partial sums over axis
        if self.sequence_parallel:
            y = reduce_scatter_region(y, self.axis, self.seq_dim)  # (B, N_local, out)
        else:
            y = reduce_from_region(y, self.axis)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return (f"in={self.in_features} split over {self.axis.name}={self.axis.size}, out={self.out_features}, "
                f"sequence_parallel={self.sequence_parallel}")


class GroupedQKVParallelLinear(TensorParallelLayer):
    """The fused QKV projection of grouped-query attention when tp is a multiple of the key/value heads
    (`networks.blocks.Attention`: rows ordered (group, [q heads, k, v], head_dim)).

    c = tp / groups ranks share each group: rank t computes the rows of query heads
    (t mod c) x r/c .. of group t // c, and the group's key and value rows, its output laid out as
    (1 group, [r/c q heads, k, v], head_dim). The weight and bias are the serial ones, replicated over
    `axis` (a key/value row is used by c ranks, so there is nothing to split); each rank's gradient holds
    the contributions of the rows it used, a partial sum over `axis` (declared: `sync_partial_grads` adds
    them, after which every rank applies the same update). The q rows are stored tp times (Megatron
    refuses tp > kv heads; vLLM replicates K/V the same way for inference).
    In: (B, N, in) replicated, or sequence shards under SP (gathered as ColumnParallelLinear does).
    """

    def __init__(self, linear: nn.Linear, axis: AxisGroup, groups: int, q_per_group: int, head_dim: int, *,
                 sequence_parallel: bool = False, seq_dim: int = 1, shards: SequenceShards | None = None,
                 keep_gathered: bool = False):
        super().__init__()
        assert axis.size % groups == 0 and q_per_group % (axis.size // groups) == 0
        self.axis, self.in_features, self.out_features = axis, linear.in_features, linear.out_features
        self.sequence_parallel, self.seq_dim = sequence_parallel, seq_dim
        self.shards, self.keep_gathered = shards, keep_gathered
        share = axis.size // groups
        self.q_local = q_per_group // share  # query heads this rank computes
        group, part = divmod(axis.rank, share)
        base = group * (q_per_group + 2) * head_dim
        self.row_ranges = ((base + part * self.q_local * head_dim, base + (part + 1) * self.q_local * head_dim),
                           (base + q_per_group * head_dim, base + (q_per_group + 2) * head_dim))  # q, then k and v
        self.register_buffer("rows", None, persistent=False)
        self.init_buffers(linear.weight.device)
        self.weight = nn.Parameter(linear.weight.detach().clone())
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone())
        self.partial_grad_axes = (axis,)

    def init_buffers(self, device: torch.device) -> None:
        """The rows of the fused weight this rank computes (an index buffer on the weight's device)."""
        self.rows = torch.cat([torch.arange(*r, device=device) for r in self.row_ranges])

    def partial_grad_params(self) -> list[nn.Parameter]:
        return [p for p in (self.weight, self.bias) if p is not None]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = to_matmul_dtype(x)
        weight = self.weight[self.rows]
        bias = None if self.bias is None else self.bias[self.rows]
        sizes = self.shards.sizes if self.shards is not None else None
        if self.sequence_parallel and not self.keep_gathered:
            return all_gather_linear(x, weight, bias, self.axis, self.seq_dim, sizes)
        x = (all_gather_region(x, self.axis, self.seq_dim, sizes) if self.sequence_parallel
             else copy_to_region(x, self.axis))
        return F.linear(x, weight, bias)

    def extra_repr(self) -> str:
        return (f"in={self.in_features}, out={self.out_features} replicated over {self.axis.name}={self.axis.size}, "
                f"{self.q_local} query heads and their group's key/value head per rank, "
                f"sequence_parallel={self.sequence_parallel}")


class SequenceParallelNorm(TensorParallelLayer):
    """A per-token norm on sequence shards (Korthikanti et al. 2022, sec. 4.2.2): LayerNorm or RMSNorm.

    Weights (D) replicated over `axis`; in/out (B, N_local, D). No communication in forward or backward:
    normalization is per token. Each rank sees only its tokens, so the weight (and bias) gradients are
    partial sums over `axis` (declared by `partial_grad_axes`).
    """

    def partial_grad_params(self) -> list[nn.Parameter]:
        return [p for p in self.parameters(recurse=False) if p is not None]

    @staticmethod
    def from_serial(norm: nn.Module, axis: AxisGroup) -> SequenceParallelNorm:
        """The same norm (copied weights), now declaring partial gradients over tp."""
        ref = norm.weight
        place = dict(device=None if ref is None else ref.device, dtype=None if ref is None else ref.dtype)
        if type(norm) is nn.LayerNorm:
            layer = SequenceParallelLayerNorm(norm.normalized_shape, axis, norm.eps, norm.elementwise_affine,
                                              norm.bias is not None, **place)
        else:
            layer = SequenceParallelRMSNorm(norm.normalized_shape, axis, norm.eps, norm.elementwise_affine, **place)
        layer.load_state_dict(norm.state_dict())
        return layer


class SequenceParallelLayerNorm(nn.LayerNorm, SequenceParallelNorm):
    """nn.LayerNorm on sequence shards (SequenceParallelNorm)."""

    def __init__(self, normalized_shape, axis: AxisGroup, eps: float = 1e-5, elementwise_affine: bool = True,
                 bias: bool = True, device=None, dtype=None):
        super().__init__(normalized_shape, eps, elementwise_affine, bias, device, dtype)
        self.axis, self.partial_grad_axes = axis, (axis,)


class SequenceParallelRMSNorm(nn.RMSNorm, SequenceParallelNorm):
    """nn.RMSNorm on sequence shards (SequenceParallelNorm)."""

    def __init__(self, normalized_shape, axis: AxisGroup, eps: float | None = None, elementwise_affine: bool = True,
                 device=None, dtype=None):
        super().__init__(normalized_shape, eps, elementwise_affine, device, dtype)
        self.axis, self.partial_grad_axes = axis, (axis,)


class ScatterSequence(nn.Module):
    """Entry of the sequence-parallel region: (B, N, D) replicated -> (B, N_local, D) shards.

    Fwd: keep own chunk along `seq_dim` (records N in `shards`); bwd: all-gather over `axis`.
    """

    def __init__(self, axis: AxisGroup, seq_dim: int, shards: SequenceShards):
        super().__init__()
        self.axis, self.seq_dim, self.shards = axis, seq_dim, shards

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.shards.enter(x.shape[self.seq_dim])
        return scatter_to_region(x, self.axis, self.seq_dim)


class GatherSequence(nn.Module):
    """Exit of the sequence-parallel region: (B, N_local, D) shards -> (B, N, D) replicated.

    Fwd: all-gather along `seq_dim` over `axis`; bwd: keep own chunk of the gradient. `feeds_matmul`: what
    follows is a matmul (the ViT's head), so the gather moves the autocast dtype (`to_matmul_dtype`).
    """

    def __init__(self, axis: AxisGroup, seq_dim: int, shards: SequenceShards, feeds_matmul: bool = False):
        super().__init__()
        self.axis, self.seq_dim, self.shards, self.feeds_matmul = axis, seq_dim, shards, feeds_matmul

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = to_matmul_dtype(x) if self.feeds_matmul else x
        return gather_from_region(x, self.axis, self.seq_dim, self.shards.sizes)
