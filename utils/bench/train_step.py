"""Benchmark the real train step: `python -m utils.bench model=vit_base precision=bf16 precision.compile=true`.

Builds the trainer with `utils.engine.build.build_trainer`, the setup train.py uses (any layout under torchrun),
feeds random batches of the training shapes (no data files needed), runs `--warmup` steps, times
`--steps` steps (defaults 5 and 20) of Trainer.train_step and prints one markdown table row: samples/s, tokens/s,
TFLOP/s per device, MFU, peak memory, the activation memory this rank keeps for backward (the peak
bytes of the tensors autograd holds during one step, weights excluded: what tp, cp, activation
checkpointing and the pipeline schedule shrink), with device and date; under pipeline parallelism a
second line gives the measured bubble next to the formula. Under torchrun every rank prints its row.

`--seed-dir PATH` (a checkout of NERSC/sc24-dl-tutorial) adds a row for the tutorial's own ViT at the
same shape, precision, compile setting, Adam kernel and batch, timed the same way in its own
interpreter (utils/bench/seed_step.py); its TFLOP/s and MFU use this project's FLOP model of the same shape.
The shape must allow it: a ViT with mlp_ratio 4. Started as one process with `parallel.tp` > 1 (and no
other axis), `--seed-dir` compares instead the tutorial's model-parallel ViT with this project's step with
sequence parallelism on and off, each on tp local ranks, in `--rounds` interleaved rounds (default 3), and
prints both ratios to the seed (utils/bench/versus_seed.py). `--json`: rank 0 prints one JSON line (seconds
per step, peak GiB) instead of the table (what that comparison reads).
"""

from __future__ import annotations

import datetime
import json
import logging
import subprocess
import sys
import tempfile
import time
import weakref
from pathlib import Path

import torch

from distributed.device import synchronize
from utils import require, tool_main
from utils.bench.versus_seed import compare, table
from utils.cli.config import load_config
from utils.comm import Axis, destroy_grid, init_grid
from utils.engine.build import build_trainer
from utils.engine.flops import device_name
from utils.engine.memory import peak_memory_gib
from utils.launch_env import launch_env
from utils.tasks import build_task

HEADER = ("| date | device | model | precision | compile | layout | global batch | samples/s | tokens/s "
          "| TFLOP/s per device | MFU | peak GiB | saved for backward MiB |\n"
          "|---|---|---|---|---|---|---|---|---|---|---|---|---|")


def parse_options(argv: list[str]) -> tuple[dict, list[str]]:
    """({'--warmup': int, '--steps': int, '--rounds': int, '--seed-dir': Path | None, '--json': bool}, the
    config overrides)."""
    options, rest = {"--warmup": 5, "--steps": 20, "--rounds": 3, "--seed-dir": None, "--json": False}, []
    it = iter(argv)
    for arg in it:
        key, _, value = arg.partition("=")
        if key == "--json":
            options[key] = True
            continue
        if key not in options:
            rest.append(arg)
            continue
        value = value or next(it, "")
        if key == "--seed-dir":
            options[key] = Path(value)
            require((Path(value) / "networks" / "vit.py").is_file() and (Path(value) / "utils" / "loss.py").is_file(),
                    f"'{value}' is not a checkout of the NERSC tutorial (no networks/vit.py, utils/loss.py)",
                    key, "git clone https://github.com/NERSC/sc24-dl-tutorial and give its path")
        else:
            require(value.isdigit() and int(value) >= 1, f"bad {key} value '{value}'", key,
                    "give a positive number of steps")
            options[key] = int(value)
    return options, rest


