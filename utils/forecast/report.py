"""Forecasts of a trained weather model: `python -m utils.forecast CHECKPOINT [--steps 20] [--init 8] --out DIR`.

CHECKPOINT is a step_* folder of any layout (read in one process, as export reads it), or a run directory, its
checkpoints/ or checkpoints/latest: the step folder it names (the newest complete one, utils/checkpoints/
run_dir.py `resolve_step`; the step taken is printed on stderr). The run's config.yaml gives the model and the
data (`data.root=PATH` and other `data.` settings may be given after the options). From the `--init` initial
times (a count, evenly spaced over the validation split, or their indices in the split: `--init 0,12,24`) the
model rolls out `--steps` steps of data.dt (utils/weather/task/forecast.py, WeatherBench 2's definitions), and DIR
receives:

    forecast.h5      `forecast` and `truth` [inits, steps, C, H, W] float32 in physical units, `init` [inits, 2]
                     (file index, time index), attributes `channels`, `lead_hours`, `checkpoint`
    metrics.md/.csv  RMSE, ACC and bias per channel and lead: the model, persistence and climatology (metrics.md
                     with each channel's units, the reader's channel table: utils/weather/data/fields.py `Channel`)
    skill_<channel>.png   RMSE and ACC against lead time (u10m, t2m, z500: those the data has)
    map_<channel>_<lead>h.png   prediction, truth and error of the first initial time at `--map-leads`
    spectra.csv, spectra_<channel>.png   zonal energy spectra of forecast and truth and the blurring figure
                     (utils/weather/task/spectra.py; outputs.py)
    ensemble.md/.csv, rank_histogram.csv   with `--members M`: M rollouts from perturbed initial states
                     (`--perturbation-std`, `--perturbation-length`, `--seed`) scored against the control forecast
                     by CRPS, spread-skill and rank histograms (utils/weather/task/ensemble.py; members.py), with units
    --output PATH    with `--output forecast.zarr` (or .nc; a relative path lies in DIR): the forecast, its truth
                     and the members in WeatherBench 2's layout (dataset.py), for xarray and WB2's evaluation

It prints, for u10m, t2m and z500 (those the data has), the RMSE at the first and last lead in the channel's units
beside persistence's (the initial state held, scored against the same truths), the blurring figure and, with
members, the CRPS and spread-skill ratio; then one line on what good values are.

Bad input (not a complete checkpoint, a run of the language model, a rollout longer than the data): one line,
exit 2.
"""

from __future__ import annotations

import argparse
import csv
import math
import sys
from pathlib import Path

from utils import ConfigError, exit_bad_input, require


def parse_args(argv: list[str] | None):
    parser = argparse.ArgumentParser(prog="python -m utils.forecast", description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", type=Path, help="a run directory (its newest complete step) or a step_* "
                        "folder of its checkpoints/")
    parser.add_argument("--steps", type=int, default=20, help="autoregressive steps of data.dt (default 20)")
    parser.add_argument("--init", "--inits", dest="init", default="8",
                        help="a count of initial times evenly spaced over the validation split (default 8), or their "
                             "indices in the split, comma-separated (e.g. 0,12,24)")
    parser.add_argument("--map-leads", type=int, nargs="*", default=[1, 4], help="steps whose maps are drawn")
    parser.add_argument("--out", type=Path, required=True, help="folder for the files, tables and figures")
    parser.add_argument("--output", type=Path, help="a .zarr or .nc path for the forecast in WeatherBench 2's "
                        "layout (relative: in --out)")
    parser.add_argument("--members", type=int, default=0, help="ensemble members from perturbed initial states "
                        "(0: none, else 2 or more)")
    parser.add_argument("--perturbation-std", type=float, default=0.05,
                        help="std of the initial perturbations in normalised units (default 0.05)")
    parser.add_argument("--perturbation-length", type=float, default=2.0,
                        help="their correlation length, grid points (std of the Gaussian smoothing; default 2)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the perturbations (default 0)")
    parser.add_argument("data", nargs="*", help="data.key=value settings over the run's (e.g. data.root=PATH)")
    return parser.parse_intermixed_args(argv)


