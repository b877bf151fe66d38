"""Losses and validation metrics of the ERA5 workload (the NERSC tutorial's definitions)."""

from __future__ import annotations

import torch
from torch import nn


class RelativeL2Loss(nn.Module):
    """The seed's `l2_loss_opt`: mean over samples of ||pred - target||_2 / ||target||_2, each norm over
    the whole sample (C x H x W)."""

    def forward(self, pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        pred, target = pred.float(), target.float()
        dims = tuple(range(1, pred.dim()))  # reduced in place: no flattening copy of a permuted prediction
        num = (pred - target).pow(2).sum(dim=dims)
        den = target.pow(2).sum(dim=dims).clamp_min(1e-12)
        return (num / den).sqrt().mean()


def weighted_sq_error(pred: torch.Tensor, target: torch.Tensor, lat_weights: torch.Tensor) -> torch.Tensor:
    """Latitude-weighted mean squared error per sample and channel, (B, C); weights (H, 1) mean 1."""
    return ((pred.float() - target.float()).pow(2) * lat_weights).mean(dim=(-2, -1))


def weighted_rmse_per_sample(pred: torch.Tensor, target: torch.Tensor, lat_weights: torch.Tensor) -> torch.Tensor:
    """Latitude-weighted RMSE per sample and channel, (B, C): what validation sums over its samples."""
    return weighted_sq_error(pred, target, lat_weights).sqrt()


def weighted_rmse(pred: torch.Tensor, target: torch.Tensor, lat_weights: torch.Tensor) -> torch.Tensor:
    """Latitude-weighted RMSE per channel, averaged over the batch: (C,) (the seed's weighted_rmse)."""
    return weighted_rmse_per_sample(pred, target, lat_weights).mean(dim=0)
