"""WikiText for language modelling: find the files, tokenize once, cache, serve fixed-length blocks.

Layouts read under `data.root` (directly or in a subfolder such as `wikitext-2/`, `wikitext-103-raw-v1/`):

    wiki.train.tokens, wiki.valid.tokens, wiki.test.tokens     as distributed (raw: wiki.*.raw)
    train-*.parquet, validation-*.parquet, test-*.parquet       Hugging Face `datasets` (column `text`)

Tokenizers: 'word' is the classic word-level vocabulary of PyTorch's word_language_model example (split
on whitespace, WikiText's `<unk>` kept, `<eos>` after every line), except that blank lines are skipped
(the example gives each one an `<eos>`); 'bpe' is a byte-level BPE trained with Hugging Face
`tokenizers` on the train split only; a path reads a pretrained model's tokenizer.json as it ships
(its end-of-text token after every line). The trained tokenizer (JSON) and each split's ids (int32
.npy) are cached beside the data, or in a user cache folder when the data folder is read-only; names
carry the tokenizer settings (a pretrained tokenizer: a hash of its file) and the source files' names
and sizes, so a change of either builds new ones. Cache files appear atomically and the first writer
wins, so concurrent ranks agree on one tokenizer. The tokenizers are in utils/language/data/tokenizers.py, the
cache in utils/data/cache.py.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from torch.utils.data import Dataset

from utils import ConfigError, require
from utils.data.cache import cache_folders, cached
from utils.language.data.corpus import ensure_sample_corpus
from utils.language.data.packing import PackedDocumentDataset, document_starts
from utils.language.data.text import TextSource
from utils.language.data.tokenizers import (
    AnyTokenizer,
    BPETokenizer,
    PretrainedTokenizer,
    WordTokenizer,
    encode_lines,
    pretrained_file,
)

SPLITS = ("train", "valid", "test")
HF_SPLITS = {"train": "train", "valid": "validation", "test": "test"}
VARIANTS = ("auto", "wikitext-2", "wikitext-103")
TOKENIZERS = ("word", "bpe")
Split = Literal["train", "valid", "test"]


@dataclass
class WikiTextConfig(TextSource):
    """Schema of `data=wikitext*`: where the corpus is, how it is tokenized (the rows: `TextSource`'s settings).

    Choices are plain `str` fields (OmegaConf structured configs do not support Literal) checked here.
    """

    kind: str = "wikitext"  # data family tag (fixed by the preset)
    root: str | None = None  # folder holding the files (or a wikitext-*/ subfolder); with sample: where to make it
    sample: bool = False  # use the project's own generated corpus (utils.corpus), made in root on first use
    variant: str = "auto"  # 'wikitext-2' | 'wikitext-103' | 'auto': the subfolder to read (auto: first found)
    raw: bool = False  # read the *-raw variant (wiki.*.raw, original text) instead of wiki.*.tokens
    tokenizer: str = "word"  # word | bpe | PATH: word-level, BPE trained on train, or a folder's tokenizer.json
    bpe_vocab_size: int = 8192  # BPE vocabulary size in tokens, special tokens included
    cache_dir: str | None = None  # cache for tokenizer and ids when the data folder is read-only (None = user cache)

    def __post_init__(self):
        require(self.kind == "wikitext", f"kind {self.kind!r} is not wikitext", "data.kind",
                "leave kind as set by the preset")
        require(self.variant in VARIANTS, f"unknown variant {self.variant!r}", "data.variant",
                f"choose one of {', '.join(VARIANTS)}")
        require(not (self.sample and self.raw), "the sample corpus has no raw variant", "data.raw",
                "set data.raw=false with data.sample=true")
        if self.tokenizer not in TOKENIZERS:
            pretrained_file(self.tokenizer)  # a path: it must exist now, not after the corpus is read
        require(260 <= self.bpe_vocab_size <= 1_000_000, f"bpe_vocab_size {self.bpe_vocab_size} out of range",
                "data.bpe_vocab_size", "use 260 (256 bytes + specials) to 1000000 tokens, e.g. 8192")
        super().__post_init__()

    def open(self) -> WikiTextCorpus:
        return load_wikitext(self)

    def trained_tokenizer(self) -> AnyTokenizer:
        """The word or BPE vocabulary trained on the corpus (found in its cache, as training read it), or the
        tokenizer folder `data.tokenizer` names."""
        if self.tokenizer not in TOKENIZERS:
            return PretrainedTokenizer.load(self.tokenizer)
        folder, sources = locate(self)
        return load_tokenizer(self, sources["train"], cache_folders(folder, self.cache_dir))[0]


# ---------------------------------------------------------------------------------------------- files
@dataclass(frozen=True)
class SplitSource:
    """The file(s) of one split: a text file, or the parquet shards of a Hugging Face split."""

    paths: tuple[Path, ...]

    def fingerprint(self) -> str:
        """Short hash of the files' names and sizes: part of every cache name derived from them."""
        key = ";".join(f"{p.name}:{p.stat().st_size}" for p in self.paths)
        return hashlib.sha1(key.encode()).hexdigest()[:10]

    def __str__(self) -> str:
        return ", ".join(str(p) for p in self.paths)


def find_split(folder: Path, split: Split, raw: bool) -> SplitSource | None:
    text = folder / f"wiki.{split}.{'raw' if raw else 'tokens'}"
    if text.is_file():
        return SplitSource((text,))
    shards = tuple(sorted(folder.glob(f"{HF_SPLITS[split]}-*.parquet")))
    return SplitSource(shards) if shards else None


def candidate_folders(root: Path, variant: str, raw: bool) -> list[Path]:
    """root itself, then the distributed and Hugging Face subfolder names of the variant(s)."""
    names = VARIANTS[1:] if variant == "auto" else (variant,)
    suffixes = ("-raw", "-raw-v1") if raw else ("", "-v1")
    return [root] + [root / (name + suffix) for name in names for suffix in suffixes]


def locate(cfg: WikiTextConfig) -> tuple[Path, dict[str, SplitSource]]:
    """The first candidate folder holding all three splits, and their sources."""
    if cfg.sample:
        folder = ensure_sample_corpus(cfg.root)
        return folder, {s: SplitSource((folder / f"wiki.{s}.tokens",)) for s in SPLITS}
    require(bool(cfg.root), "no corpus folder given", "data.root",
            "set data.root to the folder holding WikiText, or use data=wikitext_sample")
    root = Path(cfg.root).expanduser()
    require(root.is_dir(), f"corpus folder {root} does not exist", "data.root",
            "set data.root to the folder holding WikiText, or use data=wikitext_sample")
    folders = candidate_folders(root, cfg.variant, cfg.raw)
    for folder in folders:
        found = {s: find_split(folder, s, cfg.raw) for s in SPLITS}
        if all(found.values()):
            return folder, found
        if any(found.values()):
            missing = ", ".join(s for s, v in found.items() if v is None)
            raise ConfigError(f"{folder} lacks the {missing} split(s)", "data.root",
                              "copy all three splits (train, valid, test) of one WikiText variant there")
    ext = "raw" if cfg.raw else "tokens"
    raise ConfigError(f"no WikiText files found: looked for wiki.{{train,valid,test}}.{ext} or "
                      f"{{train,validation,test}}-*.parquet in {', '.join(str(f) for f in folders)}", "data.root",
                      f"put WikiText there (data.raw={str(cfg.raw).lower()} must match the files), "
                      "or use data=wikitext_sample")


def iter_lines(source: SplitSource) -> Iterator[str]:
    """The non-blank lines of a split, stripped, in file order."""
    for path in source.paths:
        try:
            if path.suffix == ".parquet":
                yield from _parquet_lines(path)
            else:
                with open(path, encoding="utf-8") as f:
                    yield from (s for s in (line.strip() for line in f) if s)
        except (UnicodeDecodeError, OSError) as err:
            raise ConfigError(f"cannot read {path} ({err})", "data.root",
                              "replace the file with a readable UTF-8 copy") from None


def _parquet_lines(path: Path) -> Iterator[str]:
    try:
        names = pq.read_schema(path).names
        column = pq.read_table(path, columns=["text"]).column("text") if "text" in names else None
    except pa.ArrowException as err:
        raise ConfigError(f"cannot read parquet file {path} ({err})", "data.root", "replace the file") from None
    require(column is not None, f"{path} has no 'text' column", "data.root",
            "use the Hugging Face wikitext parquet files (one string column 'text')")
    for chunk in column.chunks:
        yield from (s for s in (line.strip() for line in chunk.to_pylist() if line) if s)


def nonempty_lines(source: SplitSource) -> Iterator[str]:
    """iter_lines, raising ConfigError up front when the split holds no text at all."""
    lines = iter_lines(source)
    first = next(lines, None)
    require(first is not None, f"the corpus file(s) {source} hold no text", "data.root",
            "point data.root at a complete, non-empty WikiText copy")
    return itertools.chain([first], lines)


def load_tokenizer(cfg: WikiTextConfig, train: SplitSource, folders: list[Path]) -> tuple[AnyTokenizer, str]:
    """The tokenizer trained on `train` (cached) or read from the path given, and the name that tags the
    id caches made with it (for a pretrained tokenizer, a hash of its file rather than of the corpus)."""
    if cfg.tokenizer not in TOKENIZERS:
        tok = PretrainedTokenizer.load(cfg.tokenizer)
        return tok, f"tokenizer-pretrained-{tok.fingerprint}"
    settings = "word" if cfg.tokenizer == "word" else f"bpe{cfg.bpe_vocab_size}"
    name = f"tokenizer-{settings}-{train.fingerprint()}"
    kind = WordTokenizer if cfg.tokenizer == "word" else BPETokenizer

    def build(path: Path) -> None:
        lines = nonempty_lines(train)
        tok = WordTokenizer.train(lines) if kind is WordTokenizer else BPETokenizer.train(lines, cfg.bpe_vocab_size)
        tok.save(path)

    return kind.load(cached(name + ".json", folders, build)), name


def load_ids(tokenizer: AnyTokenizer, tokenizer_name: str, source: SplitSource, split: Split,
             folders: list[Path]) -> np.ndarray:
    """int32 token ids of one split, encoded once and memory-mapped from the cache afterwards."""
    def build(path: Path) -> None:
        with open(path, "wb") as f:
            np.save(f, encode_lines(tokenizer, nonempty_lines(source)))

    name = f"{split}-{source.fingerprint()}.{tokenizer_name}.npy"
    return np.load(cached(name, folders, build), mmap_mode="r")


def load_starts(tokenizer: AnyTokenizer, tokenizer_name: str, source: SplitSource, split: Split, ids: np.ndarray,
                folders: list[Path]) -> np.ndarray:
    """int64 token offsets where the split's documents start (utils/language/data/packing.py), found once and cached."""
    def build(path: Path) -> None:
        with open(path, "wb") as f:
            np.save(f, document_starts(ids, nonempty_lines(source), tokenizer.eos_id))

    return np.load(cached(f"{split}-{source.fingerprint()}.{tokenizer_name}.starts.npy", folders, build))


# ----------------------------------------------------------------------------------- samples, metrics
class LMBlockDataset(Dataset):
    """Non-overlapping blocks of a token stream: item i = (ids[i*S : i*S+S], ids[i*S+1 : i*S+S+1]), int64."""

    def __init__(self, tokens: np.ndarray | torch.Tensor, seq_len: int, split: str = "train"):
        self.tokens = tokens.numpy() if isinstance(tokens, torch.Tensor) else tokens
        self.seq_len = seq_len
        require(seq_len > 0 and len(tokens) > seq_len,
                f"the {split} split has {len(tokens)} tokens, too few for one block of seq_len {seq_len} + 1",
                "data.seq_len", "lower data.seq_len, raise the data.limit_* settings, or use a larger corpus")

    def __len__(self) -> int:
        return (len(self.tokens) - 1) // self.seq_len

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= i < len(self):
            raise IndexError(i)
        start = i * self.seq_len
        block = torch.from_numpy(np.array(self.tokens[start:start + self.seq_len + 1], dtype=np.int64))
        return block[:-1], block[1:]  # input ids (S,), next-token targets (S,)


def unigram_perplexity(train_tokens: np.ndarray, eval_tokens: np.ndarray, vocab_size: int) -> float:
    """Perplexity on `eval_tokens` of the add-one smoothed unigram model fit on `train_tokens`: the
    baseline a language model must beat (it knows token frequencies, not context)."""
    counts = np.bincount(np.asarray(train_tokens), minlength=vocab_size).astype(np.float64) + 1.0
    log_p = np.log(counts) - np.log(counts.sum())
    return float(np.exp(-log_p[np.asarray(eval_tokens)].mean()))


@dataclass
class WikiTextCorpus:
    """A tokenized corpus: the tokenizer and the int32 ids of each split (memory-mapped)."""

    folder: Path
    tokenizer: AnyTokenizer
    train: np.ndarray
    valid: np.ndarray
    test: np.ndarray
    starts: dict[str, np.ndarray] | None = None  # data.packing=documents: each split's document starts

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.vocab_size

    def dataset(self, split: Split, seq_len: int) -> LMBlockDataset | PackedDocumentDataset:
        blocks = LMBlockDataset(getattr(self, split), seq_len, split)
        return blocks if self.starts is None else PackedDocumentDataset(blocks, self.starts[split])

    @functools.cached_property
    def unigram_ppl(self) -> float:
        """Perplexity of the unigram baseline on the validation split (computed once)."""
        return unigram_perplexity(self.train, self.valid, self.vocab_size)

    def describe(self) -> str:
        """One log line: where from, vocabulary, split sizes and the unigram baseline on valid."""
        return (f"{self.folder} ({self.tokenizer.kind}): vocab {self.vocab_size}, tokens train {len(self.train)} "
                f"valid {len(self.valid)} test {len(self.test)}, unigram valid ppl {self.unigram_ppl:.1f}")


def load_wikitext(cfg: WikiTextConfig) -> WikiTextCorpus:
    """Locate, tokenize (or read the caches of) and truncate the three splits of `cfg`."""
    folder, sources = locate(cfg)
    folders = cache_folders(folder, cfg.cache_dir)
    tokenizer, tokenizer_name = load_tokenizer(cfg, sources["train"], folders)
    ids = {s: load_ids(tokenizer, tokenizer_name, sources[s], s, folders) for s in SPLITS}
    limits = {"train": cfg.limit_train_tokens, "valid": cfg.limit_eval_tokens, "test": cfg.limit_eval_tokens}
    starts = None if cfg.packing == "concat" else {
        s: load_starts(tokenizer, tokenizer_name, sources[s], s, ids[s], folders) for s in SPLITS}
    return WikiTextCorpus(folder, tokenizer, **{s: ids[s][:limits[s]] for s in SPLITS}, starts=starts)
