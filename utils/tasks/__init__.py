"""Workloads behind one interface (`Task`), and what ties them to the model families (utils/tasks/registry.py).

A task owns its datasets, builds its family's model (through the family's spec), knows its tokens per
sample and runs its own validation metrics; the trainer is the same for every task. The registry maps
`model.arch` to the family's `networks.spec.ModelSpec`, whose task says which data it trains on: the config
(utils/cli/config.py) registers the schemas and checks the pairing from it, build_task builds from it.
"""

from __future__ import annotations

import importlib
import pkgutil
from pathlib import Path
from typing import Any, ClassVar, Protocol

import torch
from torch import nn

from distributed.pipeline.stage_plan import PipelinePlan, resolve_plan
from networks.spec import ModelSpec
from utils import ConfigError, require
from utils.comm import Grid
from utils.schema import Config
from utils.tasks.registry import MODELS, spec_of


class Task(Protocol):
    """What a workload provides to the build, the trainer and the tools."""

    DATA_KIND: ClassVar[str]  # the `data.kind` it trains on (its first source's)
    DATA_NAME: ClassVar[str]  # as messages name that data
    DATA_SCHEMAS: ClassVar[dict[str, type]]  # data.kind -> the data config dataclass of each source it reads
    # data.kind -> its presets in config/data/, those that need no data first: what a one-line error offers
    DATA_PRESETS: ClassVar[dict[str, tuple[str, ...]]]
    TASK_SCHEMA: ClassVar[type]  # its settings, the `task` section (config/task/<kind>.yaml, named by the data presets)
    quality_metric: str  # the validation metric a run is judged by, besides val/loss (a TensorBoard tag)
    rollout_every: int  # optimizer steps between `evaluate_rollout`s (and one at the end); 0: none
    train_set: Any  # map-style datasets of (input, target) pairs, set by load_data
    val_set: Any

    @staticmethod
    def check_config(cfg: Config) -> None:
        """The rules that tie this task's model and data to the layout and the trainer (raise ConfigError)."""

    @staticmethod
    def loss_is_criterion(cfg: Config) -> bool:
        """Whether `training_loss` is criterion(model(x), y) under `cfg` (what a pipeline's last stage computes:
        another loss, such as several model calls or an auxiliary term, is refused under pp)."""

    def load_data(self) -> None:
        """Find, generate or read the data; every data error is raised here, before distributed work."""

    def describe(self) -> str:
        """One line on the data, for the run log."""

    def summary(self, metrics: dict[str, float]) -> str:
        """The validation metrics of a log line."""

    def build_model(self) -> nn.Module:
        """The serial model of the configured family (its spec's builder, given to the task's constructor as
        `build`); under torch.device("meta") shapes only. Parallelism is applied by the build, from the
        model's parallel plan."""

    def example_batch(self, batch_size: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Random inputs and targets of the training shapes (benchmarks, the planner)."""

    def tokens_per_sample(self) -> int:
        """Sequence positions per sample (tokens/s, FLOPs)."""

    def training_loss(self, model: nn.Module, criterion: nn.Module, x: torch.Tensor, y: torch.Tensor,
                      step: int) -> torch.Tensor:
        """The loss of a training micro-batch at optimizer step `step` (0-based), to be backpropagated."""

    def rollout_length(self, step: int) -> int:
        """Model calls per training sample at optimizer step `step` (0-based): the weather task's rollout
        curriculum K, 1 for one-step tasks (the log shows it; the ETA weighs the steps left by it)."""

    def evaluate(self, model: nn.Module, criterion: nn.Module, loader, *, grid: Grid, autocast, writer,
                 step: int) -> dict[str, float]:
        """val/loss and the task's metrics over the validation loader, reduced over the grid."""

    def evaluate_rollout(self, model: nn.Module, *, grid: Grid, autocast, writer, step: int) -> dict[str, float]:
        """Multi-step forecast skill (every `rollout_every` steps; the weather task, utils/weather/task/forecast.py)."""


def tasks() -> dict[str, type]:
    """The workloads a family names (`ModelSpec.task`), found as families are: each wing of utils/ (a package with a
    task/ package: utils/weather/, utils/language/) declares its own in its task/__init__.py (`TASKS = {name: the
    Task class}`); the core names none. Read once per process."""
    if not _TASKS:
        import utils

        for info in sorted(pkgutil.iter_modules(utils.__path__), key=lambda i: i.name):
            if info.ispkg and (Path(utils.__path__[0]) / info.name / "task" / "__init__.py").is_file():
                _TASKS.update(importlib.import_module(f"utils.{info.name}.task").TASKS)
    return _TASKS


_TASKS: dict[str, type] = {}


def task_of(spec: ModelSpec) -> type:
    """The Task class a family trains with (a family outside the tree may give its own class instead of a name)."""
    if isinstance(spec.task, type):
        return spec.task
    found = tasks()
    require(spec.task in found, f"the {spec.name} family names task {spec.task!r}", "model.arch",
            f"give its ModelSpec a task of {', '.join(found)}, or a Task class")
    return found[spec.task]


def pipeline_plan(cfg: Config) -> PipelinePlan:
    """The pipeline's stages over the family's blocks (`ModelSpec.blocks`), checked (a one-line error)."""
    par = cfg.parallel
    blocks = spec_of(cfg.model.arch).blocks(cfg.model)
    return resolve_plan(par.pp_schedule, par.pp, par.pp_stages_per_rank, par.pp_microbatches, blocks)


def check_pairing(cfg: Config) -> None:
    """The data fits the model (exit 2 naming the data presets that fit the model, and the models that fit the
    data), the family's layout rules and its split into pipeline stages, the task's own rules, and the pipeline
    computes the task's loss."""
    model, data = cfg.model, cfg.data
    spec = spec_of(model.arch)  # each schema checks its own arch tag
    task = task_of(spec)
    if data.kind not in task.DATA_SCHEMAS:
        # a model named on the command line meets the default data (ERA5) when data= is left out: the data
        # presets that fit the model come first, the models that fit the data after
        fits = [s for s in MODELS.values() if data.kind in task_of(s).DATA_SCHEMAS]
        presets = [f"data={p}" for kind in task.DATA_SCHEMAS for p in task.DATA_PRESETS.get(kind, (f"{kind}*",))]
        owner = task_of(fits[0]) if fits else None
        name = f"{owner.DATA_NAME} data" if owner and owner.DATA_KIND == data.kind else f"data of kind {data.kind}"
        other = f" (or, for {name}, {'; '.join(s.presets for s in fits)})" if fits else ""
        raise ConfigError(f"the {spec.name} model does not train on {name}", "data",
                          f"use {' or '.join([', '.join(presets[:-1]), presets[-1]] if len(presets) > 1 else presets)}"
                          + other)
    require(isinstance(cfg.task, task.TASK_SCHEMA), f"task settings of kind {getattr(cfg.task, 'kind', '?')!r} "
            f"for the {spec.name} model", "task", "leave task as the data preset sets it (config/data/)")
    spec.check_layout(model, cfg.parallel)
    if cfg.parallel.pp > 1:
        pipeline_plan(cfg)
    task.check_config(cfg)
    require(cfg.parallel.pp == 1 or task.loss_is_criterion(cfg), f"the {spec.name} task's training loss "
            "under these settings is not criterion(model(x), y), which a pipeline's last stage computes",
            "parallel.pp", "set parallel.pp=1")


def build_task(cfg: Config, load_data: bool = True) -> Task:
    """The workload of the configured model family, its data inspected (before any distributed work)."""
    spec = spec_of(cfg.model.arch)
    task = task_of(spec)(cfg.data, cfg.model, cfg.task, build=spec.build)
    if load_data:
        task.load_data()
    return task
