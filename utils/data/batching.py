"""Layout-invariant batching: every dp rank reads its slice of the same global batch.

The global batch at step s is a fixed function of (seed, s): epoch e = s // steps_per_epoch is a
permutation of the training set drawn from seed + e, and step s takes the next `global_batch_size`
indices of it. A dp rank takes its contiguous 1/dp of them. So the samples a step sees do not depend
on dp, tp, cp, pp or order, and a resumed run continues from its step with no saved loader state.

The ranks of one tp x cp group train on the same samples: only the group's first rank reads them (its
loader and workers exist, the others' do not) and `SharedBatches` broadcasts each batch over the group,
so the file system sees one read per group, not t x c.

Worker processes end with their rank, however it ends: `Loaders.close` (every exit path of
`Trainer.fit`) stops them, and each worker watches its rank's pid (`start_worker`), since a worker
that ignores the stop signals and whose parent is the forkserver outlives a rank killed by SIGKILL.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.forkserver
import multiprocessing.resource_tracker
import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial

import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from distributed.collectives import broadcast_, broadcast_object, nbytes
from utils import require
from utils.comm import AxisGroup
from utils.signals import ignore_stop_signals, stop_signals_blocked


def _forget_parent_forkserver() -> None:
    """In a child made by os.fork (the local launcher's ranks, forked from a sweep's process that already ran a
    point): the parent's forkserver is no child of this process, so `ensure_running` would fail waiting for it
    (ChildProcessError: No child processes). Forget it, and close this copy of its liveness pipe (the parent's
    server then still ends with the parent); this process starts its own server when it needs one."""
    server = multiprocessing.forkserver._forkserver
    server._lock = threading.Lock()  # a lock another thread held at the fork stays held in the child
    if getattr(server, "_forkserver_pid", None) is None:
        return
    if server._forkserver_alive_fd is not None:
        try:
            os.close(server._forkserver_alive_fd)
        except OSError:
            pass
    server._forkserver_pid = server._forkserver_address = server._forkserver_alive_fd = None
    server._inherited_fds = None


os.register_at_fork(after_in_child=_forget_parent_forkserver)


class GlobalBatchSampler(Sampler[list[int]]):
    """Index lists of this dp rank's part of each global batch, from `start_step` on, without end."""

    def __init__(self, num_samples: int, global_batch_size: int, dp_rank: int, dp_size: int, seed: int,
                 start_step: int = 0, shuffle: bool = True):
        assert global_batch_size % dp_size == 0 and 0 <= dp_rank < dp_size
        self.num_samples, self.global_batch_size = num_samples, global_batch_size
        self.local = global_batch_size // dp_size
        self.dp_rank, self.seed, self.start_step, self.shuffle = dp_rank, seed, start_step, shuffle
        self.steps_per_epoch = num_samples // global_batch_size
        assert self.steps_per_epoch >= 1

    def epoch_order(self, epoch: int) -> torch.Tensor:
        if not self.shuffle:
            return torch.arange(self.num_samples)
        g = torch.Generator().manual_seed(self.seed * 100_003 + epoch)
        return torch.randperm(self.num_samples, generator=g)

    def __iter__(self) -> Iterator[list[int]]:
        step = self.start_step
        while True:
            epoch, index = divmod(step, self.steps_per_epoch)
            order = self.epoch_order(epoch)
            for i in range(index, self.steps_per_epoch):
                batch = order[i * self.global_batch_size:(i + 1) * self.global_batch_size]
                yield batch[self.dp_rank * self.local:(self.dp_rank + 1) * self.local].tolist()
            step = (epoch + 1) * self.steps_per_epoch


