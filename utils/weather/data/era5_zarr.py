"""ERA5 as WeatherBench 2 publishes it: zarr stores read with xarray (`data=era5_zarr`), the schema and reader.

    <store>.zarr   dims time, level (hPa), latitude, longitude (any order of the two, ascending or descending
                   latitudes); variables by name: 2m_temperature (time, latitude, longitude), geopotential
                   (time, level, latitude, longitude), ...
    <store>.stats.npz   normalisation statistics of the training split (`python -m utils.data.stats`)

Channels are chosen by name and level (`data.variables=[2m_temperature,geopotential@500]`), the splits by
time ranges (`data.train=[1979-01-01,2017-12-31]`, both ends included), a coarser grid by a stride over rows
and columns (`data.stride=4`), and the model's grid is the `data.img_size` crop of that from the north-west
corner. Rows are returned north first whatever the store's order, and the latitudes and longitudes are the
store's; the hours between times come from its time coordinate (`data.dt` counts its steps).

xarray and zarr are imported here only, when a store is opened (`pip install -e ".[weather]"`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from utils import ConfigError, require
from utils.weather.data.fields import Channel

SPLITS = ("train", "valid", "test")
DEFAULT_VARIABLES = ["2m_temperature", "10m_u_component_of_wind", "10m_v_component_of_wind", "mean_sea_level_pressure",
                     "temperature@850", "geopotential@500"]
STATS_COMMAND = "python -m utils.data.stats data.root=STORE data.variables=[...]"


def split_channel(name: str) -> tuple[str, int | None]:
    """'geopotential@500' -> ('geopotential', 500); '2m_temperature' -> ('2m_temperature', None)."""
    variable, _, level = name.partition("@")
    require(bool(variable) and (not level or level.isdigit()), f"bad variable {name!r}", "data.variables",
            "name a variable (2m_temperature) or a variable at a pressure level in hPa (geopotential@500)")
    return variable, int(level) if level else None


def _check_range(name: str, value: list[str]) -> None:
    try:
        first, last = (np.datetime64(v) for v in value)
    except (TypeError, ValueError):
        raise ConfigError(f"bad time range {list(value)}", f"data.{name}",
                          "give [first, last] as dates or date-times, e.g. [2016-01-01,2016-12-31T18]") from None
    require(len(value) == 2 and first <= last, f"bad time range {list(value)}", f"data.{name}",
            "give [first, last] with first <= last")


@dataclass
class ERA5ZarrConfig:
    """Schema of `data=era5_zarr`: a WeatherBench 2-layout zarr store, its channels and time ranges."""

    kind: str = "era5_zarr"  # data source tag (one of the weather task's; fixed by the preset)
    root: str | None = None  # the zarr store (a folder)
    variables: list[str] = field(default_factory=lambda: list(DEFAULT_VARIABLES))  # name or name@level (hPa)
    train: list[str] = field(default_factory=lambda: ["1979-01-01", "2017-12-31"])  # [first, last] times, inclusive
    valid: list[str] = field(default_factory=lambda: ["2018-01-01", "2018-12-31"])  # validation times
    test: list[str] = field(default_factory=lambda: ["2020-01-01", "2020-12-31"])  # test times (WB2's year)
    stride: int = 1  # every stride-th row and column, counted from the north-west corner (a coarser grid)
    img_size: list[int] = field(default_factory=lambda: [32, 64])  # [H, W] crop of the strided grid
    dt: int = 1  # time steps of the store between input and target (hours from its time coordinate)
    stats: str | None = None  # the statistics file; None = <store>.stats.npz beside the store
    limit_nsamples: int | None = None  # use only the first N training pairs (None = all)
    limit_nsamples_val: int | None = None  # use only the first N validation pairs (None = all)

    def __post_init__(self):
        require(self.kind == "era5_zarr", f"kind {self.kind!r} is not era5_zarr", "data.kind",
                "leave kind as set by the preset")
        require(len(self.variables) > 0, "no variables", "data.variables", "list the channels, e.g. [2m_temperature]")
        for name in self.variables:
            split_channel(name)
        require(len(set(self.variables)) == len(self.variables), "a variable is listed twice", "data.variables",
                "list each channel once")
        for name in SPLITS:
            _check_range(name, getattr(self, name))
        require(self.stride >= 1, f"stride must be >= 1, got {self.stride}", "data.stride", "set a positive stride")
        require(len(self.img_size) == 2 and min(self.img_size) > 0, f"bad img_size {list(self.img_size)}",
                "data.img_size", "give [H, W] with positive sides, e.g. data.img_size=[32,64]")
        require(self.dt >= 1, f"dt must be >= 1, got {self.dt}", "data.dt", "set a positive number of steps")
        for name in ("limit_nsamples", "limit_nsamples_val"):
            value = getattr(self, name)
            require(value is None or value > 0, f"{name} must be positive", f"data.{name}",
                    "set null or a positive count")

    @property
    def channels(self) -> list[str]:
        """The channel names (what every weather data schema answers)."""
        return list(self.variables)

    def stats_path(self) -> Path:
        return Path(self.stats) if self.stats else stats_beside(Path(self.root))

    def open(self, split: str) -> ZarrReader:
        """The reader of a split ("train", "valid", "test"), its statistics loaded."""
        require(bool(self.root), "no zarr store given", "data.root", "set data.root=/path/to/store.zarr")
        require(Path(self.root).is_dir(), f"zarr store {self.root} does not exist", "data.root",
                "point it at a WeatherBench 2-layout zarr store (a folder)")
        reader = ZarrReader(self, split)
        reader.load_stats(self.stats_path())
        return reader


def stats_beside(store: Path) -> Path:
    """Where the statistics of a store go by default: <folder>/<store name without .zarr>.stats.npz."""
    store = Path(str(store).rstrip("/"))
    return store.with_name(store.name.removesuffix(".zarr") + ".stats.npz")


def xarray():
    """The xarray module, or a one-line error naming the extra that installs it."""
    try:
        import xarray
        import zarr  # noqa: F401 - xarray's zarr backend needs it
    except ImportError:
        raise ConfigError("xarray and zarr are not installed", "data", 'pip install -e ".[weather]"') from None
    return xarray


def open_store(path: Path):
    """The store as an xarray Dataset, lazily indexed (no dask): reading a selection reads only its chunks."""
    try:
        return xarray().open_zarr(path, chunks=None)
    except (OSError, ValueError, KeyError) as err:
        raise ConfigError(f"cannot open the zarr store {path} ({err})", "data.root",
                          "point data.root at a zarr store written by xarray (WeatherBench 2's layout)") from None


def store_channels(dataset) -> list[str]:
    """Every channel a store offers: its surface variables and each level of the others."""
    names = []
    for variable, array in dataset.data_vars.items():
        if {"time", "latitude", "longitude"} <= set(array.dims):
            levels = dataset["level"].values.tolist() if "level" in array.dims else [None]
            names += [variable if level is None else f"{variable}@{int(level)}" for level in levels]
    return names


class ZarrReader:
    """One split of a zarr store (a FieldReader, utils/weather/data/fields.py): one segment, its time range; the store
    is opened lazily in each process (DataLoader workers each open their own)."""

    def __init__(self, cfg: ERA5ZarrConfig, split: str, full_grid: bool = False):
        """`full_grid`: the whole strided grid instead of the `img_size` crop (the statistics command)."""
        self.path, self.split, self.stride = Path(cfg.root), split, cfg.stride
        dataset = open_store(self.path)
        missing = {"time", "latitude", "longitude"} - set(dataset.dims)
        require(not missing, f"{self.path} has no dimension {', '.join(sorted(missing))}", "data.root",
                "use a store in WeatherBench 2's layout: dims time, [level,] latitude, longitude")
        self._select_times(dataset, getattr(cfg, split), split)
        self._select_channels(dataset, cfg.variables)
        self._select_grid(dataset, None if full_grid else cfg.img_size)
        self.means = self.stds = self._climatology = None
        self._arrays, self._pid = None, None

    def _select_times(self, dataset, bounds: list[str], split: str) -> None:
        times = dataset["time"].values
        require(bool(np.all(np.diff(times) > np.timedelta64(0))), f"the times of {self.path} are not increasing",
                "data.root", "write the store with its time coordinate sorted")
        end = np.datetime64(bounds[1]) + 1  # the first instant after `last` in its own unit: a date includes its day
        lo, hi = np.searchsorted(times, np.datetime64(bounds[0])), np.searchsorted(times, end)
        require(hi > lo, f"no time of {self.path} falls in {list(bounds)} (it holds {str(times[0])[:16]} to "
                f"{str(times[-1])[:16]})",
                f"data.{split}", "choose a time range within the store's")
        steps = np.unique(np.diff(times[lo:hi]))
        require(len(steps) <= 1, f"the times of {self.path} in {list(bounds)} are not evenly spaced", f"data.{split}",
                "choose a range without gaps")
        step = steps[0] if len(steps) else np.diff(times[:2])[0] if len(times) > 1 else np.timedelta64(6, "h")
        self.hours_per_step = float(step / np.timedelta64(1, "h"))
        self._first, self.segment_lengths, self._start = int(lo), [int(hi - lo)], times[lo]
        self._bounds = (str(times[lo])[:16], str(times[hi - 1])[:16])

    def _select_channels(self, dataset, variables: list[str]) -> None:
        channels, self._layout = [], []
        for name in variables:
            variable, level = split_channel(name)
            offered = store_channels(dataset)
            require(variable in dataset.data_vars, f"{self.path} has no variable {variable!r}", "data.variables",
                    "choose among " + ", ".join(offered[:16]) + (", ..." if len(offered) > 16 else ""))
            array = dataset[variable]
            levels = [int(v) for v in dataset["level"].values] if "level" in array.dims else []
            require(bool(levels) == (level is not None), f"{variable} has {'' if levels else 'no '}pressure levels",
                    "data.variables", f"write {variable}@LEVEL, one of {levels}" if levels else f"write {variable}")
            require(level is None or level in levels, f"{variable} has no level {level}", "data.variables",
                    f"choose one of {levels}")
            packed = {"scale_factor", "add_offset"} & set(array.encoding)
            require(not packed, f"{variable} is stored packed ({', '.join(sorted(packed))})", "data.variables",
                    "write the store with unpacked floats (WeatherBench 2's are)")
            channels.append(Channel(name, variable, level, str(array.attrs.get("units", ""))))
            self._layout.append((variable, array.dims, levels.index(level) if levels else None))
        self.channels = tuple(channels)

    def _select_grid(self, dataset, img_size: list[int] | None) -> None:
        """Rows north first, every stride-th from the northernmost; columns every stride-th from the first."""
        lat, lon = (dataset[name].values.astype(np.float64) for name in ("latitude", "longitude"))
        north_first = len(lat) < 2 or lat[0] > lat[-1]
        rows = (np.arange(len(lat)) if north_first else np.arange(len(lat))[::-1])[::self.stride]
        cols = np.arange(len(lon))[::self.stride]
        if img_size is not None:
            h, w = img_size
            require(h <= len(rows) and w <= len(cols), f"img_size {[h, w]} is larger than the grid of {self.path} "
                    f"with stride {self.stride} ({[len(rows), len(cols)]})", "data.img_size",
                    f"choose a crop no larger than {[len(rows), len(cols)]} (or a smaller data.stride)")
            rows, cols = rows[:h], cols[:w]
        self.latitudes, self.longitudes = lat[rows], lon[cols]
        self._rows = slice(int(rows.min()), int(rows.max()) + 1, self.stride)
        self._cols = slice(int(cols[0]), int(cols[-1]) + 1, self.stride)
        self._flip = not north_first

    def _store(self):
        """The store's arrays of the channels, opened once per process and read with zarr directly (xarray's
        indexing costs more than the read of a small field)."""
        if self._pid != os.getpid():
            import zarr

            group = zarr.open_group(str(self.path), mode="r")
            self._arrays, self._pid = {variable: group[variable] for variable, _, _ in self._layout}, os.getpid()
        return self._arrays

    def read(self, segment: int, times: slice) -> np.ndarray:
        assert segment == 0, "a zarr split is one segment"
        span = range(self.segment_lengths[0])[times]
        index = {"time": slice(self._first + span.start, self._first + span.stop, span.step),
                 "latitude": self._rows, "longitude": self._cols}
        out = np.empty((len(span), len(self.channels), len(self.latitudes), len(self.longitudes)), np.float32)
        for c, (variable, dims, level) in enumerate(self._layout):
            at = {**index, "level": level}
            fields = self._store()[variable][tuple(at[d] for d in dims)]  # the dims left: a permutation of 3
            kept = [d for d in dims if d != "level"]
            fields = fields.transpose([kept.index(d) for d in ("time", "latitude", "longitude")])
            out[:, c] = fields[:, ::-1] if self._flip else fields
        return out

    def load_stats(self, path: Path) -> None:
        """Means, stds and time means of this reader's channels from the statistics file
        (utils/weather/data/stats.py)."""
        require(path.is_file(), f"no normalisation statistics at {path}", "data.stats",
                f"compute them with `{STATS_COMMAND}` (or point data.stats at the file)")
        with np.load(path) as stats:
            names = [str(n) for n in stats["channels"]]
            missing = [c.name for c in self.channels if c.name not in names]
            require(not missing, f"{path} has no statistics of {', '.join(missing)}", "data.stats",
                    f"recompute them for these variables: `{STATS_COMMAND}`")
            require(int(stats["stride"]) == self.stride, f"{path} holds statistics for stride {int(stats['stride'])}",
                    "data.stride", f"set data.stride={int(stats['stride'])}, or recompute them: `{STATS_COMMAND}`")
            h, w = len(self.latitudes), len(self.longitudes)
            same_grid = stats["latitudes"].shape[0] >= h and np.allclose(stats["latitudes"][:h], self.latitudes)
            require(same_grid, f"{path} holds statistics of another grid", "data.stats",
                    f"recompute them for this store: `{STATS_COMMAND}`")
            pick = [names.index(c.name) for c in self.channels]
            self.means, self.stds = stats["means"][pick].astype(np.float32), stats["stds"][pick].astype(np.float32)
            self._climatology = stats["time_means"][pick, :h, :w].astype(np.float32)
        require(bool((self.stds > 0).all()), f"{path} has non-positive standard deviations", "data.stats",
                "recompute them over a training range where every variable varies")

    def climatology(self) -> np.ndarray | None:
        return self._climatology

    def segment_name(self, segment: int) -> str:
        return f"{self.path} {self.split} times [{self._bounds[0]}, {self._bounds[1]}]"

    def segment_start(self, segment: int) -> np.datetime64:
        """The store's time of the segment's first field (forecast datasets' init times: utils/forecast/)."""
        return self._start

    def describe(self) -> str:
        return f"{self.path} ({self.split} {self._bounds[0]} to {self._bounds[1]}, every {self.hours_per_step:g} h)"

    def __getstate__(self):
        state = dict(self.__dict__)
        state["_arrays"], state["_pid"] = None, None  # a store handle is opened again in each process
        return state
