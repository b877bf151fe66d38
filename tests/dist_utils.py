"""Run a function on N gloo ranks, for multi-rank tests on CPU.

`run_ranks(fn, world_size, tmp_path, *args)` runs `fn(rank, world_size, *args)` on `world_size` ranks of
the test process's pool (tests/rank_pool.py: processes started once and reused, with RANK/WORLD_SIZE/
LOCAL_RANK set as torchrun would, so `utils.comm.init_grid` finds the launch), after initializing
torch.distributed (gloo) in each. Any exception in any rank is re-raised in the parent with the rank's
traceback; a run that fails on one rank or exceeds `timeout_s` replaces the pool's processes instead of
hanging. `fresh=True` spawns new processes instead (the original path, kept for tests that must own
their processes). `fn` must be a module-level (picklable) function.
"""

from __future__ import annotations

import datetime
import os
import queue
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

DEFAULT_TIMEOUT_S = 60.0


def _worker(rank: int, world_size: int, init_file: str, timeout_s: float, results, fn: Callable, args: tuple):
    """Body of one spawned rank: init gloo, run `fn`, report ('ok' | traceback) to the parent."""
    try:
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
        torch.set_num_threads(1)  # ranks share a few cores; oversubscription makes tests crawl
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=timeout_s))
        fn(rank, world_size, *args)
        dist.barrier()
        results.put((rank, None))
    except BaseException:  # noqa: BLE001 - every failure, assertion or not, goes to the parent
        results.put((rank, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _pooled(rank: int, world_size: int, init_file: str, timeout_s: float, fn: Callable, args: tuple) -> None:
    """One pooled rank of `run_ranks`: the process group, `fn`, a closing barrier."""
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout_s))
    fn(rank, world_size, *args)
    dist.barrier()


def run_ranks(fn: Callable, world_size: int, tmp_path: Path | str, *args, timeout_s: float = DEFAULT_TIMEOUT_S,
              fresh: bool = False) -> None:
    """Run `fn(rank, world_size, *args)` on `world_size` gloo ranks; raise if any rank fails."""
    init_file = Path(tmp_path) / f"dist_init_{time.monotonic_ns()}"
    if not fresh:
        from tests.rank_pool import pool

        results = pool().run(_pooled, world_size, str(init_file), timeout_s, fn, args, timeout_s=timeout_s + 30)
        failed = [(r, res.error) for r, res in enumerate(results) if res.error is not None]
        failed.sort(key=lambda f: f[1].startswith("stopped:"))  # the rank that failed first, not those it stopped
        if failed:
            raise RuntimeError(f"rank {failed[0][0]} failed:\n{failed[0][1]}")
        return
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, world_size, str(init_file), timeout_s, results, fn, args),
                         daemon=True) for r in range(world_size)]
    for p in procs:
        p.start()
    try:
        _collect(procs, results, timeout_s)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(timeout=5)
        results.close()
        results.join_thread()


def _collect(procs: list, results, timeout_s: float) -> None:
    """Wait for every rank's report; raise on the first failure, a silent death or the deadline."""
    deadline = time.monotonic() + timeout_s
    pending = set(range(len(procs)))
    while pending:
        try:
            rank, error = results.get(timeout=0.2)
        except queue.Empty:
            dead = [r for r in pending if not procs[r].is_alive() and procs[r].exitcode not in (None, 0)]
            if dead:
                raise RuntimeError(f"rank {dead[0]} died with exit code {procs[dead[0]].exitcode}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"ranks {sorted(pending)} did not finish within {timeout_s:.0f} s")
            continue
        if error is not None:
            raise RuntimeError(f"rank {rank} failed:\n{error}")
        pending.discard(rank)