def contiguous_part(n: int, rank: int, size: int) -> range:
    """Contiguous, nearly equal part `rank` of range(n) (validation sets split over dp)."""
    return range(n * rank // size, n * (rank + 1) // size)


@dataclass
class Loaders:
    train: DataLoader | None  # None on the ranks that receive their training batches (SharedBatches)
    val: DataLoader | EvenBatches

    def close(self) -> None:
        """End the worker processes of both loaders now (a later `iter` starts new ones). Persistent workers
        otherwise live until their iterator is garbage-collected, and one still referenced when the
        interpreter exits (by a traceback, a caller) leaves multiprocessing's exit handler joining workers
        that ignore its SIGTERM: the process never exits."""
        for loader in (self.train, self.val.loader if isinstance(self.val, EvenBatches) else self.val):
            if loader is not None:
                stop_workers(loader)


def stop_workers(loader: DataLoader) -> None:
    """Shut down the workers of `loader`'s persistent iterator, killing those that do not leave in time."""
    iterator, loader._iterator = loader._iterator, None  # torch keeps the persistent iterator there
    workers = getattr(iterator, "_workers", [])  # a multi-process iterator's worker processes
    if hasattr(iterator, "_shutdown_workers"):
        iterator._shutdown_workers()  # the end-of-work message, then a join with a timeout
    for worker in workers:
        if worker.is_alive():  # still there: its terminate() is a SIGTERM, which workers ignore
            worker.kill()
            worker.join(timeout=5)


def process_start_time(pid: int) -> int | None:
    """When process `pid` started (clock ticks since boot), or None if it is gone or a zombie (Linux
    /proc; elsewhere 0 while the pid exists)."""
    try:
        fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()  # the name may hold spaces
    except FileNotFoundError:
        return None
    except OSError:  # no /proc here
        try:
            os.kill(pid, 0)
            return 0
        except ProcessLookupError:
            return None
        except PermissionError:
            return 0
    return None if fields[0] in "ZXx" else int(fields[19])  # state; starttime is field 22 of stat


def exit_with(pid: int, poll_s: float = 0.5) -> None:
    """Exit this process (at once, no clean-up) once process `pid` has ended or become a zombie; a pid
    taken by a new process (another start time) counts as ended."""
    born = process_start_time(pid)
    while born is not None and process_start_time(pid) == born:
        time.sleep(poll_s)
    os._exit(0)


def start_worker(rank_pid: int, worker_id: int) -> None:
    """worker_init_fn: leave the stop signals to the rank, and end with the rank `rank_pid`. The parent of a
    forkserver worker is the forkserver, which lives as long as its workers (each holds the descriptor
    whose closing ends the server), so neither a parent-death signal nor torch's parent check ever fires
    when the rank dies: a thread watches the rank itself."""
    ignore_stop_signals(worker_id)
    threading.Thread(target=exit_with, args=(rank_pid,), name="exit-with-rank", daemon=True).start()


class SharedBatches:
    """Training batches (x, y) on `device`, read by rank 0 of `axis` (the tp x cp group) and broadcast to the
    group's other ranks, which have no loader. The first batch's shapes and dtypes are broadcast once; the
    training batches that follow have the same (a fixed per-rank batch). `shared_bytes`: what the reading
    rank sent for the last batch (counted on `axis` too), 0 elsewhere."""

    def __init__(self, loader: DataLoader | None, axis: AxisGroup, device: torch.device):
        assert (loader is not None) == (axis.rank == 0), "only the group's first rank reads"
        self.batches = iter(loader) if loader is not None else None
        self.axis, self.device, self.specs, self.shared_bytes = axis, device, None, 0

    def __iter__(self):
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.batches is not None:
            pair = tuple(t.to(self.device, non_blocking=True) for t in next(self.batches))
            specs = [(tuple(t.shape), t.dtype) for t in pair]
            assert self.specs in (None, specs), f"training batch {specs} differs from the first one {self.specs}"
        if self.axis.size == 1:
            return pair
        if self.specs is None:
            self.specs = broadcast_object(specs if self.batches is not None else None, self.axis)
        if self.batches is None:
            pair = tuple(torch.empty(shape, dtype=dtype, device=self.device) for shape, dtype in self.specs)
        for t in pair:
            broadcast_(t, self.axis, 0)
        self.shared_bytes = sum(nbytes(t) for t in pair) if self.axis.rank == 0 else 0
        return pair


class EvenBatches:
    """A dp rank's validation batches, padded to the count of the largest rank's part. Each padding batch
    is one sample of the validation set with no targets (y is None): the forward runs, the metrics skip
    it. Under FSDP every forward gathers weights over dp, so every rank must run as many forwards."""

    def __init__(self, loader: DataLoader, total: int):
        self.loader, self.total = loader, total

    def __len__(self) -> int:
        return self.total

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor | None]]:
        count = 0
        for x, y in self.loader:
            count += 1
            yield x, y
        if count < self.total:
            x = torch.utils.data.default_collate([self.loader.dataset.dataset[0]])[0]
            for _ in range(self.total - count):
                yield x, None


