"""A synthetic store in WeatherBench 2's zarr layout: `python -m utils.data.era5_zarr_synthetic STORE [--stats]`.

The same kind of fields as the synthetic NERSC copy (utils/weather/data/era5_synthetic.py: zonal waves travelling on a
latitude-dependent jet, mixed into each channel with fixed weights) under WeatherBench 2's names, units and
dimensions: surface variables (time, latitude, longitude), the others (time, level, latitude, longitude) on
the pressure levels given; latitudes ascending (cell centres of an equiangular grid without poles, as WB2's
64x32 store) unless `descending`; longitudes 0..360 exclusive; 6-hourly times from 2016-01-01 in one
continuous run. With the defaults the times split as SPLITS below (`data.train=...` etc.), and `--stats` writes
the statistics of the training split beside the store (utils/weather/data/stats.py).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

from utils.weather.data.era5_synthetic import _waves, make_year

SURFACE = {"2m_temperature": (280.0, 20.0, 4.0, "K"), "10m_u_component_of_wind": (0.0, 8.0, 4.0, "m/s"),
           "10m_v_component_of_wind": (0.0, 3.0, 4.0, "m/s"), "mean_sea_level_pressure": (1.0e5, 1.5e3, 8.0e2, "Pa")}
# per level (hPa): climatological value, its equator-to-pole amplitude, the anomalies' scale
ON_LEVELS = {"geopotential": ({500: 5.4e4, 850: 1.4e4, 1000: 1.0e3}, 2.0e3, 6.0e2, "m^2/s^2"),
             "temperature": ({500: 255.0, 850: 275.0, 1000: 283.0}, 15.0, 3.0, "K"),
             "u_component_of_wind": ({500: 15.0, 850: 6.0, 1000: 3.0}, 10.0, 6.0, "m/s")}
LEVELS = (500, 850)
NUM_TIMES = 176
SPLITS = {"train": ["2016-01-01", "2016-02-01T18"], "valid": ["2016-02-02", "2016-02-09T18"],
          "test": ["2016-02-10", "2016-02-13T18"]}  # 128, 32 and 16 times


def grid(num_lat: int, num_lon: int, descending: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """Latitudes (cell centres, no poles) and longitudes (0 first) of an equiangular grid."""
    lat = np.linspace(-90, 90, num_lat, endpoint=False) + 90.0 / num_lat
    return (lat[::-1] if descending else lat), np.arange(num_lon) * 360.0 / num_lon


def write_store(path: Path, *, shape: tuple[int, int] = (32, 64), levels: tuple[int, ...] = LEVELS,
                num_times: int = NUM_TIMES, descending: bool = False, lon_first: bool = False, step_hours: int = 6,
                seed: int = 0) -> Path:
    """Write the store at `path` (replaced if there) and return it: `num_times` times `step_hours` apart from
    2016-01-01. `lon_first`: each variable's dims end in (longitude, latitude), as some of WB2's regridded
    stores."""
    import xarray as xr

    lat, lon = grid(*shape, descending)
    rng = np.random.default_rng(seed)
    names = list(SURFACE) + [(v, lev) for v in ON_LEVELS for lev in levels]
    waves = _waves(rng, len(names))
    coslat = np.cos(np.deg2rad(lat))[:, None]
    clim, scale = [], []
    for name in names:
        base, amplitude, anomaly = (SURFACE[name][:3] if isinstance(name, str) else
                                    (ON_LEVELS[name[0]][0][name[1]], *ON_LEVELS[name[0]][1:3]))
        clim.append(base + amplitude * coslat)
        scale.append(anomaly)
    fields = make_year(num_times, waves, np.stack(clim), np.array(scale), rng, lat, shape[1])  # (T, C, H, W)
    spatial = ("longitude", "latitude") if lon_first else ("latitude", "longitude")
    data = {}
    for c, name in enumerate(names[:len(SURFACE)]):
        data[name] = (("time", *spatial), _spatial(fields[:, c], lon_first), {"units": SURFACE[name][3]})
    for k, variable in enumerate(ON_LEVELS):
        first = len(SURFACE) + k * len(levels)
        block = np.stack([_spatial(fields[:, first + i], lon_first) for i in range(len(levels))], axis=1)
        data[variable] = (("time", "level", *spatial), block, {"units": ON_LEVELS[variable][3]})
    times = np.datetime64("2016-01-01T00", "ns") + np.arange(num_times) * np.timedelta64(step_hours, "h")
    coords = {"time": times, "level": np.array(levels, dtype=np.int64), "latitude": lat, "longitude": lon}
    chunks = {name: {"chunks": (1, *block.shape[1:])} for name, (_, block, _) in data.items()}  # a time per chunk
    xr.Dataset(data, coords=coords).to_zarr(path, mode="w", zarr_format=2, encoding=chunks)  # as WB2 publishes them
    return path


def _spatial(fields: np.ndarray, lon_first: bool) -> np.ndarray:
    return np.ascontiguousarray(fields.swapaxes(-1, -2)) if lon_first else fields


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m utils.data.era5_zarr_synthetic",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("store", type=Path, help="the store to write (a folder, e.g. synthetic.zarr)")
    parser.add_argument("--stats", action="store_true", help="also write its statistics beside it (every channel)")
    args = parser.parse_args(argv)
    write_store(args.store)
    print(f"wrote {args.store}: {NUM_TIMES} 6-hourly times from 2016-01-01, splits {SPLITS}")
    if args.stats:
        from utils.weather.data import stats

        ranges = [f"data.{split}=[{first},{last}]" for split, (first, last) in SPLITS.items()]
        return stats.main([f"data.root={args.store}", "--all", *ranges])
    return 0


if __name__ == "__main__":
    sys.exit(main())
