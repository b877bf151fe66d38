"""Pre-tokenized shards: the folder that `python -m utils.data.prepare` writes and `data=tokens` reads.

    DIR/index.json        the corpus: the tokenizer (name, fingerprint, vocabulary size, EOS id) and, per shard,
                          its files, source, documents, tokens, dtype and sha256 checksums
    DIR/NNNNN.tokens      shard NNNNN's token ids, raw little-endian uint16 (uint32 when an id exceeds 65535):
                          each document's tokens followed by the EOS id
    DIR/NNNNN.docs.npy    where each document starts in the shard (uint64, num_documents + 1 entries, the last
                          being num_tokens). Binary, not JSON: a pre-training corpus has 10^8 documents
    DIR/NNNNN.json        the shard's own record (the entry index.json lists), written after its files: a rerun
                          of prepare keeps a shard whose record names the same source and tokenizer and whose
                          checksums still match
    DIR/tokenizer/        a copy of the tokenizer folder the shards were made with

The shards concatenated in index order are one token stream; the reader cuts training rows from it. Nothing
here imports torch, so the reader's memory can be measured alone (tests/test_tokens.py).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from utils import ConfigError, require

INDEX, FORMAT, VERSION = "index.json", "dlscale-tokens", 1
# Bytes a read of a mapping may make resident beyond its own: a page fault on a file mapping maps the cached pages
# around it too (Linux fault-around), up to a whole large folio of the page cache (2 MiB), at both ends of a read
FAULT_AROUND = 2 * (2 << 20)
PREPARE = "write it with python -m utils.data.prepare INPUT... --tokenizer DIR --out DIR (docs/configuration.md)"


DTYPES = ("uint16", "uint32")


def dtype_for(vocab_size: int) -> str:
    """The narrowest shard dtype holding ids 0..vocab_size-1."""
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    """sha256 of a file read in chunks (no memory map: hashing a corpus leaves the resident memory flat)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def replace_atomically(path: Path, data: bytes) -> None:
    """Write `data` to `path` under a temporary name, then rename it into place."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


class ShardWriter:
    """One shard written under temporary names and renamed into place by `finish`: an interrupted write
    leaves only temporary files, never a shard that looks complete."""

    def __init__(self, folder: Path, number: int, dtype: str, eos_id: int):
        self.folder, self.number, self.dtype, self.eos_id = folder, number, np.dtype(dtype), eos_id
        self.tokens_name, self.docs_name = f"{number:05d}.tokens", f"{number:05d}.docs.npy"
        self.tmp = folder / f".{self.tokens_name}.{os.getpid()}.tmp"
        self.file = open(self.tmp, "wb")  # noqa: SIM115 (closed by finish)
        self.digest, self.starts, self.num_tokens = hashlib.sha256(), [0], 0

    def add(self, documents: list[list[int]]) -> None:
        """Append documents (lists of ids), each followed by the EOS id; empty ones are skipped."""
        documents = [d for d in documents if d]
        if documents:
            eos = [self.eos_id]
            ids = np.fromiter(itertools.chain.from_iterable(d + eos for d in documents), dtype=np.int64)
            self.add_ids(ids, np.array([len(d) + 1 for d in documents]))

    def add_ids(self, ids: np.ndarray, lengths: np.ndarray) -> None:
        """Append documents given as one array of ids (each ending with its EOS) and their lengths."""
        assert lengths.sum() == len(ids) and ids.min() >= 0 and ids.max() <= np.iinfo(self.dtype).max
        data = ids.astype(self.dtype.newbyteorder("<"), copy=False).tobytes()
        self.file.write(data)
        self.digest.update(data)
        self.starts.extend((self.num_tokens + np.cumsum(lengths)).tolist())
        self.num_tokens += int(lengths.sum())

    def finish(self, record: dict) -> dict:
        """Rename the shard into place, write its document starts and its record (last); return the record."""
        self.file.close()
        os.replace(self.tmp, self.folder / self.tokens_name)
        docs = np.asarray(self.starts, dtype="<u8")
        docs_tmp = self.folder / f".{self.docs_name}.{os.getpid()}.tmp"
        with open(docs_tmp, "wb") as f:
            np.save(f, docs)
        os.replace(docs_tmp, self.folder / self.docs_name)
        record = dict(record, number=self.number, tokens_file=self.tokens_name, documents_file=self.docs_name,
                      num_documents=len(docs) - 1, num_tokens=self.num_tokens, dtype=self.dtype.name,
                      sha256=self.digest.hexdigest(), documents_sha256=sha256_file(self.folder / self.docs_name))
        replace_atomically(self.folder / f"{self.number:05d}.json", json.dumps(record, indent=1).encode())
        return record

    def abandon(self) -> None:
        self.file.close()
        self.tmp.unlink(missing_ok=True)


@dataclass(frozen=True)
class Index:
    """A prepared folder's index.json, read and checked."""

    root: Path
    tokenizer: dict  # name, fingerprint, vocab_size, eos_id, eos_token
    shards: list[dict]  # the shard records, in stream order

    @property
    def vocab_size(self) -> int:
        return int(self.tokenizer["vocab_size"])

    def path(self, shard: int, key: str = "tokens_file") -> Path:
        return self.root / self.shards[shard][key]


