"""Autograd-aware collectives: the `f`/`g` operators of tensor and sequence parallelism.

Each public function applies one collective in forward and its adjoint in backward, on the group of
one grid axis passed in explicitly as an `AxisGroup` (Megatron-LM, Shoeybi et al. 2019, sec. 3, and
sequence parallelism, Korthikanti et al. 2022, sec. 4.2.2):

    copy_to_region        fwd identity        bwd all-reduce      `f` of Megatron
    reduce_from_region    fwd all-reduce      bwd identity        `g` of Megatron
    scatter_to_region     fwd keep own chunk  bwd all-gather
    gather_from_region    fwd all-gather      bwd keep own chunk
    all_gather_region     fwd all-gather      bwd reduce-scatter  `g` of sequence parallelism
    reduce_scatter_region fwd reduce-scatter  bwd all-gather      `g-bar` of sequence parallelism
    all_gather_linear     fwd all-gather, then x @ W^T + b; bwd all-gather again, reduce-scatter dX
                          (`g` fused with the column-parallel matmul: only the shard is saved)
    sequence_to_heads     fwd all-to-all: (B, h, n_r, d) sequence shards -> (B, h/n, N, d) head shards,
                          bwd the reverse all-to-all (`heads_to_sequence`): the pair is its own adjoint

A size-1 axis returns the input unchanged (no collective, no autograd node). Splits along `dim` follow
`torch.tensor_split`: with L = q*n + r, the first r ranks hold q+1 elements and the rest q. A gather
cannot know the other ranks' lengths, so it takes `sizes` (per-rank lengths, see `split_sizes`);
without it the split is assumed even. Uneven gathers and reduce-scatters pad every chunk to the
largest one (gloo has no all-gatherv) and trim afterwards.

The collectives are the functional, counted ones of `distributed/collectives.py`, which torch.compile
traces without graph breaks. Each records on its axis the bytes this rank sends with the ring
algorithm (`ring_bytes`), n = axis.size: all-reduce 2(n-1)/n x bytes(tensor), all-gather (n-1)/n x
bytes(gathered output), reduce-scatter (n-1)/n x bytes(full input); for uneven splits that is the
padded buffer actually sent. A reduce-scatter on gloo runs as an all-reduce that keeps this rank's
chunk (cheaper there; `distributed.collectives.reduce_scatter_via`) and counts the all-reduce's
2(n-1)/n x bytes(full input); NCCL keeps Megatron's reduce-scatter. Recording goes through
`distributed.counting.record`, whose custom op torch.compile keeps in its graphs, so compiled regions
count the same bytes as eager ones, in the forward and in the compiled backward. Byte counts stay integer
arithmetic (SymInts under dynamic shapes: no specialization). Activation checkpointing: eager
recomputation re-runs the forward collectives and counts them again; in a compiled checkpointed block the
partitioner chooses which collectives to recompute and does not count those again (the counting op is
never recomputed).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from distributed.collectives import all_gather, all_reduce, all_to_all, own_chunk, reduce_scatter, split_sizes
from utils.comm import AxisGroup


def _resolve_sizes(x: torch.Tensor, axis: AxisGroup, dim: int, sizes: Sequence[int] | None) -> list[int]:
    """Per-rank lengths along `dim`: given, or an even split of the local length."""
    if sizes is None:
        return [x.shape[dim]] * axis.size
    sizes = list(sizes)
    assert len(sizes) == axis.size and sizes[axis.rank] == x.shape[dim], \
        f"sizes {sizes} do not match the local length {x.shape[dim]} on rank {axis.rank} of {axis.name}"
    assert sizes == split_sizes(sum(sizes), axis.size), f"sizes {sizes} are not a tensor_split of {sum(sizes)}"
    return sizes


class _CopyToRegion(torch.autograd.Function):
    """Megatron's `f`: identity forward, all-reduce of the gradient backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, axis: AxisGroup) -> torch.Tensor:
        ctx.axis = axis
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return all_reduce(grad, ctx.axis), None  # plant: tp_copy_skips_grad_sum


class _ReduceFromRegion(torch.autograd.Function):
    """Megatron's `g`: all-reduce forward, identity backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, axis: AxisGroup) -> torch.Tensor:
        return all_reduce(x, axis)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


class _ScatterToRegion(torch.autograd.Function):
    """Keep this rank's chunk along `dim` forward; all-gather the gradient backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, axis: AxisGroup, dim: int) -> torch.Tensor:
        ctx.axis, ctx.dim = axis, dim
        ctx.sizes = split_sizes(x.shape[dim], axis.size)
        return own_chunk(x, axis, dim).contiguous()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return all_gather(grad, ctx.axis, ctx.dim, ctx.sizes), None, None


