"""Train a model: `python train.py [model=...] [data=...] [precision=...] [parallel=...] [key=value ...]`.

A script over utils/cli/entry.py (the command line, `--help`) and utils/cli/local_launch.py (one run, here or as
the local ranks of its layout). `import train; train.main(argv)` runs the command line in this process.
Its first lines record stop signals (SIGTERM, SIGUSR1, SIGUSR2, SIGHUP): one that comes while torch is still
being imported is acted on at the run's first chance (utils/engine/preemption.py).
"""

import sys

if __name__ == "__main__":  # the standard library only: no torch yet
    from utils.engine.preemption import inherit_early_stop, record_stop_signals
    from utils.startup import pause_collector, report_fatal_signals

    pause_collector()  # until the imports are done (utils/startup.py)
    report_fatal_signals()  # a rank killed by a C++ abort or a segfault says where its Python was

    record_stop_signals()  # a stop signal from here on ends the run with a checkpoint and 75, not a kill
    inherit_early_stop()  # and one the launcher (train_mp.py) received before it started this rank
from utils.cli.entry import main  # noqa: E402 - after the signals are recorded

if __name__ == "__main__":
    sys.exit(main())
