"""Tokenizers of the language model: the classic word-level vocabulary and a byte-level BPE.

'word' is the vocabulary of PyTorch's word_language_model example (split on whitespace, WikiText's
`<unk>` kept, `<eos>` after every line); 'bpe' is a byte-level BPE (GPT-2 style) trained with Hugging
Face `tokenizers`. Both encode lines to ids, decode ids to text with `<eos>` as a newline, and save to
and load from one JSON file (utils/data/cache.py caches them).
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterable
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

UNK, EOS = "<unk>", "<eos>"


def split_at_eos(ids: Iterable[int], eos_id: int) -> list[list[int]]:
    """Lines of ids between <eos> tokens; the last one is the (possibly empty) unterminated rest."""
    lines: list[list[int]] = [[]]
    for i in ids:
        if i == eos_id:
            lines.append([])
        else:
            lines[-1].append(int(i))
    return lines


class WordTokenizer:
    """Word-level vocabulary: <unk>, <eos>, then the train split's words in order of first appearance."""

    kind = "word"

    def __init__(self, words: list[str]):
        self.words = words
        self.ids = {w: i for i, w in enumerate(words)}
        self.unk_id, self.eos_id = self.ids[UNK], self.ids[EOS]

    @classmethod
    def train(cls, lines: Iterable[str]) -> WordTokenizer:
        words = itertools.chain([UNK, EOS], itertools.chain.from_iterable(map(str.split, lines)))
        return cls(list(dict.fromkeys(words)))  # first appearances, in order (one C-level pass)

    @property
    def vocab_size(self) -> int:
        return len(self.words)

    def encode_batch(self, lines: list[str]) -> list[list[int]]:
        get, unk = self.ids.get, self.unk_id
        return [[get(w, unk) for w in line.split()] for line in lines]

    def decode(self, ids: Iterable[int]) -> str:
        """Text of `ids`: words joined by spaces, <eos> as a newline."""
        return "\n".join(" ".join(self.words[i] for i in line) for line in split_at_eos(ids, self.eos_id))

    def save(self, path: Path) -> None:
        path.write_text(json.dumps({"kind": self.kind, "words": self.words}), encoding="utf-8")

    @classmethod
    def load(cls, path: Path) -> WordTokenizer:
        return cls(json.loads(path.read_text(encoding="utf-8"))["words"])


class BPETokenizer:
    """Byte-level BPE (GPT-2 style, Hugging Face `tokenizers`); <eos> and <unk> are special tokens."""

    kind = "bpe"

    def __init__(self, tokenizer: HFTokenizer):
        self.tokenizer = tokenizer
        self.eos_id = tokenizer.token_to_id(EOS)

    @classmethod
    def train(cls, lines: Iterable[str], vocab_size: int) -> BPETokenizer:
        tokenizer = HFTokenizer(models.BPE())
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
        tokenizer.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS, UNK], show_progress=False,
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
        tokenizer.train_from_iterator(lines, trainer)
        return cls(tokenizer)

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size()

    def encode_batch(self, lines: list[str]) -> list[list[int]]:
        return [e.ids for e in self.tokenizer.encode_batch(lines)]

    def decode(self, ids: Iterable[int]) -> str:
        """Text of `ids`: each line without the prefix space the encoder added, <eos> as a newline."""
        decode = self.tokenizer.decode
        return "\n".join(decode(line, skip_special_tokens=False).removeprefix(" ")
                         for line in split_at_eos(ids, self.eos_id))

    def save(self, path: Path) -> None:
        self.tokenizer.save(str(path))

    @classmethod
    def load(cls, path: Path) -> BPETokenizer:
        return cls(HFTokenizer.from_file(str(path)))


AnyTokenizer = WordTokenizer | BPETokenizer


def encode_lines(tokenizer: AnyTokenizer, lines: Iterable[str], chunk: int = 8192) -> np.ndarray:
    """int32 ids of all lines, each followed by <eos>, encoded in chunks to bound memory."""
    parts, eos = [], [tokenizer.eos_id]
    it = iter(lines)
    while batch := list(itertools.islice(it, chunk)):
        ids = itertools.chain.from_iterable(line + eos for line in tokenizer.encode_batch(batch))
        parts.append(np.fromiter(ids, dtype=np.int32))
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int32)
