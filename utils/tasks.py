"""Workloads: what differs between the ERA5 ViT and the WikiText LM, behind one small interface.

A task owns its datasets, builds its (serial) model, knows its FLOPs per sample and runs its own
validation metrics. The trainer is the same for every task.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from networks.vit import ViT, ViTConfig
from utils.comm import AxisGroup
from utils.era5 import ERA5Config, ERA5Dataset, latitude_weights
from utils.era5_synthetic import ensure_synthetic
from utils.errors import require
from utils.metrics import weighted_sq_error


def all_reduce_sum(t: torch.Tensor, axis: AxisGroup) -> torch.Tensor:
    if axis.size > 1:
        dist.all_reduce(t, group=axis.group)
    return t


def diverging_image(field: torch.Tensor, vmax: float) -> torch.Tensor:
    """(H, W) -> (3, H, W) in [0, 1]: blue (negative), white (0), red (positive)."""
    v = (field.float() / vmax).clamp(-1, 1)
    pos, neg = v.clamp(min=0), (-v).clamp(min=0)
    return torch.stack([1 - neg, 1 - pos - neg, 1 - pos])


class WeatherTask:
    """ERA5 next-state regression with the ViT."""

    unit = "patches"
    headline_metrics = ("val/loss", "val/rmse/u10m")

    def __init__(self, data: ERA5Config, model_cfg: ViTConfig):
        require(isinstance(model_cfg, ViTConfig), "the ERA5 data needs a ViT model", "model",
                "use model=vit_tiny, vit_base or vit_large with data=era5*")
        p = model_cfg.patch_size
        require(data.img_size[0] % p == 0 and data.img_size[1] % p == 0,
                f"img_size {list(data.img_size)} is not divisible by patch_size {p}", "data.img_size",
                f"choose a crop whose sides are multiples of model.patch_size={p}")
        self.cfg, self.model_cfg = data, model_cfg
        self.train_set = self.val_set = None

    def load_data(self) -> None:
        """Find (or generate) the files and inspect them; every data error is raised here."""
        data = self.cfg
        if data.synthetic:
            root = ensure_synthetic(Path(data.root) if data.root else None)
        else:
            require(bool(data.root), "no data folder given", "data.root", "set data.root=/path/to/era5 (NERSC layout)")
            root = Path(data.root)
            require(root.is_dir(), f"data folder {root} does not exist", "data.root", "point it at the ERA5 folder")
        self.train_set = ERA5Dataset(root, "train", data, data.limit_nsamples)
        self.val_set = ERA5Dataset(root, "valid", data, data.limit_nsamples_val)
        self.lat_weights = latitude_weights(self.train_set.file_shape[0], data.img_size[0])

    def example_batch(self, batch_size: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Random inputs and targets of the training shapes (benchmarks)."""
        shape = (batch_size, len(self.cfg.channels), *self.cfg.img_size)
        return torch.randn(shape, device=device), torch.randn(shape, device=device)

    def build_model(self) -> nn.Module:
        c = len(self.cfg.channels)
        return ViT(self.model_cfg, tuple(self.cfg.img_size), c, c)

    def tokens_per_sample(self) -> int:
        h, w = self.cfg.img_size
        return (h // self.model_cfg.patch_size) * (w // self.model_cfg.patch_size)

    def flops_per_sample(self, matmul_params: int) -> float:
        """Training FLOPs per sample: S*(6*N_mm + 12*L*D*S), S = patches (fwd+bwd, attention included)."""
        s, m = self.tokens_per_sample(), self.model_cfg
        return s * (6 * matmul_params + 12 * m.depth * m.embed_dim * s)

    @torch.no_grad()
    def evaluate(self, model: nn.Module, criterion: nn.Module, loader, *, device, autocast, dp: AxisGroup,
                 writer, step: int) -> dict[str, float]:
        """val/loss and latitude-weighted val/rmse/<channel>, reduced over dp; an image of u10m."""
        weights = self.lat_weights.to(device)
        sums = torch.zeros(2 + len(self.cfg.channels), dtype=torch.float64, device=device)
        first = None
        for x, y in loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with autocast():
                pred = model(x)
            sums[0] += criterion(pred, y).double() * len(x)
            sums[1] += len(x)
            sums[2:] += weighted_sq_error(pred, y, weights).sqrt().sum(dim=0).double()
            if first is None:
                first = (pred[0, 0].float().cpu(), y[0, 0].float().cpu())
        all_reduce_sum(sums, dp)
        count = sums[1].clamp_min(1)
        metrics = {"val/loss": (sums[0] / count).item()}
        metrics.update({f"val/rmse/{c}": (sums[2 + i] / count).item() for i, c in enumerate(self.cfg.channels)})
        if first is not None and dp.rank == 0:
            pred0, tgt0 = first
            vmax = float(tgt0.abs().max().clamp_min(1e-6))
            gap = torch.ones(3, tgt0.shape[0], 2)
            writer.image("val/u10m_pred_vs_target", torch.cat([diverging_image(pred0, vmax), gap,
                                                               diverging_image(tgt0, vmax)], dim=2), step)
        return metrics


def build_task(cfg, load_data: bool = True) -> WeatherTask:
    """The workload of the configured data family, its data inspected (before any distributed work)."""
    kind = getattr(cfg.data, "kind", None)
    if kind == "era5":
        task = WeatherTask(cfg.data, cfg.model)
    else:
        raise AssertionError(f"unhandled data kind {kind}")
    if load_data:
        task.load_data()
    return task
