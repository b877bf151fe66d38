"""The run directory's name from the command line: the digest of the settings overridden beyond the presets.

The digest composes the chosen presets alone (Hydra) and compares them with the run's config; the rest of
the run directory (its name, resumption, run facts) is utils/checkpoints/run_dir.py's.
"""

from __future__ import annotations

import hashlib

from omegaconf import OmegaConf

from utils.checkpoints.run_dir import differences
from utils.cli.config import compose_config
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
