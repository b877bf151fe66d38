"""The language wing's data interface: what every text source declares once, and what the language task and the
tools read of it (utils/weather/data/fields.py is the weather wing's).

A text source is a data schema that subclasses `TextSource`, which declares and checks, once, the row settings
every source shares (seq_len, the token limits of each split, the continuations sampled at validation, packing and
its attention), and gives two things:

    open() -> Corpus        read, tokenize or map the data; every data error is raised here, before distributed work
    trained_tokenizer()     the tokenizer a run on this data trained with (what generate, evaluate and export read)

A `Corpus` is the data opened: its tokenizer and vocabulary, each split as rows of seq_len + 1 tokens (packed
documents flag their starts), the unigram baseline and a log line. The sources: utils/language/data/wikitext.py (text
files or Hugging Face parquet, tokenized here) and utils/language/data/tokens.py (pre-tokenized shards). A new one is
its
module (a subclass with these two methods), a preset in config/data/, and its line in
`LanguageTask.DATA_SCHEMAS` (utils/language/task/language.py): three files.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from torch.utils.data import Dataset

from utils import require
from utils.language.data.packing import check_packing


class Corpus(Protocol):
    """A text source opened (`TextSource.open`)."""

    tokenizer: Any  # utils.language.data.tokenizers.AnyTokenizer
    unigram_ppl: float  # the add-one smoothed unigram model's perplexity on the validation split

    @property
    def vocab_size(self) -> int: ...
    def dataset(self, split: str, seq_len: int) -> Dataset: ...
    def describe(self) -> str: ...


@dataclass
class TextSource:
    """The settings every text source shares (data.*), checked once; a source's schema subclasses it."""

    seq_len: int = 128  # tokens per sample (the model's context); must be <= model.max_positions
    limit_train_tokens: int | None = None  # use only the first N training tokens (None = all)
    limit_eval_tokens: int | None = None  # use only the first N validation/test tokens (None = all)
    sample_tokens: int = 24  # greedy tokens per fixed prompt that each validation writes to TensorBoard (0: none)
    packing: str = "concat"  # concat | documents: rows cut from one stream, or of whole documents (data/packing.py)
    attention: str = "causal"  # causal | document: over the whole row, or inside each document (packing=documents)

    def __post_init__(self):
        check_packing(self.packing, self.attention)
        require(self.seq_len > 0, f"seq_len must be positive, got {self.seq_len}", "data.seq_len",
                "set a positive number of tokens")
        require(self.sample_tokens >= 0, f"sample_tokens must be >= 0, got {self.sample_tokens}",
                "data.sample_tokens", "set 0 (no continuations) or the number of tokens to generate per prompt")
        for name in ("limit_train_tokens", "limit_eval_tokens"):
            value = getattr(self, name)
            require(value is None or value > self.seq_len, f"{name} {value} leaves no block of seq_len tokens",
                    f"data.{name}", f"set null or more than data.seq_len={self.seq_len} tokens")

    def open(self) -> Corpus:
        """The data, read or mapped (every data error raised here)."""
        raise NotImplementedError

    def trained_tokenizer(self):
        """The tokenizer a run on this data trained with (ConfigError when it cannot be read)."""
        raise NotImplementedError
