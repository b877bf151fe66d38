"""Launch the ranks a parallel layout needs on this machine: `python train_mp.py parallel=tp2 [...]`.

`python train.py parallel=tp2 [...]` started as one process (no torchrun or Slurm variables) comes here
by itself; this entry adds `--nproc N` (e.g. more data-parallel ranks than parallel.dp says).

Starts world = tp*cp*pp*dp processes of `train.py` (dp = parallel.dp, or 1 when it is derived; or
`--nproc N`) with torchrun's variables set, one GPU each when there are enough GPUs, else CPU processes
on gloo. Returns the first non-zero exit status; when a rank fails, the others are stopped at once.
Stop signals (also one received before the ranks start) are forwarded to the ranks, which checkpoint and exit
(status 75); a rank
never outlives the launcher. A script over utils/cli/local_launch.py, where all of this lives.
"""

import sys

if __name__ == "__main__":  # the standard library only: no torch yet
    from utils.engine.preemption import record_stop_signals
    from utils.startup import pause_collector, report_fatal_signals

    pause_collector()  # until the imports are done (utils/startup.py)
    report_fatal_signals()  # a rank killed by a C++ abort or a segfault says where its Python was

    record_stop_signals()  # a stop signal before the ranks start reaches them once they do
from utils.cli.local_launch import launch_main as main  # noqa: E402 - after the signals are recorded

if __name__ == "__main__":
    sys.exit(main())
