"""The ERA5 workload: next-state regression with the ViT, validated by latitude-weighted RMSE per channel.

The task owns its settings, the `task` section (config/task/weather.yaml, chosen by the weather data presets):
its training loss (utils/weather/task/weather_loss.py), rollout training, and the forecast evaluation (`task.eval`,
which a run may change between invocations: utils/cli/runs.py RESUME_SAFE). It reads its data through a reader
(utils/weather/data/fields.py), whichever source the data schema names (`DATA_SCHEMAS`: a new source adds its line).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from distributed.collectives import all_reduce_
from distributed.pipeline.schedule import from_last_stage
from networks.vit.model import ViTConfig
from utils import require
from utils.comm import Grid
from utils.weather.data.era5 import ERA5Config
from utils.weather.data.era5_zarr import ERA5ZarrConfig
from utils.weather.data.fields import FieldPairs, cell_area_weights
from utils.weather.task.ensemble import ensemble_skill
from utils.weather.task.figures import field_panels, figure_image, lead_spectra_panel, skill_panels
from utils.weather.task.forecast import Rollouts, rollout_skill
from utils.weather.task.spectra import blurring
from utils.weather.task.weather_loss import GRAPHCAST_WEIGHTS, LOSSES, WeightedMSE, loss_table
from utils.weather.task.weather_metrics import weighted_rmse_per_sample

# the channels of the skill figures (those the data has): u10m, t2m and z500 by either source's names
SKILL_CHANNELS = ("u10m", "t2m", "z500", "10m_u_component_of_wind", "2m_temperature", "geopotential@500")


@dataclass
class ForecastEvalConfig:
    """Schema of `task.eval`: the rollout evaluation (utils/weather/task/forecast.py). Resume-safe: changing it neither
    renames a run nor refuses its resume."""

    every: int = 0  # steps between rollout evaluations, and one at the end (0 = none)
    steps: int = 20  # autoregressive steps of data.dt per rollout (20 x 6 h = 5 days)
    inits: int = 8  # initial times of the validation split, evenly spaced
    # an ensemble from perturbed initial states, scored by fair CRPS and spread-skill (0 or 1: none, no cost)
    members: int = 0
    perturbation_std: float = 0.05  # of the initial perturbations, normalised units (the forecast command's)
    perturbation_length: float = 2.0  # their correlation length, grid points (0: white noise)

    def __post_init__(self):
        require(self.every >= 0, "every must be >= 0", "task.eval.every", "set 0 (none) or a number of steps")
        for name in ("steps", "inits"):
            require(getattr(self, name) > 0, f"{name} must be positive", f"task.eval.{name}", "set a positive integer")
        require(self.members >= 0, "members must be >= 0", "task.eval.members", "set 0 (none) or 2 or more")
        for name in ("perturbation_std", "perturbation_length"):
            require(getattr(self, name) >= 0, f"{name} must be >= 0", f"task.eval.{name}", "set a value >= 0")


@dataclass
class WeatherTaskConfig:
    """Schema of the weather task's `task` section: its loss, rollout training and forecast evaluation."""

    kind: str = "weather"  # task tag (fixed by the preset)
    loss: str = "relative_l2"  # relative_l2 (the seed's) | mse | area_mse | weighted_mse (weather_loss.py)
    # weighted_mse: each variable's weight by WeatherBench 2 name (others 1); its levels share it by pressure
    variable_weights: dict[str, float] = field(default_factory=lambda: dict(GRAPHCAST_WEIGHTS))
    rollout_train_steps: int = 1  # predicted steps per training sample, the loss their mean (1 = one-step)
    rollout_train_every: int = 0  # curriculum: K = min(rollout_train_steps, 1 + step // this) (0: K at once)
    eval: ForecastEvalConfig = field(default_factory=ForecastEvalConfig)

    def __post_init__(self):
        require(self.kind == "weather", f"kind {self.kind!r} is not weather", "task.kind",
                "leave kind as set by the data preset")
        require(self.loss in LOSSES, f"unknown loss {self.loss!r}", "task.loss", "choose " + ", ".join(LOSSES))
        bad = [name for name, weight in self.variable_weights.items() if not weight >= 0]
        require(not bad, f"negative weight of {', '.join(bad)}", "task.variable_weights", "give weights >= 0")
        require(self.rollout_train_steps > 0, "rollout_train_steps must be positive", "task.rollout_train_steps",
                "set a positive integer")
        require(self.rollout_train_every >= 0, "rollout_train_every must be >= 0", "task.rollout_train_every",
                "set 0 or more")


