"""Start a configured run on this machine: in this process, or as the local ranks its layout needs.

`run` trains one configured run (train.py's plain command line, each point of a Hydra sweep): here when
this process is one rank of a launch (torchrun, Slurm, or a layout of one rank), else it hands the same
command line to `launch_main`, which starts the layout's ranks here. `run_command` is the plain command
line (`python train.py key=value ...`), which every local rank runs.

`launch_main` is `python train_mp.py`: it starts world = tp*cp*pp*dp ranks (dp = parallel.dp, or 1 when it
is derived; or `--nproc N`) with torchrun's variables set, one GPU each when there are enough GPUs (a new
interpreter running train.py), CPU processes on gloo (forks of this one) on a machine without GPUs or with
`trainer.device=cpu`. Before the ranks start, `launch_plan` checks what it can (the grid, the split of the global
batch over it, the run directory's checkpoints, fewer GPUs than ranks): one line and exit 2, printed once; a
bad-input error the ranks find themselves (the data) is printed by one rank, not by each (`exit_bad_input_once`).
Returns the first non-zero exit status; when a rank fails, the others are stopped at once. Stop signals (SIGTERM,
SIGUSR1, SIGUSR2, SIGHUP, SIGINT) are forwarded to the ranks, which checkpoint and exit (status 75); a rank never
outlives the launcher.
"""

from __future__ import annotations

import atexit
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

from utils import EXIT_BAD_INPUT, ConfigError, exit_bad_input, require
from utils.cli.config import load_config
from utils.cli.launch import die_with_parent, free_port, rank_env, ranks_needed
from utils.comm import Axis, batch_parts, check_grid, destroy_grid
from utils.engine.preemption import (
    EARLY_SIGNALS,
    EXIT_LATE,
    EXIT_PREEMPTED,
    early_stop_env,
    inherit_early_stop,
    take_early_stop,
)
from utils.launch_env import LaunchEnv, launch_env

ENTRY_SCRIPT = Path(__file__).resolve().parents[2] / "train.py"  # what a new rank interpreter runs
ERRORS_ENV = "TRAIN_MP_ERRORS"  # 'fd:device:inode' of the launcher's file of the error lines its ranks printed


def starts_local_ranks(cfg) -> bool:
    """Started as one process for a layout of several ranks: they are this machine's to start."""
    return launch_env().source == "single" and ranks_needed(cfg.parallel) > 1


def run(cfg, choices: dict[str, str], config_yaml: str, argv: list[str]) -> int:
    """Train one configured run here, or hand it to `launch_main` (same `argv`), which starts the local
    ranks of its layout (their launch_env says torchrun)."""
    from utils.checkpoints.run_dir import PRESETS_FILE, preset_facts, write_facts
    from utils.cli.runs import check_run_dir, run_digest
    from utils.engine.build import build_run

    if starts_local_ranks(cfg):
        return launch_main(argv, loaded=(cfg, choices, config_yaml))
    digest = run_digest(cfg, choices, config_yaml)
    check_run_dir(cfg, choices, config_yaml, digest)  # build_run checks it too, without the presets to name
    trainer = build_run(cfg, choices, config_yaml, digest)
    if trainer.grid.is_main:
        write_facts(trainer.run_dir, PRESETS_FILE, preset_facts(choices))  # beside config.yaml
    return trainer.fit()


def run_command(argv: list[str]) -> int:
    """`python train.py [--cfg] key=value ...`: compose the config, print it (--cfg) or run it; a user
    error is the one-line message and exit 2."""
    try:
        cfg, choices, config_yaml = load_config([a for a in argv if a != "--cfg"])
        if "--cfg" in argv:
            print(config_yaml)
            return 0
        return run(cfg, choices, config_yaml, argv)
    except ConfigError as err:
        exit_bad_input_once(err)
    finally:
        destroy_grid()


def exit_bad_input_once(err: ConfigError) -> None:
    """`exit_bad_input`; among the ranks of one local launch (`ERRORS_ENV` set), an error line that another rank
    printed already is not printed again (the same data error, found by every rank)."""
    if not first_to_tell(err.line()):
        raise SystemExit(EXIT_BAD_INPUT)
    exit_bad_input(err)


