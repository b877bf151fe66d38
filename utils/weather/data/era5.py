"""ERA5 in the NERSC tutorial's on-disk layout: the data schema of `data=era5*` and its reader.

    <root>/train/<year>.h5, <root>/valid/<year>.h5, <root>/test/<year>.h5   dataset `fields` [T, C, H, W] f32
    <root>/stats/global_means.npy, global_stds.npy  [1, C, 1, 1];  <root>/stats/time_means.npy

A sample is a normalized pair (state at t, state at t+dt), cropped to `img_size` from the top-left
(`FieldPairs`, utils/weather/data/fields.py, over a `NERSCReader`). The files carry no coordinates: their rows are the
0.25-degree ERA5 grid from 90 to -89.75 degrees (720 rows, the south pole left out; `nersc_latitudes`), the
synthetic copy's are its generator's (utils/weather/data/era5_synthetic.py), and the channels are named by the table
below (WeatherBench 2's variable, pressure level and units of each).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import h5py
import numpy as np

from utils import ConfigError, require
from utils.weather.data import era5_synthetic
from utils.weather.data.fields import Channel, FieldPairs

# The 20 channels of the NERSC/FourCastNet subset, in file order (u10m first).
CHANNELS = ["u10m", "v10m", "t2m", "sp", "msl", "t850", "u1000", "v1000", "z1000", "u850", "v850", "z850",
            "u500", "v500", "z500", "t500", "z50", "r500", "r850", "tcwv"]
SPLITS = ("train", "valid", "test")
SURFACE = {"u10m": ("10m_u_component_of_wind", "m/s"), "v10m": ("10m_v_component_of_wind", "m/s"),
           "t2m": ("2m_temperature", "K"), "sp": ("surface_pressure", "Pa"), "msl": ("mean_sea_level_pressure", "Pa"),
           "tcwv": ("total_column_water_vapour", "kg/m^2")}
ON_LEVELS = {"u": ("u_component_of_wind", "m/s"), "v": ("v_component_of_wind", "m/s"), "t": ("temperature", "K"),
             "z": ("geopotential", "m^2/s^2"), "r": ("relative_humidity", "%")}


def nersc_channel(name: str) -> Channel:
    """A NERSC channel name as WeatherBench 2 names its variable: u10m, t2m, ... at the surface; u850, z500, ...
    (letter and hPa) on pressure levels; another name is a surface variable of that name and unknown units."""
    if name in SURFACE:
        return Channel(name, *SURFACE[name][:1], None, SURFACE[name][1])
    letter, level = name[:1], name[1:]
    if letter in ON_LEVELS and level.isdigit():
        variable, units = ON_LEVELS[letter]
        return Channel(name, variable, int(level), units)
    return Channel(name, name, None, "")


def nersc_latitudes(num_rows: int) -> np.ndarray:
    """Latitudes (degrees north) of the rows of a NERSC file: from 90 southwards, 180 / num_rows apart (the
    0.25-degree grid's 720 rows end at -89.75), or 180 / (num_rows - 1) apart for an odd count that includes
    both poles (721 rows: 90 to -90)."""
    step = 180.0 / (num_rows - 1 if num_rows % 2 else num_rows)
    return 90.0 - np.arange(num_rows) * step


@dataclass
class ERA5Config:
    """Schema of `data=era5*`: where the files are and which samples to draw."""

    kind: str = "era5"  # data family tag (fixed by the preset)
    root: str | None = None  # folder holding train/ valid/ stats/; None with synthetic = the user cache
    synthetic: bool = False  # generate a small synthetic copy into root on first use
    img_size: list[int] = field(default_factory=lambda: [360, 720])  # [H, W] crop of the files
    dt: int = 1  # time steps between input and target (1 step = 6 h in ERA5)
    channels: list[str] = field(default_factory=lambda: list(CHANNELS))  # names of the file channels
    limit_nsamples: int | None = None  # use only the first N training pairs (None = all)
    limit_nsamples_val: int | None = None  # use only the first N validation pairs (None = all)

    def __post_init__(self):
        require(self.kind == "era5", f"kind {self.kind!r} is not era5", "data.kind", "leave kind as set by the preset")
        require(len(self.img_size) == 2 and min(self.img_size) > 0, f"bad img_size {list(self.img_size)}",
                "data.img_size", "give [H, W] with positive sides, e.g. data.img_size=[360,720]")
        require(self.dt >= 1, f"dt must be >= 1, got {self.dt}", "data.dt", "set a positive number of steps")
        require(len(self.channels) > 0, "no channels", "data.channels", "list the file channels")
        for name in ("limit_nsamples", "limit_nsamples_val"):
            value = getattr(self, name)
            require(value is None or value > 0, f"{name} must be positive", f"data.{name}",
                    "set null or a positive count")

    def open(self, split: str) -> NERSCReader:
        """The reader of a split ("train", "valid", "test"): the synthetic copy generated first when asked for."""
        if self.synthetic:
            root = era5_synthetic.ensure_synthetic(Path(self.root) if self.root else None)
            return NERSCReader(root, split, self, era5_synthetic.latitudes())
        require(bool(self.root), "no data folder given", "data.root", "set data.root=/path/to/era5 (NERSC layout)")
        root = Path(self.root)
        require(root.is_dir(), f"data folder {root} does not exist", "data.root", "point it at the ERA5 folder")
        return NERSCReader(root, split, self)


@dataclass(frozen=True)
class FileInfo:
    path: Path
    num_times: int
    shape: tuple[int, int]  # (H, W) of the file


def split_files(root: Path, split: str) -> list[Path]:
    folder = root / split
    require(folder.is_dir(), f"missing split folder {folder}", "data.root",
            "point data.root at a folder with train/, valid/ and stats/ (the NERSC layout)")
    files = sorted(folder.glob("*.h5"))
    require(len(files) > 0, f"no <year>.h5 files in {folder}", "data.root", "copy the yearly HDF5 files there")
    return files


def inspect_file(path: Path, num_channels: int) -> FileInfo:
    """Read shape and one value at the end of `fields` (detects truncation) without loading the data."""
    try:
        with h5py.File(path, "r") as f:
            require("fields" in f, f"{path} has no dataset 'fields'", "data.root", "write fields as [T, C, H, W]")
            ds = f["fields"]
            require(ds.ndim == 4, f"{path}: fields has shape {ds.shape}", "data.root", "write fields as [T, C, H, W]")
            ds[-1, -1, -1, -1]
            t, c, h, w = ds.shape
    except (OSError, KeyError, RuntimeError) as err:
        raise ConfigError(f"unreadable or truncated HDF5 file {path} ({err})", "data.root",
                          "re-copy the file or remove it from the split folder") from None
    require(c == num_channels, f"{path} has {c} channels, the config lists {num_channels}", "data.channels",
            "list exactly the channels of the files")
    return FileInfo(path, t, (h, w))


def load_stats(root: Path, num_channels: int) -> tuple[np.ndarray, np.ndarray]:
    """Global means and stds, shape [1, C, 1, 1] float32."""
    stats = []
    for name in ("global_means.npy", "global_stds.npy"):
        path = root / "stats" / name
        require(path.is_file(), f"missing {path}", "data.root", "put stats/global_means.npy and global_stds.npy there")
        arr = np.load(path).astype(np.float32)
        require(arr.shape == (1, num_channels, 1, 1), f"{path} has shape {arr.shape}", "data.root",
                f"expected [1, {num_channels}, 1, 1]")
        stats.append(arr)
    require(bool((stats[1] > 0).all()), "global_stds.npy has non-positive entries", "data.root", "recompute the stats")
    return stats[0], stats[1]


class NERSCReader:
    """One split of the NERSC layout (a FieldReader, utils/weather/data/fields.py): its yearly files, each a segment,
    cropped to `img_size` from the top-left. Files are inspected once (shape, channels, readability) and opened
    lazily in each process (DataLoader workers each get their own handles)."""

    hours_per_step = 6.0  # the files are 6-hourly

    def __init__(self, root: Path, split: str, cfg: ERA5Config, latitudes: np.ndarray | None = None):
        """`latitudes`: of the files' rows (default: `nersc_latitudes`)."""
        names = list(cfg.channels)
        self.root, self.split = root, split
        self.infos = [inspect_file(p, len(names)) for p in split_files(root, split)]
        h, w = cfg.img_size
        for info in self.infos:
            require(h <= info.shape[0] and w <= info.shape[1],
                    f"img_size {[h, w]} is larger than the files ({list(info.shape)})", "data.img_size",
                    f"choose a crop no larger than {list(info.shape)}")
        self.img_size = (h, w)
        self.channels = tuple(nersc_channel(name) for name in names)
        rows, cols = self.infos[0].shape
        self.latitudes = (nersc_latitudes(rows) if latitudes is None else np.asarray(latitudes))[:h]
        self.longitudes = (np.arange(cols) * 360.0 / cols)[:w]
        means, stds = load_stats(root, len(names))
        self.means, self.stds = means.reshape(-1), stds.reshape(-1)
        self.segment_lengths = [info.num_times for info in self.infos]
        self._handles: dict[int, h5py.File] = {}
        self._pid = None

    def segment_name(self, segment: int) -> str:
        return self.infos[segment].path.name

    def describe(self) -> str:
        return str(self.root)

    def _fields(self, file_index: int):
        """Open files lazily, once per process."""
        if self._pid != os.getpid():
            self._handles, self._pid = {}, os.getpid()
        if file_index not in self._handles:
            self._handles[file_index] = h5py.File(self.infos[file_index].path, "r")
        return self._handles[file_index]["fields"]

    def read(self, segment: int, times: slice) -> np.ndarray:
        h, w = self.img_size
        return self._fields(segment)[times, :, :h, :w].astype(np.float32)

    def climatology(self) -> np.ndarray | None:
        """stats/time_means.npy cropped (C, H, W), or None without the file."""
        path = self.root / "stats" / "time_means.npy"
        if not path.is_file():
            return None
        (h, w), c = self.img_size, len(self.channels)
        means = np.load(path)
        require(means.ndim == 4 and means.shape[:2] == (1, c) and means.shape[2] >= h and means.shape[3] >= w,
                f"{path} has shape {list(means.shape)}", "data.root",
                f"write stats/time_means.npy as [1, {c}, H, W] of the files' grid (or remove it: ACC is then off)")
        return means.astype(np.float32)[0, :, :h, :w]

    def __getstate__(self):
        state = dict(self.__dict__)
        state["_handles"], state["_pid"] = {}, None  # h5py handles never cross processes
        return state


class ERA5Dataset(FieldPairs):
    """Normalized (x_t, x_t+dt) pairs from one split of the NERSC layout (`FieldPairs` over a `NERSCReader`)."""

    def __init__(self, root: Path, split: str, cfg: ERA5Config, limit: int | None, horizon: int = 1,
                 latitudes: np.ndarray | None = None):
        super().__init__(NERSCReader(root, split, cfg, latitudes), cfg.dt, limit, horizon)

    @property
    def _handles(self) -> dict:
        return self.reader._handles
