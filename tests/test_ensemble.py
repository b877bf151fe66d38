"""Ensemble scores and perturbations (utils/weather/task/ensemble.py): the fair CRPS and the rank histogram against the
independent `scores` library on random data, the spread-skill ratio by WeatherBench 2's definitions (and 1 for a
reliable ensemble), and perturbations that are seeded, of unit variance and of the stated correlation."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from utils.weather.task.ensemble import (
    crps,
    gaussian_kernel,
    perturbation,
    rank_histogram,
    smooth_noise,
    spread_skill,
    spread_skill_sums,
)

DIMS = ["number", "time", "channel", "latitude", "longitude"]


def _weights(num_lat: int) -> torch.Tensor:
    """Latitude weights (H, 1) of mean 1 (cos of rows from 80 to -80 degrees; any such weights will do)."""
    w = torch.cos(torch.deg2rad(torch.linspace(80, -80, num_lat, dtype=torch.float64)))
    return (w / w.mean()).unsqueeze(-1)


def _data(seed: int, members: int = 5, shape=(3, 2, 8, 16)):
    """Members (M, T, C, H, W), truth (T, C, H, W) and WB2 latitude weights (H, 1)."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(members, *shape)) * rng.uniform(0.5, 2, size=(1, 1, shape[1], 1, 1))
    y = rng.normal(size=shape) + 0.3
    return torch.from_numpy(x), torch.from_numpy(y), _weights(shape[-2])


def _xarray(x, y, w):
    xr = pytest.importorskip("xarray")
    return (xr.DataArray(x.numpy(), dims=DIMS), xr.DataArray(y.numpy(), dims=DIMS[1:]),
            xr.DataArray(w.squeeze(-1).numpy(), dims=["latitude"]))


@pytest.mark.parametrize("members", [2, 5, 8])
def test_fair_crps_equals_scores(members):
    """Area-weighted over the grid, then averaged over the times: `scores`' fair CRPS with the same weights."""
    scores = pytest.importorskip("scores")
    x, y, w = _data(members, members)
    fx, fy, fw = _xarray(x, y, w)
    want = scores.probability.crps_for_ensemble(fx, fy, "number", method="fair", weights=fw,
                                                preserve_dims=["channel"])
    np.testing.assert_allclose(crps(x, y, w).mean(dim=0).numpy(), want.values, rtol=1e-6, atol=1e-9)


def test_crps_by_hand():
    """Members 0 and 2, truth 1: E|X - y| = 1 and the fair E|X - X'| = |0 - 2| = 2, so CRPS = 1 - 2 / 2 = 0;
    identical members score their absolute error."""
    w = _weights(4)
    x = torch.stack([torch.zeros(4, 6), 2 * torch.ones(4, 6)])
    assert crps(x, torch.ones(4, 6), w).item() == pytest.approx(0.0)
    same = torch.stack([torch.full((4, 6), 3.0)] * 3)
    assert crps(same, torch.ones(4, 6), w).item() == pytest.approx(2.0)


def test_rank_histogram_equals_scores():
    scores = pytest.importorskip("scores")
    x, y, w = _data(3, 6)
    fx, fy, fw = _xarray(x, y, w)
    want = scores.probability.rank_histogram(fx, fy, "number", weights=fw, preserve_dims=["channel"])
    got = rank_histogram(x, y, w).mean(dim=0)  # (C, M + 1)
    np.testing.assert_allclose(got.numpy(), want.transpose("channel", "rank").values, rtol=1e-6, atol=1e-12)
    np.testing.assert_allclose(got.sum(-1).numpy(), 1.0, rtol=1e-12)


def test_rank_histogram_shares_ties():
    """A truth equal to two of three members may take ranks 0, 1 or 2 (none below, two at or below)."""
    x = torch.tensor([1.0, 1.0, 2.0]).view(3, 1, 1)
    got = rank_histogram(x, torch.ones(1, 1), torch.ones(1, 1))
    np.testing.assert_allclose(got.numpy(), [1 / 3, 1 / 3, 1 / 3, 0.0])


