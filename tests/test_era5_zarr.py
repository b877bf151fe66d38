"""WeatherBench 2-layout zarr stores (utils/weather/data/era5_zarr.py) against xarray on stores written here: channels
by
name and level, rows north first from either order, a stride and a crop, splits by time ranges, hours from the
time coordinate, the statistics command, and the one-line refusals; cell-area weights of real latitudes."""

from __future__ import annotations

import pickle
import subprocess
import sys

import numpy as np
import pytest

from tests.helpers import ROOT
from utils import ConfigError
from utils.weather.data import stats
from utils.weather.data.era5 import ERA5Config, NERSCReader, nersc_latitudes
from utils.weather.data.era5_zarr import ERA5ZarrConfig, stats_beside
from utils.weather.data.era5_zarr_synthetic import write_store
from utils.weather.data.fields import FieldPairs, cell_area_weights

xr = pytest.importorskip("xarray")

SPLITS = {"train": ["2016-01-01", "2016-01-06T18"], "valid": ["2016-01-07", "2016-01-08T18"],
          "test": ["2016-01-09", "2016-01-10T18"]}  # 24, 8 and 8 of the 40 six-hourly times
VARIABLES = ["2m_temperature", "geopotential@500", "temperature@850"]


def store(tmp_path, name="era5.zarr", **kw):
    """A 16 x 32 store of 40 times on levels 500, 850, 1000, with the statistics of every channel beside it."""
    path = write_store(tmp_path / name, shape=(16, 32), levels=(500, 850, 1000), num_times=40, **kw)
    assert stats.main([f"data.root={path}", "--all", *(f"data.{k}=[{a},{b}]" for k, (a, b) in SPLITS.items())]) == 0
    return path


def config(path, **kw) -> ERA5ZarrConfig:
    return ERA5ZarrConfig(**{"root": str(path), "variables": VARIABLES, "img_size": [16, 32], **SPLITS, **kw})


@pytest.fixture(scope="module")
def ascending(tmp_path_factory):
    return store(tmp_path_factory.mktemp("zarr"))


def test_channels_by_name_and_level_are_the_stores_fields_north_first(ascending):
    reader = config(ascending).open("train")
    ds = xr.open_zarr(ascending)
    assert ds.latitude.values[0] < 0 and reader.latitudes[0] > 0  # stored south first, read north first
    np.testing.assert_array_equal(reader.latitudes, ds.latitude.values[::-1])
    fields = reader.read(0, slice(2, 7, 2))  # times 2, 4, 6 of the training split
    assert fields.shape == (3, 3, 16, 32) and fields.dtype == np.float32
    want = [ds["2m_temperature"], ds["geopotential"].sel(level=500), ds["temperature"].sel(level=850)]
    for c, array in enumerate(want):
        np.testing.assert_array_equal(fields[:, c], array.isel(time=[2, 4, 6]).values[:, ::-1])
    assert [(c.variable, c.level, c.units) for c in reader.channels] == [
        ("2m_temperature", None, "K"), ("geopotential", 500, "m^2/s^2"), ("temperature", 850, "K")]
    assert reader.hours_per_step == 6.0 and reader.segment_lengths == [24]


def test_descending_and_longitude_first_stores_read_the_same(ascending, tmp_path):
    other = store(tmp_path, descending=True, lon_first=True)
    a, b = config(ascending).open("valid"), config(other).open("valid")
    np.testing.assert_array_equal(a.latitudes, b.latitudes)
    np.testing.assert_array_equal(a.read(0, slice(0, 8)), b.read(0, slice(0, 8)))
    np.testing.assert_allclose(a.means, b.means, rtol=1e-6)
    np.testing.assert_allclose(a.climatology(), b.climatology(), rtol=1e-6)


