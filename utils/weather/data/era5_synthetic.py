"""A synthetic ERA5 in the NERSC on-disk layout: smooth, advected, evolving fields for 20 channels.

Each channel is a latitude-dependent climatology plus anomalies built from a shared set of zonal
waves. Waves travel east at a latitude-dependent speed (a jet), their amplitudes oscillate slowly, and
channels mix the waves with fixed weights, so the state at t+dt is a smooth, learnable function of the
state at t that persistence (predicting no change) does not capture. Deterministic for a seed.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import h5py
import numpy as np

from utils import ConfigError
from utils.data.cache import user_cache_dir

GRID = (32, 64)  # (lat, lon) points: a 5.625-degree grid
NUM_CHANNELS = 20  # the NERSC layout's (utils/weather/data/era5.py CHANNELS)
YEARS = {"train": [2016, 2017], "valid": [2018], "test": [2019]}
STEPS_PER_YEAR = {"train": 64, "valid": 32, "test": 16}
NUM_WAVES = 12
VERSION = 2  # 2: fields in their channels' units (PLAUSIBLE)


def latitudes() -> np.ndarray:
    """Latitudes of the grid's rows (degrees north, north first): cell centres, 5.625 degrees apart, no poles."""
    return np.linspace(90, -90, GRID[0], endpoint=False) - 90.0 / GRID[0]


# Each channel's value at the poles and its equator-to-pole difference (the 20 channels of utils/weather/data/era5.py's
# CHANNELS, in file order, in their units there): fields are mapped onto them, so a channel reads in its units.
PLAUSIBLE = [(-4.0, 8.0), (-2.0, 4.0), (240.0, 50.0), (8.5e4, 1.5e4), (9.95e4, 2.0e3),  # u10m v10m t2m sp msl
             (240.0, 35.0), (-4.0, 8.0), (-2.0, 4.0), (-1.0e3, 1.5e3), (-4.0, 12.0),  # t850 u1000 v1000 z1000 u850
             (-2.0, 4.0), (1.2e4, 3.0e3), (5.0, 15.0), (-3.0, 6.0), (4.9e4, 9.0e3),  # v850 z850 u500 v500 z500
             (228.0, 40.0), (1.95e5, 1.5e4), (30.0, 30.0), (50.0, 30.0), (5.0, 40.0)]  # t500 z50 r500 r850 tcwv


