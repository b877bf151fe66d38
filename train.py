"""Train a model: `python train.py [model=...] [data=...] [precision=...] [parallel=...] [key=value ...]`.

Thin entry: compose the config, validate it against the data and the launch, build the grid, the
task and the trainer, and fit. Also runs under torchrun and srun. Started as one process for a layout
of several ranks (tp*cp*pp*dp > 1 with dp given, or tp*cp*pp > 1), it starts them itself on this
machine, one GPU each when there are enough, else CPU processes (`train_mp.py`, which it hands over to).
Sweeps and Hydra's own flags (-m, --cfg job, --info, hydra.* settings) go to Hydra's app
(utils/hydra_app.py), which runs each point through `run` below.
"""

import sys

from utils.errors import ConfigError, exit_bad_input
from utils.hydra_app import is_hydra_command

USAGE = __doc__ + """
Options: --cfg prints the resolved config and exits; --help prints this text.
Groups: model= data= precision= parallel= optim= experiment= (see config/ for the presets).
Sweeps: -m key=a,b ... runs every point (hydra/launcher=submitit_local|submitit_slurm to launch them as jobs);
Hydra's --cfg job|hydra|all, --info, hydra.run.dir=DIR and hydra.sweep.dir=DIR work as in any Hydra app.
"""


def starts_local_ranks(cfg) -> bool:
    """Started as one process for a layout of several ranks: they are this machine's to start."""
    from utils.launch import launch_env, ranks_needed

    return launch_env().source == "single" and ranks_needed(cfg.parallel) > 1


def run(cfg, choices: dict[str, str], config_yaml: str, argv: list[str]) -> int:
    """Train one configured run here, or hand it to `train_mp.py` (same `argv`), which starts the local ranks
    of its layout (their launch_env says torchrun)."""
    from utils.build import build_run

    if starts_local_ranks(cfg):
        import train_mp

        return train_mp.main(argv)
    return build_run(cfg, choices, config_yaml).fit()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--help" in argv or "-h" in argv:
        print(USAGE)
        return 0
    if is_hydra_command(argv):
        from utils import hydra_app

        return hydra_app.main(argv)
    # Imported here, not at the top: `--help` answers at once without loading torch and Hydra.
    from utils.comm import destroy_grid
    from utils.config import load_config

    try:
        cfg, choices, config_yaml = load_config([a for a in argv if a != "--cfg"])
        if "--cfg" in argv:
            print(config_yaml)
            return 0
        return run(cfg, choices, config_yaml, argv)
    except ConfigError as err:
        exit_bad_input(err)
    finally:
        destroy_grid()


if __name__ == "__main__":
    sys.exit(main())
