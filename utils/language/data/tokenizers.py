"""Tokenizers of the language model: the classic word-level vocabulary, a byte-level BPE, and a
pretrained model's own tokenizer.

'word' is the vocabulary of PyTorch's word_language_model example (split on whitespace, WikiText's
`<unk>` kept, `<eos>` after every line); 'bpe' is a byte-level BPE (GPT-2 style) trained with Hugging
Face `tokenizers`. Both encode lines to ids, decode ids to text with `<eos>` as a newline, and save to
and load from one JSON file (utils/data/cache.py caches them). 'pretrained' reads the `tokenizer.json`
that a Hugging Face model folder ships (GPT-2, Llama) as it is: never trained, never cached, its own
end-of-text token ending every line, so a fine-tune sees the ids its embedding was trained on.

`hf_files` gives each of them as the files of a Hugging Face tokenizer folder (tokenizer.json and
tokenizer_config.json naming its special tokens), which transformers' AutoTokenizer and `PretrainedTokenizer`
read back to the same ids (export-hf writes them beside the model).
"""

from __future__ import annotations

import hashlib
import itertools
import json
from collections.abc import Iterable
from pathlib import Path

import numpy as np
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, trainers
from tokenizers import Tokenizer as HFTokenizer

from utils import ConfigError, require

UNK, EOS = "<unk>", "<eos>"
# End-of-text tokens of shipped tokenizers, tried in this order when tokenizer_config.json names none:
# GPT-2's, Llama 3's, Llama 2's (and most SentencePiece models'), then this project's own (word, bpe; Gemma's).
KNOWN_EOS = ("<|endoftext|>", "<|end_of_text|>", "</s>", EOS)
CONFIG = "tokenizer_config.json"
# The files of a tokenizer folder besides tokenizer.json, copied with it (export-hf).
COMPANIONS = (CONFIG, "special_tokens_map.json", "vocab.json", "merges.txt", "generation_config.json")
TOKENIZER_FILES = ("tokenizer.json", *COMPANIONS)  # a Hugging Face folder's tokenizer files
PRETRAINED_FIX = "give a folder holding a Hugging Face tokenizer.json (or the file itself), or choose word or bpe"


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

    def to_hf(self) -> HFTokenizer:
        """The same vocabulary as a Hugging Face `tokenizers` WordLevel model, encoding any text to the same ids:
        split on what str.split splits on (Rust's whitespace, plus the separators U+001C..U+001F mapped to a
        space first), an unknown word <unk>. <unk> and <eos> are special tokens that match whole words only
        (single_word), so "x<eos>y" stays one unknown word; unlike str.split, "<eos>" beside punctuation
        ("end.<eos>") is still cut out as the end token. No decoder: tokens decode joined by spaces."""
        tokenizer = HFTokenizer(models.WordLevel(self.ids, unk_token=UNK))
        tokenizer.normalizer = normalizers.Replace(Regex("[\x1c-\x1f]"), " ")
        tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        tokenizer.add_special_tokens([AddedToken(t, single_word=True, normalized=False, special=True)
                                      for t in (UNK, EOS)])
        return tokenizer

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


def pretrained_file(spec: str) -> Path:
    """The tokenizer.json that `data.tokenizer=spec` names: the file itself, or `tokenizer.json` in the
    folder; ConfigError when neither exists (checked when the config is made, before any data is read)."""
    path = Path(spec).expanduser()
    require(path.exists(), f"tokenizer {spec!r} is neither word, bpe nor an existing path", "data.tokenizer",
            PRETRAINED_FIX)
    file = path / "tokenizer.json" if path.is_dir() else path
    require(file.is_file(), f"the folder {path} holds no tokenizer.json", "data.tokenizer", PRETRAINED_FIX)
    return file


def configured_eos(folder: Path) -> str | None:
    """`eos_token` of the folder's tokenizer_config.json (a string, or an AddedToken dict's "content");
    None when the file or the entry is absent."""
    config = folder / "tokenizer_config.json"
    if not config.is_file():
        return None
    try:
        eos = json.loads(config.read_text(encoding="utf-8")).get("eos_token")
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError) as err:
        raise ConfigError(f"cannot read {config} ({err})", "data.tokenizer",
                          "repair or remove tokenizer_config.json beside tokenizer.json") from None
    eos = eos.get("content") if isinstance(eos, dict) else eos
    require(eos is None or isinstance(eos, str), f"eos_token of {config} is {eos!r}, not a token", "data.tokenizer",
            "set eos_token to the end token's text, e.g. \"<|endoftext|>\"")
    return eos