class _GatherFromRegion(torch.autograd.Function):
    """All-gather along `dim` forward; keep this rank's chunk of the gradient backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, axis: AxisGroup, dim: int, sizes: list[int]) -> torch.Tensor:
        ctx.axis, ctx.dim, ctx.sizes = axis, dim, sizes
        return all_gather(x, axis, dim, sizes)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return own_chunk(grad, ctx.axis, ctx.dim).contiguous(), None, None, None


class _AllGatherRegion(torch.autograd.Function):
    """All-gather along `dim` forward; reduce-scatter of the gradient backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, axis: AxisGroup, dim: int, sizes: list[int], via: str | None) -> torch.Tensor:
        ctx.axis, ctx.dim, ctx.via = axis, dim, via
        return all_gather(x, axis, dim, sizes)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return reduce_scatter(grad, ctx.axis, ctx.dim, ctx.via), None, None, None, None


class _AllGatherLinear(torch.autograd.Function):
    """y = all_gather(x) @ W^T + b, saving only the sequence shard `x`: backward gathers it again for dW
    (Korthikanti et al. 2022, sec. 4.2.3; Megatron's column-parallel layer under sequence parallelism).
    Computes in x's dtype (the caller casts x to the autocast dtype): W and b are cast to it, as autocast
    would; their gradients are returned in their own dtype."""

    @staticmethod
    def forward(ctx, x, weight, bias, axis: AxisGroup, dim: int, sizes: list[int], via: str | None):
        w = weight.to(x.dtype)
        y = F.linear(all_gather(x, axis, dim, sizes), w, None if bias is None else bias.to(x.dtype))
        ctx.save_for_backward(x, w)  # the shard (1/t of the gathered input) and the weight as used
        ctx.axis, ctx.dim, ctx.sizes, ctx.via = axis, dim, sizes, via
        ctx.dtypes = (weight.dtype, None if bias is None else bias.dtype)
        return y

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, w = ctx.saved_tensors
        full = all_gather(x, ctx.axis, ctx.dim, ctx.sizes)  # the re-gather: counted like the forward one
        grad = grad.to(w.dtype)
        # plant: sp_gather_linear_keeps_own_chunk (next line)
        grad_x = reduce_scatter(grad.matmul(w), ctx.axis, ctx.dim, ctx.via)  # (..., N_local, in)
        rows = grad.reshape(-1, grad.shape[-1])  # (B*N, out_local)
        grad_w = rows.t().matmul(full.reshape(-1, full.shape[-1])).to(ctx.dtypes[0])
        grad_b = None if ctx.dtypes[1] is None else rows.sum(0).to(ctx.dtypes[1])
        return grad_x, grad_w, grad_b, None, None, None, None


