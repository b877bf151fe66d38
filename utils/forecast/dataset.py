"""Forecasts in WeatherBench 2's layout: an xarray Dataset written to zarr or NetCDF.

Each variable is named as WeatherBench 2 names it (`geopotential`, `2m_temperature`, ...), in physical units
(attribute `units`), with dimensions

    [number,] time, prediction_timedelta, [level,] latitude, longitude

`time` the initial times (datetime64), `prediction_timedelta` the leads (timedelta64), `level` the pressure
levels in hPa of the variables that have them (the union over the variables; a variable missing at a level is
NaN there), `latitude` and `longitude` in degrees, and `number` the ensemble member of an ensemble. Channels
become variables by their descriptions (`Channel`: the name, the variable, the level or None, the units):
geopotential@500 and geopotential@850 are one variable `geopotential` on levels 500 and 850; a variable's
attribute `channels` names its channels, one per level of the `level` coordinate ("-" where it has none).

A forecast file holds three groups: the root is the deterministic forecast (what WB2's evaluation reads as
`forecast_path`), `truth` the verifying fields on the same coordinates, and `ensemble` the members when there
are any. Open them with `xarray.open_dataset(path, group="truth")` (engine "zarr" for a .zarr folder, written in
zarr format 2 with consolidated metadata as WB2's stores, so `xarray.open_zarr(path)` reads it too). xarray,
zarr and h5netcdf (NetCDF) are imported here only: the rest of the project runs without them.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path

import numpy as np

from utils import require

SUFFIXES = (".zarr", ".nc")
MEMBER_DIM = "number"  # WeatherBench 2's evaluate.py default ensemble dimension (ECMWF's name)


@dataclass(frozen=True)
class Channel:
    """A channel as the dataset names it (the fields of utils/weather/data/fields.py's Channel)."""

    name: str  # the channel's own name (z500, geopotential@500)
    variable: str  # the dataset variable it belongs to
    level: int | None  # pressure level (hPa), None for a single-level variable
    units: str = ""


def channel_of(name: str) -> Channel:
    """A channel known only by its name: `variable@level` is the variable at that level, another name a
    single-level variable of that name (a reader's channel descriptions say more: use them when there are)."""
    variable, _, level = name.partition("@")
    require(not level or level.isdigit(), f"channel {name!r} has a level that is not a whole number of hPa",
            "data.channels", "name channels like geopotential@500")
    return Channel(name, variable, int(level) if level else None)


def init_times(segments: list[str], starts: list[tuple[int, int]], hours_per_step: float) -> np.ndarray:
    """datetime64 of initial times given as (segment, time index) pairs: a segment named by a year (the NERSC
    files, 2018.h5) starts on 1 January 00 UTC of that year; others are counted from 1970-01-01."""
    def start(segment: str) -> datetime:
        stem = Path(segment).stem
        return datetime(int(stem), 1, 1) if stem.isdigit() and 1 <= int(stem) <= 9999 else datetime(1970, 1, 1)

    return np.array([start(segments[s]) + timedelta(hours=t * hours_per_step) for s, t in starts],
                    dtype="datetime64[ns]")


def _variables(channels: list[Channel]) -> dict[str, list[int]]:
    """Variable -> indices of its channels, in the order of their first appearance."""
    groups: dict[str, list[int]] = {}
    for c, channel in enumerate(channels):
        groups.setdefault(channel.variable, []).append(c)
    for variable, indices in groups.items():
        levels = [channels[c].level for c in indices]
        require(None not in levels or len(levels) == 1, f"variable {variable} is both a surface field and on "
                "levels, or twice at the surface", "data.channels", "give each channel its own variable or level")
        require(len(set(levels)) == len(levels), f"variable {variable} has a level twice", "data.channels",
                "list each channel once")
    return groups


def forecast_dataset(fields: np.ndarray, channels: list[Channel], times: np.ndarray, lead_hours: list[float],
                     latitudes, longitudes, members: bool = False, attrs: dict | None = None):
    """An xarray Dataset of `fields` (T, K, C, H, W), or (M, T, K, C, H, W) when `members`: initial times, leads,
    channels and the grid, in physical units."""
    import xarray as xr

    require(fields.shape[-3] == len(channels), f"{fields.shape[-3]} channels of fields, {len(channels)} named",
            "data.channels", "name every channel")
    outer = [MEMBER_DIM] * members + ["time", "prediction_timedelta"]
    levels = sorted({c.level for c in channels if c.level is not None})
    data_vars = {}
    for variable, indices in _variables(channels).items():
        if channels[indices[0]].level is None:
            data = fields[..., indices[0], :, :]
            dims = [*outer, "latitude", "longitude"]
        else:
            data = np.full((*fields.shape[:-3], len(levels), *fields.shape[-2:]), np.nan, dtype=fields.dtype)
            for c in indices:
                data[..., levels.index(channels[c].level), :, :] = fields[..., c, :, :]
            dims = [*outer, "level", "latitude", "longitude"]
        names = {channels[c].level: channels[c].name for c in indices}
        named = " ".join(names.get(level, "-") for level in levels) if "level" in dims else names[None]
        data_vars[variable] = (dims, data, {"units": channels[indices[0]].units, "channels": named})
    coords = {"time": np.asarray(times, dtype="datetime64[ns]"),
              "prediction_timedelta": np.array([np.timedelta64(int(round(h * 3600)), "s") for h in lead_hours],
                                               dtype="timedelta64[ns]"),
              "latitude": ("latitude", np.asarray(latitudes, dtype=np.float64), {"units": "degrees_north"}),
              "longitude": ("longitude", np.asarray(longitudes, dtype=np.float64), {"units": "degrees_east"})}
    if levels:
        coords["level"] = ("level", np.array(levels, dtype=np.int64), {"units": "hPa"})
    if members:
        coords[MEMBER_DIM] = np.arange(fields.shape[0])
    return xr.Dataset(data_vars, coords, attrs=attrs or {})


def write(path: Path, groups: dict[str, object]) -> Path:
    """Write datasets to one zarr folder or NetCDF file by the path's suffix: the "" group at the root, the
    others as groups of those names. Replaces what was at `path`."""
    import shutil

    require(path.suffix in SUFFIXES, f"{path} is neither a .zarr folder nor a .nc file", "--output",
            "give a path ending in .zarr or .nc")
    for module in ("xarray", "zarr" if path.suffix == ".zarr" else "h5netcdf"):
        require(importlib.util.find_spec(module) is not None, f"writing {path.name} needs the python package "
                f"{module}", "--output", "install the weather extra: pip install -e '.[weather]'")
    if path.is_dir():
        shutil.rmtree(path)
    elif path.exists():
        path.unlink()
    path.parent.mkdir(parents=True, exist_ok=True)
    for k, (group, dataset) in enumerate(groups.items()):
        mode = "w" if k == 0 else "a"
        if path.suffix == ".zarr":  # zarr format 2, as WB2's stores, readable by zarr-python 2 and 3
            dataset.to_zarr(path, group=group or None, mode=mode, zarr_format=2, consolidated=False)
        else:
            dataset.to_netcdf(path, group=group or None, mode=mode, engine="h5netcdf")
    if path.suffix == ".zarr":
        import zarr

        zarr.consolidate_metadata(str(path))  # the root's .zmetadata covers every group: xr.open_zarr reads it
    return path


def open_group(path: Path, group: str = ""):
    """One group of a forecast file as an xarray Dataset, loaded."""
    import xarray as xr

    engine = "zarr" if Path(path).suffix == ".zarr" else "h5netcdf"
    with xr.open_dataset(path, group=group or None, engine=engine) as dataset:
        return dataset.load()
