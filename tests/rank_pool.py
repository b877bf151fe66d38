"""A pool of rank processes started once per test process and reused, so a multi-rank case costs its own
work, not the start of N interpreters that import torch (about 3 s each on 2 cores, most of a small case).

`RankPool.run(fn, world, *args)` runs `fn(rank, world, *args)` on `world` pooled processes with the
variables torchrun sets (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT on a fresh port), so
`utils.comm.init_grid` and `torch.distributed` find the launch exactly as under torchrun; `fn` returns
a picklable value per rank. `run_entry_ranks(argv, world)` runs the real entry point, `train.main(argv)`,
on every rank, with each rank's stdout and stderr caught (the trainer's log lines, a refusal's one line);
the test process composes the command line once for all of them (Hydra's compose, the same function).

What a case may leave behind is undone before the next: the process group is destroyed and freed, the logging
handlers closed, the stop-signal handlers and the environment restored, torch's default dtype, grad mode
and seeds reset. A case that fails on one rank while the others wait in a collective, that dies or that
runs past its deadline replaces every process of the pool (the others' state is unknown): nothing waits.
"""

from __future__ import annotations

import contextlib
import gc
import io
import logging
import os
import queue
import select
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass

import torch.multiprocessing as mp

PRELOAD = ("train", "utils.engine.build", "utils.engine.trainer", "torch.distributed.pipelining",
           "torch.distributed.fsdp", "torch.distributed.checkpoint", "torch.utils.tensorboard")
LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
CRASH_SIGNALS = (signal.SIGABRT, signal.SIGSEGV, signal.SIGBUS)  # a pooled process killed by the C library
FAILURE_GRACE_S = 10.0  # after one rank fails, how long the others get to fail or finish on their own


class PooledCrash(RuntimeError):
    """A pooled process died of one of CRASH_SIGNALS while it ran a case."""


@dataclass
class RankResult:
    value: object = None  # what fn returned
    error: str | None = None  # the traceback of an exception other than SystemExit
    stdout: str = ""
    stderr: str = ""


def _reset_process_state() -> None:
    """Undo what a case may leave in this process (see the module docstring)."""
    import torch

    from utils.comm import destroy_grid

    for name in ("dlscale", "dlscale.file"):
        logger = logging.getLogger(name)
        for handler in logger.handlers:
            handler.close()
        logger.handlers.clear()
    for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGHUP):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    torch.set_default_dtype(torch.float32)
    torch.set_grad_enabled(True)
    torch.manual_seed(0)
    torch._dynamo.reset()  # compiled graphs of a case hold its modules and groups
    destroy_grid()  # and the groups are freed with their threads, not at some later case's collection


def _die_with(pid: int) -> None:
    """SIGKILL this process as soon as process `pid` ends (a daemon thread waits on its pidfd). A pooled rank's
    parent is the fork server, which lives as long as any process it forked holds its pipe (every one does):
    a parent-death signal would never come. SIGKILL, because a pooled rank records SIGTERM as a stop signal
    while it runs a trainer."""
    try:
        watched = os.pidfd_open(pid)
    except ProcessLookupError:  # gone already
        os.kill(os.getpid(), signal.SIGKILL)

    def wait_then_die() -> None:
        select.select([watched], [], [])
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=wait_then_die, name="die-with-the-test-process", daemon=True).start()


