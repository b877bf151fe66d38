"""Tests of distributed.mappings: adjointness, forward values, byte accounting, size-1 no-ops.

A mapping F and its backward F* are adjoint when <F(x), y> = <x, F*(y)> for every x and cotangent y.
A distributed tensor lives either in a replicated space (every rank holds the same value; the inner
product counts it once) or a per-rank space (ranks hold independent values: shards or partial sums;
the inner product sums over ranks). Each mapping is checked between the spaces it maps.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from distributed import mappings as M
from distributed.collectives import REDUCE_SCATTER_VIA, reduce_scatter_via, ring_bytes
from tests.helpers import run_ranks
from utils.comm import AxisGroup, init_grid
from utils.schema import ParallelConfig

SHAPE = (3, 0, 5)  # dim 1 (the length under test) is filled in per case
DIM = 1


def _full(seed: int, length: int) -> torch.Tensor:
    """A tensor every rank can build identically from `seed`."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(SHAPE[0], length, SHAPE[2], generator=g, dtype=torch.float64)


def _inner(a: torch.Tensor, b: torch.Tensor, replicated: bool, axis: AxisGroup) -> float:
    """<a, b> over the distributed space: once if replicated, summed over ranks otherwise."""
    local = (a * b).sum().reshape(1)
    if replicated:
        copies = [torch.zeros_like(local) for _ in range(axis.size)]
        dist.all_gather(copies, local, group=axis.group)
        assert all(torch.equal(c, local) for c in copies), "replicated value differs across ranks"
        return float(local)
    dist.all_reduce(local, group=axis.group)
    return float(local)


def _check_adjoint(fn, x: torch.Tensor, y: torch.Tensor, in_replicated: bool, out_replicated: bool, axis):
    x = x.clone().requires_grad_(True)
    out = fn(x)
    assert out.shape == y.shape, (out.shape, y.shape)
    (grad,) = torch.autograd.grad(out, x, y)
    lhs = _inner(out.detach(), y, out_replicated, axis)
    rhs = _inner(x.detach(), grad, in_replicated, axis)
    assert abs(lhs - rhs) <= 1e-9 * max(1.0, abs(lhs)), (fn, lhs, rhs)


def _adjoint_cases(axis: AxisGroup, length: int):
    """(name, fn, x, y, input replicated?, output replicated?) for every mapping on this rank."""
    r, n = axis.rank, axis.size
    sizes = M.split_sizes(length, n)
    full_x, full_y = _full(1, length), _full(2, length)
    own_x, own_y = _full(10 + r, sizes[r]), _full(20 + r, sizes[r])
    mine_x, mine_y = _full(30 + r, length), _full(40 + r, length)
    return [
        ("copy", lambda t: M.copy_to_region(t, axis), full_x, mine_y, True, False),
        ("reduce", lambda t: M.reduce_from_region(t, axis), mine_x, full_y, False, True),
        ("scatter", lambda t: M.scatter_to_region(t, axis, DIM), full_x, own_y, True, False),
        ("gather", lambda t: M.gather_from_region(t, axis, DIM, sizes), own_x, full_y, False, True),
        ("all_gather", lambda t: M.all_gather_region(t, axis, DIM, sizes), own_x, mine_y, False, False),
        ("reduce_scatter", lambda t: M.reduce_scatter_region(t, axis, DIM), mine_x, own_y, False, False),
        ("all_gather_linear", lambda t: M.all_gather_linear(t, _weight(50 + r), None, axis, DIM, sizes), own_x,
         _full(60 + r, length)[..., :4], False, False),
    ]


