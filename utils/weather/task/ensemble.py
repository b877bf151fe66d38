"""Ensembles of the weather model: initial-condition perturbations and WeatherBench 2's probabilistic scores
(weatherbench2/metrics.py: CRPS, EnsembleVariance, EnsembleMeanMSE, RankHistogram).

Perturbations: member m of initial time t starts from x_0 + std * n, x_0 normalised and n a smooth Gaussian
field of unit variance per point, drawn for each channel from numpy's generator seeded with integers naming the
member and the initial time (and a seed): the same numbers whatever the layout, the order or the batch. n is
white noise convolved with a Gaussian kernel of standard deviation `length` grid points, periodic in longitude,
the kernel scaled so that the result keeps unit variance (points d cells apart correlate by
exp(-d^2 / (4 length^2)); length 0: white noise).

Scores, for M members X_1..X_M, truth y, at each point, then averaged over the grid with the cell-area latitude
weights w (mean 1) for each initial time, then over the initial times (as WB2 does):

    CRPS     = mean_i |X_i - y| - 1 / (2 M (M - 1)) sum_ij |X_i - X_j|      the fair (unbiased) estimator;
               the double sum from the sorted members, sum_i (2 i - M - 1) X_(i) x 2 (Zamo and Naveau 2018)
    spread   = sqrt(mean_t mean_ij w var_t),       var the members' unbiased variance (ddof 1)
    skill    = sqrt(mean_t mean_ij w (mean_i X_i - y)^2),  the ensemble mean's RMSE
    spread-skill ratio = sqrt((M + 1) / M) spread / skill
    rank histogram[b] = weighted fraction of points where b members lie below y (b = 0..M; a truth equal to
               members shares its weight equally among the ranks it could take, as `scores` does)

The factor sqrt((M + 1) / M) makes the ratio 1 for a perfectly reliable ensemble of M members, whose ensemble
mean's expected squared error is (M + 1) / M times the expected variance (Fortin et al. 2014); WB2's plots
divide the standard deviation by the RMSE without it, so `spread` and `skill` are returned as well.

`ensemble_skill` runs the members of the rollout evaluation (`task.eval.members`, utils/weather/task/weather.py) under
any layout: each dp rank takes its initial times (utils/weather/task/forecast.py `my_starts`), steps its members lead by
lead (memory: M states, not M rollouts) and sums the scores over its times; the sums are reduced over the batch
group, so the numbers are one process's and the forecast command's (`--members`, the same perturbations).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from distributed.collectives import all_reduce_
from utils.comm import Grid
from utils.weather.data.fields import cell_area_weights
from utils.weather.task.forecast import Rollouts, forecast_step, my_starts, read_batch

KERNEL_RADIUS = 3.0  # the Gaussian kernel is cut at this many standard deviations


def gaussian_kernel(length: float) -> np.ndarray:
    """1-D kernel of standard deviation `length` grid points, its squares summing to 1 ([1.0] for length 0)."""
    if length <= 0:
        return np.ones(1)
    radius = max(1, math.ceil(KERNEL_RADIUS * length))
    kernel = np.exp(-0.5 * (np.arange(-radius, radius + 1) / length) ** 2)
    return kernel / np.sqrt((kernel ** 2).sum())


def smooth_noise(shape: tuple[int, int, int], length: float, rng: np.random.Generator) -> np.ndarray:
    """Gaussian noise (C, H, W) of unit variance per point and correlation length `length` grid points: white
    noise drawn on H + 2r rows (no edge effect in latitude) and convolved with the separable kernel, periodic in
    longitude."""
    channels, height, width = shape
    kernel = gaussian_kernel(length)
    radius = len(kernel) // 2
    noise = rng.standard_normal((channels, height + 2 * radius, width))
    rows = np.lib.stride_tricks.sliding_window_view(noise, len(kernel), axis=1) @ kernel  # (C, H, W)
    wrapped = np.pad(rows, ((0, 0), (0, 0), (radius, radius)), mode="wrap")
    return np.lib.stride_tricks.sliding_window_view(wrapped, len(kernel), axis=2) @ kernel


def perturbation(shape: tuple[int, int, int], std: float, length: float, key: tuple[int, ...]) -> torch.Tensor:
    """A perturbation (C, H, W) float32 in normalised units: std x smooth noise from the generator seeded with
    `key`, non-negative integers naming the draw (the forecast command's: seed, member, segment, time)."""
    return torch.from_numpy(std * smooth_noise(shape, length, np.random.default_rng(list(key)))).float()


def perturbed(x: torch.Tensor, member: int, start: tuple[int, int], std: float, length: float,
              seed: int) -> torch.Tensor:
    """Member `member`'s initial state: x (C, H, W) normalised plus its perturbation at the initial time `start`
    (segment, time index), drawn with the key (seed, member, segment, time): the same under any layout or batch."""
    return x + perturbation(tuple(x.shape), std, length, (seed, member, *start)).to(x.device)


def _weighted_mean(values: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Mean over the grid (the last two dims) with latitude weights (H, 1) of mean 1."""
    return (values * weights).mean(dim=(-2, -1))


def crps(members: torch.Tensor, truth: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Fair CRPS of members (M, ..., H, W) against truth (..., H, W), averaged over the grid: (...,) float64."""
    num = members.shape[0]
    assert num >= 2, "the fair CRPS needs two members or more"
    x, y = members.double(), truth.double()
    skill = (x - y).abs().mean(dim=0)
    rank = torch.arange(1, num + 1, dtype=torch.float64, device=x.device).view(-1, *[1] * y.dim())
    spread = ((2 * rank - num - 1) * x.sort(dim=0).values).sum(dim=0) / (num * (num - 1))  # plant: crps_not_fair
    return _weighted_mean(skill - spread, weights.double())


def spread_skill_sums(members: torch.Tensor, truth: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Per initial time, the grid means of the members' unbiased variance and of the ensemble mean's squared
    error: (2, ...) float64 for members (M, ..., H, W) and truth (..., H, W); sum them over the initial times."""
    x, y, w = members.double(), truth.double(), weights.double()
    return torch.stack([_weighted_mean(x.var(dim=0, correction=1), w),
                        _weighted_mean((x.mean(dim=0) - y) ** 2, w)])


def spread_skill(sums: torch.Tensor, count: int, num_members: int) -> dict[str, torch.Tensor]:
    """{'spread', 'skill', 'ratio'} from `spread_skill_sums` added over `count` initial times."""
    spread, skill = (sums / count).sqrt()
    return {"spread": spread, "skill": skill, "ratio": math.sqrt((num_members + 1) / num_members) * spread / skill}


def rank_histogram(members: torch.Tensor, truth: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Weighted fractions of the truth's rank among the members, (..., M + 1) float64 summing to 1, for members
    (M, ..., H, W) and truth (..., H, W); a tie spreads its weight evenly over the ranks it spans."""
    num = members.shape[0]
    below, up_to = (members < truth).sum(dim=0), (members <= truth).sum(dim=0)  # (..., H, W)
    bins = torch.arange(num + 1, device=members.device).view(-1, *[1] * truth.dim())
    share = ((bins >= below) & (bins <= up_to)).double() / (up_to - below + 1).double()  # (M + 1, ..., H, W)
    return _weighted_mean(share, weights.double()).movedim(0, -1)


@torch.no_grad()
def ensemble_skill(model, rollouts: Rollouts, *, grid: Grid, autocast, members: int, std: float, length: float,
                   seed: int = 0) -> dict[str, torch.Tensor]:
    """{'crps', 'spread', 'skill', 'ratio'} -> (K, C) of `members` rollouts from perturbed initial states
    (`perturbed`), in physical units, the same on every rank (see the module docstring)."""
    device, batch, count = grid.device, grid.batch, len(rollouts.starts)
    mine, counted = my_starts(count, batch, device)
    x, truths = read_batch(rollouts, mine, device)
    states = [torch.stack([perturbed(x[b], m, rollouts.starts[i], std, length, seed) for b, i in enumerate(mine)])
              for m in range(members)]
    weights = cell_area_weights(rollouts.latitudes).to(device)
    means, stds = rollouts.means.to(device), rollouts.stds.to(device)
    sums = torch.zeros(rollouts.steps, 3, len(rollouts.means), dtype=torch.float64, device=device)
    for lead in range(rollouts.steps):
        states = [forecast_step(model, state, autocast) for state in states]
        physical = torch.stack(states) * stds + means  # (M, B, C, H, W)
        for c in range(sums.shape[-1]):  # a channel at a time: the scores' float64 temporaries stay M x B fields
            x, y = physical[:, :, c], truths[lead][:, c]
            sums[lead, 0, c] = crps(x, y, weights)[counted].sum()
            sums[lead, 1:, c] = spread_skill_sums(x, y, weights)[:, counted].sum(dim=1)
    all_reduce_(sums, batch)
    sums = sums.cpu()
    return {"crps": sums[:, 0] / count, **spread_skill(sums[:, 1:].movedim(1, 0), count, members)}
