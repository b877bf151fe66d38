"""Packed documents: which document each token of a row belongs to, its position in it, and the attention mask.

A row packed from whole documents (`data.packing=documents`, utils/language/data/packing.py) carries its structure in
its token ids: a token that begins a document has `DOC_START` added to its id (`pack_ids`). One int64 tensor
(B, S) is then all a batch is, as in concatenated packing, so it travels unchanged through every path a batch
takes (the tp x cp broadcast, dp splits, pipeline micro-batches, validation padding); the model reads it back
with `Documents.read` (`unpack_ids` gives the plain token ids). The first token of a row always begins a
segment (the remainder of a document cut at the previous row's end starts again at position 0). Ids without
flags (prompts, benchmark batches) read as one document per row: positions 0 .. S-1, plain causal attention.

`Documents` holds, for the full sequence (B, S) of a batch (every cp rank has the full batch before the split):
- `positions`: each token's position in its document, 0 at its start (rotary tables and learned position
  embeddings read them);
- `ids`: each token's document index in its row (0, 1, ...);
- `masked`: whether attention stays inside a document (`data.attention=document`: query i sees key j iff
  j <= i and both are in one document, block-causal); False: causal over the whole row, positions still reset.
Context-parallel attention asks it for the mask of any set of query and key positions (`mask`), whatever the
variant's layout.
"""

from __future__ import annotations

import torch

DOC_START = 1 << 40  # added to the id of a token that begins a document; far above any vocabulary


def pack_ids(tokens: torch.Tensor, starts: torch.Tensor) -> torch.Tensor:
    """int64 ids (.., S) of `tokens` with the flag of the ones that begin a document (`starts`, bool)."""
    return tokens.long() + starts.long() * DOC_START


def unpack_ids(ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(plain token ids, bool flags of document starts) of packed ids."""
    return ids % DOC_START, ids >= DOC_START


class Documents:
    """The document structure of a batch of packed rows (see the module docstring)."""

    def __init__(self, starts: torch.Tensor, masked: bool):
        """`starts` (B, S) bool: tokens that begin a document (the first of a row always does)."""
        index = torch.arange(starts.shape[-1], device=starts.device)
        starts = starts | (index == 0)
        self.ids = starts.long().cumsum(-1) - 1  # (B, S)
        self.positions = index - torch.where(starts, index, 0).cummax(-1).values  # (B, S)
        self.masked = masked
        self.cache: dict = {}  # block plans of this batch (distributed/context/ring.py), shared by every layer

    @classmethod
    def read(cls, ids: torch.Tensor, masked: bool) -> Documents:
        """The documents of packed ids (B, S)."""
        return cls(unpack_ids(ids)[1], masked)

    def mask(self, query: torch.Tensor | None = None, key: torch.Tensor | None = None) -> torch.Tensor:
        """(B, 1, nq, nk) bool: which keys each query sees, for the tokens at sequence positions `query` and
        `key` (1-D, default every token): causal, and inside one document when `masked`."""
        every = torch.arange(self.ids.shape[-1], device=self.ids.device)
        query = every if query is None else query.to(every.device)
        key = every if key is None else key.to(every.device)
        visible = (query[:, None] >= key[None, :])[None]  # (1, nq, nk)
        if self.masked:
            visible = visible & (self.ids[:, query, None] == self.ids[:, None, key])  # (B, nq, nk)
        return visible.expand(self.ids.shape[0], -1, -1)[:, None]