def _weight(seed: int) -> torch.Tensor:
    """A (4, 5) weight, other on every rank (a column-parallel shard)."""
    return torch.randn(4, SHAPE[2], generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _check_gather_linear(axis: AxisGroup, length: int) -> None:
    """The fused all-gather + linear (saving the shard) equals all_gather_region then F.linear in output, input
    gradient, weight and bias gradients, and moves one all-gather more (the backward re-gather)."""
    sizes = M.split_sizes(length, axis.size)
    x, g = _full(10 + axis.rank, sizes[axis.rank]), _full(60 + axis.rank, length)[..., :4]
    results = []
    for fused in (True, False):
        leaves = [t.clone().requires_grad_(True) for t in (x, _weight(50 + axis.rank), _weight(70)[:, 0])]
        before = axis.bytes_moved
        if fused:
            out = M.all_gather_linear(*leaves, axis, DIM, sizes)
        else:
            out = torch.nn.functional.linear(M.all_gather_region(leaves[0], axis, DIM, sizes), *leaves[1:])
        out.backward(g)
        results.append((axis.bytes_moved - before, out, *[t.grad for t in leaves]))
    (fused_bytes, *fused), (ref_bytes, *ref) = results
    for a, b in zip(fused, ref):
        torch.testing.assert_close(a, b)
    gather = ring_bytes("all_gather", axis.size * max(sizes) * SHAPE[0] * SHAPE[2] * 8, axis.size)
    assert fused_bytes == ref_bytes + gather


def _check_forward_values(axis: AxisGroup, length: int) -> None:
    r, n = axis.rank, axis.size
    sizes = M.split_sizes(length, n)
    full = _full(1, length)
    chunks = full.tensor_split(n, dim=DIM)
    partials = [_full(30 + s, length) for s in range(n)]  # every rank's partial, rebuilt locally
    total = torch.stack(partials).sum(0)
    torch.testing.assert_close(M.copy_to_region(full, axis), full)
    torch.testing.assert_close(M.reduce_from_region(partials[r], axis), total)
    torch.testing.assert_close(M.scatter_to_region(full, axis, DIM), chunks[r])
    torch.testing.assert_close(M.gather_from_region(chunks[r], axis, DIM, sizes), full)
    torch.testing.assert_close(M.all_gather_region(chunks[r], axis, -2, sizes), full)
    torch.testing.assert_close(M.reduce_scatter_region(partials[r], axis, DIM), total.tensor_split(n, dim=DIM)[r])


def _check_bytes(axis: AxisGroup) -> None:
    """Ring volumes, in units of (n-1)/n x B for a full tensor of B bytes: an all-reduce is 2 units,
    an all-gather or a reduce-scatter 1; a reduce-scatter run as an all-reduce (gloo's path) 2. Forward
    and backward are counted together; uneven gathers count the padded buffer they send."""
    n, length = axis.size, 4 * axis.size
    full = _full(1, length).requires_grad_(True)
    unit = (n - 1) * full.numel() * full.element_size() // n

    def scatter(t):  # backward: 1 unit
        return M.scatter_to_region(t, axis, DIM)

    rs = {"reduce_scatter": unit, "all_reduce": 2 * unit}
    assert reduce_scatter_via(axis) == "all_reduce"  # the default on gloo
    for via in (None, *REDUCE_SCATTER_VIA):
        reduce_scatter = rs[via or "all_reduce"]
        expected = {
            "copy": (lambda t: M.copy_to_region(t, axis), 2 * unit),
            "reduce": (lambda t: M.reduce_from_region(t, axis), 2 * unit),
            "scatter": (scatter, unit),
            "gather": (lambda t: M.gather_from_region(scatter(t), axis, DIM), 2 * unit),
            "all_gather": (lambda t: M.all_gather_region(scatter(t), axis, DIM, via=via), 2 * unit + reduce_scatter),
            "reduce_scatter": (lambda t: M.reduce_scatter_region(t, axis, DIM, via=via), unit + reduce_scatter),
        }
        for name, (fn, want) in expected.items():
            axis.bytes_moved = 0
            fn(full).sum().backward()
            assert axis.bytes_moved == want, (name, via, axis.bytes_moved, want)
    sizes = M.split_sizes(7, n)  # uneven: every rank sends max(sizes) rows, n - 1 times
    axis.bytes_moved = 0
    M.gather_from_region(_full(0, sizes[axis.rank]), axis, DIM, sizes)
    assert axis.bytes_moved == (n - 1) * max(sizes) * SHAPE[0] * SHAPE[2] * 8
    axis.bytes_moved = 0  # uneven reduce-scatter: the padded input (Megatron's path), the whole input (gloo's)
    part = _full(5, 7)
    padded = n * max(sizes) * SHAPE[0] * SHAPE[2] * 8
    M.reduce_scatter_region(part, axis, DIM, via="reduce_scatter")
    assert axis.bytes_moved == (n - 1) * padded // n
    axis.bytes_moved = 0
    M.reduce_scatter_region(part, axis, DIM, via="all_reduce")
    assert axis.bytes_moved == 2 * (n - 1) * part.numel() * 8 // n


def _check_paths_agree(axis: AxisGroup, length: int) -> None:
    """The reduce-scatter's two paths (NCCL's reduce-scatter, gloo's all-reduce + own chunk) give the same
    values and gradients in every mapping that reduce-scatters: reduce_scatter_region (forward),
    all_gather_region and all_gather_linear (backward); and each path is an adjoint pair on its own."""
    r, sizes = axis.rank, M.split_sizes(length, axis.size)
    own, mine = _full(10 + r, sizes[r]), _full(30 + r, length)
    cases = [  # (fn(t, via), input, cotangent)
        (lambda t, via: M.reduce_scatter_region(t, axis, DIM, via=via), mine, _full(20 + r, sizes[r])),
        (lambda t, via: M.all_gather_region(t, axis, DIM, sizes, via=via), own, _full(40 + r, length)),
        (lambda t, via: M.all_gather_linear(t, _weight(50 + r), None, axis, DIM, sizes, via=via), own,
         _full(60 + r, length)[..., :4]),
    ]
    for fn, x, y in cases:
        results = []
        for via in REDUCE_SCATTER_VIA:
            _check_adjoint(lambda t: fn(t, via), x, y, False, False, axis)
            leaf = x.clone().requires_grad_(True)
            out = fn(leaf, via)
            out.backward(y)
            results.append((out.detach(), leaf.grad))
        torch.testing.assert_close(results[0], results[1], rtol=1e-12, atol=1e-12)


def _check_compiles(axis: AxisGroup) -> None:
    """Every mapping traces into one graph (fullgraph) with the same values and gradients as eager."""
    sizes = M.split_sizes(7, axis.size)

    def chain(x):
        y = M.reduce_from_region(M.copy_to_region(x, axis) * 2, axis)
        shards = M.scatter_to_region(y, axis, DIM)
        full = M.gather_from_region(shards, axis, DIM, sizes) + M.all_gather_region(shards, axis, DIM, sizes)
        return M.reduce_scatter_region(full, axis, DIM).pow(2).sum()

    x = _full(3, 7).requires_grad_(True)
    (want_grad,) = torch.autograd.grad(want := chain(x), x)
    compiled = torch.compile(chain, fullgraph=True, backend="aot_eager")
    (got_grad,) = torch.autograd.grad(got := compiled(x), x)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(got_grad, want_grad)


def _mapping_checks(rank: int, world_size: int) -> None:
    grid = init_grid(ParallelConfig(tp=world_size))
    axis = grid.axis("tp")
    assert axis.size == world_size and axis.rank == rank
    for length in (8, 7, 2 * world_size + 1):  # even, uneven, uneven with more remainders
        for name, fn, x, y, in_rep, out_rep in _adjoint_cases(axis, length):
            _check_adjoint(fn, x, y, in_rep, out_rep, axis)
        _check_forward_values(axis, length)
        _check_gather_linear(axis, length)
        _check_paths_agree(axis, length)
    _check_bytes(axis)
    if world_size == 2:
        _check_compiles(axis)


@pytest.mark.parametrize("world_size", [2, 4])
def test_mappings_are_adjoint_pairs(world_size, tmp_path):
    run_ranks(_mapping_checks, world_size, tmp_path)


def test_split_sizes_follow_tensor_split():
    for length in range(0, 12):
        for parts in (1, 2, 3, 4):
            want = [c.shape[0] for c in torch.arange(length).tensor_split(parts)]
            assert M.split_sizes(length, parts) == want


def test_size_one_axis_is_a_free_noop():
    axis = AxisGroup("tp", 1, 0)
    x = torch.randn(2, 7, 3, requires_grad=True)
    fns = [lambda t: M.copy_to_region(t, axis), lambda t: M.reduce_from_region(t, axis),
           lambda t: M.scatter_to_region(t, axis, 1), lambda t: M.gather_from_region(t, axis, 1),
           lambda t: M.all_gather_region(t, axis, 1), lambda t: M.reduce_scatter_region(t, axis, 1)]
    for fn in fns:
        assert fn(x) is x  # no copy, no autograd node
    assert axis.bytes_moved == 0
