"""`data=tokens`: the language model on pre-tokenized shards (utils/data/prepare.py writes them), memory-mapped.

The shards concatenated in index order are one token stream, documents separated by the EOS id. Validation
holds `data.valid_fraction` of the documents, the last ones of each shard in proportion (every source
contributes; utils/data/shards.py `held_out_split`); training is the rest. Each split is cut into rows of
seq_len + 1 tokens by the WikiText reader's `LMBlockDataset` and served by the same layout-invariant global
batches (utils/data/batching.py), so the order is the same for any dp size and a run resumes mid-epoch
under any layout with no saved loader state. A missing or damaged index, a shard of the wrong size, or (with
`data.verify=checksum`, the default) a checksum mismatch stops the run before any work with one line.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from utils import ConfigError, require
from utils.data.shards import Index, ShardStream, check_shards, held_out_split, read_index
from utils.data.tokenizers import PretrainedTokenizer
from utils.data.wikitext import LMBlockDataset

VERIFY = ("checksum", "size")
UNIGRAM_TOKENS = 1 << 24  # tokens of each split the unigram baseline reads (a corpus may exceed memory)


@dataclass
class TokensConfig:
    """Schema of `data=tokens`: a folder of pre-tokenized shards and how it is cut into samples."""

    kind: str = "tokens"  # data family tag (fixed by the preset)
    root: str | None = None  # the folder `python -m utils.data.prepare --out` wrote (index.json, shards)
    seq_len: int = 128  # tokens per sample (the model's context); must be <= model.max_positions
    valid_fraction: float = 0.01  # documents held out for validation (the last of each shard, in proportion)
    resident_mib: int = 64  # MiB of shard pages a stream's mappings may hold resident per process (then remapped)
    verify: str = "checksum"  # checksum: sha256 of every shard at start (reads the corpus) | size: file sizes only
    limit_train_tokens: int | None = None  # use only the first N training tokens (None = all)
    limit_eval_tokens: int | None = None  # use only the first N validation tokens (None = all)
    sample_tokens: int = 24  # greedy tokens per fixed prompt that each validation writes to TensorBoard (0: none)
    packing: str = "concat"  # rows cut from the one stream of documents (the only packing of data=tokens yet)
    attention: str = "causal"  # causal over the whole row (the only attention of data=tokens yet)

    def __post_init__(self):
        require(self.kind == "tokens", f"kind {self.kind!r} is not tokens", "data.kind",
                "leave kind as set by the preset")
        require(0 < self.valid_fraction < 1, f"valid_fraction {self.valid_fraction} is not in (0, 1)",
                "data.valid_fraction", "hold out a fraction of the documents, e.g. 0.01")
        require(self.verify in VERIFY, f"unknown verify {self.verify!r}", "data.verify",
                f"choose {' or '.join(VERIFY)}")
        require(self.packing == "concat" and self.attention == "causal", f"data.packing={self.packing} with "
                f"data.attention={self.attention}: the shards are read as one stream (concatenated packing)",
                "data.packing", "set data.packing=concat and data.attention=causal with data=tokens")
        require(self.resident_mib > 0, f"resident_mib must be positive, got {self.resident_mib}", "data.resident_mib",
                "give the MiB of mapped shard pages a reader may hold, e.g. 64")
        require(self.seq_len > 0, f"seq_len must be positive, got {self.seq_len}", "data.seq_len",
                "set a positive number of tokens")
        require(self.sample_tokens >= 0, f"sample_tokens must be >= 0, got {self.sample_tokens}", "data.sample_tokens",
                "set 0 (no continuations) or the number of tokens to generate per prompt")
        for name in ("limit_train_tokens", "limit_eval_tokens"):
            value = getattr(self, name)
            require(value is None or value > self.seq_len, f"{name} {value} leaves no block of seq_len tokens",
                    f"data.{name}", f"set null or more than data.seq_len={self.seq_len} tokens")

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


@dataclass
class TokensCorpus:
    """A prepared folder: its index, the tokenizer, and the memory-mapped train and validation streams."""

    index: Index
    tokenizer: PretrainedTokenizer
    train: ShardStream
    valid: ShardStream

    @property
    def vocab_size(self) -> int:
        return self.index.vocab_size

    def dataset(self, split: str, seq_len: int) -> LMBlockDataset:
        return LMBlockDataset(getattr(self, split), seq_len, split)

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
    return TokensCorpus(index, tokenizer, *streams)
