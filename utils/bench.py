"""Benchmark the real train step: `python -m utils.bench model=vit_base precision=bf16 precision.compile=true`.

Builds the trainer with `utils.build.build_trainer`, the setup train.py uses (any layout under torchrun),
feeds random batches of the training shapes (no data files needed), runs `--warmup` steps, times
`--steps` steps of Trainer.train_step and prints one markdown table row: samples/s, tokens/s,
TFLOP/s per device, MFU, peak memory, the activation memory this rank keeps for backward (the bytes
of the tensors autograd saves in one micro-batch's forward, weights excluded: what tp, cp and
activation checkpointing shrink), with device and date. Under torchrun every rank prints its row.
"""

from __future__ import annotations

import datetime
import logging
import sys
import tempfile
import time
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


def time_steps(trainer, warmup: int, steps: int) -> float:
    """Seconds per Trainer.train_step on a random batch of the training shapes, after `warmup` steps."""
    grid = trainer.grid
    x, y = trainer.task.example_batch(trainer.tc.global_batch_size // grid.size(Axis.DP), grid.device)
    for _ in range(warmup):
        trainer.train_step(x, y)
    synchronize(grid.device)
    if grid.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(grid.device)
    start = time.perf_counter()
    for _ in range(steps):
        trainer.train_step(x, y)
    synchronize(grid.device)
    return (time.perf_counter() - start) / steps


def saved_for_backward_bytes(trainer, x: torch.Tensor, y: torch.Tensor) -> int:
    """Bytes of the tensors autograd saves in one forward of the loss of micro-batch (x, y) on this
    rank, each storage once, parameters excluded (the unwrapped model: no data-parallel hooks run)."""
    params = {p.untyped_storage().data_ptr() for p in trainer.raw_model.parameters()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), trainer.autocast():
        trainer.raw_model.criterion(trainer.raw_model(x), y)
    return sum(saved.values())


def run(argv: list[str]) -> str:
    warmup, steps, argv = parse_counts(argv)
    cfg, choices, _ = load_config(argv)
    grid = init_grid(cfg.parallel)
    task = build_task(cfg, load_data=False)
    with tempfile.TemporaryDirectory() as tmp:
        trainer = build_trainer(cfg, task, grid, logging.getLogger("dlscale"), Path(tmp))
        seconds = time_steps(trainer, warmup, steps)
        micro = trainer.tc.global_batch_size // trainer.grid.size(Axis.DP) // trainer.tc.grad_accum_steps
        saved = saved_for_backward_bytes(trainer, *trainer.task.example_batch(micro, grid.device))
    perf = trainer.throughput(seconds)
    utilization = perf.get("perf/mfu")
    return (f"| {datetime.date.today()} | {device_name(grid.device)} | {choices['model']} | {cfg.precision.mode} "
            f"| {cfg.precision.compile} | {grid.name} | {cfg.trainer.global_batch_size} "
            f"| {perf['perf/samples_per_sec']:.1f} | {perf['perf/tokens_per_sec']:.0f} "
            f"| {perf['perf/tflops_per_sec']:.1f} "
            f"| {'n/a' if utilization is None else f'{100 * utilization:.1f}%'} | {peak_memory_gib(grid.device):.2f} "
            f"| {saved / 2**20:.1f} |")


def main(argv: list[str] | None = None) -> int:
    try:
        row = run(sys.argv[1:] if argv is None else list(argv))
    except ConfigError as err:
        exit_bad_input(err)
    finally:
        destroy_grid()
    print(HEADER)
    print(row, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