def forecast(args) -> dict:
    """Roll the checkpoint's model out and return {skill, forecasts, truths, task, members, spectra}."""
    import contextlib

    from utils.comm import Grid
    from utils.engine.session import open_model
    from utils.weather.task.forecast import Rollouts, rollout_skill
    from utils.weather.task.weather import ForecastEvalConfig, WeatherTaskConfig

    times = None if "," not in args.init and args.init.strip().isdigit() else args.init.split(",")
    require(all(t.strip().isdigit() for t in (times or [args.init])) and args.steps > 0 and (times or int(args.init)),
            f"bad --steps {args.steps} or --init {args.init!r}", "--steps/--init",
            "give a positive step count, and a positive count of initial times or their indices (0,12,24)")
    count = len(times) if times else int(args.init)
    opened = open_model(args.checkpoint, "CHECKPOINT", kind="era5", data=args.data, hf_folders=False)
    if opened.taken is not None:
        print(opened.taken, file=sys.stderr)
    args.checkpoint = opened.folder
    task = opened.task(WeatherTaskConfig(eval=ForecastEvalConfig(every=1, steps=args.steps, inits=count)))
    try:
        task.load_data()  # the rollouts of --steps from --init initial times: task.eval's, named by our options
    except ConfigError as err:
        if err.setting != "task.eval.steps":
            raise
        fix = err.fix.replace("task.eval.steps", "--steps").replace("fewer task.eval.inits", "fewer --init")
        raise ConfigError(err.what, "--steps", fix) from None
    if times:
        task.rollouts = Rollouts.of(task.val_set, args.steps, count, [int(t) for t in times], "--init")
    model = opened.serial("cpu", task)
    kept, spectra = [], {}
    skill = rollout_skill(model, task.rollouts, grid=Grid.serial(), autocast=contextlib.nullcontext,
                          with_baselines=True, keep=kept, spectra=spectra)
    members = ensemble(args, model, task.rollouts)
    return {"skill": skill, "forecasts": kept[0], "truths": kept[1], "task": task, "members": members,
            "spectra": spectra}


def check_ensemble(args) -> None:
    require(args.members == 0 or args.members >= 2, f"--members {args.members}: an ensemble needs 2 members or more "
            "(the fair CRPS)", "--members", "give 0 (no ensemble) or 2 or more")
    require(args.perturbation_std >= 0 and args.perturbation_length >= 0 and args.seed >= 0,
            "negative perturbation std, length or seed", "--perturbation-std/--perturbation-length/--seed",
            "give values >= 0")


def ensemble(args, model, rollouts):
    """The members' forecasts (M, B, K, C, H, W) with --members M, else None."""
    from utils.forecast.members import run_members

    if not args.members:
        return None
    return run_members(model, rollouts, args.members, args.perturbation_std, args.perturbation_length, args.seed)


def write_more(args, result: dict, leads: list[float], drawn: list[str]) -> list[Path]:
    """Spectra, the ensemble's tables and the WeatherBench 2 dataset (outputs.py)."""
    from utils.forecast import outputs

    step = int(args.checkpoint.name.rpartition("_")[2])
    written, result["blurring"] = outputs.write_spectra(args.out, result, leads, step, drawn)
    if result["members"] is not None:
        paths, result["ensemble"] = outputs.write_ensemble(args.out, result, leads)
        written += paths
    if args.output:
        written.append(outputs.write_dataset(args.out / args.output, result, leads, args.checkpoint))
    return written


