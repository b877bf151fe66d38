"""Workloads behind one interface (`Task`), and the registry of model families that picks them.

A task owns its datasets, builds its (serial) model, knows its tokens per sample and runs its own
validation metrics; the trainer is the same for every task. `FAMILIES` maps `model.arch` to what the
rest of the code needs of a family: its config schema, the data family it trains on, and its task.
The config (utils/cli/config.py) registers the schemas and checks the pairing from it, build_task
builds from it: a third model or task is one entry here and its own modules, not an edit of five files.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

from networks.transformer import GPTConfig, LlamaConfig
from networks.vit import ViTConfig
from utils import require
from utils.comm import Grid
from utils.data.era5 import ERA5Config
from utils.data.wikitext import WikiTextConfig
from utils.tasks.language import LanguageTask
from utils.tasks.weather import WeatherTask


class Task(Protocol):
    """What a workload provides to the build, the trainer and the tools."""

    quality_metric: str  # the validation metric a run is judged by, besides val/loss (a TensorBoard tag)
    train_set: Any  # map-style datasets of (input, target) pairs, set by load_data
    val_set: Any

    @staticmethod
    def check_config(cfg: Any) -> None:
        """The rules that tie this task's model and data to the layout and the trainer (raise ConfigError)."""

    def load_data(self) -> None:
        """Find, generate or read the data; every data error is raised here, before distributed work."""

    def describe(self) -> str:
        """One line on the data, for the run log."""

    def summary(self, metrics: dict[str, float]) -> str:
        """The validation metrics of a log line."""

    def build_model(self) -> nn.Module:
        """The serial model (parallelism is applied by the build, from the model's parallel plan)."""

    def example_batch(self, batch_size: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Random inputs and targets of the training shapes (benchmarks, the planner)."""

    def tokens_per_sample(self) -> int:
        """Sequence positions per sample (tokens/s, FLOPs)."""

    def training_loss(self, model: nn.Module, criterion: nn.Module, x: torch.Tensor, y: torch.Tensor,
                      step: int) -> torch.Tensor:
        """The loss of a training micro-batch at optimizer step `step` (0-based), to be backpropagated."""

    def evaluate(self, model: nn.Module, criterion: nn.Module, loader, *, grid: Grid, autocast, writer,
                 step: int) -> dict[str, float]:
        """val/loss and the task's metrics over the validation loader, reduced over the grid."""

    def evaluate_rollout(self, model: nn.Module, *, grid: Grid, autocast, writer, step: int) -> dict[str, float]:
        """Multi-step forecast skill (trainer.rollout_every; the weather task, utils/tasks/forecast.py)."""


@dataclass(frozen=True)
class Family:
    """A model family: its `model.arch`, config schema, presets, and the data and task it trains with."""

    arch: str
    name: str  # as an error message names it
    model_schema: type
    presets: str  # the model presets, for error messages
    data_kind: str  # `data.kind` it trains on
    data_name: str
    data_schema: type
    task: type


FAMILIES = {f.arch: f for f in (
    Family("vit", "ViT", ViTConfig, "model=vit_tiny, vit_base or vit_large", "era5", "ERA5", ERA5Config, WeatherTask),
    Family("gpt", "GPT", GPTConfig, "model=gpt_tiny, gpt_small or gpt_medium", "wikitext", "WikiText", WikiTextConfig,
           LanguageTask),
    Family("llama", "Llama", LlamaConfig, "model=llama_tiny, llama_1b or llama_8b", "wikitext", "WikiText",
           WikiTextConfig, LanguageTask),
)}


def check_pairing(cfg) -> None:
    """The data fits the model (exit 2 naming the models that would), then the task's own rules."""
    model, data = cfg.model, cfg.data
    family = FAMILIES[model.arch]  # each schema checks its own arch tag
    fits = [f for f in FAMILIES.values() if f.data_kind == data.kind]
    require(family.data_kind == data.kind, f"the {fits[0].data_name} data needs a {' or '.join(f.name for f in fits)} "
            "model", "model", "use " + "; ".join(f.presets for f in fits) + f" with data={data.kind}*")
    family.task.check_config(cfg)


def build_task(cfg, load_data: bool = True) -> Task:
    """The workload of the configured model family, its data inspected (before any distributed work)."""
    task = FAMILIES[cfg.model.arch].task(cfg.data, cfg.model, cfg.trainer)
    if load_data:
        task.load_data()
    return task