def _worker(index: int, jobs, results, test_process: int) -> None:
    """A pooled rank: import the trainer (done already where this pool started the fork server), then run jobs
    until told to stop (None). It dies with the test process, so a pytest killed mid-run leaves no rank behind."""
    import importlib

    import torch

    _die_with(test_process)
    torch.set_num_threads(1)  # the pool's ranks share the cores; more threads make every collective wait
    for module in PRELOAD:
        importlib.import_module(module)
    gc.freeze()  # collections skip what the imports made, as under train.py (utils/startup.py)
    base_env = dict(os.environ)
    while (job := jobs.get()) is not None:
        job_id, rank, env, fn, args = job
        os.environ.clear()
        os.environ.update(base_env, **env)
        out, err, result = io.StringIO(), io.StringIO(), RankResult()
        try:
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                result.value = fn(rank, int(env.get("WORLD_SIZE", 1)), *args)
        except BaseException:  # noqa: BLE001 - every failure goes to the parent, the worker lives on
            result.error = traceback.format_exc()
        finally:
            with contextlib.suppress(BaseException):
                _reset_process_state()
            os.environ.clear()
            os.environ.update(base_env)
        result.stdout, result.stderr = out.getvalue(), err.getvalue()
        results.put((job_id, rank, result))


class RankPool:
    """`size` pooled rank processes (grown on demand for a larger world)."""

    def __init__(self, size: int = 4):
        # Ranks fork from multiprocessing's fork server, which imports torch and the trainer once: a spawned rank
        # imported them itself, about 4 s of CPU apiece on 2 cores, again for every process of a restarted pool.
        # The server runs no thread but the allocator's (which prepares for fork), so forking it is safe where
        # forking this test process, which runs threads, is not.
        self._ctx = mp.get_context("forkserver")
        self._ctx.set_forkserver_preload([__name__, *PRELOAD])  # no effect if a server runs already
        self._procs: list = []
        self._jobs: list = []
        self._results = self._ctx.Queue()
        self._next_job = 0
        self._grow(size)

    def _grow(self, size: int) -> None:
        while len(self._procs) < size:
            jobs = self._ctx.SimpleQueue()
            proc = self._ctx.Process(target=_worker, args=(len(self._procs), jobs, self._results, os.getpid()),
                                     daemon=True)
            proc.start()
            self._procs.append(proc)
            self._jobs.append(jobs)

    def restart(self) -> None:
        """Replace every process (after a failure that may leave ranks inside a collective)."""
        size = len(self._procs)
        for proc in self._procs:
            proc.kill()
        for proc in self._procs:
            proc.join(timeout=10)
        self._procs, self._jobs = [], []
        self._results = self._ctx.Queue()
        self._grow(size)

    def close(self) -> None:
        for jobs, proc in zip(self._jobs, self._procs):
            if proc.is_alive():
                jobs.put(None)
        for proc in self._procs:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()

    def run(self, fn: Callable, world: int, *args, timeout_s: float = 120.0,
            env: dict[str, str] | None = None) -> list[RankResult]:
        """`fn(rank, world, *args)` on `world` ranks; their results in rank order. Raises TimeoutError when
        a rank is not done within `timeout_s`, RuntimeError when a pooled process died.

        A pooled process killed by the C library (SIGABRT, SIGSEGV, SIGBUS: seen once in CI as glibc's
        "unaligned tcache chunk" at a thread's exit, in a rank that had run dozens of cases) is the pool's
        fault as much as the case's: the case runs once more in fresh processes, and a second such death
        fails it like any other."""
        try:
            return self._run_once(fn, world, *args, timeout_s=timeout_s, env=env)
        except PooledCrash as crash:
            print(f"rank pool: {crash}; the case runs again in fresh processes", file=sys.stderr)
            return self._run_once(fn, world, *args, timeout_s=timeout_s, env=env, retry=False)

    def _run_once(self, fn: Callable, world: int, *args, timeout_s: float, env: dict[str, str] | None,
                  retry: bool = True) -> list[RankResult]:
        from utils.cli.launch import free_port

        self._grow(world)
        self._next_job += 1
        job_id, port = self._next_job, free_port()
        for rank in range(world):
            launch = {} if world == 1 else dict(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                                               LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                                               MASTER_PORT=str(port))
            self._jobs[rank].put((job_id, rank, {**(env or {}), **launch}, fn, args))
        return self._collect(job_id, world, timeout_s, retry)

    def _collect(self, job_id: int, world: int, timeout_s: float, retry: bool) -> list[RankResult]:
        results: dict[int, RankResult] = {}
        deadline = time.monotonic() + timeout_s
        while len(results) < world:
            try:
                got_id, rank, result = self._results.get(timeout=0.2)
            except queue.Empty:
                dead = [i for i in range(world) if not self._procs[i].is_alive()]
                if dead or time.monotonic() > deadline:
                    codes = [self._procs[i].exitcode for i in dead]
                    self.restart()
                    crashed = [code for code in codes if code is not None and -code in CRASH_SIGNALS]
                    if crashed and retry:
                        raise PooledCrash(f"pooled rank {dead[codes.index(crashed[0])]} died of signal "
                                          f"{-crashed[0]}")
                    if any(r.error or _failed(r.value) for r in results.values()):  # the others waited on it
                        return [results.get(r, RankResult(error="stopped: another rank failed first"))
                                for r in range(world)]
                    if dead:
                        raise RuntimeError(f"pooled rank {dead[0]} died (exit code {codes[0]})")
                    raise TimeoutError(f"ranks {sorted(set(range(world)) - set(results))} not done within "
                                       f"{timeout_s:.0f} s") from None
                continue
            if got_id != job_id:
                continue  # a late report of a case abandoned by an earlier restart
            results[rank] = result
            if (result.error or _failed(result.value)) and len(results) < world:
                deadline = min(deadline, time.monotonic() + FAILURE_GRACE_S)
        return [results[r] for r in range(world)]


