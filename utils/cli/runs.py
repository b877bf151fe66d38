"""The run directory from the command line: the digest of the settings overridden beyond the presets, and the
folder a run will train in, checked before any work.

The digest composes the chosen presets alone (Hydra) and compares them with the run's config; the rest of
the run directory (its name, resumption, run facts) is utils/checkpoints/run_dir.py's. `check_run_dir` makes
the resume check of `build_run` (utils/engine/build.py) ahead of it, where the command line knows the chosen
presets (the refusal names them) and before a launcher starts ranks or a sweep trains its first point.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from omegaconf import OmegaConf

from utils.checkpoints.run_dir import check_resumable, differences, run_dir_for
from utils.cli.config import compose_config
from utils.comm import check_grid, layout_name, parse_order
from utils.launch_env import LaunchEnv
from utils.schema import Config


def override_digest(config_yaml: str, choices: dict[str, str]) -> str:
    """6 hex digits naming the settings that differ from the chosen presets ('' when none do)."""
    presets = compose_config([f"{g}={c}" for g, c in choices.items() if c not in ("None", "null")])
    del presets.hydra
    changed = differences(OmegaConf.to_yaml(presets), config_yaml)
    return hashlib.sha1("\n".join(changed).encode()).hexdigest()[:6] if changed else ""


def run_digest(cfg: Config, choices: dict[str, str], config_yaml: str) -> str:
    """The digest a default run directory's name carries (`utils.checkpoints.run_dir.run_dir_for`); '' with run.dir
    set, which needs none (and no composition)."""
    return "" if cfg.run.dir else override_digest(config_yaml, choices)


def planned_run_dir(cfg: Config, choices: dict[str, str], digest: str, world: int | None = None) -> Path:
    """The run directory `build_run` trains this run in when launched on `world` ranks (None: this process's
    launch, as read from the environment)."""
    sizes = check_grid(cfg.parallel, None if world is None else LaunchEnv(world_size=world))
    return run_dir_for(cfg, choices, layout_name(sizes, parse_order(cfg.parallel.order)), digest)


def check_run_dir(cfg: Config, choices: dict[str, str], config_yaml: str, digest: str,
                  world: int | None = None) -> Path:
    """The planned run directory, refused (ConfigError) when the run would continue checkpoints of other
    settings there (`check_resumable`, with the presets named); nothing is created."""
    from utils.engine.build import resume_run_dir

    run_dir = planned_run_dir(cfg, choices, digest, world)
    previous = resume_run_dir(cfg.trainer.resume, run_dir)
    if previous is not None:
        check_resumable(previous, config_yaml, choices)
    return run_dir