def test_spread_skill_by_wb2s_definitions():
    """spread^2 = time mean of the weighted mean unbiased variance; skill^2 = time mean of the weighted mean
    squared error of the ensemble mean (WB2's EnsembleVariance, EnsembleMeanMSE); ratio x sqrt((M + 1) / M)."""
    x, y, w = _data(4, 5)
    got = spread_skill(spread_skill_sums(x, y, w).sum(dim=1), count=3, num_members=5)
    xs, ys, ws = x.numpy(), y.numpy(), w.numpy()
    variance = np.mean([np.mean(ws * xs[:, t].var(axis=0, ddof=1), axis=(-2, -1)) for t in range(3)], axis=0)
    mse = np.mean([np.mean(ws * (xs[:, t].mean(axis=0) - ys[t]) ** 2, axis=(-2, -1)) for t in range(3)], axis=0)
    np.testing.assert_allclose(got["spread"].numpy(), np.sqrt(variance), rtol=1e-12)
    np.testing.assert_allclose(got["skill"].numpy(), np.sqrt(mse), rtol=1e-12)
    np.testing.assert_allclose(got["ratio"].numpy(), math.sqrt(6 / 5) * np.sqrt(variance / mse), rtol=1e-12)


def test_a_reliable_ensemble_has_a_ratio_of_one():
    """Truth and members drawn alike (exchangeable): the ratio is 1 within sampling error, where the plain
    std / RMSE would be sqrt(M / (M + 1)) = 0.89 for 4 members."""
    gen = torch.Generator().manual_seed(0)
    centre = torch.randn(20, 1, 32, 64, generator=gen, dtype=torch.float64)
    x = centre + torch.randn(4, 20, 1, 32, 64, generator=gen, dtype=torch.float64)
    y = centre[:, 0] + torch.randn(20, 32, 64, generator=gen, dtype=torch.float64)
    ratio = spread_skill(spread_skill_sums(x, y.unsqueeze(1), _weights(32)).sum(dim=1), 20, 4)["ratio"]
    assert ratio.item() == pytest.approx(1.0, abs=0.02)


def test_the_kernel_keeps_unit_variance():
    for length in (0.0, 0.7, 2.0, 5.0):
        kernel = gaussian_kernel(length)
        assert (kernel ** 2).sum() == pytest.approx(1.0) and len(kernel) % 2 == 1


def _correlation(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.mean(a * b) / np.sqrt(np.mean(a * a) * np.mean(b * b)))


def test_smooth_noise_has_unit_variance_and_the_stated_correlation():
    """Points d cells apart correlate by exp(-d^2 / (4 length^2)), in latitude, in longitude and across the
    longitude seam (the last columns and the first are neighbours)."""
    length = 2.0
    noise = smooth_noise((1000, 24, 32), length, np.random.default_rng(0))
    assert noise.shape == (1000, 24, 32) and noise.std() == pytest.approx(1.0, abs=0.02)
    for d in (1, 2, 4):
        want = math.exp(-d ** 2 / (4 * length ** 2))
        assert _correlation(noise[:, :-d], noise[:, d:]) == pytest.approx(want, abs=0.015)
        assert _correlation(noise[..., :-d], noise[..., d:]) == pytest.approx(want, abs=0.015)
        assert _correlation(noise[..., -d:], noise[..., :d]) == pytest.approx(want, abs=0.03)
    white = smooth_noise((400, 24, 32), 0.0, np.random.default_rng(1))
    assert abs(_correlation(white[:, :-1], white[:, 1:])) < 0.02


def test_perturbations_are_seeded_by_their_key_alone():
    """The same key gives the same field in any order of drawing; another member, time or seed another one."""
    first = [perturbation((2, 8, 16), 0.1, 1.5, (0, m, 0, t)) for m in range(3) for t in range(2)]
    again = [perturbation((2, 8, 16), 0.1, 1.5, (0, m, 0, t)) for t in reversed(range(2)) for m in range(3)]
    assert torch.equal(first[0], again[3]) and torch.equal(first[5], again[2])
    assert first[0].dtype == torch.float32 and first[0].shape == (2, 8, 16)
    assert not torch.equal(first[0], first[1]) and not torch.equal(first[0], first[2])
    assert not torch.equal(first[0], perturbation((2, 8, 16), 0.1, 1.5, (1, 0, 0, 0)))
    assert torch.equal(perturbation((2, 8, 16), 0.2, 1.5, (0, 0, 0, 0)), 2 * first[0])