class PretrainedTokenizer:
    """A Hugging Face tokenizer.json as a pretrained model ships it (GPT-2, Llama), read, never trained.

    The end of every corpus line is the tokenizer's own end-of-text token: `eos_token` of a
    tokenizer_config.json beside the file, else the first of KNOWN_EOS in the vocabulary. Lines are
    encoded without the tokenizer's own special tokens (Llama's post-processor would put a BOS before
    every line) and without truncation or padding, whatever the file sets. `vocab_size` counts the added
    tokens too (GPT-2: 50257, Llama 3: 128256: the rows of the pretrained embedding), so the model's
    padding to its vocabulary multiple starts from the real count and padding rows never count as
    tokens. `fingerprint` hashes the file's bytes and the chosen end token: it names the id caches, so
    two tokenizers never share one.
    """

    kind = "pretrained"

    def __init__(self, tokenizer: HFTokenizer, eos_token: str, fingerprint: str, file: Path | None = None):
        self.tokenizer, self.eos_token, self.fingerprint, self.file = tokenizer, eos_token, fingerprint, file
        tokenizer.no_truncation()  # some shipped files cap lengths (512 tokens): a line must stay whole
        tokenizer.no_padding()
        self.eos_id = tokenizer.token_to_id(eos_token)
        vocab = tokenizer.get_vocab(with_added_tokens=True)
        # Shipped counts have no holes; a file with one still gets a row for its highest id.
        self.vocab_size = max(tokenizer.get_vocab_size(with_added_tokens=True), max(vocab.values(), default=-1) + 1)

    @classmethod
    def load(cls, spec: str) -> PretrainedTokenizer:
        """The tokenizer that `data.tokenizer=spec` names; ConfigError when it cannot be read or has no
        end-of-text token."""
        file = pretrained_file(spec)
        try:
            data = file.read_bytes()
            tokenizer = HFTokenizer.from_buffer(data)
        except Exception as err:  # noqa: BLE001 - `tokenizers` raises a bare Exception on a bad file
            first = str(err).splitlines()[0] if str(err) else type(err).__name__
            raise ConfigError(f"cannot read {file} as a Hugging Face tokenizer ({first})", "data.tokenizer",
                              PRETRAINED_FIX) from None
        vocab = tokenizer.get_vocab(with_added_tokens=True)
        eos = configured_eos(file.parent)
        if eos is None:
            eos = next((name for name in KNOWN_EOS if name in vocab), None)
            require(eos is not None, f"{file} has none of the end-of-text tokens {', '.join(KNOWN_EOS)}",
                    "data.tokenizer", "name the tokenizer's end token as eos_token in a tokenizer_config.json "
                    "beside tokenizer.json")
        require(eos in vocab, f"eos_token {eos!r} of {file.parent / 'tokenizer_config.json'} is not in {file}",
                "data.tokenizer", "set eos_token to a token of the tokenizer's vocabulary")
        fingerprint = hashlib.sha1(data + b"\0" + eos.encode()).hexdigest()[:10]
        return cls(tokenizer, eos, fingerprint, file)

    def encode_batch(self, lines: list[str]) -> list[list[int]]:
        return [e.ids for e in self.tokenizer.encode_batch(lines, add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> str:
        """Text of `ids`, the end token as a newline. Corpus lines are stripped, so a leading space on a
        decoded line is the tokenizer's own prefix space (add_prefix_space) and is dropped, as in bpe."""
        decode = self.tokenizer.decode
        return "\n".join(decode(line, skip_special_tokens=False).removeprefix(" ")
                         for line in split_at_eos(ids, self.eos_id))


AnyTokenizer = WordTokenizer | BPETokenizer | PretrainedTokenizer


def encode_lines(tokenizer: AnyTokenizer, lines: Iterable[str], chunk: int = 8192) -> np.ndarray:
    """int32 ids of all lines, each followed by <eos>, encoded in chunks to bound memory."""
    parts, eos = [], [tokenizer.eos_id]
    it = iter(lines)
    while batch := list(itertools.islice(it, chunk)):
        ids = itertools.chain.from_iterable(line + eos for line in tokenizer.encode_batch(batch))
        parts.append(np.fromiter(ids, dtype=np.int32))
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int32)


# ------------------------------------------------------------------------- as a Hugging Face folder
def load_file(spec: str) -> AnyTokenizer:
    """The tokenizer of a file or folder: this project's word vocabulary (a cached `{"kind": "word"}` file), else
    a Hugging Face tokenizer.json (this project's cached bpe files among them: their end token is <eos>)."""
    file = pretrained_file(spec)
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        data = None  # PretrainedTokenizer.load says what is wrong
    if isinstance(data, dict) and data.get("kind") == WordTokenizer.kind and isinstance(data.get("words"), list):
        words = data["words"]
        require(UNK in words and EOS in words, f"{file} is a word vocabulary without {UNK} and {EOS}",
                "data.tokenizer", "give the vocabulary file a word run cached")
        return WordTokenizer(words)
    return PretrainedTokenizer.load(spec)


def _json(data: dict) -> bytes:
    return (json.dumps(data, indent=2, ensure_ascii=False) + "\n").encode("utf-8")


def hf_files(tokenizer: AnyTokenizer) -> dict[str, bytes]:
    """{name: bytes} of a Hugging Face tokenizer folder that transformers' AutoTokenizer.from_pretrained and
    `PretrainedTokenizer.load` read as `tokenizer`: the same ids, the same end token.

    word and bpe: tokenizer.json (`WordTokenizer.to_hf`, or the BPE itself) and a tokenizer_config.json naming
    <eos> the end and <unk> the unknown token (neither has a beginning or a padding token), decoded without
    transformers' clean-up of spaces. pretrained: its files as they are (tokenizer.json, and the COMPANIONS
    beside it), with a tokenizer_config.json naming the end token where it has none (`eos_token` added; a
    `<unk>` special token named the unknown one when the file is new)."""
    generic = {"tokenizer_class": "PreTrainedTokenizerFast"}  # read as tokenizer.json says, whatever config.json
    plain = {"clean_up_tokenization_spaces": False}  # decoded as utils.generate decodes
    if not isinstance(tokenizer, PretrainedTokenizer):
        hf = tokenizer.to_hf() if isinstance(tokenizer, WordTokenizer) else tokenizer.tokenizer
        config = {**generic, "eos_token": EOS, "unk_token": UNK, **plain}
        return {"tokenizer.json": hf.to_str(pretty=True).encode("utf-8"), CONFIG: _json(config)}
    file = tokenizer.file
    require(file is not None, "the tokenizer was not read from a file", "--tokenizer", "give its tokenizer.json")
    files = {"tokenizer.json": file.read_bytes()}
    files.update({name: (file.parent / name).read_bytes() for name in COMPANIONS if (file.parent / name).is_file()})
    if CONFIG in files and configured_eos(file.parent) is None:
        files[CONFIG] = _json({**json.loads(files[CONFIG]), "eos_token": tokenizer.eos_token})
    elif CONFIG not in files:
        specials = {t.content for t in tokenizer.tokenizer.get_added_tokens_decoder().values() if t.special}
        unk = {"unk_token": UNK} if UNK in specials else {}
        files[CONFIG] = _json({**generic, "eos_token": tokenizer.eos_token, **unk, **plain})
    return files


def special_ids(files: dict[str, bytes]) -> dict[str, int | None]:
    """{"bos_id", "eos_id", "pad_id"} (config.json's bos_token_id, ...) of the folder `hf_files` gives: the ids of
    the tokens its tokenizer_config.json names (None where it names none, or one outside the vocabulary)."""
    config = json.loads(files[CONFIG])
    tokenizer = HFTokenizer.from_str(files["tokenizer.json"].decode("utf-8"))
    ids = {}
    for key in ("bos_token", "eos_token", "pad_token"):
        token = config.get(key)
        token = token.get("content") if isinstance(token, dict) else token
        ids[f"{key.removesuffix('_token')}_id"] = tokenizer.token_to_id(token) if isinstance(token, str) else None
    return ids
