"""The intended layout against the single-device curve for a few steps, and the model's throughput and MFU.

Both runs are the real trainer (utils.engine.build.build_trainer, as train.py and utils.bench build it) taking
`Trainer.train_step`s on the same global batches: random inputs of the training shapes drawn from a fixed seed
per step (no data files), each batch rank given its slice. The layout's losses and gradient norms must follow the
single-device run's within the project's layout contract (tests/test_matrix.py, which compares both): relative 1e-4
in fp32, 8 unit roundoffs of the autocast dtype's mantissa in bf16 (3.1e-2), tf32 and fp16 (3.9e-3). Every rank runs
the single-device curve on its own device at once, after the layout's trainer is freed (Python's garbage collected
and the CUDA allocator's cache emptied, distributed/device.py `free_memory`): no rank waits in a collective while
another computes (an NCCL barrier would give up after parallel.init_timeout_s), and the ranks' verdicts are combined
as every check's are. A model that does not fit one device is reported as such.
Then the layout's trainer is timed as utils.bench times it: samples/s, TFLOP/s per device and MFU
(utils.engine.flops), peak memory.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import tempfile
from pathlib import Path

import torch

from distributed.device import free_memory
from utils.bench.train_step import time_steps
from utils.comm import Grid
from utils.doctor.report import Check
from utils.engine.build import build_trainer
from utils.engine.memory import peak_memory_gib
from utils.schema import ParallelConfig
from utils.tasks import build_task

TOLERANCE = {"fp32": 1e-4, "bf16": 8 * 2.0**-8, "tf32": 8 * 2.0**-11, "fp16": 8 * 2.0**-11}
SEED = 1234  # the batches' seed (step s draws with SEED + s)


def global_batch(task, size: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The step's global batch, the same on every rank and device (drawn on the CPU, global RNG untouched)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED + step)
        return task.example_batch(size, torch.device("cpu"))


def curve(trainer, steps: int) -> dict[str, list[float]]:
    """The global-batch mean loss and the global gradient norm of `steps` train steps on the fixed batches (this
    rank's slice of each). Both are compared: with random targets the loss hardly depends on the model (a
    weather MSE stays near the targets' variance), the gradient norm does."""
    batch, size = trainer.grid.batch, trainer.tc.global_batch_size
    local = size // batch.size
    values = {"loss": [], "grad_norm": []}
    for step in range(steps):
        x, y = (t[batch.rank * local:(batch.rank + 1) * local].to(trainer.grid.device)
                for t in global_batch(trainer.task, size, step))
        loss, grad_norm = trainer.train_step(x, y)
        values["loss"].append(float(loss))
        values["grad_norm"].append(float(grad_norm))
    return values


def build(cfg, grid: Grid, tmp: Path):
    task = build_task(cfg, load_data=False)
    return build_trainer(cfg, task, grid, logging.getLogger("dlscale.doctor"), tmp)


def serial_curve(cfg, device: torch.device, steps: int, tmp: Path) -> dict[str, list[float]] | str:
    """The single-device losses, or why there are none (the model does not fit one device)."""
    single = dataclasses.replace(cfg, parallel=ParallelConfig(),
                                 trainer=dataclasses.replace(cfg.trainer, ckpt_async=False))
    try:
        return curve(build(single, Grid.serial(device), tmp / "single"), steps)
    except torch.OutOfMemoryError:
        return "the model does not fit one device: no single-device curve"


def deviation(layout: dict[str, list[float]], single: dict[str, list[float]]) -> float:
    """The largest relative difference of the two runs' losses and gradient norms (inf when one is not finite)."""
    pairs = [(a, b) for key in layout for a, b in zip(layout[key], single[key], strict=True)]
    if not all(math.isfinite(a) and math.isfinite(b) for a, b in pairs):
        return math.inf
    return max(abs(a - b) / max(abs(b), 1e-12) for a, b in pairs)


def curve_check(cfg, grid: Grid, losses: dict[str, list[float]], steps: int, tmp: Path) -> Check:
    """This rank's single-device curve against the layout's (every rank at once, no collective)."""
    if grid.world_size == 1:
        return Check("layout", "single-device curve", "pass", "the layout is one device: nothing to compare",
                     {"layout": losses})
    single = serial_curve(cfg, grid.device, steps, tmp)
    if isinstance(single, str):
        return Check("layout", f"{grid.name} vs single device, {steps} steps", "warn", single, {"layout": losses})
    worst, tol = deviation(losses, single), TOLERANCE[cfg.precision.mode]
    return Check("layout", f"{grid.name} vs single device, {steps} steps ({cfg.precision.mode})",
                 "pass" if worst <= tol else "fail", f"largest relative difference of the losses and gradient norms "
                 f"{worst:.2g}, tolerance {tol:.2g}", {"layout": losses, "single_device": single, "deviation": worst,
                                                       "tolerance": tol})


def throughput_check(trainer, warmup: int, steps: int) -> Check:
    """samples/s, TFLOP/s per device and MFU of `steps` timed steps (utils.bench's timing)."""
    seconds, _ = time_steps(trainer, warmup, steps)
    perf, peak = trainer.throughput(seconds), peak_memory_gib(trainer.grid.device)
    mfu = perf.get("perf/mfu")
    text = (f"{perf['perf/samples_per_sec']:.3g} samples/s, {perf['perf/tflops_per_sec']:.3g} TFLOP/s per device, "
            f"MFU {'unknown (no peak for this device)' if mfu is None else f'{100 * mfu:.1f}%'}, "
            f"step {1e3 * seconds:.1f} ms, peak {peak:.2f} GiB")
    finite = all(math.isfinite(v) and v > 0 for v in perf.values())
    return Check("layout", f"throughput of {trainer.grid.name} ({steps} timed steps)",
                 "fail" if not finite else "pass" if mfu is not None else "warn", text,
                 {**perf, "step_time_s": seconds, "peak_gib": peak})


def training_checks(cfg, grid: Grid, steps: int, timed_steps: int) -> list[Check]:
    """The layout's curve (then its trainer is freed), the single-device curve, the throughput."""
    with tempfile.TemporaryDirectory() as tmp:
        trainer = build(cfg, grid, Path(tmp) / "layout")
        losses = curve(trainer, steps)
        perf = throughput_check(trainer, 1, timed_steps)
        del trainer
        free_memory(grid.device)  # what the layout's trainer held, before the single-device model is built
        return [curve_check(cfg, grid, losses, steps, Path(tmp)), perf]
