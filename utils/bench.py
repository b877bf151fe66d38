"""Benchmark the real train step: `python -m utils.bench model=vit_base precision=bf16 precision.compile=true`.

Builds the trainer with `utils.build.build_trainer`, the setup train.py uses (any layout under torchrun),
feeds random batches of the training shapes (no data files needed), runs `--warmup` steps, times
`--steps` steps (defaults 5 and 20) of Trainer.train_step and prints one markdown table row: samples/s, tokens/s,
TFLOP/s per device, MFU, peak memory, the activation memory this rank keeps for backward (the peak
bytes of the tensors autograd holds during one step, weights excluded: what tp, cp, activation
checkpointing and the pipeline schedule shrink), with device and date; under pipeline parallelism a
second line gives the measured bubble next to the formula. Under torchrun every rank prints its row.
"""

from __future__ import annotations

import datetime
import logging
import sys
import tempfile
import time
import weakref
from pathlib import Path

import torch

from utils.build import build_trainer
from utils.comm import Axis, destroy_grid, init_grid
from utils.config import load_config
from utils.errors import ConfigError, exit_bad_input
from utils.flops import device_name
from utils.tasks import build_task
from utils.trainer import peak_memory_gib

HEADER = ("| date | device | model | precision | compile | layout | global batch | samples/s | tokens/s "
          "| TFLOP/s per device | MFU | peak GiB | saved for backward MiB |\n"
          "|---|---|---|---|---|---|---|---|---|---|---|---|---|")


def parse_counts(argv: list[str]) -> tuple[int, int, list[str]]:
    counts, rest = {"--warmup": 5, "--steps": 20}, []
    it = iter(argv)
    for arg in it:
        key, _, value = arg.partition("=")
        if key in counts:
            value = value or next(it, "")
            if not value.isdigit() or int(value) < 1:
                raise ConfigError(f"bad {key} value '{value}'", key, "give a positive number of steps")
            counts[key] = int(value)
        else:
            rest.append(arg)
    return counts["--warmup"], counts["--steps"], rest


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_steps(trainer, warmup: int, steps: int) -> tuple[float, list[float]]:
    """Seconds per Trainer.train_step on a random batch of the training shapes, after `warmup` steps, and
    under pipeline parallelism the measured bubble of every timed step."""
    grid = trainer.grid
    x, y = trainer.task.example_batch(trainer.tc.global_batch_size // grid.size(Axis.DP), grid.device)
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
    fake tensors (utils/plan.py) have too, where a data pointer they have not."""
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


def run(argv: list[str]) -> str:
    warmup, steps, argv = parse_counts(argv)
    cfg, choices, _ = load_config(argv)
    grid = init_grid(cfg.parallel)
    task = build_task(cfg, load_data=False)
    with tempfile.TemporaryDirectory() as tmp:
        trainer = build_trainer(cfg, task, grid, logging.getLogger("dlscale"), Path(tmp))
        seconds, bubbles = time_steps(trainer, warmup, steps)
        batch = trainer.tc.global_batch_size // trainer.grid.size(Axis.DP)
        saved = saved_for_backward_bytes(trainer, *trainer.task.example_batch(batch, grid.device))
    perf = trainer.throughput(seconds)
    pipeline = ""
    if trainer.pipeline is not None:
        plan = trainer.pipeline.plan
        pipeline = (f"\npipeline {plan.schedule}, pp rank {grid.rank(Axis.PP)} (stages "
                    f"{plan.stages_of(grid.rank(Axis.PP))}): p={plan.pp}, {plan.stages_per_rank} stage(s) per rank, "
                    f"m={plan.microbatches}: bubble measured {sum(bubbles) / len(bubbles):.3f} "
                    f"(mean over pp ranks and timed steps); {plan.bubble_text()}")
    utilization = perf.get("perf/mfu")
    return (f"| {datetime.date.today()} | {device_name(grid.device)} | {choices['model']} | {cfg.precision.mode} "
            f"| {cfg.precision.compile} | {grid.name} | {cfg.trainer.global_batch_size} "
            f"| {perf['perf/samples_per_sec']:.1f} | {perf['perf/tokens_per_sec']:.0f} "
            f"| {perf['perf/tflops_per_sec']:.1f} "
            f"| {'n/a' if utilization is None else f'{100 * utilization:.1f}%'} | {peak_memory_gib(grid.device):.2f} "
            f"| {saved / 2**20:.1f} |" + pipeline)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__.strip())
        return 0
    try:
        row = run(argv)
    except ConfigError as err:
        exit_bad_input(err)
    finally:
        destroy_grid()
    print(HEADER)
    print(row, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