def time_steps(trainer, warmup: int, steps: int) -> tuple[float, list[float]]:
    """Seconds per Trainer.train_step on a random batch of the training shapes, after `warmup` steps, and
    under pipeline parallelism the measured bubble of every timed step."""
    grid = trainer.grid
    x, y = trainer.task.example_batch(trainer.tc.global_batch_size // grid.batch.size, grid.device)
    for _ in range(warmup):
        trainer.train_step(x, y)
    synchronize(grid.device)
    if grid.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(grid.device)
    start, bubbles = time.perf_counter(), []
    for _ in range(steps):
        trainer.train_step(x, y)
        if trainer.pipeline is not None:
            bubbles.append(trainer.pipeline.bubble)
    synchronize(grid.device)
    return (time.perf_counter() - start) / steps, bubbles


class _Saved:
    """A tensor autograd saved, held until autograd drops it (then `weakref.finalize` counts it freed)."""

    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor


def storage_id(t: torch.Tensor) -> int:
    """The identity of a tensor's storage (shared by its views): the address of its StorageImpl, which
    fake tensors (utils/plan/cost_model.py) have too, where a data pointer they have not."""
    return t.untyped_storage()._cdata


def saved_for_backward_bytes(trainer, x: torch.Tensor, y: torch.Tensor, params=None) -> int:
    """Peak bytes of the tensors autograd holds for backward during one Trainer.train_step on (x, y), each
    storage once, parameters excluded. Without pipeline parallelism that is one micro-batch's forward;
    with it, every microbatch the schedule has in flight at once (1F1B: about one per stage, GPipe: all).
    `params`: the tensors standing for the weights (default the model's parameters; the planner passes
    their fake counterparts)."""
    params = {storage_id(p) for p in (trainer.raw_model.parameters() if params is None else params)}
    live: dict[int, list[int]] = {}  # storage -> [bytes, saved references]
    total = peak = 0

    def release(ptr: int) -> None:
        nonlocal total
        live[ptr][1] -= 1
        if live[ptr][1] == 0:
            total -= live.pop(ptr)[0]

    def pack(t: torch.Tensor):
        nonlocal total, peak
        ptr = storage_id(t)
        if ptr in params:
            return t
        if ptr not in live:
            live[ptr] = [t.untyped_storage().nbytes(), 0]
            total += live[ptr][0]
            peak = max(peak, total)
        live[ptr][1] += 1
        held = _Saved(t)
        weakref.finalize(held, release, ptr)
        return held

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda h: h.tensor if isinstance(h, _Saved) else h):
        trainer.train_step(x, y)
    return peak


def seed_spec(cfg, task, device: torch.device, warmup: int, steps: int) -> dict:
    """What utils/bench/seed_step.py needs to time the tutorial's ViT at this run's shape."""
    x, y = task.example_batch(1, torch.device("cpu"))
    m = cfg.model
    return {"img_size": list(x.shape[2:]), "in_channels": x.shape[1], "out_channels": y.shape[1],
            "patch_size": m.patch_size, "embed_dim": m.embed_dim, "depth": m.depth, "num_heads": m.num_heads,
            "batch": cfg.trainer.global_batch_size, "precision": cfg.precision.mode, "compile": cfg.precision.compile,
            "fused": cfg.optim.fused, "device": device.type, "warmup": warmup, "steps": steps}


