"""Step watchdog: a rank that makes no progress for `trainer.hang_timeout_s` dumps its stacks and exits.

A rank stopped inside a collective (SIGSTOP, a dead NIC, a deadlock) leaves its partners waiting in
that collective. Each rank's watchdog thread watches its own progress: the trainer calls `phase(name)`
as it moves between data, forward/backward, optimizer, validation and checkpoint. When no phase
starts for `timeout_s`, the watchdog writes every thread's stack to
`<run.dir>/hang_rank<r>.txt`, prints one line naming the rank and the phase it is stuck in, and exits
the process with EXIT_HANG; the launcher (train_mp.py, torchrun, srun --kill-on-bad-exit) then stops
the other ranks, the stopped one included.

For the stacks to be written the step watchdog must fire before the backend's own: NCCL's watchdog thread
aborts a collective that outlives its group's timeout and kills the process without a stack. While the loop
runs, every process group's timeout is raised to `trainer.hang_timeout_s` + 120 s
(utils/comm/timeouts.py `watchdog_safe_timeout`) and put back (`parallel.init_timeout_s`) after it.
"""

from __future__ import annotations

import faulthandler
import os
import sys
import threading
import time
from pathlib import Path

from utils.comm.timeouts import restore_group_timeouts, set_group_timeouts, watchdog_safe_timeout

EXIT_HANG = 77


class StepWatchdog:
    """Context manager around the training loop; `timeout_s` <= 0 disables it."""

    def __init__(self, timeout_s: float, run_dir: Path, rank: int):
        self.timeout_s, self.run_dir, self.rank = timeout_s, Path(run_dir), rank
        self.current, self.since = "start", time.monotonic()
        self._done = threading.Event()
        self._timeouts: dict[str, float] = {}  # the groups' timeouts before the loop (none in one process)

    def phase(self, name: str) -> None:
        """Progress: the rank now enters `name`."""
        self.current, self.since = name, time.monotonic()

    def __enter__(self) -> StepWatchdog:
        if self.timeout_s > 0:
            self.phase("data")
            self._timeouts = set_group_timeouts(watchdog_safe_timeout(self.timeout_s))  # the backend fires later
            threading.Thread(target=self._watch, name="step-watchdog", daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self._done.set()
        restore_group_timeouts(self._timeouts)  # each group's own again (init_grid's parallel.init_timeout_s)

    def _watch(self) -> None:
        while not self._done.wait(min(1.0, self.timeout_s / 4)):
            stuck = time.monotonic() - self.since
            if stuck > self.timeout_s:
                self._fire(stuck)

    def _fire(self, stuck: float) -> None:
        path = self.run_dir / f"hang_rank{self.rank}.txt"
        try:
            with open(path, "w") as f:
                f.write(f"rank {self.rank}: no progress for {stuck:.0f} s in phase '{self.current}'\n\n")
                f.flush()
                faulthandler.dump_traceback(file=f, all_threads=True)
        except OSError:
            path = None
        print(f"error: rank {self.rank} made no progress for {stuck:.0f} s in phase '{self.current}' "
              f"(trainer.hang_timeout_s={self.timeout_s:g}); stacks in {path}; a partner rank may be stopped "
              "or dead", file=sys.stderr, flush=True)
        os._exit(EXIT_HANG)
