"""How many bytes of text each token id stands for: the denominator of bits per byte.

Bits per byte (validation's val/bpb, `python -m utils.evaluate`) divides a model's summed negative
log-likelihood by the UTF-8 bytes of the text its targets decode to, so models with different tokenizers
compare. The count comes from the tokenizer's vocabulary, per id:
- byte-level BPE (`bpe`, and a pretrained tokenizer.json whose decoder is ByteLevel: GPT-2, Llama 3): each
  character of the token is one byte (the ByteLevel alphabet), so the count is exact, the space a token
  starts with ("Ġthe": 4 bytes) included;
- another pretrained model (SentencePiece-style, Llama 2): `<0xNN>` byte-fallback tokens count 1, the
  others the UTF-8 bytes of their text with the meta space `▁` as one space;
- `word`: a word's UTF-8 bytes plus the one separator after it (the space to the next word, or the
  line's newline), the end token 0; a line's tokens then add up to its decoded bytes exactly. So too a
  pretrained tokenizer.json of a WordLevel model (a word vocabulary as export-hf writes it), whose
  tokens decode joined by spaces;
- the end-of-text token of a BPE or pretrained tokenizer counts 1 (the newline it decodes to); another
  special token the UTF-8 bytes of its text.
"""

from __future__ import annotations

import json
import re

import numpy as np

from utils.language.data.tokenizers import AnyTokenizer, WordTokenizer

BYTE_FALLBACK = re.compile(r"^<0x[0-9A-Fa-f]{2}>$")
META_SPACE = "\u2581"  # SentencePiece's space


def token_bytes(tokenizer: AnyTokenizer) -> np.ndarray:
    """int64 (vocab_size,): the bytes of text each id stands for (see the module docstring)."""
    if isinstance(tokenizer, WordTokenizer):
        counts = np.array([len(w.encode("utf-8")) + 1 for w in tokenizer.words], dtype=np.int64)
        counts[tokenizer.eos_id] = 0
        return counts
    hf = tokenizer.tokenizer
    spec = json.loads(hf.to_str())
    if spec.get("model", {}).get("type") == "WordLevel" and not spec.get("decoder"):
        counts = np.zeros(tokenizer.vocab_size, dtype=np.int64)
        for token, i in hf.get_vocab(with_added_tokens=True).items():
            counts[i] = 0 if i == tokenizer.eos_id else len(token.encode("utf-8")) + 1
        return counts
    byte_level = _uses_byte_level(spec)
    specials = {t.content for t in hf.get_added_tokens_decoder().values() if t.special}
    counts = np.zeros(tokenizer.vocab_size, dtype=np.int64)
    for token, i in hf.get_vocab(with_added_tokens=True).items():
        if i == tokenizer.eos_id:
            counts[i] = 1
        elif token in specials or not byte_level:
            counts[i] = 1 if BYTE_FALLBACK.match(token) else len(token.replace(META_SPACE, " ").encode("utf-8"))
        else:
            counts[i] = len(token)  # one ByteLevel character per byte
    return counts


def _uses_byte_level(spec: dict) -> bool:
    """Whether a tokenizer.json's decoder (or one of a Sequence's) is ByteLevel."""
    decoder = spec.get("decoder") or {}
    parts = decoder.get("decoders", [decoder]) if decoder.get("type") == "Sequence" else [decoder]
    return any(part.get("type") == "ByteLevel" for part in parts)