def _failed(value: object) -> bool:
    return isinstance(value, int) and value != 0


@contextlib.contextmanager
def _composed_as(argv: list[str], composed: bytes | None):
    """Hydra's composition of exactly `argv` answered with `composed` (the pickled DictConfig the test process
    made with the same `compose_config`); any other command line composes as usual."""
    import pickle

    from utils.cli import config

    compose = config.compose_config

    def compose_config(args: list[str]):
        return pickle.loads(composed) if composed is not None and list(args) == argv else compose(args)

    config.compose_config = compose_config
    try:
        yield
    finally:
        config.compose_config = compose


def _entry(rank: int, world: int, argv: list[str], composed: bytes | None = None) -> int:
    """The real entry point on one rank: `train.main(argv)`'s exit status (SystemExit's code included).
    `composed`: the command line's composition, made once by the test process (see `run_entry_ranks`)."""
    import train

    try:
        with _composed_as(list(argv), composed):
            return int(train.main(list(argv)) or 0)
    except SystemExit as exit_:
        return exit_.code if isinstance(exit_.code, int) else 1


_POOL: RankPool | None = None


def pool() -> RankPool:
    """This test process's pool (started on first use, ended at exit)."""
    global _POOL
    if _POOL is None:
        import atexit

        _POOL = RankPool()
        atexit.register(_POOL.close)
    return _POOL


def run_entry_ranks(argv: list[str], world: int | None = None, timeout_s: float = 180.0) -> list[RankResult]:
    """`python train.py argv` as `world` torchrun ranks would run it (default: the ranks its layout needs,
    as train_mp.py starts them), on the pool; each result's value is that rank's exit status.

    The command line is composed here once (`utils.cli.config.compose_config`, Hydra's compose: about 0.1 s
    of CPU) and handed to the ranks, each of which would compose the same: every rank still checks and types
    it (`typed_config`, the config's own checks). A command line Hydra refuses is composed by each rank,
    which refuses it as train.py does."""
    import pickle

    from utils import ConfigError
    from utils.cli.config import compose_config, load_config

    if world is None:
        from utils.cli.launch import ranks_needed

        world = ranks_needed(load_config(list(argv))[0].parallel)
    try:
        composed = pickle.dumps(compose_config(list(argv)))
    except ConfigError:
        composed = None
    return pool().run(_entry, world, list(argv), composed, timeout_s=timeout_s)
