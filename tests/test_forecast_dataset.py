"""Forecasts in WeatherBench 2's layout (utils/forecast/dataset.py): channels grouped into variables on pressure
levels, the coordinates WB2 names, zarr and NetCDF read back by xarray; and through the forecast command, the
RMSE and CRPS that the independent `scores` library computes from the file equal the command's own tables."""

from __future__ import annotations

import csv
import warnings

import numpy as np
import pytest
import torch

from tests.helpers import QUIET
from tests.rank_pool import run_entry_ranks
from utils.forecast.dataset import Channel, channel_of, forecast_dataset, init_times, open_group, write

xr = pytest.importorskip("xarray")
CHANNELS = [Channel("t2m", "2m_temperature", None, "K"), Channel("z500", "geopotential", 500, "m^2/s^2"),
            Channel("z850", "geopotential", 850, "m^2/s^2"), Channel("t850", "temperature", 850, "K")]
LAT = np.linspace(90, -90, 5)
LON = np.arange(8) * 45.0


def wb2_weights(latitudes) -> np.ndarray:
    """WeatherBench 2's metrics.get_lat_weights, written out: cell areas between the midpoints of the sorted
    latitudes (the poles at the ends), normalised to mean 1, in the coordinate's order."""
    lat = np.deg2rad(np.asarray(latitudes, dtype=np.float64))
    order = np.argsort(lat)
    ordered = lat[order]
    bounds = np.concatenate([[-np.pi / 2], (ordered[:-1] + ordered[1:]) / 2, [np.pi / 2]])
    area = np.empty_like(lat)
    area[order] = np.sin(bounds[1:]) - np.sin(bounds[:-1])
    return area / area.mean()


def _fields(*shape, seed=0) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=(*shape, len(CHANNELS), len(LAT), len(LON))).astype(np.float32)


def test_channels_become_variables_on_levels():
    fields = _fields(3, 2)
    ds = forecast_dataset(fields, CHANNELS, init_times(["data/valid/2018.h5"], [(0, 0), (0, 4), (0, 9)], 6.0),
                          [6, 12], LAT, LON)
    assert list(ds.data_vars) == ["2m_temperature", "geopotential", "temperature"]
    assert ds["2m_temperature"].dims == ("time", "prediction_timedelta", "latitude", "longitude")
    assert ds["geopotential"].dims == ("time", "prediction_timedelta", "level", "latitude", "longitude")
    assert ds["level"].values.tolist() == [500, 850] and ds["level"].attrs["units"] == "hPa"
    np.testing.assert_array_equal(ds["geopotential"].sel(level=850).values, fields[:, :, 2])
    np.testing.assert_array_equal(ds["temperature"].sel(level=850).values, fields[:, :, 3])
    assert np.isnan(ds["temperature"].sel(level=500).values).all()  # the channels have no t500
    assert ds["geopotential"].attrs == {"units": "m^2/s^2", "channels": "z500 z850"}
    assert ds["temperature"].attrs["channels"] == "- t850" and ds["2m_temperature"].attrs["channels"] == "t2m"
    assert [str(t) for t in ds["time"].values.astype("datetime64[h]")] == ["2018-01-01T00", "2018-01-02T00",
                                                                           "2018-01-03T06"]
    assert ds["prediction_timedelta"].values.tolist() == [np.timedelta64(h, "h").astype("timedelta64[ns]") for h in
                                                          (6, 12)]
    members = forecast_dataset(_fields(4, 3, 2), CHANNELS, ds["time"].values, [6, 12], LAT, LON, members=True)
    assert members["geopotential"].dims[:3] == ("number", "time", "prediction_timedelta")
    assert members["number"].values.tolist() == [0, 1, 2, 3]


def test_channel_names_with_levels():
    assert channel_of("geopotential@500") == Channel("geopotential@500", "geopotential", 500)
    assert channel_of("2m_temperature") == Channel("2m_temperature", "2m_temperature", None)
    assert init_times(["stores/era5.zarr"], [(0, 2)], 6.0)[0] == np.datetime64("1970-01-01T12")


@pytest.mark.parametrize("suffix", [".zarr", ".nc"])
def test_the_groups_read_back_with_xarray(suffix, tmp_path):
    fields = _fields(2, 3)
    times = init_times(["2019.h5"], [(0, 0), (0, 2)], 6.0)
    forecast = forecast_dataset(fields, CHANNELS, times, [6, 12, 18], LAT, LON, attrs={"checkpoint": "step_1"})
    truth = forecast_dataset(fields + 1, CHANNELS, times, [6, 12, 18], LAT, LON)
    path = write(tmp_path / f"forecast{suffix}", {"": forecast, "truth": truth})
    engine = {"engine": "zarr"} if suffix == ".zarr" else {"engine": "h5netcdf"}
    with xr.open_dataset(path, **engine) as root, xr.open_dataset(path, group="truth", **engine) as verifying:
        xr.testing.assert_identical(root.load(), forecast)
        xr.testing.assert_identical(verifying.load(), truth)
    assert open_group(path).attrs["checkpoint"] == "step_1"
    if suffix == ".zarr":  # consolidated, as WB2's stores: xr.open_zarr reads every group without a warning
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            xr.testing.assert_identical(xr.open_zarr(path, group="truth").load(), truth)