def seed_row(seed_dir: Path, cfg, trainer, warmup: int, steps: int) -> str:
    """The table row of the tutorial's ViT at this run's shape (utils/bench/seed_step.py, its own interpreter)."""
    script = Path(__file__).with_name("seed_step.py")
    spec = seed_spec(cfg, trainer.task, trainer.device, warmup, steps)
    proc = subprocess.run([sys.executable, str(script), str(seed_dir), json.dumps(spec)], capture_output=True,
                          text=True)
    require(proc.returncode == 0, f"the NERSC tutorial's ViT failed: {proc.stderr.strip().splitlines()[-1:]}",
            "--seed-dir", "check the checkout (python utils/bench/seed_step.py runs it alone)")
    measured = json.loads(proc.stdout.strip().splitlines()[-1])
    commit = subprocess.run(["git", "-C", str(seed_dir), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True)
    name = f"NERSC tutorial ViT{' @' + commit.stdout.strip() if commit.returncode == 0 else ''}"
    perf = trainer.throughput(measured["seconds"])
    return row(cfg, trainer, name, perf, measured["peak_gib"], "n/a")


def row(cfg, trainer, model: str, perf: dict, peak_gib: float, saved: str) -> str:
    utilization = perf.get("perf/mfu")
    return (f"| {datetime.date.today()} | {device_name(trainer.device)} | {model} | {cfg.precision.mode} "
            f"| {cfg.precision.compile} | {trainer.grid.name} | {cfg.trainer.global_batch_size} "
            f"| {perf['perf/samples_per_sec']:.1f} | {perf['perf/tokens_per_sec']:.0f} "
            f"| {perf['perf/tflops_per_sec']:.1f} "
            f"| {'n/a' if utilization is None else f'{100 * utilization:.1f}%'} | {peak_gib:.2f} | {saved} |")


def versus_seed(cfg, seed_dir: Path, argv: list[str], options: dict) -> str:
    """The tp comparison with the tutorial (utils/bench/versus_seed.py), from one process."""
    p = cfg.parallel
    require(p.cp == p.pp == 1 and p.dp in (0, 1), f"the tutorial's model-parallel ViT is compared at tp only, not "
            f"tp={p.tp} cp={p.cp} pp={p.pp} dp={p.dp}", "--seed-dir", "set parallel.tp alone (e.g. parallel=tp2)")
    device = torch.device("cuda" if torch.cuda.device_count() >= p.tp else "cpu")
    spec = seed_spec(cfg, build_task(cfg, load_data=False), device, options["--warmup"], options["--steps"])
    seconds = compare(argv, seed_dir, spec, p.tp, options["--warmup"], options["--steps"], options["--rounds"])
    name = device_name(device) + ("" if device.type == "cuda" else ", gloo")
    return table(seconds, p.tp, name, options["--rounds"], options["--steps"])


def run(argv: list[str]) -> str:
    """What the benchmark prints: the table (or rank 0's JSON line under --json; other ranks print nothing)."""
    options, argv = parse_options(argv)
    warmup, steps, seed_dir = options["--warmup"], options["--steps"], options["--seed-dir"]
    cfg, choices, _ = load_config(argv)
    if seed_dir is not None:
        require(cfg.model.arch == "vit" and cfg.model.mlp_ratio == 4, "the NERSC tutorial has only a ViT with "
                "mlp_ratio 4", "--seed-dir", "benchmark a model=vit_* with model.mlp_ratio=4, or drop --seed-dir")
        if cfg.parallel.tp > 1 and launch_env().source == "single":
            return versus_seed(cfg, seed_dir, argv, options)
    grid = init_grid(cfg.parallel)
    require(seed_dir is None or grid.world_size == 1, f"the tutorial's ViT is timed on one rank, not {grid.world_size}",
            "--seed-dir", "benchmark parallel=single, or start parallel=tpN as one process (no torchrun), "
            "or drop --seed-dir")
    task = build_task(cfg, load_data=False)
    with tempfile.TemporaryDirectory() as tmp:
        trainer = build_trainer(cfg, task, grid, logging.getLogger("dlscale"), Path(tmp))
        seconds, bubbles = time_steps(trainer, warmup, steps)
        if options["--json"]:
            peak = peak_memory_gib(grid.device)
            return json.dumps({"seconds": seconds, "peak_gib": peak}) if grid.global_rank == 0 else ""
        batch = trainer.tc.global_batch_size // trainer.grid.batch.size
        saved = saved_for_backward_bytes(trainer, *trainer.task.example_batch(batch, grid.device))
    peak = peak_memory_gib(grid.device)
    perf = trainer.throughput(seconds)
    pipeline = ""
    if trainer.pipeline is not None:
        plan = trainer.pipeline.plan
        pipeline = (f"\npipeline {plan.schedule}, pp rank {grid.rank(Axis.PP)} (stages "
                    f"{plan.stages_of(grid.rank(Axis.PP))}): p={plan.pp}, {plan.stages_per_rank} stage(s) per rank, "
                    f"m={plan.microbatches}: bubble measured {sum(bubbles) / len(bubbles):.3f} "
                    f"(mean over pp ranks and timed steps); {plan.bubble_text()}")
    ours = row(cfg, trainer, choices["model"], perf, peak, f"{saved / 2**20:.1f}") + pipeline
    rows = ours if seed_dir is None else ours + "\n" + seed_row(seed_dir, cfg, trainer, warmup, steps)
    return HEADER + "\n" + rows


def main(argv: list[str] | None = None) -> int:
    return tool_main(__doc__, argv, lambda args: run(args) or None, destroy_grid)