class WeatherTask:
    """ERA5 next-state regression with the ViT."""

    DATA_KIND, DATA_NAME, TASK_SCHEMA = "era5", "ERA5", WeatherTaskConfig
    DATA_SCHEMAS = {"era5": ERA5Config, "era5_zarr": ERA5ZarrConfig}  # data.kind -> schema (config/data/ presets)
    DATA_PRESETS = {"era5": ("era5_synthetic", "era5"), "era5_zarr": ("era5_zarr",)}

    @staticmethod
    def check_config(cfg) -> None:
        model, data, cp, task = cfg.model, cfg.data, cfg.parallel.cp, cfg.task
        p = model.patch_size
        require(data.img_size[0] % p == 0 and data.img_size[1] % p == 0,
                f"img_size {list(data.img_size)} is not divisible by patch_size {p}", "data.img_size",
                f"choose a crop whose sides are multiples of model.patch_size={p}")
        tokens = (data.img_size[0] // p) * (data.img_size[1] // p)
        require(task.rollout_train_steps == 1 or cfg.parallel.pp == 1,
                f"task.rollout_train_steps={task.rollout_train_steps} with parallel.pp={cfg.parallel.pp}: "
                "a rollout feeds the last stage's prediction back to the first stage within one step, which the "
                "pipeline schedules do not do", "task.rollout_train_steps",
                "use parallel.pp=1 (tp, cp, dp and fsdp run rollout training), or rollout_train_steps=1")
        require(tokens >= cp, f"{tokens} patches cannot be split over parallel.cp={cp}", "parallel.cp",
                f"use parallel.cp <= {tokens} or a larger data.img_size")

    @property
    def quality_metric(self) -> str:
        """The validation metric a run is judged by, besides val/loss."""
        return f"val/rmse/{self.channels[0]}"

    def describe(self) -> str:
        text = f"{self.train_set.reader.describe()}: {len(self.train_set)} train / {len(self.val_set)} valid pairs"
        pairs, times = self.train_set, sum(self.train_set.reader.segment_lengths)
        if len(pairs) == pairs.offsets[-1]:  # not limited: say why there are fewer pairs than times
            text += (f" (of {times} train times, the last {pairs.dt * pairs.horizon} of each file have no target "
                     f"{pairs.horizon} x data.dt={pairs.dt} steps ahead)")
        if self.train_horizon > 1:
            text += (f"; rollout training: K={self.rollout_length(0)} at step 0" + (
                f", +1 every {self.curriculum} steps up to {self.train_horizon}" if self.curriculum else ""))
        if self.rollouts is not None:
            text += (f"; rollouts of {self.eval.steps} steps from {self.eval.inits} initial times"
                     + ("" if self.rollouts.climatology is not None else
                        " (no stats/time_means.npy: rollout ACC and the climatology baseline are left out)"))
            if self.eval.members >= 2:
                text += f"; an ensemble of {self.eval.members} members (CRPS, spread-skill)"
        return text

    def summary(self, metrics: dict[str, float]) -> str:
        first = f"val/rmse/{self.channels[0]}"
        return f"val/loss={metrics['val/loss']:.4g} {first}={metrics[first]:.4g}"

    def __init__(self, data: ERA5Config | ERA5ZarrConfig, model_cfg: ViTConfig, task: WeatherTaskConfig | None = None,
                 build=None):
        self.cfg, self.model_cfg, self.build = data, model_cfg, build  # build: the family's (networks/spec.py)
        self.settings = task or WeatherTaskConfig()
        self.eval = self.settings.eval
        self.rollout_every = self.eval.every  # the trainer's cadence of evaluate_rollout
        self.train_horizon, self.curriculum = self.settings.rollout_train_steps, self.settings.rollout_train_every
        self.channels = list(data.channels)
        self.train_set = self.val_set = self.rollouts = None
        self.loss_weights = np.ones((len(self.channels), 1, 1), np.float32)  # without data (planner): shapes only
        self.lat_weights = torch.ones(data.img_size[0], 1)  # val/rmse's, from the data's latitudes in load_data
        self.baselines_logged, self.baseline_curves = False, {}

    def load_data(self) -> None:
        """Open the readers of the training and validation splits; every data error is raised here."""
        data = self.cfg
        self.train_set = FieldPairs(data.open("train"), data.dt, data.limit_nsamples, self.train_horizon)
        self.val_set = FieldPairs(data.open("valid"), data.dt, data.limit_nsamples_val)
        reader = self.val_set.reader
        self.lat_weights = cell_area_weights(reader.latitudes).float()  # the rows' true latitudes, as WB2's
        if self.settings.loss != "relative_l2":
            self.loss_weights = loss_table(self.settings.loss, reader.channels, reader.latitudes,
                                           self.settings.variable_weights)
        if self.rollout_every:  # the initial times and their truths, checked before any distributed work
            self.rollouts = Rollouts.of(self.val_set, self.eval.steps, self.eval.inits)

    def lead_hours(self, steps: int) -> list[int | float]:
        """Lead times (hours, an int when whole) of a rollout's steps: data.dt steps of the data's time step."""
        hours = self.val_set.reader.hours_per_step if self.val_set is not None else 6.0
        leads = [(k + 1) * self.cfg.dt * hours for k in range(steps)]
        return [int(lead) if float(lead).is_integer() else lead for lead in leads]

    def example_batch(self, batch_size: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Random inputs and targets of the training shapes (benchmarks)."""
        shape = (batch_size, len(self.channels), *self.cfg.img_size)
        return torch.randn(shape, device=device), torch.randn(shape, device=device)

    @staticmethod
    def loss_is_criterion(cfg) -> bool:
        """One-step training is; rollout training feeds predictions back (refused under pp by check_config)."""
        return cfg.task.rollout_train_steps == 1

    def build_model(self) -> nn.Module:
        """The family's model, its criterion the configured loss (the ViT's own for relative_l2): what the
        trainer, validation and a pipeline's last stage compute."""
        model = self.build(self.model_cfg, self)
        if self.settings.loss != "relative_l2":
            model.criterion = WeightedMSE(self.loss_weights)
        return model

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
        """val/loss and latitude-weighted val/rmse/<channel> (normalised units, the cell-area weights of the
        data's latitudes, the root per sample as the seed's), reduced over dp; an image of u10m.

        Under pipeline parallelism `model` is the forward pass through the stages: the predictions exist
        on the last stage's ranks, whose sums the reduction over dp x pp adds (the others add zeros)."""
        device, batch = grid.device, grid.batch
        weights = self.lat_weights.to(device)
        sums = torch.zeros(2 + len(self.channels), dtype=torch.float64, device=device)
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
        metrics.update({f"val/rmse/{c}": (sums[2 + i] / count).item() for i, c in enumerate(self.channels)})
        if first is not None and batch.rank == 0 and writer.draws_images:  # rank 0 alone draws the figure
            channel = self.channels[0]
            writer.image(f"val/{channel}_pred_vs_target", figure_image(field_panels(*first, channel, step)), step)
        return metrics

    def evaluate_rollout(self, model: nn.Module, *, grid: Grid, autocast, writer, step: int) -> dict[str, float]:
        """rollout/<metric>/<channel>/<lead>h of the model (utils/weather/task/forecast.py): RMSE, ACC, bias and the
        blurring figure of its zonal energy spectra (utils/weather/task/spectra.py), with task.eval.members >= 2 the
        ensemble's fair CRPS and spread-skill ratio (utils/weather/task/ensemble.py); the persistence and climatology
        baselines once as baseline/<name>/<metric>/<channel>/<lead>h; figures of RMSE and ACC against lead time
        and of the spectra for u10m, t2m and z500 (those the data has). Returns the model's scalars."""
        first, spectral = not self.baselines_logged, {}
        skill = rollout_skill(model, self.rollouts, grid=grid, autocast=autocast, with_baselines=first,
                              spectra=spectral)
        blur = blurring(spectral["forecast"], spectral["truth"])  # (K, C)
        metrics = self._scalars("rollout", {**skill["model"], "blurring": blur})
        if self.eval.members >= 2:
            scores = ensemble_skill(model, self.rollouts, grid=grid, autocast=autocast, members=self.eval.members,
                                    std=self.eval.perturbation_std, length=self.eval.perturbation_length)
            metrics.update(self._scalars("rollout", {"crps": scores["crps"], "spread_skill": scores["ratio"]}))
        if first:
            self.baselines_logged = True
            writer.scalars({tag: value for name in skill if name != "model"
                            for tag, value in self._scalars(f"baseline/{name}", skill[name]).items()}, step)
            self.baseline_curves = {name: skill[name] for name in skill if name != "model"}
        if grid.batch.rank == 0 and writer.draws_images:
            self._draw_rollout(writer, skill["model"], (spectral["forecast"], spectral["truth"], blur), step)
        return metrics

    def _scalars(self, prefix: str, values: dict[str, torch.Tensor]) -> dict[str, float]:
        """{prefix/metric/channel/<lead>h: value} of (K, C) tensors, NaNs (undefined figures) left out."""
        leads = self.lead_hours(self.eval.steps)
        return {f"{prefix}/{metric}/{channel}/{lead:g}h": float(values[metric][k, c])
                for metric in values for c, channel in enumerate(self.channels)
                for k, lead in enumerate(leads) if not math.isnan(float(values[metric][k, c]))}

    def _draw_rollout(self, writer, skill: dict[str, torch.Tensor], spectral: tuple, step: int) -> None:
        """The skill and spectra figures of the skill channels the data has (rank 0)."""
        leads = self.lead_hours(self.eval.steps)
        for channel in [c for c in SKILL_CHANNELS if c in self.channels]:
            c = self.channels.index(channel)
            curves = {name: {m: v[:, c].tolist() for m, v in values.items()}
                      for name, values in {"model": skill, **self.baseline_curves}.items()}
            writer.image(f"rollout/skill_{channel}", figure_image(skill_panels(leads, curves, channel, step)), step)
            writer.image(f"rollout/spectra_{channel}",
                         figure_image(lead_spectra_panel(*spectral, leads, c, channel, step)), step)
