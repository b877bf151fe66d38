"""Which tokens each context-parallel rank holds, shared by every cp layer of one model.

Two layouts of a sequence of N tokens over the cp ranks of `axis`:
- contiguous (non-causal models, the ViT): rank r holds the r-th chunk of `torch.tensor_split`
  (uneven lengths allowed: 4050 patches over 4 ranks are 1013, 1013, 1012, 1012);
- balanced (causal models, the LM): the sequence is cut into 2*cp equal chunks and rank r holds chunks
  r and 2cp-1-r, so every rank has as many query-key pairs left unmasked by causality (N must be a
  multiple of 2*cp). Contiguous shards would give the last rank cp times the first one's work.

`ContextShards.enter(length, device)` fixes the layout for a sequence length (cached per length), and
the model's region markers and layers then read it: `shard` keeps this rank's tokens (backward:
the gradient scattered into zeros, no communication: everything before the split gets cp-partial
gradients, which the data-parallel reduction sums over cp), `unshard` gathers every rank's tokens
back into sequence order (backward: this rank's part of the gradient), `positions` gives the global
position of every rank's tokens (rotary tables and causal masks read them).
"""

from __future__ import annotations

import torch

from distributed.context.ring import position_bounds
from distributed.mappings import gather_from_region
from utils import require
from utils.comm import AxisGroup


def chunk_positions(length: int, size: int, balanced: bool) -> list[torch.Tensor]:
    """Global positions of every rank's tokens (a list of `size` LongTensors) for a layout."""
    if not balanced:
        return list(torch.arange(length).tensor_split(size))
    chunks = torch.arange(length).chunk(2 * size)
    return [torch.cat((chunks[r], chunks[2 * size - 1 - r])) for r in range(size)]


class ContextShards:
    """The token layout of one model over the cp axis, fixed per sequence length by `enter`."""

    def __init__(self, axis: AxisGroup, balanced: bool):
        self.axis, self.balanced = axis, balanced
        self.multiple = 2 * axis.size if balanced else 1  # a sequence length must be a multiple of this
        self._cache: dict[tuple[int, str], tuple[list[torch.Tensor], torch.Tensor, torch.Tensor, list]] = {}
        self._groups: dict[tuple[int, int], tuple] = {}  # hierarchical attention's group layouts (`groups`)

    def enter(self, length: int, device: torch.device) -> None:
        """Fix the layout for sequences of `length` tokens on `device`."""
        require(length % self.multiple == 0 and length >= self.axis.size,
                f"a sequence of {length} tokens cannot be split over cp={self.axis.size}" +
                (f" in 2 x cp = {self.multiple} equal chunks" if self.balanced else ""), "parallel.cp",
                f"use a sequence length that is a multiple of {self.multiple} (and at least cp)")
        key = (length, str(device))
        if key not in self._cache:
            host = chunk_positions(length, self.axis.size, self.balanced)
            positions = [p.to(device) for p in host]
            bounds = position_bounds(host, [len(p) for p in host])  # on the host: no device sync per layer
            rank_order = torch.cat(positions)
            self._cache[key] = positions, torch.argsort(rank_order), rank_order, bounds
        # bounds: (min, max) position per rank; rank_order: the global position of every token in rank order
        self.positions, self._order, self.rank_order, self.bounds = self._cache[key]
        self.sizes = [len(p) for p in self.positions]
        self.chunk = length // self.multiple if self.balanced else None  # tokens per chunk of the balanced layout

    def groups(self, a2a: int) -> tuple[list[int], list[int], list[torch.Tensor] | None, list]:
        """For all-to-all groups of `a2a` consecutive cp ranks joined by a ring: (the token counts of this
        rank's group members, each group's token count, each group's global positions (its members' in
        rank order; None for the contiguous layout of non-causal models), their bounds). Cached per length."""
        key = (sum(self.sizes), a2a)
        cache = self._groups
        if key not in cache:
            count = self.axis.size // a2a
            members = [list(range(g * a2a, (g + 1) * a2a)) for g in range(count)]
            sizes = [sum(self.sizes[r] for r in m) for m in members]
            # plant: hierarchical_group_positions_reversed (next line)
            positions = [torch.cat([self.positions[r] for r in m]) for m in members] if self.balanced else None
            host = None if positions is None else [p.cpu() for p in positions]
            cache[key] = sizes, positions, position_bounds(host, sizes)
        group = self.axis.rank // a2a
        sizes, positions, bounds = cache[key]
        return [self.sizes[r] for r in range(group * a2a, (group + 1) * a2a)], sizes, positions, bounds

    @property
    def order(self) -> torch.Tensor | None:
        """Indices that put tokens gathered in rank order into sequence order (None: already in it)."""
        return self._order if self.balanced else None

    @property
    def local_positions(self) -> torch.Tensor:
        """Global positions of this rank's tokens, (N_local,)."""
        return self.positions[self.axis.rank]

    def shard(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """This rank's tokens of a full sequence along `dim` (index_select: its backward scatters)."""
        if not self.balanced:
            start = sum(self.sizes[:self.axis.rank])
            return x.narrow(dim, start, self.sizes[self.axis.rank])
        return x.index_select(dim, self.local_positions)

    def unshard(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """Every rank's tokens along `dim`, back in sequence order (fwd all-gather, bwd own part)."""
        gathered = gather_from_region(x, self.axis, dim, self.sizes)  # rank order
        return gathered if not self.balanced else gathered.index_select(dim, self._order)
