"""Train a model: `python train.py [model=...] [data=...] [precision=...] [parallel=...] [key=value ...]`.

Thin entry: compose the config, validate it against the data and the launch, build the grid, the
task and the trainer, and fit. Also runs under torchrun and srun. Started as one process for a layout
of several ranks (tp*cp*pp*dp > 1 with dp given, or tp*cp*pp > 1), it starts them itself on this
machine, one GPU each when there are enough, else CPU processes (`train_mp.py`, which it hands over to).
"""

import sys

from utils.errors import ConfigError, exit_bad_input

USAGE = __doc__ + """
Options: --cfg prints the resolved config and exits; --help prints this text.
Groups: model= data= precision= parallel= optim= experiment= (see config/ for the presets).
"""


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--help" in argv or "-h" in argv:
        print(USAGE)
        return 0
    # Imported here, not at the top: `--help` answers at once without loading torch and Hydra.
    from utils.build import build_run
    from utils.comm import destroy_grid
    from utils.config import load_config
    from utils.launch import launch_env, ranks_needed

    try:
        cfg, choices, config_yaml = load_config([a for a in argv if a != "--cfg"])
        if "--cfg" in argv:
            print(config_yaml)
            return 0
        if launch_env().source == "single" and ranks_needed(cfg.parallel) > 1:
            import train_mp  # the ranks are this machine's: start them (their launch_env says torchrun)

            return train_mp.main(argv)
        trainer = build_run(cfg, choices, config_yaml)
        return trainer.fit()
    except ConfigError as err:
        exit_bad_input(err)
    finally:
        destroy_grid()


if __name__ == "__main__":
    sys.exit(main())
