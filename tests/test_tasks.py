"""The tasks' validation numbers, computed here independently from what evaluate() reports."""

from __future__ import annotations

import contextlib
import math

import numpy as np
import torch
from torch import nn

from networks.vit.model import RelativeL2Loss
from utils.cli.config import load_config
from utils.comm import Grid
from utils.data.batching import build_loaders
from utils.tasks import build_task


class Persistence(nn.Module):
    """Predicts no change: its error grows with the field's motion, which differs by latitude."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


class Recorder:
    """Stands for the TensorBoard writer."""

    draws_images = True

    def __init__(self):
        self.images: dict[str, torch.Tensor] = {}

    def image(self, tag: str, image: torch.Tensor, step: int) -> None:
        self.images[tag] = image


def expected_rmse(pairs: list[tuple[np.ndarray, np.ndarray]], weighted: bool) -> np.ndarray:
    """Mean over samples of sqrt(mean over the grid of w(lat) * error^2), per channel, in float64 numpy;
    w = the area of each row's cell normalized to mean 1: the synthetic grid's rows are cells of 180 / H degrees
    from the north pole to the south pole (centres 87.19 to -87.19 on 32 rows, not 90 to -90)."""
    num_lat = pairs[0][0].shape[-2]
    bounds = np.deg2rad(90.0 - np.arange(num_lat + 1) * 180.0 / num_lat)
    area = np.sin(bounds[:-1]) - np.sin(bounds[1:])
    w = area / area.mean() if weighted else np.ones(num_lat)
    per_sample = [np.sqrt((w[:, None] * (x - y) ** 2).mean(axis=(-2, -1))) for x, y in pairs]
    return np.mean(per_sample, axis=0)


def test_weather_validation_reports_latitude_weighted_rmse(era5_root):
    cfg, _, _ = load_config([f"data.root={era5_root}", "data.limit_nsamples_val=6", "trainer.num_workers=0"])
    task = build_task(cfg)
    loaders = build_loaders(task.train_set, task.val_set, global_batch_size=4, dp_rank=0, dp_size=1, seed=0,
                            start_step=0, num_workers=0, pin_memory=False)
    writer = Recorder()
    metrics = task.evaluate(Persistence(), RelativeL2Loss(), loaders.val, grid=Grid.serial(),
                            autocast=contextlib.nullcontext, writer=writer, step=1)
    pairs = [(x.double().numpy(), y.double().numpy()) for x, y in (task.val_set[i] for i in range(6))]
    want = expected_rmse(pairs, weighted=True)
    got = np.array([metrics[f"val/rmse/{c}"] for c in cfg.data.channels])
    np.testing.assert_allclose(got, want, rtol=1e-5)
    unweighted = expected_rmse(pairs, weighted=False)
    assert np.abs(unweighted / want - 1).max() > 0.01  # the weights matter for these fields
    losses = [RelativeL2Loss()(torch.from_numpy(x)[None], torch.from_numpy(y)[None]).item() for x, y in pairs]
    assert math.isclose(metrics["val/loss"], np.mean(losses), rel_tol=1e-5)
    assert writer.images["val/u10m_pred_vs_target"].shape[0] == 3
    quiet = Recorder()  # trainer.log_images=false (utils/engine/logger.py TensorBoard.draws_images): no figure
    quiet.draws_images = False
    again = task.evaluate(Persistence(), RelativeL2Loss(), loaders.val, grid=Grid.serial(),
                          autocast=contextlib.nullcontext, writer=quiet, step=1)
    assert again == metrics and not quiet.images
