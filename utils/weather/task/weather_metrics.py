"""Validation metrics of the ERA5 workload (the NERSC tutorial's definitions); the training loss is the
ViT's own criterion (networks/vit/model.py RelativeL2Loss)."""

from __future__ import annotations

import torch


def weighted_sq_error(pred: torch.Tensor, target: torch.Tensor, lat_weights: torch.Tensor) -> torch.Tensor:
    """Latitude-weighted mean squared error per sample and channel, (B, C); weights (H, 1) mean 1."""
    return ((pred.float() - target.float()).pow(2) * lat_weights).mean(dim=(-2, -1))


def weighted_rmse_per_sample(pred: torch.Tensor, target: torch.Tensor, lat_weights: torch.Tensor) -> torch.Tensor:
    """Latitude-weighted RMSE per sample and channel, (B, C): what validation sums over its samples."""
    return weighted_sq_error(pred, target, lat_weights).sqrt()


def weighted_rmse(pred: torch.Tensor, target: torch.Tensor, lat_weights: torch.Tensor) -> torch.Tensor:
    """Latitude-weighted RMSE per channel, averaged over the batch: (C,) (the seed's weighted_rmse)."""
    return weighted_rmse_per_sample(pred, target, lat_weights).mean(dim=0)