def test_rmse_from_the_file_equals_the_metrics(tmp_path):
    """scores.continuous.rmse over time, latitude and longitude with WB2's weights of the file's latitudes: the
    RMSE of utils/weather/task/forecast.py (sqrt of the time mean of the weighted MSE) at every lead and channel."""
    scores = pytest.importorskip("scores")
    from utils.weather.data.fields import cell_area_weights
    from utils.weather.task.forecast import skill, skill_sums

    f, o = _fields(4, 3, seed=1), _fields(4, 3, seed=2)
    times = init_times(["2018.h5"], [(0, t) for t in range(4)], 6.0)
    path = write(tmp_path / "f.zarr", {"": forecast_dataset(f, CHANNELS, times, [6, 12, 18], LAT, LON),
                                       "truth": forecast_dataset(o, CHANNELS, times, [6, 12, 18], LAT, LON)})
    fc, truth = open_group(path), open_group(path, "truth")
    weights = xr.DataArray(wb2_weights(fc["latitude"].values), dims=["latitude"])
    w = cell_area_weights(LAT)
    for k in range(3):
        want = skill(skill_sums(torch.from_numpy(f[:, k]), torch.from_numpy(o[:, k]), w, None), 4)["rmse"].numpy()
        for c, channel in enumerate(CHANNELS):
            pick = {"prediction_timedelta": k} | ({} if channel.level is None else {"level": [500, 850].index(
                channel.level)})
            got = scores.continuous.rmse(fc[channel.variable].isel(pick), truth[channel.variable].isel(pick),
                                         weights=weights)
            assert float(got) == pytest.approx(want[c], rel=1e-6)


def _table(path, key: str) -> dict[tuple[str, int], float]:
    with path.open() as f:
        return {(row["channel"], int(float(row["lead_h"]))): float(row[key]) for row in csv.DictReader(f)
                if row.get("forecast", "model") == "model"}


@pytest.mark.slow
def test_the_forecast_commands_dataset_gives_scores_its_rmse_and_crps(era5_root, tmp_path):
    """A checkpoint forecast with 3 members into forecast.zarr: xarray opens it, and `scores` computes from it
    (WB2's latitude weights of its latitude coordinate) the RMSE of metrics.csv and the CRPS of ensemble.csv."""
    scores = pytest.importorskip("scores")
    from utils.forecast.report import main

    run_dir = tmp_path / "run"
    results = run_entry_ranks([*QUIET, "trainer.max_steps=1", "trainer.global_batch_size=4",
                               f"data.root={era5_root}", f"run.dir={run_dir}"], 1)
    assert [r.value for r in results] == [0], results[0].error or results[0].stderr[-2000:]
    out = tmp_path / "out"
    assert main([str(run_dir / "checkpoints" / "step_0000001"), "--steps", "3", "--init", "3", "--members", "3",
                 "--map-leads", "--out", str(out), "--output", "forecast.zarr", f"data.root={era5_root}"]) == 0
    fc, truth, members = (open_group(out / "forecast.zarr", group) for group in ("", "truth", "ensemble"))
    assert members.sizes["number"] == 3 and fc.sizes == truth.sizes
    weights = xr.DataArray(wb2_weights(fc["latitude"].values), dims=["latitude"])
    rmse, crps = _table(out / "metrics.csv", "rmse"), _table(out / "ensemble.csv", "crps")
    for variable in fc.data_vars:
        names = fc[variable].attrs["channels"].split()
        for i, name in enumerate(names):
            if name == "-":
                continue
            pick = {} if "level" not in fc[variable].dims else {"level": i}
            f, y, x = fc[variable].isel(pick), truth[variable].isel(pick), members[variable].isel(pick)
            got = scores.continuous.rmse(f, y, weights=weights, preserve_dims=["prediction_timedelta"])
            fair = scores.probability.crps_for_ensemble(x, y, "number", method="fair", weights=weights,
                                                        preserve_dims=["prediction_timedelta"])
            for k, hours in enumerate((6, 12, 18)):
                assert float(got[k]) == pytest.approx(rmse[(name, hours)], rel=1e-5)
                assert float(fair[k]) == pytest.approx(crps[(name, hours)], rel=1e-5)
    assert len(rmse) == len(crps) == 20 * 3


@pytest.mark.parametrize("args,line", [
    (["--members", "1"], "error: --members 1: an ensemble needs 2 members or more (the fair CRPS) (--members): give 0 "
                         "(no ensemble) or 2 or more"),
    (["--members", "4", "--perturbation-std", "-1"], "error: negative perturbation std, length or seed "
     "(--perturbation-std/--perturbation-length/--seed): give values >= 0"),
])
def test_bad_ensemble_settings_are_one_line_before_any_work(args, line, tmp_path, capsys):
    from utils.forecast.report import main

    with pytest.raises(SystemExit) as exit_:
        main([str(tmp_path / "run" / "checkpoints" / "step_0000001"), "--out", str(tmp_path / "out"), *args])
    assert exit_.value.code == 2 and capsys.readouterr().err.strip().splitlines() == [line]


def test_a_forecast_file_is_zarr_or_netcdf(tmp_path):
    from utils import ConfigError

    with pytest.raises(ConfigError, match="neither a .zarr folder nor a .nc file"):
        write(tmp_path / "forecast.h5", {})
