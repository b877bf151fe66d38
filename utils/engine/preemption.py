"""Preemption: SIGTERM, SIGUSR1, SIGUSR2, SIGINT or SIGHUP end a run with a checkpoint instead of losing its steps.

What Slurm sends at a time limit or on preemption (SIGTERM, or SIGUSR1 ahead of time with
`--signal=USR1@120`; submitit asks for SIGUSR2), what a closed terminal (SIGHUP) or Ctrl-C (SIGINT) sends:
the handler only records the request. The trainer finishes the step it is in, every rank agrees (the request is
max-reduced over all ranks, since ranks may see the signal at different steps), writes a checkpoint and
exits with EXIT_PREEMPTED (75, EX_TEMPFAIL: "try again"), which a Slurm script turns into a requeue.
If the step and the checkpoint are not done `deadline_s` after the signal, the process exits with
EXIT_LATE instead of waiting for SIGKILL. A second Ctrl-C interrupts at once.

A signal can come at any moment, also while the interpreter still imports torch (seconds to minutes on a
cluster file system): the entry points call `record_stop_signals` on their first lines, and the
`StopRequest` that set-up installs takes over what it recorded (`take_early_stop`).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

from utils.signals import SIGNALS

EXIT_PREEMPTED = 75  # a checkpoint of the step reached was written: requeue or re-run to continue
EXIT_LATE = 76  # the deadline passed before the checkpoint was complete: the previous one stands
# Before set-up Ctrl-C keeps its default (nothing to save yet: the user wants out); the others are recorded.
EARLY_SIGNALS = tuple(sig for sig in SIGNALS if sig != signal.SIGINT)
_early: list[tuple[int, float]] = []  # (signal, time.monotonic()) of the first stop signal before set-up


def _record_early(signum: int, frame) -> None:
    if not _early:
        _early.append((signum, time.monotonic()))


def record_stop_signals() -> None:
    """From an entry point's first lines (before the heavy imports): a stop signal is recorded, not fatal;
    the run's `StopRequest` takes it over and acts on it at its first chance (utils/engine/trainer.py
    `stop_before_start`: a checkpoint of the step reached, exit 75). Main thread only."""
    for sig in EARLY_SIGNALS:
        signal.signal(sig, _record_early)


def take_early_stop() -> tuple[int, float] | None:
    """The stop signal recorded before set-up and when it came (time.monotonic()), once; None without one."""
    return _early.pop() if _early else None


EARLY_STOP_VAR = "DLSCALE_EARLY_STOP"  # "signal,monotonic time": the launcher's stop signal from before its ranks


def early_stop_env(early: tuple[int, float]) -> dict[str, str]:
    """The variable that hands a launcher's early stop signal to the ranks it starts. A signal sent to a rank
    just started can be lost: CPython clears a fork's pending signals after fork (issue 9535), and a new
    interpreter dies of one that comes before its handlers are up."""
    return {EARLY_STOP_VAR: f"{early[0]},{early[1]!r}"}


def inherit_early_stop() -> None:
    """In a rank: the launcher's early stop signal (`early_stop_env`), recorded as if it had come here."""
    if (value := os.environ.get(EARLY_STOP_VAR)) and not _early:
        signum, at = value.split(",")
        _early.append((int(signum), float(at)))


class StopRequest:
    """Context manager that installs the handlers (main thread only) and restores the previous ones; after
    a stop was requested it leaves SIGTERM, SIGUSR1, SIGUSR2 and SIGHUP ignored instead: the process is on its way
    out with EXIT_PREEMPTED, and the SIGTERM srun sends the other ranks of a job step once the first one
    has exited (--kill-on-bad-exit) must not turn their 75 into death by signal (143).

    A run installs it first thing in set-up (`utils.engine.build.build_run`, before the grid, the data and the
    checkpoint load, which can take minutes) and `Trainer.fit` enters the same one: entering an installed
    request changes nothing, and a signal received during set-up, or before it (`record_stop_signals`), is
    acted on before the first step."""

    def __init__(self, deadline_s: float):
        self.deadline_s = deadline_s
        self.signum: int | None = None
        self._previous: dict[int, object] = {}
        self._installed = False
        self._timer: threading.Timer | None = None

    @property
    def requested(self) -> bool:
        return self.signum is not None

    def __enter__(self) -> StopRequest:
        if not self._installed and threading.current_thread() is threading.main_thread():
            self._previous = {sig: signal.signal(sig, self._handle) for sig in SIGNALS}
            self._installed = True
            early = take_early_stop()
            if early is not None and not self.requested:
                self._record(*early)
        return self

    def __exit__(self, *exc) -> None:
        if self._timer is not None:
            self._timer.cancel()
        for sig, handler in self._previous.items():
            signal.signal(sig, signal.SIG_IGN if self.requested and sig != signal.SIGINT else handler)
        self._previous, self._installed = {}, False

    def _handle(self, signum: int, frame) -> None:
        if self.requested and signum == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl-C: the user does not want to wait
        if not self.requested:
            self._record(signum, time.monotonic())

    def _record(self, signum: int, at: float) -> None:
        """The request, and the deadline counted from the signal's arrival `at` (time.monotonic())."""
        self.signum = signum
        self._timer = threading.Timer(max(0.0, self.deadline_s - (time.monotonic() - at)), self._late)
        self._timer.daemon = True
        self._timer.start()

    def _late(self) -> None:
        print(f"error: no checkpoint within trainer.preempt_deadline_s={self.deadline_s:g} s of "
              f"{signal.Signals(self.signum).name}; exiting (the previous checkpoint stands)",
              file=sys.stderr, flush=True)
        os._exit(EXIT_LATE)