def read_index(root: Path, setting: str = "data.root") -> Index:
    """index.json of `root`; a one-line ConfigError when it is missing, unreadable or not an index."""
    file = root / INDEX
    require(file.is_file(), f"{root} holds no {INDEX}", setting, PREPARE)
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
        ok = data.get("format") == FORMAT and data.get("version") == VERSION
        tokenizer, shards = data["tokenizer"], data["shards"]
        ok = ok and all(k in tokenizer for k in ("vocab_size", "eos_id", "fingerprint")) and len(shards) > 0
        fields = ("tokens_file", "documents_file", "num_documents", "num_tokens", "dtype", "sha256", "documents_sha256")
        ok = ok and all(k in s for s in shards for k in fields) and all(s["dtype"] in DTYPES for s in shards)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError, KeyError, TypeError) as err:
        raise ConfigError(f"cannot read {file} ({err})", setting, "prepare the folder again: " + PREPARE) from None
    require(ok, f"{file} is not a complete {FORMAT} index of version {VERSION}", setting,
            "prepare the folder again: " + PREPARE)
    return Index(root, tokenizer, shards)


def check_shards(index: Index, checksum: bool, setting: str = "data.root") -> None:
    """Every shard's files exist with the sizes and document counts the index gives; with `checksum`, their
    sha256 match too."""
    for i, shard in enumerate(index.shards):
        tokens, docs = index.path(i), index.path(i, "documents_file")
        size = shard["num_tokens"] * np.dtype(shard["dtype"]).itemsize
        require(tokens.is_file() and docs.is_file(), f"shard {tokens} or {docs.name} is missing", setting,
                "prepare the folder again: " + PREPARE)
        require(tokens.stat().st_size == size, f"shard {tokens} has {tokens.stat().st_size} bytes, the index "
                f"says {size}", setting, "prepare the folder again (a rerun redoes only the damaged shards)")
        try:
            starts = np.load(docs, mmap_mode="r")
            ok = starts.shape == (shard["num_documents"] + 1,) and int(starts[-1]) == shard["num_tokens"]
        except (OSError, ValueError, EOFError):
            ok = False
        require(ok, f"{docs} does not hold the {shard['num_documents']} document starts of {tokens.name}", setting,
                "prepare the folder again (a rerun redoes only the damaged shards)")
        if checksum:
            for file, key in ((tokens, "sha256"), (docs, "documents_sha256")):
                require(sha256_file(file) == shard[key], f"the checksum of {file} does not match {INDEX}", setting,
                        "prepare the folder again (a rerun redoes only the damaged shards)")


