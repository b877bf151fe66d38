"""The ERA5 workload: next-state regression with the ViT, validated by latitude-weighted RMSE per channel."""

from __future__ import annotations

import math
from pathlib import Path

import torch
from torch import nn

from distributed.collectives import all_reduce_
from distributed.pipeline.schedule import from_last_stage
from networks.vit import ViTConfig
from utils import require
from utils.comm import Grid
from utils.data.era5 import ERA5Config, ERA5Dataset, latitude_weights
from utils.data.era5_synthetic import ensure_synthetic
from utils.tasks.figures import field_panels, figure_image, skill_panels
from utils.tasks.forecast import Rollouts, rollout_skill
from utils.tasks.weather_metrics import weighted_rmse_per_sample

HOURS_PER_STEP = 6  # ERA5's files are 6-hourly
SKILL_CHANNELS = ("u10m", "t2m", "z500")  # the channels of the skill figures (those the data has)


class WeatherTask:
    """ERA5 next-state regression with the ViT."""

    DATA_KIND, DATA_NAME, DATA_SCHEMA = "era5", "ERA5", ERA5Config

    @staticmethod
    def check_config(cfg) -> None:
        model, data, cp = cfg.model, cfg.data, cfg.parallel.cp
        p = model.patch_size
        require(data.img_size[0] % p == 0 and data.img_size[1] % p == 0,
                f"img_size {list(data.img_size)} is not divisible by patch_size {p}", "data.img_size",
                f"choose a crop whose sides are multiples of model.patch_size={p}")
        tokens = (data.img_size[0] // p) * (data.img_size[1] // p)
        require(cfg.trainer.rollout_train_steps == 1 or cfg.parallel.pp == 1,
                f"trainer.rollout_train_steps={cfg.trainer.rollout_train_steps} with parallel.pp={cfg.parallel.pp}: "
                "a rollout feeds the last stage's prediction back to the first stage within one step, which the "
                "pipeline schedules do not do", "trainer.rollout_train_steps",
                "use parallel.pp=1 (tp, cp, dp and fsdp run rollout training), or rollout_train_steps=1")
        require(tokens >= cp, f"{tokens} patches cannot be split over parallel.cp={cp}", "parallel.cp",
                f"use parallel.cp <= {tokens} or a larger data.img_size")

    @property
    def quality_metric(self) -> str:
        """The validation metric a run is judged by, besides val/loss."""
        return f"val/rmse/{self.cfg.channels[0]}"

    def describe(self) -> str:
        text = (f"{self.train_set.infos[0].path.parent.parent}: {len(self.train_set)} train / {len(self.val_set)} "
                "valid pairs")
        if self.rollouts is not None:
            text += (f"; rollouts of {self.rollout_steps} steps from {self.rollout_inits} initial times"
                     + ("" if self.rollouts.climatology is not None else
                        " (no stats/time_means.npy: rollout ACC and the climatology baseline are left out)"))
        return text

    def summary(self, metrics: dict[str, float]) -> str:
        first = f"val/rmse/{self.cfg.channels[0]}"
        return f"val/loss={metrics['val/loss']:.4g} {first}={metrics[first]:.4g}"

    def __init__(self, data: ERA5Config, model_cfg: ViTConfig, trainer=None, build=None):
        self.cfg, self.model_cfg, self.build = data, model_cfg, build  # build: the family's (networks/spec.py)
        self.rollout_steps, self.rollout_inits = (trainer.rollout_steps, trainer.rollout_inits) if trainer else (0, 0)
        self.rollout_on = bool(trainer and trainer.rollout_every)
        self.train_horizon, self.curriculum = (trainer.rollout_train_steps, trainer.rollout_train_every) \
            if trainer else (1, 0)
        self.train_set = self.val_set = self.rollouts = None
        self.baselines_logged, self.baseline_curves = False, {}

    def load_data(self) -> None:
        """Find (or generate) the files and inspect them; every data error is raised here."""
        data = self.cfg
        if data.synthetic:
            root = ensure_synthetic(Path(data.root) if data.root else None)
        else:
            require(bool(data.root), "no data folder given", "data.root", "set data.root=/path/to/era5 (NERSC layout)")
            root = Path(data.root)
            require(root.is_dir(), f"data folder {root} does not exist", "data.root", "point it at the ERA5 folder")
        self.train_set = ERA5Dataset(root, "train", data, data.limit_nsamples, self.train_horizon)
        self.val_set = ERA5Dataset(root, "valid", data, data.limit_nsamples_val)
        self.lat_weights = latitude_weights(data.img_size[0])
        if self.rollout_on:  # the initial times and their truths, checked before any distributed work
            self.rollouts = Rollouts.of(self.val_set, root, self.rollout_steps, self.rollout_inits)

    def example_batch(self, batch_size: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Random inputs and targets of the training shapes (benchmarks)."""
        shape = (batch_size, len(self.cfg.channels), *self.cfg.img_size)
        return torch.randn(shape, device=device), torch.randn(shape, device=device)

    @staticmethod
    def loss_is_criterion(cfg) -> bool:
        """One-step training is; rollout training feeds predictions back (refused under pp by check_config)."""
        return cfg.trainer.rollout_train_steps == 1

    def build_model(self) -> nn.Module:
        return self.build(self.model_cfg, self)

    def rollout_length(self, step: int) -> int:
        """K predicted steps per training sample at optimizer step `step`: the curriculum (a function of the
        step, so a resumed run continues it exactly)."""
        if not self.curriculum:
            return self.train_horizon
        return min(self.train_horizon, 1 + step // self.curriculum)

    def training_loss(self, model: nn.Module, criterion: nn.Module, x: torch.Tensor, y: torch.Tensor,
                      step: int) -> torch.Tensor:
        """One step: criterion(model(x), y). Rollout training (y holds K_max states): the mean of the criterion
        over the first K predictions, each fed back (in float32) with the graph kept, so the backward runs
        through the whole rollout; the blocks' activation checkpointing bounds the memory of K forwards."""
        if self.train_horizon == 1:
            return criterion(model(x), y)
        steps, total = self.rollout_length(step), 0.0
        for k in range(steps):
            x = model(x).float()
            total = total + criterion(x, y[:, k])
        return total / steps

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

    def evaluate_rollout(self, model: nn.Module, *, grid: Grid, autocast, writer, step: int) -> dict[str, float]:
        """rollout/<metric>/<channel>/<lead>h of the model (utils/tasks/forecast.py), and the persistence and
        climatology baselines once as baseline/<name>/<metric>/<channel>/<lead>h; a figure of RMSE and ACC
        against lead time for u10m, t2m and z500 (those the data has). Returns the model's scalars."""
        first = not self.baselines_logged
        skill = rollout_skill(model, self.rollouts, grid=grid, autocast=autocast, with_baselines=first)
        leads = [(k + 1) * self.cfg.dt * HOURS_PER_STEP for k in range(self.rollout_steps)]

        def scalars(prefix: str, values: dict) -> dict[str, float]:
            return {f"{prefix}/{metric}/{channel}/{lead}h": float(values[metric][k, c])
                    for metric in values for c, channel in enumerate(self.cfg.channels)
                    for k, lead in enumerate(leads) if not math.isnan(float(values[metric][k, c]))}

        metrics = scalars("rollout", skill["model"])
        if first:
            self.baselines_logged = True
            writer.scalars({tag: value for name in skill if name != "model"
                            for tag, value in scalars(f"baseline/{name}", skill[name]).items()}, step)
            self.baseline_curves = {name: skill[name] for name in skill if name != "model"}
        if grid.batch.rank == 0 and writer.active:
            for channel in [c for c in SKILL_CHANNELS if c in self.cfg.channels]:
                c = self.cfg.channels.index(channel)
                curves = {name: {m: v[:, c].tolist() for m, v in values.items()}
                          for name, values in {"model": skill["model"], **self.baseline_curves}.items()}
                writer.image(f"rollout/skill_{channel}", figure_image(skill_panels(leads, curves, channel, step)), step)
        return metrics
