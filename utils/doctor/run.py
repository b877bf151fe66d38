"""`python -m utils.doctor [options] [overrides]`: the doctor's command line, its ranks and its launcher.

Launched like training: under torchrun or srun every process is one rank; started as one process for a layout
of several ranks it starts them here (one per GPU as new interpreters, or forked CPU ranks on gloo) with the
project's launcher (utils/cli/local_launch.py: the same environment, supervision and stop signals as
`train_mp.py`). Every rank runs every check (`checks_of_rank`); the verdicts are combined over the ranks (a check
fails when it fails on any rank) and rank 0 writes the report and prints it. The exit status is rank 0's:
0, or the sum of the failing classes' bits (utils/doctor/report.py); 2 for bad input, before any work.
"""

from __future__ import annotations

import datetime
import json
import subprocess
import sys
import traceback
from pathlib import Path

import torch

from distributed.collectives import all_reduce, barrier
from utils import ConfigError, exit_bad_input, require, require_torch
from utils.cli import local_launch
from utils.cli.config import load_config
from utils.cli.launch import die_with_parent, free_port, rank_env
from utils.comm import Grid, destroy_grid, init_grid
from utils.doctor.adjoints import adjoint_checks
from utils.doctor.bandwidth import bandwidth_checks, bandwidth_file, measure
from utils.doctor.campaign import campaign_main
from utils.doctor.environment import environment_checks, node_of_every_rank
from utils.doctor.layers import layer_checks
from utils.doctor.report import STATUSES, Check, default_out_dir, exit_status, markdown, write_report
from utils.doctor.training import training_checks
from utils.engine.preemption import take_early_stop

ROOT = Path(__file__).resolve().parents[2]
# option -> (default on a GPU, default on the CPU): what a few minutes buy on each
OPTIONS = {"--out": (None, None), "--steps": (5, 3), "--timed-steps": (20, 3), "--iters": (20, 3),
           "--sizes-mib": ("1,32,256", "0.0625,1"), "--min-bandwidth-fraction": (0.25, 0.0), "--skip": ("", "")}
SKIPPABLE = ("bandwidth", "mappings", "layers", "layout")
USAGE = """usage: python -m utils.doctor [options] [overrides]   (docs/doctor.md)
  overrides as train.py takes them (model=vit_base parallel=tp2 precision=bf16 ...); launched like training
  --out DIR                   report folder (default outputs/doctor/<layout>-<UTC time>)
  --steps N                   steps of the layout against the single-device curve (GPU 5, CPU 3)
  --timed-steps N             timed steps for samples/s, TFLOP/s and MFU (GPU 20, CPU 3)
  --iters N                   timed calls per collective and size (GPU 20, CPU 3)
  --sizes-mib A,B,...         message sizes in MiB (GPU 1,32,256; CPU 0.0625,1)
  --min-bandwidth-fraction X  fail an axis below X times the planner's assumed link (GPU 0.25, CPU 0)
  --skip A,B                  leave out these classes of checks: bandwidth, mappings, layers, layout
       python -m utils.doctor --campaign [--dry-run] [--out DIR] [--seed-dir PATH] [--budget-s S]
  the GPU campaign (docs/gpu_campaign.md): environment, pytest -m gpu, the doctor, utils.bench; a report"""


def parse_options(argv: list[str]) -> tuple[dict, list[str]]:
    """({option: value or None (the device's default)}, the config overrides)."""
    options, rest, it = dict.fromkeys(OPTIONS), [], iter(argv)
    for arg in it:
        key, eq, value = arg.partition("=")
        if key not in OPTIONS:
            require(not arg.startswith("--"), f"unknown option '{arg}'", arg, "see python -m utils.doctor --help")
            rest.append(arg)
            continue
        value = value if eq else next(it, "")
        if key == "--skip":
            bad = [k for k in value.split(",") if k not in SKIPPABLE]
            require(not bad, f"cannot skip '{','.join(bad)}'", key, "name classes among " + ", ".join(SKIPPABLE))
            options[key] = value
            continue
        try:
            parsed = value if key == "--out" else [float(v) for v in value.split(",")] if key == "--sizes-mib" \
                else float(value)
        except ValueError:
            parsed = None
        numbers = [] if key == "--out" else parsed if isinstance(parsed, list) else [parsed]
        require(parsed not in (None, "") and all(n is not None and n >= 0 for n in numbers)
                and (key == "--min-bandwidth-fraction" or all(n and n > 0 for n in numbers)),
                f"bad {key} value '{value}'", key, "give " + ("a folder" if key == "--out" else "positive numbers"))
        options[key] = parsed
    return options, rest


def resolved(options: dict, device: torch.device) -> dict:
    """The options with each unset one at its default for this device type."""
    column = 0 if device.type == "cuda" else 1
    out = {key: OPTIONS[key][column] if value is None else value for key, value in options.items()}
    if isinstance(out["--sizes-mib"], str):
        out["--sizes-mib"] = [float(v) for v in out["--sizes-mib"].split(",")]
    for key in ("--steps", "--timed-steps", "--iters"):
        out[key] = int(out[key])
    return out


def guarded(kind: str, fn, *args) -> list[Check]:
    """The checks `fn` makes, or one failed check with the exception that stopped it."""
    try:
        return fn(*args)
    except Exception as err:  # noqa: BLE001 - a doctor reports what broke instead of dying
        traceback.print_exc()
        return [Check(kind, "ran to the end", "fail", f"{type(err).__name__}: {str(err).splitlines()[0][:300]}")]


