"""The command line of train.py: `--help`, Hydra's own command lines, or one run (utils/cli/local_launch.py).

train.py is a script over this module (no library module imports a script). Only the standard library and
utils.cli.hydra_app's argument check are imported at the top, so `--help` answers without loading torch.
"""

from __future__ import annotations

import sys

from utils.cli.hydra_app import is_hydra_command

USAGE = """Train a model: `python train.py [model=...] [data=...] [precision=...] [parallel=...] [key=value ...]`.

Thin entry: compose the config, validate it against the data and the launch, build the grid, the
task and the trainer, and fit. Also runs under torchrun and srun. Started as one process for a layout
of several ranks (tp*cp*pp*dp > 1 with dp given, or tp*cp*pp > 1), it starts them itself on this
machine, one GPU each when there are enough, else CPU processes (`train_mp.py`, which it hands over to).
Sweeps and Hydra's own flags (-m, --cfg job, --info, hydra.* settings) go to Hydra's app
(utils/cli/hydra_app.py), which runs each point through `run` (utils/cli/local_launch.py).

Options: --cfg prints the resolved config and exits; --help prints this text.
Groups: model= data= precision= parallel= optim= experiment= (see config/ for the presets).
Sweeps: -m key=a,b ... runs every point (hydra/launcher=submitit_local|submitit_slurm to launch them as jobs);
Hydra's --cfg job|hydra|all, --info, hydra.run.dir=DIR and hydra.sweep.dir=DIR work as in any Hydra app.
"""


def main(argv: list[str] | None = None) -> int:
    """`python train.py ...`: the exit status (a user error: one line on stderr and exit 2)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--help" in argv or "-h" in argv:
        print(USAGE)
        return 0
    from utils import ConfigError, exit_bad_input, require_torch

    try:
        require_torch()
    except ConfigError as err:
        exit_bad_input(err)
    # Imported here, not at the top: `--help` answers at once without loading torch and Hydra. The trainer too
    # (`run` would import it): the collector resumes once the imports are done (utils/startup.py).
    from utils.cli import hydra_app
    from utils.cli.local_launch import run_command
    from utils.engine import build  # noqa: F401
    from utils.startup import imports_done

    imports_done()
    return hydra_app.main(argv) if is_hydra_command(argv) else run_command(argv)
