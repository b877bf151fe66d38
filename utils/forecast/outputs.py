"""The forecast command's spectra, ensemble tables and WeatherBench 2 dataset (beside report.py's HDF5 file,
metrics and skill figures):

    spectra.csv              per channel and lead: the blurring figure (utils/weather/task/spectra.py: forecast / truth
                             of the mid-latitude zonal energy spectra over the highest quarter of wavenumbers)
    spectra_<channel>.png    forecast and truth spectra at a few leads (u10m, t2m, z500: those the data has)
    ensemble.md/.csv, rank_histogram.csv   with --members M (members.py; ensemble.md with each channel's units)
    --output PATH            the forecast, its truth and the members in WeatherBench 2's layout (dataset.py)

The grid, the channels' variables and the initial times come from the rollouts' reader (utils/weather/data/fields.py).
"""

from __future__ import annotations

import csv
from datetime import datetime
from pathlib import Path

import numpy as np
import torch

from utils.forecast import dataset, members
from utils.weather.task import spectra
from utils.weather.task.figures import lead_spectra_panel


def init_times(rollouts) -> np.ndarray:
    """datetime64 of the initial times: a reader's `segment_start(segment)` where it has one, else the NERSC
    convention (a segment named by a year starts on 1 January 00 UTC), else counted from 1970-01-01."""
    reader = rollouts.reader
    if hasattr(reader, "segment_start"):
        return np.array([np.datetime64(reader.segment_start(s), "ns") + np.timedelta64(int(t * reader.hours_per_step
                         * 3600), "s") for s, t in rollouts.starts], dtype="datetime64[ns]")
    names = [reader.segment_name(s) for s in range(len(reader.segment_lengths))]
    return dataset.init_times(names, rollouts.starts, reader.hours_per_step)


def channels(rollouts) -> list[dataset.Channel]:
    return [dataset.Channel(c.name, c.variable, c.level, c.units) for c in rollouts.reader.channels]


def write_spectra(out: Path, result: dict, leads: list[float], step: int,
                  drawn: list[str]) -> tuple[list[Path], torch.Tensor]:
    """spectra.csv (the blurring figure of every channel and lead) and the figures of the `drawn` channels;
    returns the paths and the blurring (K, C)."""
    rollouts = result["task"].rollouts
    names = [c.name for c in rollouts.reader.channels]
    predicted, true = result["spectra"]["forecast"], result["spectra"]["truth"]  # the rollout's (report.py)
    blur = spectra.blurring(predicted, true)  # (K, C)
    paths = [out / "spectra.csv"]
    with paths[0].open("w", newline="") as f:
        csv.writer(f).writerows([("channel", "lead_h", "blurring"),
                                 *((c, lead, float(blur[k, i])) for i, c in enumerate(names)
                                   for k, lead in enumerate(leads))])
    for channel in drawn:
        paths.append(out / f"spectra_{channel}.png")
        lead_spectra_panel(predicted, true, blur, leads, names.index(channel), channel, step).savefig(paths[-1])
    return paths, blur


def write_dataset(path: Path, result: dict, leads: list[float], checkpoint: Path) -> Path:
    """The control forecast (root), the truth and the members in WeatherBench 2's layout, at `path`."""
    rollouts = result["task"].rollouts
    common = dict(channels=channels(rollouts), times=init_times(rollouts), lead_hours=leads,
                  latitudes=rollouts.latitudes, longitudes=rollouts.reader.longitudes)
    attrs = {"checkpoint": str(checkpoint), "created": datetime.now().isoformat(timespec="seconds")}
    groups = {"": dataset.forecast_dataset(result["forecasts"].numpy(), attrs=attrs, **common),
              "truth": dataset.forecast_dataset(result["truths"].numpy(), attrs=attrs, **common)}
    if result.get("members") is not None:
        groups["ensemble"] = dataset.forecast_dataset(result["members"].numpy(), members=True, attrs=attrs, **common)
    return dataset.write(path, groups)


def write_ensemble(out: Path, result: dict, leads: list[float]) -> tuple[list[Path], dict[str, torch.Tensor]]:
    """The ensemble's tables (members.py), scored with the deterministic metrics' latitude weights."""
    from utils.weather.data.fields import cell_area_weights

    weights = cell_area_weights(result["task"].rollouts.latitudes)
    scores = members.ensemble_scores(result["members"], result["forecasts"], result["truths"], weights)
    table = result["task"].rollouts.reader.channels
    return members.write_tables(out, scores, [c.name for c in table], leads, [c.units for c in table]), scores
