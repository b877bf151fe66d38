"""Benchmark the real train step: `python -m utils.bench model=vit_base precision=bf16 precision.compile=true`.

Builds the model, optimizer and precision setup exactly as train.py does (any layout under torchrun),
feeds random batches of the training shapes (no data files needed), runs `--warmup` steps, times
`--steps` steps of Trainer.train_step and prints one markdown table row: samples/s, tokens/s,
TFLOP/s per device, MFU, peak memory, with device and date.
"""

from __future__ import annotations

import datetime
import logging
import sys
import tempfile
import time
from pathlib import Path

import torch

from utils.errors import ConfigError, exit_bad_input

HEADER = ("| date | device | model | precision | compile | layout | global batch | samples/s | tokens/s "
          "| TFLOP/s per device | MFU | peak GiB |\n|---|---|---|---|---|---|---|---|---|---|---|---|")


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


def run(argv: list[str]) -> str:
    from utils.build import build_model
    from utils.runs import layout_name
    from utils.comm import Axis, init_grid
    from utils.config import load_config
    from utils.flops import device_name, mfu
    from utils.optim import build_optimizer, build_scheduler
    from utils.precision import configure_matmul, grad_scaler
    from utils.tasks import build_task
    from utils.trainer import Trainer, peak_memory_gib

    warmup, steps, argv = parse_counts(argv)
    cfg, choices, _ = load_config(argv)
    grid = init_grid(cfg.parallel)
    task = build_task(cfg, load_data=False)
    configure_matmul(cfg.precision.mode)
    built = build_model(cfg, task, grid)
    optimizer = build_optimizer(cfg.optim, built.raw.parameters(), grid.device)
    scheduler = build_scheduler(cfg.optim, optimizer, warmup + steps)
    with tempfile.TemporaryDirectory() as tmp:
        trainer = Trainer(cfg=cfg, grid=grid, task=task, built=built, optimizer=optimizer,
                          scheduler=scheduler, scaler=grad_scaler(cfg.precision.mode, grid.device), loaders=None,
                          run_dir=Path(tmp), log=logging.getLogger("dlscale"))
        batch = cfg.trainer.global_batch_size
        x, y = task.example_batch(batch // grid.size(Axis.DP), grid.device)
        for _ in range(warmup):
            trainer.train_step(x, y)
        synchronize(grid.device)
        if grid.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(grid.device)
        start = time.perf_counter()
        for _ in range(steps):
            trainer.train_step(x, y)
        synchronize(grid.device)
        seconds = (time.perf_counter() - start) / steps
        trainer.tb.close()
    tflops = trainer.flops_per_sample * batch / seconds / grid.world_size / 1e12
    utilization = mfu(tflops, grid.device, cfg.precision.mode)
    return (f"| {datetime.date.today()} | {device_name(grid.device)} | {choices['model']} | {cfg.precision.mode} "
            f"| {cfg.precision.compile} | {layout_name(grid.sizes, grid.order)} | {batch} | {batch / seconds:.1f} "
            f"| {batch * task.tokens_per_sample() / seconds:.0f} | {tflops:.1f} "
            f"| {'n/a' if utilization is None else f'{100 * utilization:.1f}%'} | {peak_memory_gib(grid.device):.2f} |")


def main(argv: list[str] | None = None) -> int:
    try:
        row = run(sys.argv[1:] if argv is None else list(argv))
    except ConfigError as err:
        exit_bad_input(err)
    print(HEADER)
    print(row, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
