"""Normalisation statistics of a zarr store: `python -m utils.data.stats data.root=STORE [data.key=value ...]`.

Over the training split (`data.train`, its time range) of the configured channels (`data.variables`; `--all`:
every variable and level of the store) on the strided grid (`data.stride`, the whole grid, not the crop), it
computes each channel's mean and standard deviation over times and grid points (as the NERSC files'
stats/global_means.npy and global_stds.npy) and its time-mean field (the climatology of the forecast skill, as
stats/time_means.npy), in float64, and writes them to `data.stats` (default: <store>.stats.npz beside the
store; `--out PATH` elsewhere):

    channels [C] names, means [C], stds [C], time_means [C, H, W], latitudes [H], longitudes [W] (rows north
    first), stride, train [first, last], num_times

The settings are `data=era5_zarr`'s (utils/weather/data/era5_zarr.py), given as on train.py's command line. Bad input:
one line, exit 2.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np

from utils import ConfigError, exit_bad_input, require
from utils.weather.data.era5_zarr import ERA5ZarrConfig, ZarrReader, open_store, store_channels

CHUNK = 16  # times read at once


def parse_args(argv: list[str] | None):
    parser = argparse.ArgumentParser(prog="python -m utils.data.stats", description=__doc__.split("\n\n")[0])
    parser.add_argument("settings", nargs="*", help="data.key=value settings of data=era5_zarr (data.root=STORE ...)")
    parser.add_argument("--all", action="store_true", help="every variable and level of the store")
    parser.add_argument("--out", type=Path, help="the file to write (default: data.stats, or beside the store)")
    return parser.parse_intermixed_args(argv)


def data_config(settings: list[str]) -> ERA5ZarrConfig:
    """The data schema with `data.key=value` settings (the `data.` prefix optional), validated."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    dotlist = [s.removeprefix("data.") for s in settings]
    bad = [s for s in dotlist if "=" not in s]
    require(not bad, f"not a setting: {bad[0] if bad else ''}", "command line", "write data.key=value")
    try:
        merged = OmegaConf.merge(OmegaConf.structured(ERA5ZarrConfig), OmegaConf.from_dotlist(dotlist))
        return OmegaConf.to_object(merged)
    except OmegaConfBaseException as err:
        if isinstance(err.__cause__, ConfigError):
            raise err.__cause__ from None
        raise ConfigError(f"bad setting: {str(err).splitlines()[0]}", "command line",
                          "give data.key=value settings of data=era5_zarr") from None


def compute(reader: ZarrReader) -> dict[str, np.ndarray]:
    """Means, stds and time means of every channel of the reader's split, accumulated in float64."""
    num_times = reader.segment_lengths[0]
    shape = (len(reader.channels), len(reader.latitudes), len(reader.longitudes))
    total, squares, fields = np.zeros(shape[0]), np.zeros(shape[0]), np.zeros(shape)
    for start in range(0, num_times, CHUNK):
        chunk = reader.read(0, slice(start, min(num_times, start + CHUNK))).astype(np.float64)  # (T, C, H, W)
        total += chunk.sum(axis=(0, 2, 3))
        squares += (chunk ** 2).sum(axis=(0, 2, 3))
        fields += chunk.sum(axis=0)
    count = num_times * shape[1] * shape[2]
    means = total / count
    stds = np.sqrt(np.maximum(squares / count - means ** 2, 0.0))
    return {"means": means, "stds": stds, "time_means": fields / num_times}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        cfg = data_config(args.settings)
        require(bool(cfg.root) and Path(cfg.root).is_dir(), f"no zarr store at {cfg.root}", "data.root",
                "set data.root=/path/to/store.zarr")
        if args.all:
            cfg = replace(cfg, variables=store_channels(open_store(Path(cfg.root))))
        reader = ZarrReader(cfg, "train", full_grid=True)
        stats = compute(reader)
    except ConfigError as err:
        exit_bad_input(err)
    out = args.out or cfg.stats_path()
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("wb") as f:  # np.savez adds no suffix to an open file
        np.savez(f, channels=np.array([c.name for c in reader.channels]), latitudes=reader.latitudes,
                 longitudes=reader.longitudes, stride=np.int64(cfg.stride), train=np.array(cfg.train),
                 num_times=np.int64(reader.segment_lengths[0]), **stats)
    print(f"wrote {out}: {len(reader.channels)} channels over {reader.segment_lengths[0]} times of the training "
          f"split ({reader.describe()})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
