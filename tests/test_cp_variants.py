"""Every `parallel.cp_attention` variant at op level: `ContextParallelAttention` on cp=2 and 4 gloo ranks.

For each variant (allgather, ring, alltoall; hierarchical at cp=4 as 2 groups of 2), causal (the balanced
layout) and non-causal (contiguous, even and uneven lengths), with as many key/value heads as query heads
and with grouped K/V (grouped-query attention), the output and dQ, dK, dV of each rank's own tokens equal
serial SDPA over the full sequence within 1e-10 (float64); the all-to-all's bytes on the cp axis equal
its docstring's formula. Under bf16 autocast (as the trainer calls attention) each variant is as accurate
against float64 as serial SDPA under the same autocast on the same peaked inputs
(tests/attention_accuracy.py's measure and slack; the matrix checks the same on the variants as its cases
build them, at cp=2 only).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from distributed.context.attention import VARIANTS, ContextParallelAttention
from distributed.context.layout import ContextShards
from tests.attention_accuracy import SLACK, relative_errors, under_autocast
from tests.helpers import run_ranks
from utils.comm import AxisGroup

B, H, D = 2, 4, 8
TOL = 1e-10


def _reference(q, k, v, grad, causal: bool) -> list[torch.Tensor]:
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=k.shape[1] != q.shape[1])
    out.backward(grad)
    return [out.detach(), q.grad, k.grad, v.grad]


def _check(axis: AxisGroup, variant: str, n: int, causal: bool, kv_heads: int, hierarchy=None) -> None:
    gen = torch.Generator().manual_seed(n + 10 * kv_heads + causal)
    q, grad = (torch.randn(B, H, n, D, generator=gen, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(B, kv_heads, n, D, generator=gen, dtype=torch.float64) for _ in range(2))
    ref = _reference(q, k, v, grad, causal)
    shards = ContextShards(axis, balanced=causal)
    shards.enter(n, torch.device("cpu"))
    local = [shards.shard(t, 2).detach().clone().requires_grad_() for t in (q, k, v)]
    attention = ContextParallelAttention(shards, causal, variant, hierarchy=hierarchy)
    before = int(axis.counter)
    out = attention(*local)
    out.backward(shards.shard(grad, 2))
    got = [out.detach(), *(t.grad for t in local)]
    for name, g, r in zip(("out", "dq", "dk", "dv"), got, ref):
        torch.testing.assert_close(g, shards.shard(r, 2), rtol=TOL, atol=TOL, msg=f"{variant} {name}")
    if variant == "alltoall":  # q, k, v and out there and back; uneven lengths padded to the longest
        longest, cp = max(shards.sizes), axis.size
        kv = kv_heads if kv_heads % cp == 0 else H  # grouped K/V that cp does not divide travel repeated
        elements = B * longest * D * (H + 2 * kv + H)
        assert int(axis.counter) - before == 2 * (cp - 1) * elements * 8 // cp
    if variant == "hierarchical":  # the all-to-alls inside the group, the flat ring's formula across the groups
        inner, outer = hierarchy
        a, g = inner.size, outer.size
        members, sizes, _, _ = shards.groups(a)
        kv = kv_heads if kv_heads % a == 0 else H
        a2a = 2 * (a - 1) * B * max(members) * D * (H + 2 * kv + H) * 8 // a
        block = [2 * B * (kv // a) * n * D * 8 for n in sizes]  # a group's K and V for this rank's heads
        hops = [block[(outer.rank - s) % g] for s in range(g)]
        assert int(axis.counter) - before == a2a + 2 * sum(hops[:-1]) + sum(hops)


def _check_autocast(axis: AxisGroup, variant: str, n: int, causal: bool, hierarchy=None) -> None:
    """bf16 autocast: this rank's out, dQ, dK, dV within SLACK x serial SDPA's relative error against float64."""
    gen = torch.Generator().manual_seed(7 + causal)
    q, k, v, grad = (torch.randn(B, H, n, D, generator=gen, dtype=torch.float64) for _ in range(4))
    q = q * 6.0  # peaked rows: where statistics kept in bf16 hurt most
    shards = ContextShards(axis, balanced=causal)
    shards.enter(n, torch.device("cpu"))
    want = [shards.shard(t, 2) for t in _reference(q, k, v, grad, causal)]
    serial = under_autocast(lambda *t: F.scaled_dot_product_attention(*t, is_causal=causal), q, k, v, grad,
                            torch.bfloat16)
    bound = relative_errors([shards.shard(t, 2) for t in serial], want)
    attention = ContextParallelAttention(shards, causal, variant, hierarchy=hierarchy)
    got = relative_errors(under_autocast(attention, *(shards.shard(t, 2) for t in (q, k, v, grad)),
                                         torch.bfloat16), want)
    worse = [f"{name} {g:.2e} > {SLACK} x {b:.2e}" for name, g, b in zip(("out", "dq", "dk", "dv"), got, bound)
             if g > SLACK * b]
    assert not worse, f"{variant} (causal={causal}) under bf16 autocast: " + ", ".join(worse)


def _all_variants(rank: int, world: int) -> None:
    from utils.comm import init_grid
    from utils.schema import ParallelConfig

    grid = init_grid(ParallelConfig(cp=world, cp_attention="hierarchical" if world == 4 else "ring", cp_a2a=2))
    axis = grid.axis("cp")
    for variant in VARIANTS if world == 4 else [v for v in VARIANTS if v != "hierarchical"]:
        hierarchy = grid.cp_hierarchy if variant == "hierarchical" else None
        for kv_heads in (H, H // 2, 1):
            _check(axis, variant, 8 * world, True, kv_heads, hierarchy)  # balanced: 2cp chunks of 4 tokens
            _check(axis, variant, 8 * world + 3, False, kv_heads, hierarchy)  # contiguous, uneven
        _check_autocast(axis, variant, 16 * world, True, hierarchy)
        _check_autocast(axis, variant, 16 * world + 3, False, hierarchy)


def test_every_variant_equals_serial_attention_cp2(tmp_path):
    run_ranks(_all_variants, 2, tmp_path)


def test_every_variant_equals_serial_attention_cp4(tmp_path):
    run_ranks(_all_variants, 4, tmp_path)
