"""Figures for TensorBoard images, drawn with matplotlib's Agg canvas (no display, no pyplot state)."""

from __future__ import annotations

import numpy as np
import torch

from utils.weather.task.spectra import resolved_top


def field_panels(pred: torch.Tensor, target: torch.Tensor, name: str, step: int, units: str = "normalized units",
                 sample: str = "first validation sample"):
    """Prediction, target and error (prediction - target) of one (H, W) field side by side, titled, on one
    diverging colour scale symmetric about 0 whose range is printed on the shared colour bar: the three
    panels' colours mean the same value. A matplotlib Figure (see `figure_image`)."""
    from matplotlib.figure import Figure

    pred, target = pred.float().cpu(), target.float().cpu()
    panels = (("prediction", pred), ("target", target), ("error (prediction - target)", pred - target))
    vmax = max(float(field.abs().max()) for _, field in panels) or 1e-6
    height, width = target.shape
    panel_w = 4.0
    fig = Figure(figsize=(3 * panel_w, panel_w * height / width + 1.6), dpi=100, layout="constrained")
    axes = fig.subplots(1, 3)
    for ax, (title, field) in zip(axes, panels):
        shown = ax.imshow(field.numpy(), cmap="RdBu_r", vmin=-vmax, vmax=vmax, interpolation="nearest")
        ax.set_title(title)
        ax.set_xticks([])
        ax.set_yticks([])
    fig.suptitle(f"{name}, {sample}, step {step}")
    fig.colorbar(shown, ax=list(axes), orientation="horizontal", shrink=0.5,
                 label=f"{name} ({units}); shared colour range [{-vmax:.3g}, {vmax:.3g}]")
    return fig


def figure_image(fig) -> torch.Tensor:
    """A matplotlib Figure drawn on the Agg canvas: an RGB image (3, H, W) in [0, 1] for TensorBoard."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    rgb = np.asarray(canvas.buffer_rgba())[..., :3]
    return torch.from_numpy(rgb.copy()).permute(2, 0, 1).float() / 255


def skill_panels(leads_h: list[int], curves: dict[str, dict[str, list[float]]], channel: str, step: int):
    """RMSE (physical units) and ACC against lead time for one channel, one line per forecast (the model and
    its baselines; a baseline without a metric, as climatology's ACC, is left out). A matplotlib Figure."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 4), dpi=100, layout="constrained")
    for ax, metric, label in zip(fig.subplots(1, 2), ("rmse", "acc"), ("RMSE", "ACC")):
        for name, values in curves.items():
            if metric in values and not all(np.isnan(values[metric])):
                ax.plot(leads_h, values[metric], marker="o", markersize=3, label=name)
        ax.set_xlabel("lead time (h)")
        ax.set_title(f"{channel} {label}")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(f"rollout skill at step {step} (WeatherBench 2 definitions)")
    return fig


def spectra_panel(curves: dict[float, tuple[torch.Tensor, torch.Tensor, float]], channel: str, step: int):
    """Forecast (solid) and truth (dashed) spectra against zonal wavenumber k >= 1, log-log, one colour per
    lead (its blurring figure in the legend). A matplotlib Figure."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6, 4.5), dpi=100, layout="constrained")
    ax = fig.subplots()
    for n, (lead, (predicted, true, blur)) in enumerate(curves.items()):
        k = np.arange(1, len(true))
        ax.loglog(k, predicted[1:].numpy(), color=f"C{n}", label=f"{lead:g} h forecast (blurring {blur:.3g})")
        ax.loglog(k, true[1:].numpy(), color=f"C{n}", linestyle="--", label=f"{lead:g} h truth")
    high = resolved_top(true).nonzero().flatten().tolist() or [0]
    ax.axvspan(high[0] - 0.5, high[-1] + 0.5, color="0.9", zorder=0, label="blurring wavenumbers")
    ax.set_xlabel("zonal wavenumber")
    ax.set_ylabel("energy (units^2 m), mid-latitude mean")
    ax.set_title(f"{channel} zonal energy spectra, step {step}")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7)
    return fig


def lead_spectra_panel(predicted: torch.Tensor, true: torch.Tensor, blur: torch.Tensor, leads: list[float],
                       channel: int, name: str, step: int):
    """`spectra_panel` of channel index `channel` (named `name`) at the first, the middle and the last lead of
    spectra (K, C, W // 2 + 1) and blurring figures (K, C): what the forecast command and the rollout evaluation
    draw."""
    shown = sorted({0, len(leads) // 2, len(leads) - 1})
    curves = {leads[k]: (predicted[k, channel], true[k, channel], float(blur[k, channel])) for k in shown}
    return spectra_panel(curves, name, step)
