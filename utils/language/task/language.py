"""The WikiText workload: next-token prediction with the decoder-only Transformer, validated by perplexity and
bits per byte."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from distributed.collectives import all_reduce_
from networks.transformer import GPTConfig, check_seq_len, padded_vocab_size
from utils import require
from utils.comm import Axis, Grid
from utils.language.data.text import TextSource
from utils.language.data.token_bytes import token_bytes
from utils.language.data.tokens import TokensConfig
from utils.language.data.wikitext import WikiTextConfig
from utils.language.task.generate import greedy_decode
from utils.schema import Config
from utils.tasks.registry import MODELS, spec_of


@dataclass
class LanguageTaskConfig:
    """Schema of the language task's `task` section (config/task/language.yaml): no settings of its own yet."""

    kind: str = "language"  # task tag (fixed by the preset)

    def __post_init__(self):
        require(self.kind == "language", f"kind {self.kind!r} is not language", "task.kind",
                "leave kind as set by the data preset")


class LanguageTask:
    """Next-token prediction on WikiText with a decoder-only Transformer family (GPT, Llama, ...)."""

    DATA_KIND, DATA_NAME, TASK_SCHEMA = "wikitext", "WikiText", LanguageTaskConfig
    DATA_SCHEMAS = {"wikitext": WikiTextConfig, "tokens": TokensConfig}  # data.kind -> schema (config/data/ presets)
    DATA_PRESETS = {"wikitext": ("wikitext_sample", "wikitext"), "tokens": ("tokens",)}
    rollout_every = 0  # no forecasts
    num_prompts, prompt_len = 3, 8
    quality_metric = "val/ppl"  # the validation metric a run is judged by, besides val/loss

    @staticmethod
    def check_config(cfg: Config) -> None:
        model, data, cp = cfg.model, cfg.data, cfg.parallel.cp
        check_seq_len(model, data.seq_len)
        require(data.seq_len % (2 * cp) == 0, f"data.seq_len={data.seq_len} is not a multiple of 2 x parallel.cp="
                f"{2 * cp} (the causal load balance cuts the sequence into 2 x cp equal chunks)", "data.seq_len",
                f"use a multiple of {2 * cp}")
        spec = spec_of(model.arch)
        readers = [s.presets for s in MODELS.values() if s.documents]
        require(data.packing == "concat" or spec.documents, f"the {spec.name} model does not "
                "read packed documents", "data.packing", f"set data.packing=concat, or use {' or '.join(readers)}")
        require(data.packing == "concat" or not cfg.precision.compile,
                "packed documents with precision.compile=true (the blocks take the batch's documents, which "
                "torch.compile would guard on per batch)",
                "precision.compile", "set precision.compile=false or data.packing=concat")

    def __init__(self, data: TextSource, model_cfg: GPTConfig,
                 task: LanguageTaskConfig | None = None, build=None):
        self.cfg, self.model_cfg, self.build = data, model_cfg, build  # build: the family's (networks/spec.py)
        self.new_tokens = data.sample_tokens  # greedy tokens per prompt at each validation (0: no decoding)
        self.train_set = self.val_set = self.corpus = None
        self.unigram_ppl = float("nan")
        self.token_bytes: torch.Tensor | None = None  # (vocab,) bytes of text per id (bits per byte)
        self.data_less_vocab = 50257  # the vocabulary without data (benchmarks, dry runs): GPT-2's by default

    def load_data(self) -> None:
        """Read, tokenize (or load the caches of) the corpus; every data error is raised here."""
        self.corpus = self.cfg.open()  # a text source (utils/language/data/text.py)
        self.train_set = self.corpus.dataset("train", self.cfg.seq_len)
        self.val_set = self.corpus.dataset("valid", self.cfg.seq_len)
        self.unigram_ppl = self.corpus.unigram_ppl
        self.token_bytes = torch.from_numpy(token_bytes(self.corpus.tokenizer))

    def describe(self) -> str:
        if not self.corpus:
            return ""
        padded = padded_vocab_size(self.vocab_size, self.model_cfg.vocab_multiple)
        note = (f"; vocabulary padded from {self.vocab_size} to {padded} rows (multiple of model.vocab_multiple="
                f"{self.model_cfg.vocab_multiple}, split over tp ranks); padded logits are masked")
        return self.corpus.describe() + (note if padded != self.vocab_size else "")

    @property
    def vocab_size(self) -> int:
        return self.corpus.vocab_size if self.corpus else self.data_less_vocab

    @staticmethod
    def loss_is_criterion(cfg: Config) -> bool:
        return True

    def build_model(self) -> nn.Module:
        model = self.build(self.model_cfg, self)
        if self.cfg.packing == "documents":  # rows carry their documents (networks/documents.py)
            model.documents = self.cfg.attention
        return model

    def example_batch(self, batch_size: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        shape = (batch_size, self.cfg.seq_len)
        return (torch.randint(self.vocab_size, shape, device=device),
                torch.randint(self.vocab_size, shape, device=device))

    def tokens_per_sample(self) -> int:
        return self.cfg.seq_len

    @staticmethod
    def rollout_length(step: int) -> int:
        return 1  # one model call per sample

    def training_loss(self, model: nn.Module, criterion: nn.Module, x: torch.Tensor, y: torch.Tensor,
                      step: int) -> torch.Tensor:
        return criterion(model(x), y)

    def summary(self, metrics: dict[str, float]) -> str:
        bpb = f" val/bpb={metrics['val/bpb']:.4g}" if "val/bpb" in metrics else ""
        return (f"val/loss={metrics['val/loss']:.4g} val/ppl={metrics['val/ppl']:.4g}{bpb} "
                f"(unigram ppl {self.unigram_ppl:.4g})")

    @torch.no_grad()
    def evaluate(self, model: nn.Module, criterion: nn.Module, loader, *, grid: Grid, autocast,
                 writer, step: int) -> dict[str, float]:
        """val/loss, val/ppl and val/bpb over the validation blocks (sums reduced over dp and pp); greedy
        continuations as text. Bits per byte: the summed token NLL (nats) over ln 2 x the UTF-8 bytes the
        targets decode to (utils/language/data/token_bytes.py); absent without a corpus (a benchmark's random ids)."""
        sums = torch.zeros(4, dtype=torch.float64, device=grid.device)  # [sum of means, rows, NLL, bytes]
        table = None if self.token_bytes is None else self.token_bytes.to(grid.device)
        for x, y in loader:
            x = x.to(grid.device, non_blocking=True)
            with autocast():
                logits = model(x)  # None off the last pipeline stage (see WeatherTask.evaluate)
                if logits is not None and y is not None:  # y None: a padding batch (EvenBatches)
                    y = y.to(grid.device, non_blocking=True)
                    sums += self._block_sums(criterion(logits, y).double(), y, table)
        all_reduce_(sums, grid.metrics)
        loss = (sums[0] / sums[1].clamp_min(1)).item()
        if self.new_tokens:  # a collective (tp ranks decode together): every rank, not only the writer
            writer.text("val/samples", self.continuations(model, grid, autocast), step)
        metrics = {"val/loss": loss, "val/ppl": math.exp(min(loss, 50.0))}
        if table is not None:
            metrics["val/bpb"] = (sums[2] / (math.log(2) * sums[3].clamp_min(1))).item()
        return metrics

    @staticmethod
    def _block_sums(mean: torch.Tensor, y: torch.Tensor, table: torch.Tensor | None) -> torch.Tensor:
        """[mean x rows, rows, NLL in nats, bytes] of one batch: `mean` is the criterion's mean over its
        counted targets (ignore_index -100 does not count), so their NLL sum is mean x their number."""
        counted = y != -100
        nbytes = table[y.clamp_min(0)].masked_fill(~counted, 0).sum() if table is not None else mean.new_zeros(())
        return torch.stack([mean * len(y), mean.new_tensor(len(y)), mean * counted.sum(), nbytes.to(mean)])

    def prompt_starts(self) -> list[int]:
        """Where the fixed prompts start: evenly spaced places of the validation split, each followed by
        at least `new_tokens` true tokens."""
        span = len(self.corpus.valid) - self.prompt_len - self.new_tokens
        return [i * span // self.num_prompts for i in range(self.num_prompts)]

    def prompts(self) -> torch.Tensor:
        """The fixed prompts: `prompt_len` tokens at each of `prompt_starts`."""
        valid = self.corpus.valid
        return torch.tensor(np.stack([valid[s:s + self.prompt_len] for s in self.prompt_starts()]).astype(np.int64))

    def continuations(self, model: nn.Module, grid: Grid, autocast) -> str:
        """Greedy continuations of the fixed prompts next to the text that follows them in the corpus, as a
        markdown table (prompt, model, true text)."""
        prompts = self.prompts().to(grid.device)
        buffer = greedy_decode(model, prompts, self.new_tokens, tp=grid.axis(Axis.TP), autocast=autocast)
        valid, n, decode = self.corpus.valid, self.prompt_len, self.corpus.tokenizer.decode

        def cell(tokens) -> str:  # one table cell: no line breaks, pipes escaped
            return " ".join(decode([int(t) for t in tokens]).split()).replace("|", "\\|") or " "

        rows = [f"| {cell(row[:n])} | {cell(row[n:])} | {cell(valid[s + n:s + n + self.new_tokens])} |"
                for row, s in zip(buffer.cpu(), self.prompt_starts())]
        return "\n".join(["| prompt | model (greedy) | true text |", "|---|---|---|", *rows])
