"""The stop signals of a job, and how the helper processes of a rank keep out of them.

SIGTERM, SIGUSR1, SIGUSR2, SIGINT and SIGHUP are what Slurm sends at a time limit or on preemption, what
submitit asks for, what a closed terminal or Ctrl-C sends: a rank turns them into a checkpoint and an exit
(utils/engine/preemption.py). Its helper processes (data workers, the forkserver, the resource tracker) must
neither die of them nor act on them; the data loaders (utils/data/batching.py) use the two helpers here.
Standard library only, below every package.
"""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator

SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGINT, signal.SIGHUP)


def ignore_stop_signals(_worker_id: int = 0) -> None:
    """For DataLoader workers: leave the signals to the trainer (Slurm signals every process of a step;
    a worker that died of SIGTERM would fail the trainer's last fetch). Workers exit with their rank
    (utils/data/batching.py `start_worker`)."""
    for sig in SIGNALS:
        signal.signal(sig, signal.SIG_IGN)


@contextlib.contextmanager
def stop_signals_blocked() -> Iterator[None]:
    """Hold the stop signals back while helper processes start (the forkserver, the resource tracker):
    they inherit the blocked mask across exec and so survive a signal sent to every process of a job
    (Slurm's SIGUSR1 included), while this process receives what arrived once the block ends."""
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)