def write_outputs(args, result: dict) -> list[Path]:
    import h5py
    import numpy as np

    from utils.weather.task.figures import field_panels, skill_panels
    from utils.weather.task.weather import SKILL_CHANNELS

    task, skill, out = result["task"], result["skill"], args.out
    out.mkdir(parents=True, exist_ok=True)
    channels, leads = task.channels, task.lead_hours(args.steps)
    written = [out / "forecast.h5", out / "metrics.md", out / "metrics.csv"]
    with h5py.File(written[0], "w") as f:
        f.create_dataset("forecast", data=result["forecasts"].numpy().astype(np.float32))
        f.create_dataset("truth", data=result["truths"].numpy().astype(np.float32))
        f.create_dataset("init", data=np.array(task.rollouts.starts, dtype=np.int64))
        f.attrs.update(channels=list(channels), lead_hours=leads, checkpoint=str(args.checkpoint))
    rows = [(channel, lead, name, *(float(skill[name][m][k, c]) for m in ("rmse", "acc", "bias")))
            for c, channel in enumerate(channels) for k, lead in enumerate(leads) for name in skill]
    with written[2].open("w", newline="") as f:
        csv.writer(f).writerows([("channel", "lead_h", "forecast", "rmse", "acc", "bias"), *rows])
    cell = lambda v: "" if math.isnan(v) else f"{v:.4g}"  # noqa: E731 - undefined ACC (climatology): empty
    units = dict(zip(channels, channel_units(task), strict=True))
    written[1].write_text("| channel | units | lead (h) | forecast | RMSE | ACC | bias |\n"
                          "|---|---|---:|---|---:|---:|---:|\n" +
                          "".join(f"| {c} | {units[c]} | {lead} | {n} | {cell(r)} | {cell(a)} | {cell(b)} |\n"
                                  for c, lead, n, r, a, b in rows))
    for channel in [c for c in SKILL_CHANNELS if c in channels]:
        c = channels.index(channel)
        curves = {name: {m: v[:, c].tolist() for m, v in values.items()} for name, values in skill.items()}
        path = out / f"skill_{channel}.png"
        skill_panels(leads, curves, channel, step=int(args.checkpoint.name.rpartition("_")[2])).savefig(path)
        written.append(path)
        for lead in [k for k in args.map_leads if 1 <= k <= args.steps]:
            pred, truth = result["forecasts"][0, lead - 1, c], result["truths"][0, lead - 1, c]
            path = out / f"map_{channel}_{leads[lead - 1]}h.png"
            field_panels(pred, truth, f"{channel} at {leads[lead - 1]} h", int(args.checkpoint.name.rpartition("_")[2]),
                         units=units[channel] or "physical units", sample="first initial time").savefig(path)
            written.append(path)
    return written + write_more(args, result, leads, [c for c in SKILL_CHANNELS if c in channels])


def channel_units(task) -> list[str]:
    """The units of each channel the rollouts read (the reader's channel table; "" where the source says none)."""
    return [c.units for c in task.rollouts.reader.channels]


GOOD = ("good: an RMSE below persistence's; blurring (the forecast's small-scale energy over the truth's) near 1, "
        "below 1 smoothed (near 0: the small scales gone), above 1 noisier than the truth")
GOOD_ENSEMBLE = "; spread/skill near 1 well dispersed, below 1 under-dispersive (overconfident)"


def summary(args, result: dict) -> list[str]:
    """The lines the command prints: what was written, then per channel (u10m, t2m, z500: those the data has, else
    the first) with its units the RMSE at the first and last lead beside persistence's (the initial state held,
    scored against the same truths), the blurring at the last lead and, with members, the CRPS and spread-skill
    ratio there; last, what good values are."""
    from utils.weather.task.weather import SKILL_CHANNELS

    task, skill, members = result["task"], result["skill"], result["members"]
    channels, units, leads = task.channels, channel_units(task), task.lead_hours(args.steps)
    lines = [f"wrote {len(result['written'])} files to {args.out}: {len(task.rollouts.starts)} rollouts of "
             f"{args.steps} steps of {leads[0]} h"]
    for channel in [c for c in SKILL_CHANNELS if c in channels] or list(channels[:1]):
        c = channels.index(channel)
        rmse = {(name, k): f"{float(skill[name]['rmse'][k, c]):.4g}" for name in ("model", "persistence")
                for k in (0, -1)}
        line = (f"{channel} ({units[c] or 'units not given'}): RMSE {rmse['model', 0]} at {leads[0]} h (persistence "
                f"{rmse['persistence', 0]}), {rmse['model', -1]} at {leads[-1]} h (persistence "
                f"{rmse['persistence', -1]}); blurring {float(result['blurring'][-1, c]):.3g} at {leads[-1]} h")
        if members is not None:
            scores = result["ensemble"]
            line += (f"; {len(members)} members: CRPS {float(scores['crps'][-1, c]):.4g} (control "
                     f"{float(scores['crps_control'][-1, c]):.4g}), spread/skill "
                     f"{float(scores['spread_skill'][-1, c]):.3g} at {leads[-1]} h")
        lines.append(line)
    return [*lines, GOOD + (GOOD_ENSEMBLE if members is not None else "")]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        check_ensemble(args)
        result = forecast(args)
        result["written"] = write_outputs(args, result)
    except ConfigError as err:
        exit_bad_input(err)
    print("\n".join(summary(args, result)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
