"""The weather task's training loss (`task.loss`): the seed's relative L2, or a weighted mean squared error.

    relative_l2   the seed's loss, the ViT's own criterion (networks/vit/model.py RelativeL2Loss): the default
    mse           mean over samples, channels and grid points of (f - o)^2, in normalised units
    area_mse      the same with each row weighted by its cell area w_j (WeatherBench 2's latitude weights of the
                  data's latitudes, mean 1: utils/weather/data/fields.py cell_area_weights)
    weighted_mse  GraphCast's (google-deepmind/graphcast losses.py weighted_mse_per_level): per channel c of
                  variable v, the area-weighted MSE times a_c, summed over channels, with
                      a_c = w_v / L_v                      for a surface variable (L_v = 1)
                      a_c = w_v * p_c / mean_v(p) / L_v    on pressure levels: proportional to the pressure p_c
                  (hPa) of the level, normalised to mean 1 over v's L_v levels, so that each variable weighs w_v
                  in all (`task.variable_weights`, by WeatherBench 2 name, default GraphCast's: 2m_temperature 1,
                  10 m winds, mean sea level pressure and 6-hourly precipitation 0.1, every other variable 1)

All three MSEs are one module (`WeightedMSE`): mean over (B, C, H, W) of a weight table (C, H, 1) times the
squared error, the table C * a_c * w_j (or w_j, or 1). The ViT's output is the whole field on every rank under
every layout (context parallelism gathers its tokens before the head), so the loss of each rank is the one of
a single process: the table follows the rows of the field, whatever rank held which patches.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import torch
from torch import nn

from utils.weather.data.fields import Channel, cell_area_weights

LOSSES = ("relative_l2", "mse", "area_mse", "weighted_mse")
# GraphCast's per-variable weights, over WeatherBench 2's ERA5 variables (a setting can change a listed one only:
# `task.variable_weights={geopotential:2}`; an unlisted variable weighs 1)
GRAPHCAST_WEIGHTS = {"2m_temperature": 1.0, "10m_u_component_of_wind": 0.1, "10m_v_component_of_wind": 0.1,
                     "mean_sea_level_pressure": 0.1, "total_precipitation_6hr": 0.1, "surface_pressure": 1.0,
                     "total_column_water_vapour": 1.0, "geopotential": 1.0, "temperature": 1.0,
                     "u_component_of_wind": 1.0, "v_component_of_wind": 1.0, "specific_humidity": 1.0,
                     "vertical_velocity": 1.0, "relative_humidity": 1.0}


def channel_weights(channels: Sequence[Channel], variable_weights: Mapping[str, float]) -> np.ndarray:
    """GraphCast's per-channel weights a_c (C,) float64 (see the module docstring): each variable's add up to its
    weight (1 for a variable `variable_weights` does not name)."""
    weights = np.zeros(len(channels))
    for variable in {c.variable for c in channels}:
        members = [i for i, c in enumerate(channels) if c.variable == variable]
        pressures = np.array([channels[i].level or 1.0 for i in members], dtype=np.float64)
        share = pressures / pressures.mean() if channels[members[0]].level is not None else np.ones(len(members))
        weights[members] = variable_weights.get(variable, 1.0) * share / len(members)
    return weights


def loss_table(loss: str, channels: Sequence[Channel], latitudes: np.ndarray,
               variable_weights: Mapping[str, float]) -> np.ndarray:
    """The weights (C, H, 1) float32 of a weighted MSE (`loss` one of mse, area_mse, weighted_mse) of fields with
    these channels and rows."""
    num = len(channels)
    rows = np.ones((1, 1)) if loss == "mse" else cell_area_weights(latitudes).numpy()  # (H, 1)
    table = np.ones((num, 1, 1)) * rows[None]
    if loss == "weighted_mse":
        table = table * (num * channel_weights(channels, variable_weights))[:, None, None]
    return table.astype(np.float32)


class WeightedMSE(nn.Module):
    """mean over (B, C, H, W) of weights (C, H, 1) x (pred - target)^2, computed in float32. The weights are a
    buffer computed from the table, again on the rank's device once a meta-built model is allocated
    (`init_buffers`, utils/engine/materialize.py); not part of the state dict."""

    def __init__(self, table: np.ndarray):
        super().__init__()
        self.table = np.asarray(table, dtype=np.float32)
        self.register_buffer("weights", None, persistent=False)
        self.init_buffers()

    def init_buffers(self, device: torch.device | None = None) -> None:
        self.weights = torch.tensor(self.table, device=device)

    def forward(self, pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return ((pred.float() - target.float()).pow(2) * self.weights).mean()
