"""Forecast skill by WeatherBench 2's definitions: autoregressive rollouts against persistence and climatology.

From an initial state x_0 the model predicts x_1, is fed its own prediction (in float32 whatever the autocast
dtype), and so on for K steps of data.dt (6 h each in ERA5). At each lead time l and for each channel c, in
physical units (the normalisation undone with the data's means and stds, utils/weather/data/fields.py):

    w_j      cell-area latitude weights: sin(phi_j + d/2) - sin(phi_j - d/2) of row j (bounds clipped to the
             poles), normalised to mean 1 over the rows; phi_j the data's latitude of row j, d the rows' spacing
             (utils/weather/data/fields.py cell_area_weights)
    MSE_t    = mean_ij w_j (f - o)^2                      for initial time t, forecast f, truth o
    RMSE     = sqrt(mean_t MSE_t)                         the root after the time mean, as WB2
    bias     = mean_t mean_ij w_j (f - o)
    ACC_t    = sum_ij w_j f' o' / sqrt(sum_ij w_j f'^2 * sum_ij w_j o'^2),   f' = f - C, o' = o - C
    ACC      = mean_t ACC_t

with C the data's climatology (one time-mean field per channel, as FourCastNet's ACC: stats/time_means.npy in the
NERSC layout, the statistics file's time means of a zarr store; WB2's climatology is by day of year and hour).
Baselines: persistence (f = x_0 at every lead) and climatology (f = C, whose ACC is undefined: NaN, as in WB2).
Without a climatology (no time_means.npy) ACC and the climatology baseline are left out with a notice, RMSE and
bias are still reported. The data are read through the split's reader only.

The rollout also gives the zonal energy spectra of the model's forecast and of the truth per lead and channel
(utils/weather/task/spectra.py: sums over initial times, reduced as the skill's), from which the blurring figure comes.

Under any layout the sums over initial times are reduced over the batch group (each dp rank takes every
dp-th initial time; tp, cp and pp ranks of a replica compute the same), so the numbers are those of one process.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from distributed.collectives import all_reduce_
from distributed.pipeline.schedule import from_last_stage
from utils import ConfigError, require
from utils.comm import Grid
from utils.weather.data.fields import FieldPairs, FieldReader, cell_area_weights
from utils.weather.task.spectra import spectra_sums

METRICS = ("rmse", "acc", "bias")


def skill_sums(forecast: torch.Tensor, truth: torch.Tensor, weights: torch.Tensor,
               climatology: torch.Tensor | None, counted: torch.Tensor | None = None) -> torch.Tensor:
    """Per-channel sums over the initial times of a batch (B, C, H, W), float64: rows [weighted MSE,
    weighted mean error, ACC] (the ACC row NaN without a climatology); a row's mean over times is the metric
    (the RMSE after its square root). `counted` (B,) bool leaves out padding samples."""
    f, o = forecast.double(), truth.double()
    rows = [((f - o) ** 2 * weights).mean(dim=(-2, -1)), ((f - o) * weights).mean(dim=(-2, -1))]
    if climatology is None:
        rows.append(torch.full_like(rows[0], math.nan))
    else:
        fa, oa = f - climatology.double(), o - climatology.double()
        num = (weights * fa * oa).sum(dim=(-2, -1))
        den = ((weights * fa ** 2).sum(dim=(-2, -1)) * (weights * oa ** 2).sum(dim=(-2, -1))).sqrt()
        rows.append(num / den)  # 0/0 (no forecast anomaly): NaN, as WB2
    per_sample = torch.stack(rows, dim=1)  # (B, 3, C)
    if counted is not None:
        per_sample = per_sample[counted]
    return per_sample.sum(0)


def skill(sums: torch.Tensor, count: int) -> dict[str, torch.Tensor]:
    """{'rmse', 'bias', 'acc'} per channel from `skill_sums` added over `count` initial times."""
    mean = sums / count
    return {"rmse": mean[0].sqrt(), "bias": mean[1], "acc": mean[2]}


@dataclass
class Rollouts:
    """The initial times of the rollout evaluation: evenly spaced over a split, each with K truths after it."""

    reader: FieldReader  # the split's (utils/weather/data/fields.py): the only one that opens files
    starts: list[tuple[int, int]]  # (segment, time index) of each initial time
    steps: int
    dt: int
    means: torch.Tensor  # (C, 1, 1)
    stds: torch.Tensor
    climatology: torch.Tensor | None  # (C, H, W) physical, or None when the data has none

    @property
    def latitudes(self) -> np.ndarray:
        """Of the fields' rows (the latitude weights are their cell areas)."""
        return self.reader.latitudes

    @classmethod
    def of(cls, dataset: FieldPairs, steps: int, count: int, times: list[int] | None = None,
           setting: str = "task.eval.inits") -> Rollouts:
        """`count` initial times of `dataset`'s split, each followed by `steps` x dt times; or the given `times`:
        indices of the split's times, counted over its segments in order."""
        span, lengths = steps * dataset.dt, dataset.reader.segment_lengths
        if times is not None:
            return cls._at(dataset, steps, [cls._locate(dataset.reader, t, span, setting) for t in times])
        usable = [(i, t) for i, num in enumerate(lengths) for t in range(num - span)]
        if len(usable) < count:  # the longest rollout that has `count` starts
            fits = [s for s in range(1, max(lengths)) if sum(max(0, num - s * dataset.dt) for num in lengths) >= count]
            raise ConfigError(
                f"a rollout of {steps} steps of dt={dataset.dt} needs {span} times after each of {count} initial "
                f"times, and the validation split holds {len(usable)} such start{'s' * (len(usable) != 1)} "
                f"(segments of at most {max(lengths)} times)", "task.eval.steps",
                (f"use task.eval.steps <= {max(fits)} or " if fits else "use ") + "fewer task.eval.inits")
        return cls._at(dataset, steps, [usable[k * len(usable) // count] for k in range(count)])

    @staticmethod
    def _locate(reader: FieldReader, time: int, span: int, setting: str) -> tuple[int, int]:
        """(segment, time index) of the split's time `time`, checked to have `span` times after it."""
        first = 0
        for i, num in enumerate(reader.segment_lengths):
            if first <= time < first + num:
                left = num - 1 - (time - first)
                require(left >= span, f"initial time {time} is {left} times before the end of "
                        f"{reader.segment_name(i)}, a rollout needs {span}", setting,
                        "choose an earlier initial time or fewer steps")
                return i, time - first
            first += num
        raise ConfigError(f"initial time {time} is outside the split's {first} times", setting,
                          f"give times from 0 to {first - 1}")

    @classmethod
    def _at(cls, dataset: FieldPairs, steps: int, starts: list[tuple[int, int]]) -> Rollouts:
        clim = dataset.reader.climatology()
        return cls(dataset.reader, starts, steps, dataset.dt, dataset.means, dataset.stds,
                   None if clim is None else torch.from_numpy(np.ascontiguousarray(clim, dtype=np.float32)))

    def read(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(x_0 normalised (C, H, W), truths in physical units (K, C, H, W)) of initial time `index`."""
        segment, t = self.starts[index]
        fields = torch.from_numpy(self.reader.read(segment, slice(t, t + self.steps * self.dt + 1, self.dt)))
        return (fields[0] - self.means) / self.stds, fields[1:]


def my_starts(count: int, batch, device) -> tuple[list[int], torch.Tensor]:
    """This dp rank's initial times (indices of the rollouts' starts) and which of them count, (B,) bool: each dp
    rank takes every dp-th one, and every rank runs the same number of forwards (FSDP gathers over dp x cp), a
    short rank repeating one of its times without counting it."""
    mine = list(range(count))[batch.rank::batch.size]
    per_rank = -(-count // batch.size)
    counted = torch.tensor([True] * len(mine) + [False] * (per_rank - len(mine)), device=device)
    return mine + [mine[0] if mine else 0] * (per_rank - len(mine)), counted


def read_batch(rollouts: Rollouts, indices: list[int], device) -> tuple[torch.Tensor, torch.Tensor]:
    """x_0 of the initial times `indices` (B, C, H, W) normalised and their truths (K, B, C, H, W) physical, through
    `rollouts.read` (a wrapper's too: the forecast command's perturbed members)."""
    pairs = [rollouts.read(i) for i in indices]
    return torch.stack([p[0] for p in pairs]).to(device), torch.stack([p[1] for p in pairs], dim=1).to(device)


def forecast_step(model, x: torch.Tensor, autocast) -> torch.Tensor:
    """One autoregressive step: the model's prediction of x on every pp rank, in float32 whatever the autocast
    dtype (what is fed back)."""
    with autocast():
        pred = model(x)
    return from_last_stage(model, None if pred is None else pred.float(), x)


@torch.no_grad()
def rollout_skill(model, rollouts: Rollouts, *, grid: Grid, autocast, with_baselines: bool,
                  keep: list | None = None, spectra: dict | None = None) -> dict[str, dict[str, torch.Tensor]]:
    """{'model', ['persistence', 'climatology']} -> {'rmse', 'acc', 'bias'} -> (K, C) tensors, the same on
    every rank. `model` is the forward pass (under pp: through the stages, the output on the last stage).
    `keep`: a list that receives this rank's (forecasts, truths), each (B, K, C, H, W) in physical units.
    `spectra`: a dict that receives 'forecast' and 'truth', the model's and the truth's band-mean zonal energy
    spectra per lead and channel averaged over the initial times (K, C, W // 2 + 1) (utils/weather/task/spectra.py),
    from sums reduced over the batch group as the skill's: the same on every rank."""
    device, batch, count = grid.device, grid.batch, len(rollouts.starts)
    mine, counted = my_starts(count, batch, device)
    names = ["model"] + (["persistence"] + (["climatology"] if rollouts.climatology is not None else [])
                         if with_baselines else [])
    num_channels, lat = len(rollouts.means), rollouts.latitudes
    sums = torch.zeros(len(names), rollouts.steps, 3, num_channels, dtype=torch.float64, device=device)
    weights = cell_area_weights(lat).to(device)
    means, stds = rollouts.means.to(device), rollouts.stds.to(device)
    clim = rollouts.climatology.to(device) if rollouts.climatology is not None else None
    x, truths = read_batch(rollouts, mine, device)
    start, spectral = x * stds + means, []
    for lead in range(rollouts.steps):
        x = forecast_step(model, x, autocast)
        forecasts = {"model": x * stds + means, "persistence": start,
                     "climatology": None if clim is None else clim.expand_as(start)}
        for k, name in enumerate(names):
            sums[k, lead] = skill_sums(forecasts[name], truths[lead], weights, clim, counted)
        if spectra is not None:
            spectral.append(torch.stack([spectra_sums(f, lat, counted) for f in (forecasts["model"], truths[lead])]))
        if keep is not None:
            keep.append(forecasts["model"][counted].cpu())
    if keep is not None:
        keep[:] = [torch.stack(keep, dim=1), truths[:, counted].transpose(0, 1).cpu()]
    all_reduce_(sums, batch)
    if spectra is not None:
        spectral = all_reduce_(torch.stack(spectral), batch).cpu() / count  # (K, 2, C, W // 2 + 1)
        spectra.update(forecast=spectral[:, 0], truth=spectral[:, 1])
    return {name: {metric: torch.stack([skill(sums[k, lead], count)[metric]
                                        for lead in range(rollouts.steps)]).cpu() for metric in METRICS}
            for k, name in enumerate(names)}
