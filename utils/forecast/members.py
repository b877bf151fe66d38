"""The forecast command's ensemble (`--members M`): M rollouts from perturbed initial states, scored against the
deterministic (control) forecast with WeatherBench 2's probabilistic scores (utils/weather/task/ensemble.py).

Each member is the same rollout as the control (utils/weather/task/forecast.py `rollout_skill`), its initial states read
through `PerturbedRollouts`. Files written beside metrics.csv:

    ensemble.md/.csv        per channel and lead: CRPS of the ensemble and of the control (a one-member CRPS is
                            its mean absolute error), RMSE of the ensemble mean and of the control, spread
                            (sqrt of the mean unbiased variance) and the spread-skill ratio
    rank_histogram.csv      per channel and lead: the weighted fraction of the truth's rank among the members
"""

from __future__ import annotations

import csv
import math
from pathlib import Path

import torch

from utils.weather.task.ensemble import crps, perturbed, rank_histogram, spread_skill, spread_skill_sums

COLUMNS = ("crps", "crps_control", "rmse_mean", "rmse_control", "spread", "spread_skill")


class PerturbedRollouts:
    """A rollouts object (utils/weather/task/forecast.py `Rollouts`) whose initial states carry member `member`'s
    perturbation; everything else is the wrapped object's."""

    def __init__(self, rollouts, member: int, std: float, length: float, seed: int):
        self.rollouts, self.member, self.std, self.length, self.seed = rollouts, member, std, length, seed

    def __getattr__(self, name: str):
        return getattr(self.rollouts, name)

    def read(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, truths = self.rollouts.read(index)
        return perturbed(x, self.member, self.rollouts.starts[index], self.std, self.length, self.seed), truths


def run_members(model, rollouts, num_members: int, std: float, length: float, seed: int) -> torch.Tensor:
    """Forecasts of the members, (M, B, K, C, H, W) float32 in physical units (B initial times, K leads)."""
    import contextlib

    from utils.comm import Grid
    from utils.weather.task.forecast import rollout_skill

    members = []
    for member in range(num_members):
        kept: list = []
        rollout_skill(model, PerturbedRollouts(rollouts, member, std, length, seed), grid=Grid.serial(),
                      autocast=contextlib.nullcontext, with_baselines=False, keep=kept)
        members.append(kept[0])
    return torch.stack(members)


def ensemble_scores(members: torch.Tensor, control: torch.Tensor, truths: torch.Tensor,
                    weights: torch.Tensor) -> dict[str, torch.Tensor]:
    """COLUMNS -> (K, C) and 'rank_histogram' -> (K, C, M + 1), from members (M, B, K, C, H, W), the control and
    the truths (B, K, C, H, W); each lead scored apart (memory: one lead of the members at a time)."""
    num_members, count, steps = members.shape[:3]
    rows = []
    for lead in range(steps):
        x, f, y = members[:, :, lead], control[:, lead].double(), truths[:, lead].double()
        sums = spread_skill_sums(x, y, weights).sum(dim=1)  # (2, C)
        both = spread_skill(sums, count, num_members)
        rows.append({"crps": crps(x, y, weights).mean(dim=0),
                     "crps_control": ((f - y).abs() * weights).mean(dim=(-2, -1)).mean(dim=0),
                     "rmse_mean": both["skill"],
                     "rmse_control": ((f - y) ** 2 * weights).mean(dim=(-2, -1)).mean(dim=0).sqrt(),
                     "spread": both["spread"], "spread_skill": both["ratio"],
                     "rank_histogram": rank_histogram(x, y, weights).mean(dim=0)})
    return {name: torch.stack([row[name] for row in rows]) for name in rows[0]}


def write_tables(out: Path, scores: dict[str, torch.Tensor], channels: list[str], leads: list[float],
                 units: list[str] | None = None) -> list[Path]:
    """ensemble.md (with each channel's `units`: those of CRPS, RMSE and spread), ensemble.csv and
    rank_histogram.csv in `out`."""
    units = dict(zip(channels, units or [""] * len(channels), strict=True))
    rows = [(channel, lead, *(float(scores[name][k, c]) for name in COLUMNS))
            for c, channel in enumerate(channels) for k, lead in enumerate(leads)]
    paths = [out / "ensemble.md", out / "ensemble.csv", out / "rank_histogram.csv"]
    with paths[1].open("w", newline="") as f:
        csv.writer(f).writerows([("channel", "lead_h", *COLUMNS), *rows])
    cell = lambda v: "" if math.isnan(v) else f"{v:.4g}"  # noqa: E731 - a table cell
    paths[0].write_text("| channel | units | lead (h) | CRPS | CRPS control | RMSE ens. mean | RMSE control | spread | "
                        "spread/skill |\n|---|---|---:|---:|---:|---:|---:|---:|---:|\n" +
                        "".join(f"| {c} | {units[c]} | {lead} | " + " | ".join(cell(v) for v in values) + " |\n"
                                for c, lead, *values in rows))
    hist = scores["rank_histogram"]
    with paths[2].open("w", newline="") as f:
        csv.writer(f).writerows([("channel", "lead_h", "rank", "fraction"),
                                 *((channel, lead, b, float(hist[k, c, b])) for c, channel in enumerate(channels)
                                   for k, lead in enumerate(leads) for b in range(hist.shape[-1]))])
    return paths