def _channel_climatology(lat: np.ndarray, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Per-channel mean field (C, H, 1) and anomaly scale (C,) in the channels' units: random shapes, each
    mapped linearly onto its PLAUSIBLE pole value and equator-to-pole difference."""
    coslat = np.cos(np.deg2rad(lat))[None, :, None]
    rng.uniform(size=NUM_CHANNELS)  # version 1's offsets: drawn still, so the waves (and normalised fields) stay
    amplitude = rng.uniform(5, 40, size=(NUM_CHANNELS, 1, 1))
    scale = rng.uniform(1, 10, size=NUM_CHANNELS)
    pole, difference = (np.array(column)[:, None, None] for column in zip(*PLAUSIBLE))
    gain = difference / amplitude  # version 1's fields, linearly mapped: the anomalies scale with the difference
    return pole + difference * coslat, gain[:, 0, 0] * scale


def _waves(rng: np.random.Generator, num_channels: int = NUM_CHANNELS) -> dict[str, np.ndarray]:
    return {
        "m": rng.integers(1, 6, size=NUM_WAVES),  # zonal wavenumber
        "lat0": rng.uniform(-60, 60, size=NUM_WAVES),  # band centre (deg)
        "width": rng.uniform(15, 35, size=NUM_WAVES),  # band width (deg)
        "amp_period": rng.uniform(20, 60, size=NUM_WAVES),  # steps per amplitude cycle
        "mix": rng.normal(size=(num_channels, NUM_WAVES)) / np.sqrt(NUM_WAVES),
    }


def make_year(num_steps: int, waves: dict, clim: np.ndarray, scale: np.ndarray, rng: np.random.Generator,
              lat: np.ndarray | None = None, num_lon: int = GRID[1]) -> np.ndarray:
    """Fields [T, C, H, W] float32 for one year with its own random phases, on this module's grid or on the rows
    `lat` (degrees) and `num_lon` columns (utils/weather/data/era5_zarr_synthetic.py)."""
    lat = latitudes() if lat is None else lat
    lon = np.linspace(0, 2 * np.pi, num_lon, endpoint=False)
    jet = 0.12 + 0.10 * np.cos(np.deg2rad(2 * lat))  # eastward phase speed (rad/step) by latitude
    phase = rng.uniform(0, 2 * np.pi, size=NUM_WAVES)
    amp_phase = rng.uniform(0, 2 * np.pi, size=NUM_WAVES)
    envelope = np.exp(-(((lat[None, :] - waves["lat0"][:, None]) / waves["width"][:, None]) ** 2))  # (K, H)
    t = np.arange(num_steps)[:, None, None, None]  # (T, 1, 1, 1)
    m = waves["m"][None, :, None, None]
    shift = jet[None, None, :, None] * t  # (T, 1, H, 1)
    angle = m * (lon[None, None, None, :] - shift) + phase[None, :, None, None]  # (T, K, H, W)
    amp = 1.0 + 0.5 * np.sin(2 * np.pi * t / waves["amp_period"][None, :, None, None] + amp_phase[None, :, None, None])
    wave_fields = amp * envelope[None, :, :, None] * np.cos(angle)  # (T, K, H, W)
    anomalies = np.einsum("ck,tkhw->tchw", waves["mix"], wave_fields)
    fields = clim[None] + scale[None, :, None, None] * anomalies
    return fields.astype(np.float32)


def generate(root: Path, seed: int = 0) -> None:
    """Write train/valid/test yearly files and stats/ under `root` (which must not exist yet)."""
    rng = np.random.default_rng(seed)
    clim, scale = _channel_climatology(latitudes(), rng)
    waves = _waves(rng)
    train = []
    for split, years in YEARS.items():
        (root / split).mkdir(parents=True)
        for year in years:
            fields = make_year(STEPS_PER_YEAR[split], waves, clim, scale, np.random.default_rng([seed, year]))
            with h5py.File(root / split / f"{year}.h5", "w") as f:
                f.create_dataset("fields", data=fields)
            if split == "train":
                train.append(fields)
    stack = np.concatenate(train).astype(np.float64)
    (root / "stats").mkdir()
    np.save(root / "stats" / "global_means.npy", stack.mean(axis=(0, 2, 3), keepdims=True).astype(np.float32))
    np.save(root / "stats" / "global_stds.npy", stack.std(axis=(0, 2, 3), keepdims=True).astype(np.float32))
    np.save(root / "stats" / "time_means.npy", stack.mean(axis=0, keepdims=True).astype(np.float32))


def default_cache_dir() -> Path:
    return user_cache_dir() / f"era5_synthetic_v{VERSION}"


def ensure_synthetic(root: Path | None, seed: int = 0) -> Path:
    """Generate the synthetic dataset at `root` (default: the user cache) unless it is already there.

    Written to a temporary folder and renamed into place, so concurrent ranks never see half a dataset;
    when two processes race, the first rename wins and the other copy is discarded (they are identical).
    """
    root = Path(root) if root else default_cache_dir()
    if (root / "stats" / "global_stds.npy").is_file():
        return root
    if root.is_dir() and any(root.iterdir()):
        raise ConfigError(f"{root} is neither empty nor a synthetic ERA5 copy", "data.root",
                          "point data.root at an empty or new folder (or leave it null for the user cache)")
    root.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".era5_synthetic-", dir=root.parent))
    try:
        generate(tmp / "data", seed)
        try:
            os.rename(tmp / "data", root)
        except OSError:
            if not (root / "stats" / "global_stds.npy").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return root