class _ReduceScatterRegion(torch.autograd.Function):
    """Reduce-scatter along `dim` forward; all-gather of the gradient backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, axis: AxisGroup, dim: int, via: str | None) -> torch.Tensor:
        ctx.axis, ctx.dim = axis, dim
        ctx.sizes = split_sizes(x.shape[dim], axis.size)
        return reduce_scatter(x, axis, dim, via)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return all_gather(grad, ctx.axis, ctx.dim, ctx.sizes), None, None, None


def copy_to_region(x: torch.Tensor, axis: AxisGroup) -> torch.Tensor:
    """Enter a tensor-parallel region: fwd identity, bwd all-reduce (sum) over `axis`.

    The `f` operator of Megatron-LM (Shoeybi et al. 2019, fig. 3): placed before a column-parallel
    linear whose replicated input feeds every rank, so the input gradient is the sum of the ranks'
    partial gradients.
    """
    return x if axis.size == 1 else _CopyToRegion.apply(x, axis)


def reduce_from_region(x: torch.Tensor, axis: AxisGroup) -> torch.Tensor:
    """Leave a tensor-parallel region: fwd all-reduce (sum) over `axis`, bwd identity.

    The `g` operator of Megatron-LM (Shoeybi et al. 2019, fig. 3): sums the partial outputs of a
    row-parallel linear; the replicated output gradient passes through unchanged.
    """
    return x if axis.size == 1 else _ReduceFromRegion.apply(x, axis)


def scatter_to_region(x: torch.Tensor, axis: AxisGroup, dim: int) -> torch.Tensor:
    """Split a replicated tensor along `dim`: fwd keep own chunk (tensor_split), bwd all-gather.

    Enters the sequence-parallel region (Korthikanti et al. 2022) from replicated activations.
    """
    return x if axis.size == 1 else _ScatterToRegion.apply(x, axis, dim % x.dim())


def gather_from_region(x: torch.Tensor, axis: AxisGroup, dim: int,
                       sizes: Sequence[int] | None = None) -> torch.Tensor:
    """Reassemble chunks along `dim`: fwd all-gather, bwd keep own chunk of the gradient.

    Leaves the sequence-parallel region (Korthikanti et al. 2022) for replicated computation, or
    gathers a column-parallel output (Megatron's `gather_output`). `sizes`: per-rank lengths along
    `dim` (default: every rank holds as many as this one).
    """
    if axis.size == 1:
        return x
    dim %= x.dim()
    return _GatherFromRegion.apply(x, axis, dim, _resolve_sizes(x, axis, dim, sizes))


def all_gather_region(x: torch.Tensor, axis: AxisGroup, dim: int, sizes: Sequence[int] | None = None,
                      via: str | None = None) -> torch.Tensor:
    """Sequence shards -> full sequence for a tensor-parallel block: fwd all-gather, bwd reduce-scatter.

    The `g` operator of sequence parallelism (Korthikanti et al. 2022, fig. 5), replacing Megatron's
    `f`: the gradients of the replicated full input are partial over `axis`, summed and split back.
    `via`: how the backward reduce-scatter runs (`distributed.collectives.reduce_scatter`; None: by backend).
    """
    if axis.size == 1:
        return x
    dim %= x.dim()
    return _AllGatherRegion.apply(x, axis, dim, _resolve_sizes(x, axis, dim, sizes), via)


def all_gather_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, axis: AxisGroup, dim: int,
                      sizes: Sequence[int] | None = None, via: str | None = None) -> torch.Tensor:
    """`F.linear(all_gather_region(x, axis, dim, sizes), weight, bias)`, keeping only the shard `x` for
    backward, which all-gathers it again: activation memory of the column-parallel input falls to 1/t
    for one more all-gather per layer in backward. Computes in x's dtype. `via`: as for `all_gather_region`."""
    if axis.size == 1:
        return F.linear(x, weight.to(x.dtype), None if bias is None else bias.to(x.dtype))
    dim %= x.dim()
    return _AllGatherLinear.apply(x, weight, bias, axis, dim, _resolve_sizes(x, axis, dim, sizes), via)


def reduce_scatter_region(x: torch.Tensor, axis: AxisGroup, dim: int, via: str | None = None) -> torch.Tensor:
    """Partial full-sequence outputs -> summed sequence shards: fwd reduce-scatter, bwd all-gather.

    The `g-bar` operator of sequence parallelism (Korthikanti et al. 2022, fig. 5), replacing
    Megatron's `g` after a row-parallel linear. `via`: how the reduce-scatter runs
    (`distributed.collectives.reduce_scatter`: 'reduce_scatter' or 'all_reduce'; None: by the axis' backend).
    """
    return x if axis.size == 1 else _ReduceScatterRegion.apply(x, axis, dim % x.dim(), via)


class _SequenceToHeads(torch.autograd.Function):
    """All-to-all from sequence shards to head shards; backward the reverse all-to-all."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, axis: AxisGroup, sizes: list[int]) -> torch.Tensor:
        ctx.axis, ctx.sizes = axis, sizes
        heads = split_sizes(x.shape[1], axis.size)
        return all_to_all(x, axis, 1, 2, heads, sizes)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _heads_to_sequence(grad, ctx.axis, ctx.sizes), None, None


class _HeadsToSequence(torch.autograd.Function):
    """All-to-all from head shards back to sequence shards; backward the reverse all-to-all."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, axis: AxisGroup, sizes: list[int]) -> torch.Tensor:
        ctx.axis, ctx.sizes = axis, sizes
        return _heads_to_sequence(x, axis, sizes)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        heads = split_sizes(grad.shape[1], ctx.axis.size)
        return all_to_all(grad, ctx.axis, 1, 2, heads, ctx.sizes), None, None


def _heads_to_sequence(x: torch.Tensor, axis: AxisGroup, sizes: list[int]) -> torch.Tensor:
    return all_to_all(x, axis, 2, 1, sizes, [x.shape[1]] * axis.size)


def sequence_to_heads(x: torch.Tensor, axis: AxisGroup, sizes: Sequence[int]) -> torch.Tensor:
    """(B, h, n_r, d) with rank r holding `sizes[r]` tokens -> (B, h/n, N, d): this rank's heads for every
    token, in rank order (DeepSpeed-Ulysses' first all-to-all). h must be a multiple of the axis size."""
    if axis.size == 1:
        return x
    assert x.shape[1] % axis.size == 0, f"{x.shape[1]} heads cannot be split over {axis.name}={axis.size}"
    return _SequenceToHeads.apply(x, axis, list(sizes))


def heads_to_sequence(x: torch.Tensor, axis: AxisGroup, sizes: Sequence[int]) -> torch.Tensor:
    """The inverse of `sequence_to_heads`: (B, h/n, N, d) -> (B, h, n_r, d)."""
    if axis.size == 1:
        return x
    return _HeadsToSequence.apply(x, axis, list(sizes))