def test_pairs_are_normalised_by_the_statistics_and_pickle(ascending):
    pairs = FieldPairs(config(ascending, dt=2).open("train"), 2, None)
    assert len(pairs) == 24 - 2
    x, y = pairs[3]
    fields = pairs.reader.read(0, slice(3, 6, 2))
    means, stds = pairs.reader.means[:, None, None], pairs.reader.stds[:, None, None]
    np.testing.assert_allclose(x.numpy(), (fields[0] - means) / stds, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(y.numpy(), (fields[1] - means) / stds, rtol=1e-5, atol=1e-5)
    clone = pickle.loads(pickle.dumps(pairs))  # as a DataLoader worker receives it: the store opened again
    assert clone.reader._arrays is None and (clone[3][0] == x).all()


def test_statistics_are_those_of_the_training_times(ascending):
    ds = xr.open_zarr(ascending).sel(time=slice(*SPLITS["train"]))
    reader = config(ascending).open("test")  # any split reads the training split's statistics
    for c, array in enumerate([ds["2m_temperature"], ds["geopotential"].sel(level=500),
                               ds["temperature"].sel(level=850)]):
        values = array.values.astype(np.float64)
        assert reader.means[c] == pytest.approx(values.mean(), rel=1e-6)
        assert reader.stds[c] == pytest.approx(values.std(), rel=1e-5)
        np.testing.assert_allclose(reader.climatology()[c], values.mean(axis=0)[::-1], rtol=1e-6)
    with np.load(stats_beside(ascending)) as saved:
        assert int(saved["num_times"]) == 24 and len(saved["channels"]) == 2 + 3 * 3 + 2  # every channel (--all)


def test_stride_and_crop_keep_every_other_row_from_the_north(ascending):
    path = ascending.parent / "stride2.stats.npz"  # statistics are of one stride's grid
    assert stats.main([f"data.root={ascending}", "data.stride=2", f"--out={path}", "data.variables=[2m_temperature]",
                       *(f"data.{k}=[{a},{b}]" for k, (a, b) in SPLITS.items())]) == 0
    reader = config(ascending, stride=2, img_size=[6, 12], variables=["2m_temperature"], stats=str(path)).open("valid")
    ds = xr.open_zarr(ascending)
    np.testing.assert_array_equal(reader.latitudes, ds.latitude.values[::-1][::2][:6])
    np.testing.assert_array_equal(reader.longitudes, ds.longitude.values[::2][:12])
    want = ds["2m_temperature"].sel(time=slice(*SPLITS["valid"])).values[:, ::-1][:, ::2, ::2][:, :6, :12]
    np.testing.assert_array_equal(reader.read(0, slice(0, 8))[:, 0], want)
    assert reader.climatology().shape == (1, 6, 12)


def test_hours_come_from_the_time_coordinate(tmp_path):
    path = write_store(tmp_path / "h12.zarr", shape=(8, 16), levels=(500,), num_times=12, step_hours=12)
    cfg = config(path, variables=["2m_temperature"], img_size=[8, 16], train=["2016-01-01", "2016-01-06"])
    assert stats.main([f"data.root={path}", "data.variables=[2m_temperature]", "data.train=[2016-01-01,2016-01-06]"]) \
        == 0
    reader = cfg.open("train")
    assert reader.hours_per_step == 12.0 and reader.segment_lengths == [12]  # a date includes its whole day


@pytest.mark.parametrize("kw,setting,what", [
    (dict(variables=["geopotential"]), "data.variables", "geopotential has pressure levels"),
    (dict(variables=["2m_temperature@500"]), "data.variables", "2m_temperature has no pressure levels"),
    (dict(variables=["geopotential@300"]), "data.variables", "geopotential has no level 300"),
    (dict(variables=["snow"]), "data.variables", "has no variable 'snow'"),
    (dict(valid=["2019-01-01", "2019-12-31"]), "data.valid", "no time of"),
    (dict(img_size=[32, 32]), "data.img_size", "larger than the grid"),
    (dict(stats="/nonexistent/stats.npz"), "data.stats", "no normalisation statistics"),
    (dict(stride=2, img_size=[8, 16]), "data.stride", "statistics for stride 1"),
])
def test_bad_settings_are_one_line_errors(ascending, kw, setting, what):
    with pytest.raises(ConfigError) as err:
        config(ascending, **kw).open("valid")
    assert err.value.setting == setting and what in err.value.what


@pytest.mark.parametrize("kw,setting", [(dict(variables=["geopotential@x"]), "data.variables"),
                                        (dict(train=["2017-01-01", "2016-01-01"]), "data.train"),
                                        (dict(train=["yesterday", "today"]), "data.train"),
                                        (dict(stride=0), "data.stride")])
def test_bad_schema_values_are_refused_at_once(kw, setting):
    with pytest.raises(ConfigError) as err:
        ERA5ZarrConfig(**kw)
    assert err.value.setting == setting


def test_the_stats_command_refuses_with_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        stats.main([f"data.root={tmp_path / 'missing.zarr'}"])
    assert exit_.value.code == 2 and capsys.readouterr().err.count("\n") == 1


def test_cell_area_weights_follow_the_real_latitudes():
    """The NERSC files' 720 rows, 90 to -89.75: the north pole's cell is a quarter-width cap, the last row a full
    cell (no south pole row); either order gives the same weight per latitude."""
    lat = nersc_latitudes(720)
    assert lat[0] == 90.0 and lat[-1] == -89.75
    w = cell_area_weights(lat).squeeze(-1).numpy()
    d = np.deg2rad(0.125)
    area = np.sin(np.minimum(np.deg2rad(lat) + d, np.pi / 2)) - np.sin(np.deg2rad(lat) - d)
    np.testing.assert_allclose(w, area / area.mean(), rtol=1e-12)
    np.testing.assert_allclose(cell_area_weights(lat[::-1]).squeeze(-1).numpy(), w[::-1], rtol=1e-12)
    assert w.mean() == pytest.approx(1.0) and w[0] < w[-1]  # the pole's cap is smaller than the row at -89.75


def test_the_synthetic_nersc_copy_reports_its_generators_latitudes(era5_root):
    from utils.weather.data.era5_synthetic import latitudes

    cfg = ERA5Config(synthetic=True, root=str(era5_root), img_size=[32, 64])
    reader = cfg.open("valid")
    assert isinstance(reader, NERSCReader) and reader.latitudes[0] == pytest.approx(87.1875)
    np.testing.assert_array_equal(reader.latitudes, latitudes())


@pytest.mark.slow  # a fresh interpreter importing torch: 8 s on 2 loaded cores
def test_the_project_imports_without_xarray():
    code = ("import sys; import train, utils.weather.task.weather, utils.weather.data.era5_zarr, "
            "utils.weather.data.stats; "
            "assert 'xarray' not in sys.modules and 'zarr' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, timeout=120)


def test_forecast_init_times_are_the_stores_datetimes(ascending):
    """The forecast dataset's `time` coordinate (utils/forecast/outputs.py) is the store's time of each initial
    time, not a count of steps from 1970."""
    from types import SimpleNamespace

    from utils.forecast.outputs import init_times

    reader = pickle.loads(pickle.dumps(config(ascending).open("valid")))
    got = init_times(SimpleNamespace(reader=reader, starts=[(0, 0), (0, 3), (0, 7)]))
    want = xr.open_zarr(ascending).time.sel(time=slice(*SPLITS["valid"])).values[[0, 3, 7]]
    np.testing.assert_array_equal(got, want.astype("datetime64[ns]"))
    assert str(got[1]).startswith("2016-01-07T18")
