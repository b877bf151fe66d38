"""Every `parallel.cp_attention` variant with packed documents (`data.attention=document`) at op level.

On cp=2 and cp=4 gloo ranks (hierarchical at cp=4 as 2 groups of 2), with as many key/value heads as query heads
and grouped K/V, rows whose document boundaries fall anywhere in a rank's shard (inside chunks, on a chunk's edge,
a document shorter than a chunk): each rank's output and dQ, dK, dV equal float64 SDPA over the full rows with an
explicit block-causal mask built here token by token (1e-10). The ring's score work per rank (`ring_work`, the plan
it runs, and the pairs its forward scores) with documents is the causal plan's for one document per row and
less for many short ones or boundaries in a shard.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from distributed.context import blocks
from distributed.context.attention import VARIANTS, ContextParallelAttention
from distributed.context.blocks import block_attention
from distributed.context.layout import ContextShards, chunk_positions
from distributed.context.ring import ring_work
from networks.documents import Documents
from tests.helpers import run_ranks
from utils.comm import AxisGroup

B, H, D = 2, 4, 8
TOL = 1e-10


def _starts(n: int) -> torch.Tensor:
    """Document starts of two rows of n tokens: row 0 cut at uneven places (one on a chunk edge of cp=2, n/4),
    row 1 in documents of 3 tokens."""
    starts = torch.zeros(B, n, dtype=torch.bool)
    starts[0, [3, n // 4, n // 4 + 1, n // 2 + 5, n - 2]] = True
    starts[1, ::3] = True
    return starts


def explicit_mask(starts: torch.Tensor) -> torch.Tensor:
    """(B, 1, n, n): query i sees key j iff j <= i and no document starts in (j, i], written out pair by pair."""
    n = starts.shape[1]
    mask = torch.zeros(B, 1, n, n, dtype=torch.bool)
    for b in range(B):
        for i in range(n):
            for j in range(i + 1):
                mask[b, 0, i, j] = not bool(starts[b, j + 1:i + 1].any())
    return mask


def _reference(q, k, v, grad, mask) -> list[torch.Tensor]:
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=k.shape[1] != q.shape[1])
    out.backward(grad)
    return [out.detach(), q.grad, k.grad, v.grad]


def _check(axis: AxisGroup, variant: str, n: int, kv_heads: int, hierarchy=None) -> None:
    gen = torch.Generator().manual_seed(n + kv_heads)
    q, grad = (torch.randn(B, H, n, D, generator=gen, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(B, kv_heads, n, D, generator=gen, dtype=torch.float64) for _ in range(2))
    starts = _starts(n)
    ref = _reference(q, k, v, grad, explicit_mask(starts))
    shards = ContextShards(axis, balanced=True)
    shards.enter(n, torch.device("cpu"))
    local = [shards.shard(t, 2).detach().clone().requires_grad_() for t in (q, k, v)]
    attention = ContextParallelAttention(shards, True, variant, hierarchy=hierarchy)
    documents, pairs = Documents(starts, masked=True), []

    def counted(q_, k_, *rest):
        pairs.append(q_.shape[-2] * k_.shape[-2] // (H // kv_heads))  # the folded query heads of a group: once
        return block_attention(q_, k_, *rest)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(blocks, "block_attention", counted)
        out = attention(*local, documents)
    if variant == "ring":  # the forward scored exactly the pairs of the plan ring_work counts
        work = ring_work(axis.rank, shards.sizes, shards.positions, shards.chunk, Documents(starts, masked=True))
        assert sum(pairs) == work < ring_work(axis.rank, shards.sizes, shards.positions, shards.chunk)
    out.backward(shards.shard(grad, 2))
    for name, g, r in zip(("out", "dq", "dk", "dv"), [out.detach(), *(t.grad for t in local)], ref):
        torch.testing.assert_close(g, shards.shard(r, 2), rtol=TOL, atol=TOL, msg=f"{variant} {name}")


def _all_variants(rank: int, world: int) -> None:
    from utils.comm import init_grid
    from utils.schema import ParallelConfig

    grid = init_grid(ParallelConfig(cp=world, cp_attention="hierarchical" if world == 4 else "ring", cp_a2a=2))
    for variant in VARIANTS if world == 4 else [v for v in VARIANTS if v != "hierarchical"]:
        hierarchy = grid.cp_hierarchy if variant == "hierarchical" else None
        for kv_heads in (H, H // 2):
            _check(grid.axis("cp"), variant, 8 * world, kv_heads, hierarchy)


def test_every_variant_masks_documents_cp2(tmp_path):
    run_ranks(_all_variants, 2, tmp_path)


def test_every_variant_masks_documents_cp4(tmp_path):
    run_ranks(_all_variants, 4, tmp_path)


def test_ring_skips_blocks_outside_documents():
    cp, n = 4, 64
    positions = chunk_positions(n, cp, balanced=True)
    sizes, chunk = [len(p) for p in positions], n // (2 * cp)
    one = Documents(torch.zeros(1, n, dtype=torch.bool), masked=True)
    short = torch.zeros(1, n, dtype=torch.bool)
    short[0, ::4] = True  # documents of 4 tokens: half a chunk
    for rank in range(cp):
        causal = ring_work(rank, sizes, positions, chunk)
        assert causal == (2 * cp + 1) * chunk ** 2  # the balanced causal plan (ring.py's docstring)
        assert ring_work(rank, sizes, positions, chunk, one) == causal  # one document: nothing more to skip
        # documents of 4 tokens: only each query chunk's own diagonal chunk pair has visible pairs
        assert ring_work(rank, sizes, positions, chunk, Documents(short, masked=True)) == 2 * chunk ** 2
        assert ring_work(rank, sizes, positions, None, Documents(short, masked=True)) == sizes[rank] ** 2
