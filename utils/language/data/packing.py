"""Packed documents (`data.packing=documents`): where WikiText's articles start, and rows that say so.

A document is one article: it starts at its title line (`= Title =`; sections are `= = Heading = =`). Every
line of the token stream ends with <eos>, so an <eos> stands between two articles; a document's tokens are
that separating <eos> followed by its lines (the split's first document has none before it). The target
after a document's last token is therefore the <eos> (its end, predicted from its own text), and the <eos>
predicts the next document's first token with only itself as context: no token is predicted from another
document's text, so no target needs the ignore index and every row counts all its targets (the per-rank means
of dp and cp stay exact).

Rows are the stream cut every `seq_len` tokens, as with concatenated packing, so each row holds whole documents
except at its end, where the document that does not fit is cut and its remainder starts the next row (at
position 0 again: a row never sees the one before). Each input token carries the flag of a document start
(`networks.documents.pack_ids`); positions and the block-causal mask follow from the flags in the model.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import torch
from torch.utils.data import Dataset

from networks.documents import pack_ids
from utils import require

PACKINGS = ("concat", "documents")
ATTENTIONS = ("causal", "document")


def is_title(line: str) -> bool:
    """A WikiText article's title line (stripped): `= Title =`, not a section's `= = Heading = =`."""
    return line.startswith("= ") and not line.startswith("= =") and line.endswith(" =")


def document_starts(ids: np.ndarray, lines: Iterable[str], eos_id: int) -> np.ndarray:
    """int64 offsets in the token stream `ids` (every line followed by <eos>) where a document starts: the
    <eos> before each title line, and 0."""
    line_starts = np.concatenate(([0], np.flatnonzero(np.asarray(ids) == eos_id) + 1))  # one past the last too
    titles = np.fromiter((is_title(line) for line in lines), dtype=bool)
    require(len(titles) == len(line_starts) - 1, f"the token stream has {len(line_starts) - 1} <eos> tokens for "
            f"{len(titles)} lines (a line's text encodes to <eos>)", "data.packing",
            "set data.packing=concat for this corpus and tokenizer")
    starts = np.maximum(line_starts[:-1][titles] - 1, 0)
    return np.unique(np.concatenate(([0], starts))).astype(np.int64)


class PackedDocumentDataset(Dataset):
    """The rows of `blocks` (utils.language.data.wikitext.LMBlockDataset) with the document starts flagged in the
    inputs:
    item i = (packed ids of stream[i*S : i*S+S], plain next-token targets stream[i*S+1 : i*S+S+1]), int64."""

    def __init__(self, blocks: Dataset, starts: np.ndarray):
        self.blocks, self.seq_len = blocks, blocks.seq_len
        self.is_start = np.zeros(len(blocks.tokens), dtype=bool)
        self.is_start[starts[starts < len(blocks.tokens)]] = True

    def __len__(self) -> int:
        return len(self.blocks)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = self.blocks[i]
        start = i * self.seq_len
        return pack_ids(x, torch.from_numpy(self.is_start[start:start + self.seq_len].copy())), y


def check_packing(packing: str, attention: str) -> None:
    """User errors of `data.packing` and `data.attention`."""
    require(packing in PACKINGS, f"unknown packing {packing!r}", "data.packing", f"choose one of {', '.join(PACKINGS)}")
    require(attention in ATTENTIONS, f"unknown attention {attention!r}", "data.attention",
            f"choose one of {', '.join(ATTENTIONS)}")
    require(attention == "causal" or packing == "documents", "data.attention=document needs documents to mask: "
            "rows cut from one stream have none", "data.attention",
            "set data.packing=documents or data.attention=causal")
