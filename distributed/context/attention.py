"""Attention over a sequence split across the cp ranks: the two variants of `parallel.cp_attention`.

Each rank holds the queries, keys and values of its own tokens, (B, h, N_local, d) (h = the heads of
this tp rank; keys and values may have h/r heads, grouped-query attention), in the layout of
`distributed/context/layout.py`. Both variants move the grouped K/V, never copies per query head.

- `allgather` (the NERSC seed's semantics): forward all-gathers K and V over cp (`all_gather_region`:
  backward reduce-scatters their gradients) and runs SDPA of the local queries against the full
  sequence, with a boolean mask from the global positions when causal. Per block and step each rank
  sends (cp-1)/cp x 2 x bytes(full K) forward and as much backward; it holds the full K and V.
- `ring` (`distributed/context/ring.py`): K/V blocks travel around the ring while each rank computes
  blockwise attention with the log-sum-exp and merges exactly; the full K/V is never held.

Both return exactly what single-process attention gives for this rank's queries. Under torch.compile
`allgather` traces into the block's one graph; `ring` runs eagerly between two graphs of the block.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from distributed.context.layout import ContextShards
from distributed.context.ring import ring_attention
from distributed.mappings import all_gather_region

VARIANTS = ("allgather", "ring")


@torch.compiler.disable
def _ring(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, shards: ContextShards, causal: bool) -> torch.Tensor:
    """The ring runs eagerly between compiled graphs: its point-to-point hops and the block plan it
    derives from the positions (Python ints) are not traceable. One graph break per attention layer."""
    if not causal:
        return ring_attention(q, k, v, shards.axis, shards.sizes, None)
    return ring_attention(q, k, v, shards.axis, shards.sizes, shards.positions, shards.bounds)


class ContextParallelAttention(nn.Module):
    """Drop-in for `networks.blocks.ScaledDotProductAttention` under context parallelism."""

    def __init__(self, shards: ContextShards, causal: bool, variant: str, dropout: float = 0.0):
        super().__init__()
        assert variant in VARIANTS, variant
        assert variant == "allgather" or dropout == 0, "ring attention has no dropout (refused by utils.cli.config)"
        self.shards, self.causal, self.variant, self.dropout = shards, causal, variant, dropout

    @classmethod
    def from_serial(cls, core: nn.Module, shards: ContextShards, variant: str) -> ContextParallelAttention:
        return cls(shards, core.causal, variant, core.dropout)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        shards = self.shards
        if self.variant == "ring":
            return _ring(q, k, v, shards, self.causal)
        k_all = all_gather_region(k, shards.axis, 2, shards.sizes)  # (B, h, N, d) in rank order
        v_all = all_gather_region(v, shards.axis, 2, shards.sizes)
        mask = None
        if self.causal:  # query i sees key j iff pos(i) >= pos(j); keys are in rank order
            mask = shards.local_positions[:, None] >= torch.cat(shards.positions)[None, :]
        p = self.dropout if self.training else 0.0  # on a stream per shard: parallelize_context wraps it
        return F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=mask, dropout_p=p,
                                              enable_gqa=k.shape[1] != q.shape[1])

    def extra_repr(self) -> str:
        return f"cp={self.shards.axis.size}, causal={self.causal}, variant={self.variant}"