def check_batch(global_batch_size: int, dp: int, grad_accum_steps: int, num_samples: int,
                microbatches: int = 1) -> None:
    """User errors of the batch settings against the layout and the data (their signs are checked by
    TrainerConfig), raised before any work. `microbatches`: pipeline microbatches per accumulation step."""
    parts = dp * grad_accum_steps * microbatches
    pipeline = f" x pp_microbatches={microbatches}" if microbatches > 1 else ""
    require(global_batch_size % parts == 0,
            f"global_batch_size {global_batch_size} is not divisible by dp={dp} x grad_accum_steps={grad_accum_steps}"
            + pipeline, "trainer.global_batch_size", f"use a multiple of {parts}")
    require(num_samples >= global_batch_size,
            f"the training set has {num_samples} samples, fewer than one global batch of {global_batch_size}",
            "trainer.global_batch_size", "lower the batch size or raise data.limit_nsamples")


def build_loaders(train_set: Dataset, val_set: Dataset, *, global_batch_size: int, dp_rank: int, dp_size: int,
                  seed: int, start_step: int, num_workers: int, pin_memory: bool,
                  worker_start: str = "forkserver", even_val_batches: bool = False, read_train: bool = True) -> Loaders:
    """Train loader over GlobalBatchSampler from `start_step` (none without `read_train`: the rank receives
    its batches, see SharedBatches); val loader over this rank's val shard.

    `worker_start`: how worker processes start. By the time the loaders start their workers a rank
    runs gloo/NCCL, OpenMP and TensorBoard threads; `fork` copies the process in whatever state those
    threads left the heap and the libraries' globals (HDF5's among them), which is not safe in a
    threaded process. `forkserver` (default) forks workers from a clean single-threaded server, started
    here with the stop signals blocked, so that neither it nor its workers die of a signal sent to every
    process of a job (`spawn` workers have that window until their init function ignores the signals).
    """
    sampler = GlobalBatchSampler(len(train_set), global_batch_size, dp_rank, dp_size, seed, start_step)
    context = multiprocessing.get_context(worker_start) if num_workers > 0 else None
    if worker_start != "fork" and num_workers > 0:
        with stop_signals_blocked():
            multiprocessing.resource_tracker.ensure_running()
            if worker_start == "forkserver":  # the server imports what a worker unpickles (torch, the datasets)
                # once, and every worker forks with it loaded: otherwise each imports it again, seconds apiece
                preload = dict.fromkeys(["__main__", __name__, type(train_set).__module__, type(val_set).__module__])
                multiprocessing.forkserver.set_forkserver_preload(list(preload))
                multiprocessing.forkserver.ensure_running()
    init = partial(start_worker, os.getpid())
    workers = {"num_workers": num_workers, "pin_memory": pin_memory, "persistent_workers": num_workers > 0,
               "worker_init_fn": init if num_workers > 0 else None, "multiprocessing_context": context}
    if num_workers > 0:
        workers["prefetch_factor"] = 4
    # Own generators: worker seeds never draw from the global RNG, which dropout uses (exact resume)
    train = DataLoader(train_set, batch_sampler=sampler, generator=torch.Generator().manual_seed(seed),
                       **workers) if read_train else None
    val_part = torch.utils.data.Subset(val_set, contiguous_part(len(val_set), dp_rank, dp_size))
    val_workers = min(num_workers, 2)
    val = DataLoader(val_part, batch_size=max(1, global_batch_size // dp_size), shuffle=False,
                     num_workers=val_workers, pin_memory=pin_memory, persistent_workers=val_workers > 0,
                     worker_init_fn=init if val_workers > 0 else None,
                     multiprocessing_context=multiprocessing.get_context(worker_start) if val_workers > 0 else None,
                     generator=torch.Generator().manual_seed(seed))
    if even_val_batches:  # as many validation batches on every dp rank (see EvenBatches)
        largest = max(len(contiguous_part(len(val_set), r, dp_size)) for r in range(dp_size))
        val = EvenBatches(val, -(-largest // val.batch_size))
    return Loaders(train, val)