def checks_of_rank(cfg, grid: Grid, opts: dict) -> tuple[list[Check], dict, dict | None]:
    """Every check on this rank, the environment's facts and the bandwidth file's contents (None: skipped)."""
    skip = opts["--skip"].split(",")
    checks, facts = environment_checks(grid, cfg.precision.mode)
    node_of = [node for node, _ in node_of_every_rank(grid)]
    groups: dict = {}

    def bandwidth() -> list[Check]:
        groups.update(measure(grid, opts["--sizes-mib"], 2, opts["--iters"], node_of))
        return bandwidth_checks(groups, grid.device, opts["--min-bandwidth-fraction"])

    checks += [] if "bandwidth" in skip else guarded("bandwidth", bandwidth)
    axes = [grid.axis(a) for a in grid.order if grid.size(a) > 1]
    for kind, fn in (("mappings", adjoint_checks), ("layers", layer_checks)):
        if kind not in skip and not axes:
            checks.append(Check(kind, "one rank", "pass", "no axis above one rank: nothing parallel to check"))
        for axis in axes if kind not in skip else []:
            checks += guarded(kind, fn, axis, grid.device)
    grid.reset_comm_bytes()
    if "layout" not in skip:
        checks += guarded("layout", training_checks, cfg, grid, opts["--steps"], opts["--timed-steps"])
    measured = "bandwidth" not in skip and (groups or grid.world_size == 1)  # no file of figures not measured
    return checks, facts, bandwidth_file(groups, grid) if measured else None


def combine(checks: list[Check], grid: Grid) -> list[Check]:
    """Rank 0's checks, each with the worst status any rank gave it (a class stopped by an error on some ranks
    only leaves the ranks with different lists: then rank 0's, and one failure that says so)."""
    counts = all_reduce(torch.tensor([len(checks), -len(checks)], device=grid.device), grid.world, "max").tolist()
    if counts[0] != -counts[1]:
        return checks + [Check("environment", "the ranks agree", "fail", f"the ranks made {-counts[1]} to {counts[0]} "
                               "checks: a class stopped with an error on some ranks only (see every rank's output)")]
    local = torch.tensor([STATUSES.index(c.status) for c in checks], device=grid.device)
    worst = all_reduce(local, grid.world, "max").tolist()
    for check, status in zip(checks, worst, strict=True):
        if STATUSES[status] != check.status:
            check.status, check.detail = STATUSES[status], f"{STATUSES[status]} on another rank; rank 0: {check.detail}"
    return checks


def rank_main(cfg, model: str, options: dict) -> int:
    """One rank of the doctor: its checks, the combined verdict; rank 0 writes the report."""
    grid = init_grid(cfg.parallel)
    opts = resolved(options, grid.device)
    checks, facts, bandwidths = checks_of_rank(cfg, grid, opts)
    checks = combine(checks, grid) if grid.world_size > 1 else checks
    code = exit_status(checks)
    if grid.is_main:
        out = Path(opts["--out"]) if opts["--out"] else default_out_dir(cfg.run.root, grid.name)
        header = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                  "layout": grid.signature, "model": model, "precision": cfg.precision.mode, **facts}
        header.pop("links")
        path = write_report(out, checks, header)
        (out / "links.txt").write_text(facts["links"] + "\n")
        print(markdown(checks, header), flush=True)
        print(f"doctor: report {path}", flush=True)
        if bandwidths is not None:
            (out / "bandwidths.json").write_text(json.dumps(bandwidths, indent=1) + "\n")
            print(f"doctor: measured bandwidths {out / 'bandwidths.json'} (python -m utils.plan --bandwidths FILE)",
                  flush=True)
    if grid.world_size > 1:
        barrier(grid.world)
    return code if grid.is_main else 0


def rank_command(argv: list[str]) -> int:
    """This process is one rank (torchrun, srun, a launched local rank or a one-rank layout)."""
    try:
        options, rest = parse_options(argv)
        cfg, choices, _ = load_config(rest)
        return rank_main(cfg, choices.get("model", cfg.model.arch), options)
    except ConfigError as err:
        exit_bad_input(err)
    finally:
        destroy_grid()


class DoctorRank(local_launch.ForkedRank):
    """A CPU rank forked from the launcher (see ForkedRank) that runs the doctor instead of train.py."""

    @staticmethod
    def _run_rank(env: dict[str, str], argv: list[str]) -> int:
        local_launch.run_command = rank_command  # in this forked child only: ForkedRank's command is the doctor's
        return local_launch.ForkedRank._run_rank(env, argv)


def launch(argv: list[str], world: int, use_gpus: bool) -> int:
    """Start `world` local ranks of the doctor (local_launch.launch's way, with the doctor's command)."""
    port = free_port()
    print(f"doctor: launching {world} ranks on {'GPUs' if use_gpus else 'CPU (gloo)'}", flush=True)
    early = take_early_stop()  # before forking (local_launch.launch's reason)
    if torch.cuda.is_available():
        procs = [subprocess.Popen([sys.executable, "-m", "utils.doctor", *argv], cwd=ROOT, preexec_fn=die_with_parent,
                                  env=rank_env(r, world, port, use_gpus)) for r in range(world)]
    else:
        procs = [DoctorRank(rank_env(r, world, port, False), argv) for r in range(world)]
    local_launch.forward_stop_signals(procs, early)
    return local_launch.supervise(procs)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if any(a in ("-h", "--help") for a in argv):
        print(USAGE)
        return 0
    if "--campaign" in argv:  # the GPU campaign (utils/doctor/campaign.py)
        try:
            require_torch()
            return campaign_main([a for a in argv if a != "--campaign"])
        except ConfigError as err:
            exit_bad_input(err)
    try:
        options, rest = parse_options(argv)
        cfg, _, _ = load_config(rest)
        if local_launch.starts_local_ranks(cfg):
            return launch(argv, *local_launch.launch_plan(rest, None))
    except ConfigError as err:
        exit_bad_input(err)
    return rank_command(argv)
