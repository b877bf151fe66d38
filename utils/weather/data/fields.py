"""The weather data interface: a data source is a reader of gridded fields, and the weather task reads only
through it (utils/weather/task/weather.py, utils/weather/task/forecast.py).

A reader (`FieldReader`) is one split of a source: its channels (names, WeatherBench 2 variables, pressure
levels, units), its grid (the latitudes and longitudes of the rows and columns it returns), the hours between
its consecutive times, its segments (runs of consecutive times: a yearly file, a time range) and its
normalisation statistics; `read(segment, times)` returns physical fields (T, C, H, W) float32. Only readers open
files. `FieldPairs` turns any reader into the training samples: normalised (x_t, x_t+dt) pairs that never
cross a segment.

A new source is its module (a data schema whose `open(split)` returns a reader, and the reader), a preset in
config/data/, and its schema's line in the weather task's `DATA_SCHEMAS` (utils/weather/task/weather.py); the NERSC
HDF5 files (utils/weather/data/era5.py) and WeatherBench 2's zarr stores (utils/weather/data/era5_zarr.py) are the two
here.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch
from torch.utils.data import Dataset

from utils import require


@dataclass(frozen=True)
class Channel:
    """One input/output channel of the model: a variable at a level."""

    name: str  # as the config and the metrics name it (u10m; geopotential@500)
    variable: str  # WeatherBench 2's name of the variable (10m_u_component_of_wind; geopotential)
    level: int | None  # pressure level in hPa; None for a surface (single-level) variable
    units: str  # physical units of the fields read ("" when the source does not say)


class FieldReader(Protocol):
    """One split of a gridded data source (see the module docstring)."""

    channels: tuple[Channel, ...]
    latitudes: np.ndarray  # (H,) degrees north of the rows `read` returns, in that order
    longitudes: np.ndarray  # (W,) degrees east of its columns
    hours_per_step: float  # hours between consecutive times of a segment
    segment_lengths: list[int]  # times in each segment
    means: np.ndarray  # (C,) normalisation means of the training split, physical units
    stds: np.ndarray  # (C,) normalisation standard deviations, positive

    def segment_name(self, segment: int) -> str:
        """A segment as messages name it (its file, its time range)."""

    def read(self, segment: int, times: slice) -> np.ndarray:
        """Fields (T, C, H, W) float32 in physical units at `times` (a slice, step allowed) of `segment`."""

    def climatology(self) -> np.ndarray | None:
        """(C, H, W) time-mean fields (the forecast skill's climatology), or None when the source has none."""

    def describe(self) -> str:
        """Where the data is, for the run log."""


def channel_shape(reader: FieldReader) -> tuple[int, int, int]:
    """(C, H, W) of the fields a reader returns."""
    return len(reader.channels), len(reader.latitudes), len(reader.longitudes)


def stat_tensors(reader: FieldReader) -> tuple[torch.Tensor, torch.Tensor]:
    """The reader's means and stds as float32 tensors (C, 1, 1), which broadcast over fields (C, H, W)."""
    num = len(reader.channels)
    means = torch.from_numpy(np.asarray(reader.means, dtype=np.float32).reshape(num, 1, 1))
    stds = torch.from_numpy(np.asarray(reader.stds, dtype=np.float32).reshape(num, 1, 1))
    return means, stds


class FieldPairs(Dataset):
    """Normalised (x_t, x_t+dt) pairs of a reader, each a float32 tensor [C, H, W]; with `horizon` K > 1
    (rollout training) the target is the K states after x_t, [K, C, H, W]. Pairs never cross segments; index i
    counts the pairs of the segments in order."""

    def __init__(self, reader: FieldReader, dt: int, limit: int | None, horizon: int = 1):
        self.reader, self.dt, self.horizon = reader, dt, horizon
        span = dt * horizon
        for segment, num_times in enumerate(reader.segment_lengths):
            require(num_times > span, f"{reader.segment_name(segment)} has {num_times} time steps, need more than "
                    f"dt={span}", "data.dt", "use a smaller dt")
        self.means, self.stds = stat_tensors(reader)  # (C, 1, 1)
        self.offsets = np.cumsum([0] + [n - span for n in reader.segment_lengths]).tolist()
        self.length = min(self.offsets[-1], limit) if limit else self.offsets[-1]

    @property
    def img_size(self) -> tuple[int, int]:
        return channel_shape(self.reader)[1:]

    def __len__(self) -> int:
        return self.length

    def locate(self, index: int) -> tuple[int, int]:
        """(segment, time in the segment) of pair `index`'s input."""
        segment = bisect.bisect_right(self.offsets, index) - 1
        return segment, index - self.offsets[segment]

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= index < self.length:
            raise IndexError(index)
        segment, t = self.locate(index)
        fields = torch.from_numpy(self.reader.read(segment, slice(t, t + self.dt * self.horizon + 1, self.dt)))
        x, y = fields[0], fields[1] if self.horizon == 1 else fields[1:]
        return (x - self.means) / self.stds, (y - self.means) / self.stds


def cell_area_weights(latitudes: np.ndarray | int) -> torch.Tensor:
    """WeatherBench 2's latitude weights, (H, 1) float64 of mean 1: row j's cell area between its bounds,
    sin(phi_j + d/2) - sin(phi_j - d/2) clipped to the poles, d the rows' spacing. `latitudes`: of the rows in
    any order (ascending or descending), degrees, evenly spaced; an int H stands for H rows from 90 to -90."""
    if isinstance(latitudes, int):
        latitudes = 90.0 - np.arange(latitudes) * 180.0 / max(1, latitudes - 1)
    lat = np.asarray(latitudes, dtype=np.float64)
    step = float(np.abs(np.diff(lat)).mean()) if len(lat) > 1 else 180.0
    upper, lower = np.minimum(lat + step / 2, 90.0), np.maximum(lat - step / 2, -90.0)
    w = np.sin(np.deg2rad(upper)) - np.sin(np.deg2rad(lower))
    return torch.from_numpy(w / w.mean()).unsqueeze(-1)