def first_to_tell(line: str, environ=os.environ) -> bool:
    """Whether no other rank of this launch printed `line` (then recorded as printed): the launcher's file, an
    unlinked one each rank inherits (nothing is left behind, however the launcher ends), read and appended under a
    lock. True outside such a launch, or when the descriptor named is not that file."""
    import fcntl

    try:
        fd, device, inode = (int(part) for part in environ.get(ERRORS_ENV, "").split(":"))
        if (os.fstat(fd).st_dev, os.fstat(fd).st_ino) != (device, inode):
            return True
        fcntl.lockf(fd, fcntl.LOCK_EX)  # a process's lock: forked ranks share the file's description
    except (ValueError, OSError):
        return True
    try:
        told = os.pread(fd, os.fstat(fd).st_size, 0).decode().splitlines()
        if line in told:
            return False
        os.pwrite(fd, f"{line}\n".encode(), os.fstat(fd).st_size)
        return True
    finally:
        fcntl.lockf(fd, fcntl.LOCK_UN)


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


def gpus_for_ranks(device: str, world: int, visible: int) -> bool:
    """Whether `world` local ranks get a GPU each (else they run on the CPU over gloo): with `trainer.device`
    auto, when this machine has GPUs at all; fewer GPUs than ranks is refused rather than quietly run on
    the CPU. `visible`: the GPUs this process sees."""
    if device == "cpu" or visible == 0:
        return False
    require(visible >= world, f"{world} ranks but {visible} GPU(s) visible, and the CPU was not asked for",
            "trainer.device", f"start at most {visible} ranks (parallel=..., --nproc), or set trainer.device=cpu")
    return True


