"""The rollout evaluation's spectra and ensemble (utils/weather/task/forecast.py `rollout_skill(spectra=...)`,
utils/weather/task/ensemble.py `ensemble_skill`): the spectra are those of the kept forecasts and truths, the ensemble's
scores are the forecast command's (the same perturbations, scored from whole rollouts), and a 2-rank data-parallel
layout, whose second rank pads its share of three initial times, gives one process's numbers."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch

from tests.helpers import run_ranks
from utils.comm import Grid
from utils.weather.data.fields import cell_area_weights
from utils.weather.task import spectra as spectral
from utils.weather.task.ensemble import ensemble_skill
from utils.weather.task.forecast import rollout_skill

MEMBERS = dict(members=3, std=0.1, length=1.0, seed=4)


class _Rollouts:
    """Three initial times of 2 channels on an 8 x 16 grid, 3 steps, in place of a reader (Rollouts' interface):
    zonal waves up to wavenumber 6 moving eastwards, so the truth has energy at small scales."""
    starts, steps, climatology = [(0, 0), (0, 5), (1, 2)], 3, None
    latitudes = np.linspace(78.75, -78.75, 8)
    means, stds = torch.tensor([1.0, -2.0]).view(2, 1, 1), torch.tensor([0.5, 3.0]).view(2, 1, 1)

    def read(self, index):
        segment, t = self.starts[index]
        lon = torch.arange(16) * 2 * torch.pi / 16
        times = torch.arange(t, t + self.steps + 1, dtype=torch.float32).view(-1, 1, 1, 1)
        k = torch.tensor([1.0, 6.0]).view(1, 2, 1, 1)
        rows = torch.linspace(0.5, 1.5, 8).view(1, 1, 8, 1)
        fields = torch.sin(k * lon - 0.3 * times + segment) * rows * self.stds + self.means  # (K + 1, C, H, W)
        return (fields[0] - self.means) / self.stds, fields[1:]


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Conv2d(2, 2, 3, padding=1, padding_mode="circular")


def _evaluate(grid: Grid) -> dict[str, torch.Tensor]:
    """The model's RMSE, forecast and truth spectra, blurring and ensemble scores under `grid`."""
    model, got = _model(), {}
    with torch.no_grad():
        skill = rollout_skill(model, _Rollouts(), grid=grid, autocast=contextlib.nullcontext, with_baselines=False,
                              spectra=got)
    got.update(rmse=skill["model"]["rmse"], blurring=spectral.blurring(got["forecast"], got["truth"]))
    ensemble = ensemble_skill(model, _Rollouts(), grid=grid, autocast=contextlib.nullcontext, **MEMBERS)
    return {**got, **{f"ensemble_{name}": value for name, value in ensemble.items()}}


def test_the_spectra_are_those_of_the_kept_forecasts_and_truths():
    got, kept = {}, []
    rollout_skill(_model(), _Rollouts(), grid=Grid.serial(), autocast=contextlib.nullcontext, with_baselines=False,
                  keep=kept, spectra=got)
    lat = _Rollouts.latitudes
    torch.testing.assert_close(got["forecast"], spectral.lead_spectra(kept[0], lat), rtol=1e-12, atol=0)
    torch.testing.assert_close(got["truth"], spectral.lead_spectra(kept[1], lat), rtol=1e-12, atol=0)
    assert got["truth"].shape == (3, 2, 9) and got["truth"][:, 1, 6].min() > 0  # the k = 6 wave of channel 1
    blur = spectral.blurring(got["forecast"], got["truth"])
    assert torch.isfinite(blur).all() and not torch.allclose(blur, torch.ones_like(blur))


def test_the_ensemble_scores_are_the_forecast_commands():
    from utils.forecast.members import ensemble_scores, run_members

    model, kept = _model(), []
    rollout_skill(model, _Rollouts(), grid=Grid.serial(), autocast=contextlib.nullcontext, with_baselines=False,
                  keep=kept)
    members = run_members(model, _Rollouts(), MEMBERS["members"], MEMBERS["std"], MEMBERS["length"], MEMBERS["seed"])
    want = ensemble_scores(members, kept[0], kept[1], cell_area_weights(_Rollouts.latitudes))
    got = ensemble_skill(model, _Rollouts(), grid=Grid.serial(), autocast=contextlib.nullcontext, **MEMBERS)
    for ours, theirs in (("crps", "crps"), ("spread", "spread"), ("skill", "rmse_mean"), ("ratio", "spread_skill")):
        torch.testing.assert_close(got[ours], want[theirs], rtol=1e-6, atol=0)
    assert (got["crps"] > 0).all() and (got["spread"] > 0).all()
    other = ensemble_skill(model, _Rollouts(), grid=Grid.serial(), autocast=contextlib.nullcontext,
                           **{**MEMBERS, "seed": 5})
    assert not torch.allclose(other["crps"], got["crps"])  # the members are the seed's


def _dp_rank(rank: int, world_size: int, want: dict[str, torch.Tensor]) -> None:
    from utils.comm import init_grid
    from utils.schema import ParallelConfig

    got = _evaluate(init_grid(ParallelConfig(dp=world_size)))
    assert got.keys() == want.keys()
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, rtol=1e-6, atol=1e-12, msg=name)


@pytest.mark.parametrize("world_size", [2])
def test_data_parallel_spectra_and_ensemble_equal_one_process(world_size, tmp_path):
    want = _evaluate(Grid.serial())
    assert torch.isfinite(want["ensemble_ratio"]).all() and torch.isfinite(want["blurring"]).all()
    run_ranks(_dp_rank, world_size, tmp_path, want, timeout_s=300)
