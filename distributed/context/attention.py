"""Attention over a sequence split across the cp ranks: the four variants of `parallel.cp_attention`.

Each rank holds the queries, keys and values of its own tokens, (B, h, N_local, d) (h = the heads of
this tp rank; keys and values may have h/r heads, grouped-query attention), in the layout of
`distributed/context/layout.py`. Every variant moves grouped K/V as it is (the all-to-alls repeat it
only when their group size does not divide its heads).

- `allgather` (the NERSC seed's semantics): forward all-gathers K and V over cp (`all_gather_region`:
  backward reduce-scatters their gradients) and runs SDPA of the local queries against the full
  sequence, with a boolean mask from the global positions when causal. Per block and step each rank
  sends (cp-1)/cp x 2 x bytes(full K) forward and as much backward; it holds the full K and V.
- `ring` (`distributed/context/ring.py`): K/V blocks travel around the ring while each rank computes
  blockwise attention with the log-sum-exp and merges exactly; the full K/V is never held.
- `alltoall` (DeepSpeed-Ulysses, Jacobs et al. 2023; anemoi's sequence sharding): an all-to-all turns
  q, k and v from sequence shards into head shards, (B, h/cp, N, d): each rank attends with plain SDPA
  over the whole sequence for its h/cp heads (tokens put in sequence order first, so causal attention is
  `is_causal` with no mask), and a second all-to-all turns the output back. Each all-to-all moves
  (cp-1)/cp of its buffer: per layer and step, forward (cp-1)/cp x (bytes(q) + bytes(k) + bytes(v) +
  bytes(out)) of this rank's shards, backward as much again. The heads of this rank (after tp) must be a
  multiple of cp; grouped K/V heads that are not are repeated to the query heads first (then k and v
  move as many bytes as q).
- `hierarchical` (Megatron-core's a2a+p2p): the cp ranks form groups of `parallel.cp_a2a` nearest ranks
  (one node's GPUs, by the axis order); an all-to-all inside each group turns its members' sequence
  shards into head shards of the group's tokens, a ring across the groups (the ranks with the same
  heads) runs ring attention on them, and an all-to-all turns the output back. The bulk (q, k, v and
  out, (a-1)/a of them) moves inside a group; across groups the ring makes g-1 hops (g = cp/a) instead of
  cp-1, each the size of a flat ring's hop (h/a heads of a times the tokens). The ring runs the generic
  position-masked blocks (a group's tokens span both halves of the balanced layout).

With packed documents (`data.attention=document`) each variant takes the batch's `Documents` (every rank holds the
full rows before the split) and masks by document at its own positions: all-gather its queries against every key
in rank order, all-to-all the whole sequence in order, the rings per block (distributed/context/ring.py).

Each returns exactly what single-process attention gives for this rank's queries. Under torch.compile
`allgather` and `alltoall` trace into the block's one graph; `ring` (and the hierarchical variant's ring)
runs eagerly between two graphs of the block.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from distributed.context.layout import ContextShards
from distributed.context.ring import ring_attention

# plant: cp_allgather_key_grads_unsummed (next line)
from distributed.mappings import all_gather_region, heads_to_sequence, sequence_to_heads
from networks.documents import Documents
from utils.comm import AxisGroup
from utils.schema import CP_VARIANTS

VARIANTS = CP_VARIANTS


@functools.cache
def eager_between_graphs(fn):
    """`fn` under `torch.compiler.disable`, made when a layer that needs it is built: the decorator imports
    torch._dynamo (most of a second), which a process without a ring need not pay at its start."""
    return torch.compiler.disable(fn)


def _ring(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, shards: ContextShards, causal: bool,
          documents: Documents | None = None) -> torch.Tensor:
    """The ring runs eagerly between compiled graphs: its point-to-point hops and the block plan it
    derives from the positions (Python ints) are not traceable. One graph break per attention layer."""
    if not causal:
        return ring_attention(q, k, v, shards.axis, shards.sizes, None)
    return ring_attention(q, k, v, shards.axis, shards.sizes, shards.positions, shards.bounds, shards.chunk,
                          documents, "ring")


def _hierarchical_ring(q, k, v, outer: AxisGroup, sizes: list[int], positions, bounds,
                       documents: Documents | None = None) -> torch.Tensor:
    """The ring across the groups runs eagerly, as the flat ring does."""
    return ring_attention(q, k, v, outer, sizes, positions, bounds, documents=documents, tag="groups")


class ContextParallelAttention(nn.Module):
    """Drop-in for `networks.blocks.ScaledDotProductAttention` under context parallelism."""

    def __init__(self, shards: ContextShards, causal: bool, variant: str, dropout: float = 0.0,
                 hierarchy: tuple[AxisGroup, AxisGroup] | None = None):
        super().__init__()
        assert variant in VARIANTS, variant
        assert variant in ("allgather", "alltoall") or dropout == 0, (
            "the ring has no dropout (refused by utils.schema.Config)")
        assert (variant == "hierarchical") == (hierarchy is not None), "hierarchical attention needs its two groups"
        self.shards, self.causal, self.variant, self.dropout = shards, causal, variant, dropout
        self.hierarchy = hierarchy  # (all-to-all group, ring across the groups): utils.comm.Grid.cp_hierarchy
        if variant in ("ring", "hierarchical"):  # eager between compiled graphs (see `_ring`)
            self.ring = eager_between_graphs(_ring if variant == "ring" else _hierarchical_ring)

    @classmethod
    def from_serial(cls, core: nn.Module, shards: ContextShards, variant: str,
                    hierarchy: tuple[AxisGroup, AxisGroup] | None = None) -> ContextParallelAttention:
        return cls(shards, core.causal, variant, core.dropout, hierarchy)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                documents: Documents | None = None) -> torch.Tensor:
        """`documents` (packed rows, `data.attention=document`): attention also inside each document, the mask
        read for each variant's own token layout from the batch's documents (every rank has the full rows)."""
        shards = self.shards
        assert documents is None or self.causal, "documents are masked in causal models only"
        if self.variant == "ring":
            return self.ring(q, k, v, shards, self.causal, documents)
        if self.variant == "alltoall":
            return self._alltoall(q, k, v, documents)
        if self.variant == "hierarchical":
            return self._hierarchical(q, k, v, documents)
        # plant: cp_allgather_key_grads_unsummed (next line)
        k_all = all_gather_region(k, shards.axis, 2, shards.sizes)  # (B, h, N, d) in rank order
        v_all = all_gather_region(v, shards.axis, 2, shards.sizes)
        mask = None
        if documents is not None:  # (B, 1, N_local, N): causal and inside each document
            mask = documents.mask(shards.local_positions, shards.rank_order)
        elif self.causal:  # query i sees key j iff pos(i) >= pos(j); keys are in rank order
            mask = shards.local_positions[:, None] >= shards.rank_order[None, :]
        p = self.dropout if self.training else 0.0  # on a stream per shard: parallelize_context wraps it
        return F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=mask, dropout_p=p,
                                              enable_gqa=k.shape[1] != q.shape[1])

    def _alltoall(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  documents: Documents | None = None) -> torch.Tensor:
        """Head-sharded attention over the whole sequence between two all-to-alls (see the module doc)."""
        shards, cp = self.shards, self.shards.axis.size
        if k.shape[1] % cp:  # grouped K/V heads that cp does not divide: one copy per query head
            k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
        q, k, v = (sequence_to_heads(t, shards.axis, shards.sizes) for t in (q, k, v))  # (B, h/cp, N, d), rank order
        order = shards.order  # rank order -> sequence order (identity for the contiguous layout)
        if order is not None:
            q, k, v = (t.index_select(2, order) for t in (q, k, v))
        p = self.dropout if self.training else 0.0
        if documents is not None:  # the whole sequence in order: the documents' block-causal mask (B, 1, N, N)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=documents.mask(), dropout_p=p,
                                                 enable_gqa=k.shape[1] != q.shape[1])
        else:
            # plant: alltoall_drops_causal (next line)
            out = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=self.causal,
                                                 enable_gqa=k.shape[1] != q.shape[1])
        if order is not None:
            out = out.index_select(2, shards.rank_order)
        return heads_to_sequence(out, shards.axis, shards.sizes)

    def _hierarchical(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      documents: Documents | None = None) -> torch.Tensor:
        """All-to-all inside the group of nearby ranks, ring across the groups, all-to-all back."""
        inner, outer = self.hierarchy
        members, sizes, positions, bounds = self.shards.groups(inner.size)
        if k.shape[1] % inner.size:  # grouped K/V heads the group does not divide: one copy per query head
            k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
        q, k, v = (sequence_to_heads(t, inner, members) for t in (q, k, v))  # (B, h/a, the group's tokens, d)
        out = self.ring(q, k, v, outer, sizes, positions if self.causal else None, bounds, documents)
        return heads_to_sequence(out, inner, members)

    def extra_repr(self) -> str:
        return f"cp={self.shards.axis.size}, causal={self.causal}, variant={self.variant}"