def launch_plan(argv: list[str], nproc: int | None, loaded: tuple | None = None) -> tuple[int, bool]:
    """(ranks the grid needs, whether each gets a GPU), validated like train.py does, before anything starts: the
    grid, the split of the global batch over it (the data's size aside), and the run directory's checkpoints
    (each rank would print the same error otherwise). `loaded`: `load_config(argv)`, if composed already."""
    from utils.cli.runs import check_run_dir, run_digest
    from utils.data.batching import check_batch
    from utils.tasks import pipeline_plan

    cfg, choices, config_yaml = loaded or load_config(argv)
    p = cfg.parallel
    world = nproc or ranks_needed(p)
    sizes = check_grid(p, LaunchEnv(world_size=world))
    batch = cfg.trainer.global_batch_size
    check_batch(batch, batch_parts(sizes), cfg.trainer.grad_accum_steps, batch,
                pipeline_plan(cfg).microbatches if sizes[Axis.PP] > 1 else 1)
    check_run_dir(cfg, choices, config_yaml, run_digest(cfg, choices, config_yaml), world)
    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return world, gpus_for_ranks(cfg.trainer.device, world, visible)


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
    A rank killed by signal n fails with 128 + n, as a shell reports it (Popen says -n, and
    `sys.exit(-n)` would exit with 256 - n: 247 for SIGKILL).
    """
    preempted_at = None
    while True:
        codes = [p.poll() for p in procs]
        failed = [c for c in codes if c not in (None, 0, EXIT_PREEMPTED)]
        if failed:
            stop_all(procs)
            return 128 - failed[0] if failed[0] < 0 else failed[0]
        if all(c is not None for c in codes):
            return EXIT_PREEMPTED if EXIT_PREEMPTED in codes else 0
        if EXIT_PREEMPTED in codes:
            preempted_at = preempted_at or time.time()
            if time.time() - preempted_at > preempt_grace_s:
                stop_all(procs)
                return EXIT_LATE
        time.sleep(0.1)


def forward_stop_signals(procs: list[subprocess.Popen], early: tuple[int, float] | None = None) -> None:
    """A stop signal to the launcher (SIGTERM, SIGUSR1, SIGUSR2, SIGHUP, SIGINT) reaches every rank as SIGTERM
    (each finishes its step, checkpoints and exits); a second one kills them. `early`, one the launcher received
    while it started the ranks, is forwarded now (one from before that went to the ranks in their environment:
    `early_stop_env`). Ranks also die with the launcher (die_with_parent)."""
    received = []

    def forward(signum, frame):
        for p in procs:
            if p.poll() is None and received:
                p.kill()
            elif p.poll() is None:
                p.send_signal(signal.SIGTERM)
        received.append(signum)

    for sig in (*EARLY_SIGNALS, signal.SIGINT):
        signal.signal(sig, forward)
    if early is not None:
        forward(early[0], None)


def launch_main(argv: list[str] | None = None, loaded: tuple | None = None) -> int:
    """`python train_mp.py [--nproc N] key=value ...`: start the layout's ranks here; the job's status. `loaded`:
    `load_config(argv)`'s result when the caller composed it already (train.py: the config is composed once per
    process)."""
    import utils.engine.build  # noqa: F401 - forked CPU ranks inherit the trainer imported (ForkedRank)
    from utils.startup import imports_done

    imports_done()  # train_mp.py paused the collector (utils/startup.py)
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        nproc, argv = parse_nproc(argv)
        world, use_gpus = launch_plan(argv, nproc, loaded)
    except ConfigError as err:
        exit_bad_input(err)
    return launch(argv, world, use_gpus)


class ForkedRank:
    """A CPU rank forked from this launcher, which has imported torch and checked the config already: it
    starts at once instead of spending seconds of a shared core importing torch (the figures:
    docs/measurements.md). Used only where no GPU is
    usable: a process that has touched CUDA must not fork. The child runs `run_command` (train.py's
    command line) with the rank's torchrun variables and thread count, as a fresh process would; the
    launcher supervises it through the part of subprocess.Popen's interface that `supervise` and
    `stop_all` use."""

    def __init__(self, env: dict[str, str], argv: list[str]):
        sys.stdout.flush()
        sys.stderr.flush()
        self.returncode: int | None = None
        self.pid = os.fork()
        if self.pid == 0:
            os._exit(self._run_rank(env, argv))

    @staticmethod
    def _run_rank(env: dict[str, str], argv: list[str]) -> int:
        """In the child: `run_command`; its exit status (1 and the traceback for an exception)."""
        code = 1
        try:
            die_with_parent()
            os.environ.clear()
            os.environ.update(env)
            inherit_early_stop()  # the launcher's stop signal from before the ranks started
            torch.set_num_threads(int(env["OMP_NUM_THREADS"]))  # OpenMP read the variable at import already
            code = run_command(argv)
        except SystemExit as exit_:
            code = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
        except BaseException:  # noqa: BLE001 - what the interpreter does: print it, status 1
            traceback.print_exc()
        finally:
            atexit._run_exitfuncs()  # the interpreter's exit, which os._exit skips
            sys.stdout.flush()
            sys.stderr.flush()
        return code or 0

    def poll(self) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"rank pid {self.pid}", timeout)
            time.sleep(0.02)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def launch(argv: list[str], world: int, use_gpus: bool) -> int:
    """Start `world` local ranks of train.py's command line with `argv` (on a GPU each with `use_gpus`, else on
    the CPU), supervise them, return the job's exit status. On a machine with GPUs each rank is a new
    interpreter (CPU ranks hidden from the GPUs); on a machine without one, a fork of this one."""
    gpus = torch.cuda.is_available()
    port = free_port()
    print(f"train_mp: launching {world} ranks on {'GPUs' if use_gpus else 'CPU (gloo)'}", flush=True)
    early = take_early_stop()  # before forking: handed to every rank in its environment, not sent to it
    errors = tempfile.TemporaryFile()  # the error lines the ranks printed (`first_to_tell`)
    fd, stat = errors.fileno(), os.fstat(errors.fileno())
    told = {ERRORS_ENV: f"{fd}:{stat.st_dev}:{stat.st_ino}", **({} if early is None else early_stop_env(early))}
    try:
        if gpus:
            procs = [subprocess.Popen([sys.executable, str(ENTRY_SCRIPT), *argv], env={
                **rank_env(r, world, port, use_gpus), **told}, preexec_fn=die_with_parent, pass_fds=(fd,))
                for r in range(world)]
        else:
            import utils.engine.build  # noqa: F401 - the rest of what a rank imports: once here, not in every rank

            procs = [ForkedRank({**rank_env(r, world, port, False), **told}, argv) for r in range(world)]
        forward_stop_signals(procs, take_early_stop())  # one that came while the ranks were being started
        return supervise(procs)
    finally:
        errors.close()

