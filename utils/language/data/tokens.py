"""`data=tokens`: the language model on pre-tokenized shards (utils/language/data/prepare.py writes them),
memory-mapped.

The shards concatenated in index order are one token stream, documents separated by the EOS id. Validation
holds `data.valid_fraction` of the documents, the last ones of each shard in proportion (every source
contributes; utils/language/data/shards.py `held_out_split`); training is the rest. Each split is cut into rows of
seq_len + 1 tokens by the WikiText reader's `LMBlockDataset` and served by the same layout-invariant global
batches (utils/data/batching.py), so the order is the same for any dp size and a run resumes mid-epoch
under any layout with no saved loader state. A missing or damaged index, a shard of the wrong size, or (with
`data.verify=checksum`, the default) a checksum mismatch stops the run before any work with one line.
With `data.packing=documents` the rows also flag where documents start (`PackedShardRows`).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from networks.documents import pack_ids
from utils import ConfigError, require
from utils.language.data.shards import Index, ShardStream, check_shards, document_starts, held_out_split, read_index
from utils.language.data.text import TextSource
from utils.language.data.tokenizers import PretrainedTokenizer
from utils.language.data.wikitext import LMBlockDataset

VERIFY = ("checksum", "size")
UNIGRAM_TOKENS = 1 << 24  # tokens of each split the unigram baseline reads (a corpus may exceed memory)


@dataclass
class TokensConfig(TextSource):
    """Schema of `data=tokens`: a folder of pre-tokenized shards (the rows: `TextSource`'s settings)."""

    kind: str = "tokens"  # data family tag (fixed by the preset)
    root: str | None = None  # the folder `python -m utils.data.prepare --out` wrote (index.json, shards)
    valid_fraction: float = 0.01  # documents held out for validation (the last of each shard, in proportion)
    resident_mib: int = 64  # MiB of shard pages a stream's mappings may hold resident per process (then remapped)
    verify: str = "checksum"  # checksum: sha256 of every shard at start (reads the corpus) | size: file sizes only

    def __post_init__(self):
        require(self.kind == "tokens", f"kind {self.kind!r} is not tokens", "data.kind",
                "leave kind as set by the preset")
        require(0 < self.valid_fraction < 1, f"valid_fraction {self.valid_fraction} is not in (0, 1)",
                "data.valid_fraction", "hold out a fraction of the documents, e.g. 0.01")
        require(self.verify in VERIFY, f"unknown verify {self.verify!r}", "data.verify",
                f"choose {' or '.join(VERIFY)}")
        require(self.resident_mib > 0, f"resident_mib must be positive, got {self.resident_mib}", "data.resident_mib",
                "give the MiB of mapped shard pages a reader may hold, e.g. 64")
        super().__post_init__()

    def open(self) -> TokensCorpus:
        return load_tokens(self)

    def trained_tokenizer(self) -> PretrainedTokenizer:
        """The tokenizer the shards were made with (its copy in root)."""
        try:
            return PretrainedTokenizer.load(self.tokenizer)
        except ConfigError as err:
            raise ConfigError(err.what, "data.root", "give the run's shard folder: data.root=DIR") from None

    @property
    def tokenizer(self) -> str:
        """The tokenizer folder the shards were made with (its copy in root; what export and generate read)."""
        return str(Path(self.root or ".").expanduser() / "tokenizer")


def token_counts(stream: ShardStream, vocab_size: int, limit: int, chunk: int = 1 << 20) -> np.ndarray:
    """How often each id occurs in the first `limit` tokens of `stream`, read in chunks."""
    counts = np.zeros(vocab_size, dtype=np.int64)
    for start in range(0, min(len(stream), limit), chunk):
        counts += np.bincount(stream[start:min(start + chunk, limit)], minlength=vocab_size)[:vocab_size]
    return counts


class PackedShardRows(Dataset):
    """data.packing=documents on shards: the rows of `blocks` (over a ShardStream) with their document starts
    flagged as utils.language.data.packing flags WikiText's: the split's first token and the EOS before every later
    document (the one separating it from the one before). The starts of a row are looked up in the shards'
    memory-mapped document starts, so memory does not grow with the corpus."""

    def __init__(self, blocks: LMBlockDataset, index: Index):
        self.blocks, self.seq_len, self.index, self.stream = blocks, blocks.seq_len, index, blocks.tokens

    def __len__(self) -> int:
        return len(self.blocks)

    def flags(self, start: int, stop: int) -> np.ndarray:
        """bool (stop - start,): which tokens of stream[start:stop] are flagged as document starts."""
        stream, flags = self.stream, np.zeros(stop - start, dtype=bool)
        first = int(np.searchsorted(stream.ends, start, side="right"))
        last = min(int(np.searchsorted(stream.ends, stop, side="right")), len(stream.segments) - 1)
        for k in range(first, last + 1):  # the segments whose flags can fall in [start, stop)
            shard, a, b = (int(v) for v in stream.segments[k])
            begin = int(stream.ends[k]) - (b - a)  # where segment k starts in the stream
            docs = document_starts(self.index, shard)
            inner = np.asarray(docs[np.searchsorted(docs, a, side="right"):np.searchsorted(docs, b)], np.int64)
            marks = np.concatenate(([begin - 1 if k else 0], begin + inner - a - 1))
            flags[marks[(marks >= start) & (marks < stop)] - start] = True
        return flags

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = self.blocks[i]
        return pack_ids(x, torch.from_numpy(self.flags(i * self.seq_len, (i + 1) * self.seq_len))), y


@dataclass
class TokensCorpus:
    """A prepared folder: its index, the tokenizer, and the memory-mapped train and validation streams."""

    index: Index
    tokenizer: PretrainedTokenizer
    train: ShardStream
    valid: ShardStream
    packing: str = "concat"  # data.packing

    @property
    def vocab_size(self) -> int:
        return self.index.vocab_size

    def dataset(self, split: str, seq_len: int) -> LMBlockDataset | PackedShardRows:
        blocks = LMBlockDataset(getattr(self, split), seq_len, split)
        return blocks if self.packing == "concat" else PackedShardRows(blocks, self.index)

    @functools.cached_property
    def unigram_ppl(self) -> float:
        """Perplexity on validation of the add-one unigram model of the training tokens (each split's first
        UNIGRAM_TOKENS tokens): the baseline a language model must beat."""
        counts = token_counts(self.train, self.vocab_size, UNIGRAM_TOKENS).astype(np.float64) + 1.0
        log_p = np.log(counts) - math.log(counts.sum())
        seen = token_counts(self.valid, self.vocab_size, UNIGRAM_TOKENS)
        return float(np.exp(-(seen * log_p).sum() / max(1, seen.sum())))

    def describe(self) -> str:
        """One log line: where from, tokenizer, vocabulary, split sizes and the unigram baseline on valid."""
        tok = self.index.tokenizer
        return (f"{self.index.root} ({len(self.index.shards)} shards, tokenizer {tok.get('name', '?')}): vocab "
                f"{self.vocab_size}, tokens train {len(self.train)} valid {len(self.valid)}, unigram valid ppl "
                f"{self.unigram_ppl:.1f}")


def load_tokens(cfg: TokensConfig) -> TokensCorpus:
    """Read and check the index and shards of `cfg.root`, split them and open the streams (nothing is loaded)."""
    require(bool(cfg.root), "no shard folder given", "data.root",
            "set data.root to a folder written by python -m utils.data.prepare")
    root = Path(cfg.root).expanduser()
    require(root.is_dir(), f"shard folder {root} does not exist", "data.root",
            "set data.root to a folder written by python -m utils.data.prepare")
    index = read_index(root)
    check_shards(index, checksum=cfg.verify == "checksum")
    try:
        tokenizer = PretrainedTokenizer.load(cfg.tokenizer)
    except ConfigError as err:
        raise ConfigError(err.what, "data.root", "prepare the folder again (it copies the tokenizer there)") from None
    require(tokenizer.fingerprint == index.tokenizer["fingerprint"], f"{cfg.tokenizer} is not the tokenizer the "
            "shards were made with (another fingerprint)", "data.root", "prepare the folder again")
    train, valid = held_out_split(index, cfg.valid_fraction)
    files, dtypes = [index.path(i) for i in range(len(index.shards))], [s["dtype"] for s in index.shards]
    streams = [ShardStream(files, dtypes, segments, cfg.resident_mib << 20).head(limit)
               for segments, limit in ((train, cfg.limit_train_tokens), (valid, cfg.limit_eval_tokens))]
    for split, stream in zip(("train", "valid"), streams):
        require(len(stream) > cfg.seq_len, f"the {split} split of {root} has {len(stream)} tokens, too few for one "
                f"row of data.seq_len={cfg.seq_len} + 1", "data.valid_fraction" if split == "valid" else "data.root",
                "hold out more documents (data.valid_fraction)" if split == "valid" else "prepare a larger corpus")
    return TokensCorpus(index, tokenizer, *streams, packing=cfg.packing)