def document_starts(index: Index, shard: int) -> np.ndarray:
    """Where each document of a shard starts, and its end (memory-mapped, uint64)."""
    return np.load(index.path(shard, "documents_file"), mmap_mode="r")


def held_out_split(index: Index, fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """(train, valid) token ranges as rows (shard, start, stop). Validation holds `fraction` of all documents,
    the last ones of each shard in proportion to its documents: shard i gives floor(fraction x documents up
    to and with i) - floor(fraction x documents before i), so every source contributes."""
    train, valid, before = [], [], 0
    for i, shard in enumerate(index.shards):
        n = shard["num_documents"]
        held = math.floor(fraction * (before + n)) - math.floor(fraction * before)
        before += n
        cut = int(document_starts(index, i)[n - held])
        if cut > 0:
            train.append((i, 0, cut))
        if held > 0:
            valid.append((i, cut, shard["num_tokens"]))
    return np.array(train, dtype=np.int64).reshape(-1, 3), np.array(valid, dtype=np.int64).reshape(-1, 3)


class ShardStream:
    """Token ranges of memory-mapped shards as one read-only array: `len()` and `[a:b]` (a copy, int of the
    shard dtype). A read maps its shard (numpy.memmap) and every mapping is dropped once the reads since
    the last drop may have made `resident_bytes` resident (FAULT_AROUND counted per read): the pages read
    stay in the page cache, shared and reclaimable, but leave this process's resident set, which stays
    near that bound however large the shards. Picklable (data-loader workers map their own)."""

    def __init__(self, files: list[Path], dtypes: list[str], segments: np.ndarray, resident_bytes: int = 64 << 20):
        self.files, self.dtypes, self.segments = files, [np.dtype(d) for d in dtypes], segments
        self.ends = np.cumsum(segments[:, 2] - segments[:, 1])
        self.resident_bytes, self.maps, self.touched = resident_bytes, {}, 0

    def __len__(self) -> int:
        return int(self.ends[-1]) if len(self.ends) else 0

    def __getstate__(self) -> dict:
        return dict(self.__dict__, maps={}, touched=0)

    def head(self, n: int | None) -> ShardStream:
        """The first n tokens (all for None) as a stream of their own."""
        if n is None or n >= len(self):
            return self
        keep = int(np.searchsorted(self.ends, n, side="left")) + 1
        segments = self.segments[:keep].copy()
        segments[-1, 2] -= int(self.ends[keep - 1]) - n
        return ShardStream(self.files, [d.name for d in self.dtypes], segments, self.resident_bytes)

    def __getitem__(self, key: slice) -> np.ndarray:
        assert isinstance(key, slice), "a token stream is read by slices"
        start, stop, step = key.indices(len(self))
        assert step == 1, "a token stream is read by contiguous slices"
        parts = []
        while start < stop:
            k = int(np.searchsorted(self.ends, start, side="right"))
            shard, first, last = (int(v) for v in self.segments[k])
            lo = first + start - (int(self.ends[k]) - (last - first))
            hi = min(last, lo + stop - start)
            parts.append(self.read(shard, lo, hi))
            start += hi - lo
        return np.concatenate(parts) if len(parts) != 1 else parts[0]

    def read(self, shard: int, lo: int, hi: int) -> np.ndarray:
        """A copy of tokens [lo, hi) of a shard, through its mapping (made anew after a drop)."""
        if self.touched >= self.resident_bytes:
            self.maps.clear()  # unmaps: the copies returned hold no view of them
            self.touched = 0
        if shard not in self.maps:
            self.maps[shard] = np.memmap(self.files[shard], dtype=self.dtypes[shard].newbyteorder("<"), mode="r")
        out = np.array(self.maps[shard][lo:hi], dtype=self.dtypes[shard])
        self.touched += out.nbytes + FAULT_AROUND  # what a read can map: its pages and the kernel's neighbours
        return out
