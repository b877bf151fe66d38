"""Collective micro-benchmark: `torchrun --nproc_per_node=2 -m utils.bench.collectives [--shape B,N,D] [--reps R]`.

Times the counted collectives of `distributed/collectives.py` that tensor and sequence parallelism use, on
the tp axis of a tp=world grid, at one activation shape (default 8,128,192: the ViT at embed 192, 64 x 128
pixels, patch 8, batch 8, fp32): the all-reduce of the full tensor (tp without sequence parallelism), the
reduce-scatter along the token dim by each path (`via='reduce_scatter'`: a reduce-scatter; `via='all_reduce'`:
an all-reduce keeping this rank's chunk) and the all-gather of a token shard. The operations are interleaved
(one of each per repetition, ranks aligned by a barrier before each), so drifting machine load hits them alike.
Rank 0 prints a markdown table: bytes this rank sends (as counted), median, lower and upper quartile in ms.
This is what `distributed.collectives.reduce_scatter_via` rests on (docs/measurements.md).
"""

from __future__ import annotations

import datetime
import statistics
import sys
import time

import torch

from distributed.collectives import all_gather, all_reduce, barrier, own_chunk, reduce_scatter, split_sizes
from distributed.device import synchronize
from utils import ConfigError, require, tool_main
from utils.comm import destroy_grid, init_grid
from utils.engine.flops import device_name
from utils.launch_env import launch_env
from utils.schema import ParallelConfig


def parse(argv: list[str]) -> tuple[tuple[int, ...], int]:
    shape, reps, it = (8, 128, 192), 100, iter(argv)
    for arg in it:
        key, _, value = arg.partition("=")
        value = value or next(it, "")
        if key == "--shape":
            parts = value.split(",")
            require(len(parts) == 3 and all(p.isdigit() and int(p) > 0 for p in parts), f"bad --shape '{value}'",
                    "--shape", "give B,N,D (three positive integers)")
            shape = tuple(int(p) for p in parts)
        elif key == "--reps":
            require(value.isdigit() and int(value) > 0, f"bad --reps '{value}'", "--reps", "give a positive number")
            reps = int(value)
        else:
            raise ConfigError(f"unknown option '{arg}'", "argv", "use --shape B,N,D and --reps R")
    return shape, reps


def time_interleaved(ops: dict, reps: int, axis, device: torch.device) -> tuple[dict[str, int], dict[str, list]]:
    """(bytes each op sends, seconds of each of its `reps` calls), the ops interleaved. A call is timed from a
    barrier to the device's end of its work (`synchronize`: on NCCL a collective returns once queued, and
    timing the launch would report microseconds for any size)."""
    sent, times = {}, {name: [] for name in ops}
    for name, op in ops.items():  # warm-up, and the bytes each sends
        axis.bytes_moved = 0
        op()
        sent[name] = axis.bytes_moved
    for _ in range(reps):
        for name, op in ops.items():
            synchronize(device)
            barrier(axis)
            start = time.perf_counter()
            op()
            synchronize(device)
            times[name].append(time.perf_counter() - start)
    return sent, times


def run(argv: list[str]) -> str:
    shape, reps = parse(argv)
    world = launch_env().world_size
    require(world > 1, "the collectives need two or more ranks", "torchrun",
            "torchrun --nproc_per_node=2 -m utils.bench.collectives")
    grid = init_grid(ParallelConfig(tp=world))
    axis = grid.axis("tp")
    full = torch.randn(shape, device=grid.device)
    shard = own_chunk(full, axis, 1).contiguous()
    sizes = split_sizes(shape[1], axis.size)
    ops = {"all-reduce (full tensor)": lambda: all_reduce(full, axis),
           "reduce-scatter, via='reduce_scatter'": lambda: reduce_scatter(full, axis, 1, via="reduce_scatter"),
           "reduce-scatter, via='all_reduce' (gloo default)": lambda: reduce_scatter(full, axis, 1, via="all_reduce"),
           "all-gather (token shard)": lambda: all_gather(shard, axis, 1, sizes)}
    sent, times = time_interleaved(ops, reps, axis, grid.device)
    if grid.global_rank != 0:
        return ""
    backend = torch.distributed.get_backend(axis.group)
    lines = [f"{datetime.date.today()}, {device_name(grid.device)}, {backend}, {world} ranks, "
             f"torch {torch.__version__}, "
             f"shape {tuple(shape)} {full.dtype}, {reps} interleaved repetitions",
             "| collective | bytes sent per rank | median ms | quartiles ms |", "|---|---|---|---|"]
    for name, values in times.items():
        q1, q2, q3 = statistics.quantiles(values, n=4)
        lines.append(f"| {name} | {sent[name]} | {1e3 * q2:.2f} | {1e3 * q1:.2f}-{1e3 * q3:.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    return tool_main(__doc__, argv, lambda args: run(args) or None, destroy_grid)


if __name__ == "__main__":
    sys.exit(main())
