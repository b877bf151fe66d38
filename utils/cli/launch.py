"""Starting ranks: the write side of the launch environment (utils/launch_env.py reads it).

`rank_env` sets torchrun's variables for a local rank (`train_mp.py`), so the ranks it starts read them
exactly as under torchrun; `ranks_needed` is the world size a layout asks for, `free_port` a local
rendezvous port (below the kernel's ephemeral range), `die_with_parent` ties a started rank's life to its
launcher's.
"""

from __future__ import annotations

import ctypes
import os
import random
import signal
import socket
from pathlib import Path

from utils.schema import ParallelConfig


def ranks_needed(parallel: ParallelConfig) -> int:
    """The world size a layout asks for when started as one process: tp*cp*pp*dp (dp=0, derived: 1)."""
    return parallel.tp * parallel.cp * parallel.pp * max(parallel.dp, 1)


EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")  # Linux; elsewhere the kernel's own choice
LOWEST_PORT = 15000  # the rendezvous ports start here (as submit/common.sh's rendezvous_port)


def free_port(range_file: Path = EPHEMERAL_RANGE) -> int:
    """A TCP port that is free on this machine now, for a local rendezvous: a random one below the kernel's
    ephemeral range. The kernel hands the ports of that range to outgoing connections and to listeners on port
    0 (gloo's, NCCL's), so a port taken from it can be taken again by another job's ranks while these ranks
    import torch, before their store binds it (EADDRINUSE); below it, only another explicit choice can."""
    try:
        low = int(range_file.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 0
    choose = random.SystemRandom()  # not the global generator, which a seeded process repeats
    for _ in range(64 if low > LOWEST_PORT + 1000 else 0):
        port = choose.randrange(LOWEST_PORT, low)
        with socket.socket() as s:
            try:
                s.bind(("", port))
                return port
            except OSError:
                continue
    with socket.socket() as s:  # no range known (or every pick taken): the kernel's choice
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def die_with_parent(sig: int = signal.SIGTERM) -> None:
    """For rank processes a launcher starts (Popen preexec_fn, Linux): `sig` when the launcher dies, even
    of SIGKILL, so a rank never trains on as an orphan. A no-op where prctl is missing."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, sig)  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def rank_env(rank: int, world: int, port: int, use_gpus: bool, environ=os.environ) -> dict[str, str]:
    """The environment of local rank `rank` of `world`, as torchrun would set it on one machine."""
    env = dict(environ, RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
               LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if not use_gpus:
        env["CUDA_VISIBLE_DEVICES"] = ""
        # CPU ranks share the cores: more threads than cores makes every collective wait on spinning threads
        env["OMP_NUM_THREADS"] = str(max(1, len(os.sched_getaffinity(0)) // world))
    return env
