"""Every mapping of distributed/mappings.py against its adjoint, on the device, in fp32 and bf16.

A mapping f and its backward f* are adjoint when <f(x), y> = <x, f*(y)> for every x and cotangent y
(tests/test_mappings.py checks the same in float64 on CPU). A distributed tensor lives in a replicated space
(every rank holds the same value: the inner product counts it once) or a per-rank space (shards or partial
sums: the inner product sums over ranks). The cotangent is y = f(x) + z with z random: the f(x) part makes
<f(x), y> as large as its terms (no cancellation hides a wrong backward), z covers directions f(x) misses.

Tolerance from the dtype: the two sides are rounded sums of products, each rounded at most ~(n + 2) times
(n ranks' partial sums, the cast to the dtype, one matmul rounding), so |lhs - rhs| <= 2 (n + 2) eps x the sum
of |terms|, eps = torch.finfo(dtype).eps (fp32 1.2e-7, bf16 7.8e-3). A wrong backward (a missing sum, a
wrong chunk) is off by a fraction of the terms themselves, 0.3 or more, far above bf16's bound at 8 ranks (0.16).
"""

from __future__ import annotations

import math

import torch

from distributed import mappings as M
from distributed.collectives import all_reduce_, split_sizes
from utils.comm import AxisGroup
from utils.doctor.report import Check

DTYPES = (torch.float32, torch.bfloat16)
B, C, HEAD_DIM = 3, 5, 2  # (B, length, C) tensors; all_gather_linear's weight is (4, C)


def tolerance(dtype: torch.dtype, n: int) -> float:
    return 2 * (n + 2) * torch.finfo(dtype).eps


def randn(shape, seed: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The same values on every rank (and every device) for the same seed."""
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(device, dtype)


def inner(a: torch.Tensor, b: torch.Tensor, replicated: bool, axis: AxisGroup) -> torch.Tensor:
    """(<a, b>, sum |a b|) over the distributed space, in float64: once if replicated, summed over ranks if not."""
    prod = a.double() * b.double()
    local = torch.stack([prod.sum(), prod.abs().sum()])
    return local if replicated else all_reduce_(local, axis)


def cases(axis: AxisGroup, length: int, dtype: torch.dtype, device: torch.device) -> list[tuple]:
    """(name, f, x, seed of z, input replicated?, output replicated?) for every mapping: x and z are full
    (replicated), own (this rank's chunk) or mine (full length, other on every rank)."""
    r, n = axis.rank, axis.size
    sizes = split_sizes(length, n)

    def full(seed):
        return randn((B, length, C), seed, dtype, device)

    def own(seed):
        return randn((B, sizes[r], C), seed + r, dtype, device)

    def mine(seed):
        return randn((B, length, C), seed + r, dtype, device)

    weight = randn((4, C), 50 + r, dtype, device)
    heads = 2 * n  # sequence_to_heads splits heads evenly
    seq = randn((B, heads, sizes[r], HEAD_DIM), 70 + r, dtype, device)  # (B, h, n_r, d) sequence shards
    by_head = randn((B, 2, length, HEAD_DIM), 80 + r, dtype, device)  # (B, h/n, N, d) head shards
    return [
        ("copy_to_region", lambda t: M.copy_to_region(t, axis), full(1), mine, True, False),
        ("reduce_from_region", lambda t: M.reduce_from_region(t, axis), mine(30), full, False, True),
        ("scatter_to_region", lambda t: M.scatter_to_region(t, axis, 1), full(1), own, True, False),
        ("gather_from_region", lambda t: M.gather_from_region(t, axis, 1, sizes), own(10), full, False, True),
        ("all_gather_region", lambda t: M.all_gather_region(t, axis, 1, sizes), own(10), mine, False, False),
        ("reduce_scatter_region", lambda t: M.reduce_scatter_region(t, axis, 1), mine(30), own, False, False),
        ("all_gather_linear", lambda t: M.all_gather_linear(t, weight, None, axis, 1, sizes), own(10),
         lambda s: mine(s)[..., :4], False, False),
        ("sequence_to_heads", lambda t: M.sequence_to_heads(t, axis, sizes), seq,
         lambda s: randn((B, 2, length, HEAD_DIM), s + r, dtype, device), False, False),
        ("heads_to_sequence", lambda t: M.heads_to_sequence(t, axis, sizes), by_head,
         lambda s: randn((B, heads, sizes[r], HEAD_DIM), s + r, dtype, device), False, False),
    ]


def deviation(fn, x: torch.Tensor, z_of, in_rep: bool, out_rep: bool, axis: AxisGroup) -> float:
    """|<f(x), y> - <x, f*(y)>| / (sum of |terms|) for y = f(x) + z."""
    x = x.clone().requires_grad_(True)
    out = fn(x)
    y = out.detach() + z_of(90)
    (grad,) = torch.autograd.grad(out, x, y)
    lhs, rhs = inner(out.detach(), y, out_rep, axis), inner(x.detach(), grad, in_rep, axis)
    return float((lhs[0] - rhs[0]).abs() / torch.maximum(lhs[1], rhs[1]).clamp_min(1e-30))


def adjoint_checks(axis: AxisGroup, device: torch.device) -> list[Check]:
    """A line per mapping and dtype on `axis` (an even and an uneven length each: the worst is reported)."""
    checks = []
    for dtype in DTYPES:
        tol = tolerance(dtype, axis.size)
        worst: dict[str, float] = {}
        errors: dict[str, str] = {}
        for length in (4 * axis.size, 2 * axis.size + 1):
            for name, fn, x, z_of, in_rep, out_rep in cases(axis, length, dtype, device):
                try:
                    dev = deviation(fn, x, z_of, in_rep, out_rep, axis)
                except RuntimeError as err:  # e.g. a backward with a wrong arity: this mapping fails, the rest run
                    dev, errors[name] = math.inf, str(err).splitlines()[0][:200]
                worst[name] = max(worst.get(name, 0.0), dev)
        kind = str(dtype).removeprefix("torch.")
        for name, dev in worst.items():
            checks.append(Check("mappings", f"{name} on {axis.name} ({axis.size} ranks), {kind}",
                                "pass" if dev <= tol else "fail", errors.get(name, f"<f(x),y> and <x,f*(y)> differ by "
                                f"{dev:.2g} of their terms, tolerance {tol:.2g}"),
                                {"deviation": dev, "tolerance": tol}))
    return checks
