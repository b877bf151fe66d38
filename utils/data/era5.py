"""ERA5 reader for the NERSC tutorial's on-disk layout.

    <root>/train/<year>.h5, <root>/valid/<year>.h5, <root>/test/<year>.h5   dataset `fields` [T, C, H, W] f32
    <root>/stats/global_means.npy, global_stds.npy  [1, C, 1, 1];  <root>/stats/time_means.npy

A sample is a normalized pair (state at t, state at t+dt), cropped to `img_size` from the top-left.
Files are inspected once at start (shape, channels, readability) and opened lazily in each worker.
"""

from __future__ import annotations

import bisect
import os
from dataclasses import dataclass, field
from pathlib import Path

import h5py
import numpy as np
import torch
from torch.utils.data import Dataset

from utils import ConfigError, require

# The 20 channels of the NERSC/FourCastNet subset, in file order (u10m first).
CHANNELS = ["u10m", "v10m", "t2m", "sp", "msl", "t850", "u1000", "v1000", "z1000", "u850", "v850", "z850",
            "u500", "v500", "z500", "t500", "z50", "r500", "r850", "tcwv"]
SPLITS = ("train", "valid", "test")


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


def inspect_file(path: Path, num_channels: int, dt: int) -> FileInfo:
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
    require(t > dt, f"{path} has {t} time steps, need more than dt={dt}", "data.dt", "use a smaller dt")
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


class ERA5Dataset(Dataset):
    """Normalized (x_t, x_t+dt) pairs from one split, each a float32 tensor [C, H, W]; with `horizon` K > 1
    (rollout training) the target is the K states after x_t, [K, C, H, W]."""

    def __init__(self, root: Path, split: str, cfg: ERA5Config, limit: int | None, horizon: int = 1):
        num_channels = len(cfg.channels)
        self.infos = [inspect_file(p, num_channels, cfg.dt * horizon) for p in split_files(root, split)]
        h, w = cfg.img_size
        for info in self.infos:
            require(h <= info.shape[0] and w <= info.shape[1],
                    f"img_size {[h, w]} is larger than the files ({list(info.shape)})", "data.img_size",
                    f"choose a crop no larger than {list(info.shape)}")
        self.img_size, self.dt, self.horizon = (h, w), cfg.dt, horizon
        means, stds = load_stats(root, num_channels)
        self.means, self.stds = torch.from_numpy(means[0]), torch.from_numpy(stds[0])  # (C, 1, 1)
        counts = [i.num_times - cfg.dt * horizon for i in self.infos]
        self.offsets = np.cumsum([0] + counts).tolist()
        self.length = min(self.offsets[-1], limit) if limit else self.offsets[-1]
        self._handles: dict[int, h5py.File] = {}
        self._pid = None

    def __len__(self) -> int:
        return self.length

    def _fields(self, file_index: int):
        """Open files lazily, once per process (DataLoader workers each get their own handles)."""
        if self._pid != os.getpid():
            self._handles, self._pid = {}, os.getpid()
        if file_index not in self._handles:
            self._handles[file_index] = h5py.File(self.infos[file_index].path, "r")
        return self._handles[file_index]["fields"]

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= index < self.length:
            raise IndexError(index)
        file_index = bisect.bisect_right(self.offsets, index) - 1
        t = index - self.offsets[file_index]
        h, w = self.img_size
        fields = self._fields(file_index)
        x = torch.from_numpy(fields[t, :, :h, :w].astype(np.float32))
        if self.horizon == 1:
            y = torch.from_numpy(fields[t + self.dt, :, :h, :w].astype(np.float32))
        else:
            end = t + self.dt * self.horizon + 1
            y = torch.from_numpy(fields[t + self.dt:end:self.dt, :, :h, :w].astype(np.float32))
        return (x - self.means) / self.stds, (y - self.means) / self.stds

    def __getstate__(self):
        state = dict(self.__dict__)
        state["_handles"], state["_pid"] = {}, None  # h5py handles never cross processes
        return state


def latitude_weights(num_lat: int) -> torch.Tensor:
    """cos(latitude) weights normalized to mean 1, shape (num_lat, 1), as the seed's weighted RMSE:
    row j of the crop sits at latitude 90 - j * 180 / (num_lat - 1), north pole first."""
    j = torch.arange(num_lat, dtype=torch.float64)
    w = torch.cos(torch.deg2rad(90.0 - j * 180.0 / max(1, num_lat - 1)))
    return (w / w.mean()).float().unsqueeze(-1)
