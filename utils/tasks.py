"""Workloads: what differs between the ERA5 ViT and the WikiText LM, behind one small interface.

A task owns its datasets, builds its (serial) model, knows its tokens per sample and runs its own
validation metrics. The trainer is the same for every task. Which model fits which data is a rule of
the config (utils/config.py), checked before a task is built.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch
from torch import nn

from distributed.collectives import all_reduce_
from distributed.pipeline.schedule import from_last_stage
from networks.transformer import GPT, GPTConfig, padded_vocab_size
from networks.vit import ViT, ViTConfig
from utils.comm import Axis, Grid
from utils.data.era5 import ERA5Config, ERA5Dataset, latitude_weights
from utils.data.era5_synthetic import ensure_synthetic
from utils.data.wikitext import WikiTextConfig, load_wikitext
from utils.errors import require
from utils.figures import field_panels, figure_image
from utils.generate import greedy_decode
from utils.metrics import weighted_rmse_per_sample


class WeatherTask:
    """ERA5 next-state regression with the ViT."""

    @property
    def quality_metric(self) -> str:
        """The validation metric a run is judged by, besides val/loss."""
        return f"val/rmse/{self.cfg.channels[0]}"

    def describe(self) -> str:
        return f"{self.train_set.infos[0].path.parent.parent}: {len(self.train_set)} train / {len(self.val_set)} valid pairs"

    def summary(self, metrics: dict[str, float]) -> str:
        first = f"val/rmse/{self.cfg.channels[0]}"
        return f"val/loss={metrics['val/loss']:.4g} {first}={metrics[first]:.4g}"

    def __init__(self, data: ERA5Config, model_cfg: ViTConfig):
        self.cfg, self.model_cfg = data, model_cfg
        self.train_set = self.val_set = None

    def load_data(self) -> None:
        """Find (or generate) the files and inspect them; every data error is raised here."""
        data = self.cfg
        if data.synthetic:
            root = ensure_synthetic(Path(data.root) if data.root else None)
        else:
            require(bool(data.root), "no data folder given", "data.root", "set data.root=/path/to/era5 (NERSC layout)")
            root = Path(data.root)
            require(root.is_dir(), f"data folder {root} does not exist", "data.root", "point it at the ERA5 folder")
        self.train_set = ERA5Dataset(root, "train", data, data.limit_nsamples)
        self.val_set = ERA5Dataset(root, "valid", data, data.limit_nsamples_val)
        self.lat_weights = latitude_weights(data.img_size[0])

    def example_batch(self, batch_size: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Random inputs and targets of the training shapes (benchmarks)."""
        shape = (batch_size, len(self.cfg.channels), *self.cfg.img_size)
        return torch.randn(shape, device=device), torch.randn(shape, device=device)

    def build_model(self) -> nn.Module:
        c = len(self.cfg.channels)
        return ViT(self.model_cfg, tuple(self.cfg.img_size), c, c)

    def tokens_per_sample(self) -> int:
        h, w = self.cfg.img_size
        return (h // self.model_cfg.patch_size) * (w // self.model_cfg.patch_size)

    @torch.no_grad()
    def evaluate(self, model: nn.Module, criterion: nn.Module, loader, *, grid: Grid, autocast,
                 writer, step: int) -> dict[str, float]:
        """val/loss and latitude-weighted val/rmse/<channel>, reduced over dp; an image of u10m.

        Under pipeline parallelism `model` is the forward pass through the stages: the predictions exist
        on the last stage's ranks, whose sums the reduction over dp x pp adds (the others add zeros)."""
        device, batch = grid.device, grid.batch
        weights = self.lat_weights.to(device)
        sums = torch.zeros(2 + len(self.cfg.channels), dtype=torch.float64, device=device)
        first = None
        for x, y in loader:
            x = x.to(device, non_blocking=True)
            with autocast():
                pred = model(x)
            if y is None:  # a padding batch (utils/data/batching.py: EvenBatches)
                continue
            y = y.to(device, non_blocking=True)
            if pred is not None:
                sums[0] += criterion(pred, y).double() * len(x)
                sums[1] += len(x)
                sums[2:] += weighted_rmse_per_sample(pred, y, weights).sum(dim=0).double()
            if first is None:
                image = from_last_stage(model, None if pred is None else pred[0, 0].float(), y[0, 0].float())
                first = (image.cpu(), y[0, 0].float().cpu())
        all_reduce_(sums, grid.metrics)
        count = sums[1].clamp_min(1)
        metrics = {"val/loss": (sums[0] / count).item()}
        metrics.update({f"val/rmse/{c}": (sums[2 + i] / count).item() for i, c in enumerate(self.cfg.channels)})
        if first is not None and batch.rank == 0 and writer.active:  # rank 0 alone draws and writes the figure
            channel = self.cfg.channels[0]
            writer.image(f"val/{channel}_pred_vs_target", figure_image(field_panels(*first, channel, step)), step)
        return metrics


class LanguageTask:
    """Next-token prediction on WikiText with the decoder-only Transformer."""

    num_prompts, prompt_len = 3, 8
    quality_metric = "val/ppl"  # the validation metric a run is judged by, besides val/loss

    def __init__(self, data: WikiTextConfig, model_cfg: GPTConfig):
        self.cfg, self.model_cfg = data, model_cfg
        self.new_tokens = data.sample_tokens  # greedy tokens per prompt at each validation (0: no decoding)
        self.train_set = self.val_set = self.corpus = None
        self.unigram_ppl = float("nan")

    def load_data(self) -> None:
        """Read, tokenize (or load the caches of) the corpus; every data error is raised here."""
        self.corpus = load_wikitext(self.cfg)
        self.train_set = self.corpus.dataset("train", self.cfg.seq_len)
        self.val_set = self.corpus.dataset("valid", self.cfg.seq_len)
        self.unigram_ppl = self.corpus.unigram_ppl

    def describe(self) -> str:
        if not self.corpus:
            return ""
        padded = padded_vocab_size(self.vocab_size, self.model_cfg.vocab_multiple)
        note = (f"; vocabulary padded from {self.vocab_size} to {padded} rows (multiple of model.vocab_multiple="
                f"{self.model_cfg.vocab_multiple}, split over tp ranks); padded logits are masked")
        return self.corpus.describe() + (note if padded != self.vocab_size else "")

    @property
    def vocab_size(self) -> int:
        return self.corpus.vocab_size if self.corpus else 50257  # GPT-2's vocabulary for data-less benchmarks

    def build_model(self) -> nn.Module:
        return GPT(self.model_cfg, self.vocab_size)

    def example_batch(self, batch_size: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        shape = (batch_size, self.cfg.seq_len)
        return (torch.randint(self.vocab_size, shape, device=device),
                torch.randint(self.vocab_size, shape, device=device))

    def tokens_per_sample(self) -> int:
        return self.cfg.seq_len

    def summary(self, metrics: dict[str, float]) -> str:
        return f"val/loss={metrics['val/loss']:.4g} val/ppl={metrics['val/ppl']:.4g} (unigram ppl {self.unigram_ppl:.4g})"

    @torch.no_grad()
    def evaluate(self, model: nn.Module, criterion: nn.Module, loader, *, grid: Grid, autocast,
                 writer, step: int) -> dict[str, float]:
        """val/loss and val/ppl over the validation blocks (reduced over dp); greedy continuations as text."""
        sums = torch.zeros(2, dtype=torch.float64, device=grid.device)
        for x, y in loader:
            x = x.to(grid.device, non_blocking=True)
            with autocast():
                logits = model(x)  # None off the last pipeline stage (see WeatherTask.evaluate)
                if logits is not None and y is not None:  # y None: a padding batch (EvenBatches)
                    y = y.to(grid.device, non_blocking=True)
                    sums[0] += criterion(logits, y).double() * len(x)
                    sums[1] += len(x)
        all_reduce_(sums, grid.metrics)
        loss = (sums[0] / sums[1].clamp_min(1)).item()
        if self.new_tokens:  # a collective (tp ranks decode together): every rank, not only the writer
            writer.text("val/samples", self.continuations(model, grid, autocast), step)
        return {"val/loss": loss, "val/ppl": math.exp(min(loss, 50.0))}

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


def build_task(cfg, load_data: bool = True) -> WeatherTask | LanguageTask:
    """The workload of the configured data family, its data inspected (before any distributed work)."""
    kind = getattr(cfg.data, "kind", None)
    if kind == "era5":
        task = WeatherTask(cfg.data, cfg.model)
    elif kind == "wikitext":
        task = LanguageTask(cfg.data, cfg.model)
    else:
        raise AssertionError(f"unhandled data kind {kind}")
    if load_data:
        task.load_data()
    return task
