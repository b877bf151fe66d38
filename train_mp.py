"""Launch the ranks a parallel layout needs on this machine: `python train_mp.py parallel=tp2 [...]`.

`python train.py parallel=tp2 [...]` started as one process (no torchrun or Slurm variables) comes here
by itself; this entry adds `--nproc N` (e.g. more data-parallel ranks than parallel.dp says).

Starts world = tp*cp*pp*dp processes of `train.py` (dp = parallel.dp, or 1 when it is derived; or
`--nproc N`) with torchrun's variables set, one GPU each when there are enough GPUs, else CPU processes
on gloo. Returns the first non-zero exit status; when a rank fails, the others are stopped at once.
SIGTERM, SIGINT and SIGHUP are forwarded to the ranks, which checkpoint and exit (status 75); a rank
never outlives the launcher.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

from utils.comm import check_grid
from utils.config import load_config
from utils.errors import ConfigError, exit_bad_input
from utils.launch import LaunchEnv, die_with_parent, free_port, rank_env, ranks_needed
from utils.preemption import EXIT_LATE, EXIT_PREEMPTED


def parse_nproc(argv: list[str]) -> tuple[int | None, list[str]]:
    """Take `--nproc N` / `--nproc=N` out of argv."""
    rest, nproc, i = [], None, 0
    while i < len(argv):
        arg = argv[i]
        if arg.startswith("--nproc"):
            value = arg.split("=", 1)[1] if "=" in arg else (argv[i + 1] if i + 1 < len(argv) else "")
            i += 1 if "=" in arg else 2
            if not value.isdigit() or int(value) < 1:
                raise ConfigError(f"bad --nproc value '{value}'", "--nproc", "give a positive number of ranks")
            nproc = int(value)
            continue
        rest.append(arg)
        i += 1
    return nproc, rest


def world_size(argv: list[str], nproc: int | None) -> int:
    """Ranks the grid needs (validated like train.py does, before anything starts)."""
    cfg, _, _ = load_config(argv)
    p = cfg.parallel
    world = nproc or ranks_needed(p)
    check_grid(p, LaunchEnv(world_size=world))
    return world


def stop_all(procs: list[subprocess.Popen], grace_s: float = 10.0) -> None:
    """SIGTERM to every live rank, SIGKILL to those still there after `grace_s`."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.time() + grace_s
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.time()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def supervise(procs: list[subprocess.Popen], preempt_grace_s: float = 180.0) -> int:
    """Wait for all ranks; the first failure stops the rest and is returned.

    Ranks that stopped on a signal with a checkpoint (EXIT_PREEMPTED) wait for the others, which stop at
    the same step; the job then returns EXIT_PREEMPTED (EXIT_LATE if some rank is not done in time).
    """
    preempted_at = None
    while True:
        codes = [p.poll() for p in procs]
        failed = [c for c in codes if c not in (None, 0, EXIT_PREEMPTED)]
        if failed:
            stop_all(procs)
            return failed[0]
        if all(c is not None for c in codes):
            return EXIT_PREEMPTED if EXIT_PREEMPTED in codes else 0
        if EXIT_PREEMPTED in codes:
            preempted_at = preempted_at or time.time()
            if time.time() - preempted_at > preempt_grace_s:
                stop_all(procs)
                return EXIT_LATE
        time.sleep(0.1)


def forward_stop_signals(procs: list[subprocess.Popen]) -> None:
    """SIGTERM, SIGINT or SIGHUP to the launcher reach every rank as SIGTERM (each finishes its step,
    checkpoints and exits); a second one kills them. Ranks also die with the launcher (die_with_parent)."""
    received = []

    def forward(signum, frame):
        for p in procs:
            if p.poll() is None and received:
                p.kill()
            elif p.poll() is None:
                p.send_signal(signal.SIGTERM)
        received.append(signum)

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, forward)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        nproc, argv = parse_nproc(argv)
        world = world_size(argv, nproc)
    except ConfigError as err:
        exit_bad_input(err)
    return launch(argv, world)


def launch(argv: list[str], world: int) -> int:
    """Start `world` local ranks of train.py with `argv`, supervise them, return the job's exit status."""
    use_gpus = torch.cuda.is_available() and torch.cuda.device_count() >= world
    port = free_port()
    entry = str(Path(__file__).resolve().parent / "train.py")
    print(f"train_mp: launching {world} ranks on {'GPUs' if use_gpus else 'CPU (gloo)'}", flush=True)
    procs = [subprocess.Popen([sys.executable, entry, *argv], env=rank_env(r, world, port, use_gpus),
                              preexec_fn=die_with_parent) for r in range(world)]
    forward_stop_signals(procs)
    return supervise(procs)


if __name__ == "__main__":
    sys.exit(main())
