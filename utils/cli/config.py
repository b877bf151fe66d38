"""The config tree's composition: the typed schemas (utils/schema.py) registered with Hydra, the command line, errors.

`load_config(argv)` composes config/config.yaml with the command-line overrides (Hydra's compose API,
version_base pinned), and `typed_config` converts once to dataclasses with OmegaConf.to_object (which
runs every schema's __post_init__ validation), then checks the pairing of model and data against the
registry of families (`utils.tasks.check_pairing`); every Hydra/OmegaConf failure becomes a one-line
ConfigError. Hydra's app (utils/cli/hydra_app.py) hands `typed_config` the config it composed for a sweep
point. Below the entry point nothing sees a DictConfig.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from contextlib import contextmanager
from pathlib import Path

from hydra import compose, initialize_config_dir
from hydra.core.config_store import ConfigStore
from hydra.core.global_hydra import GlobalHydra
from hydra.errors import ConfigCompositionException, MissingConfigException, OverrideParseException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from utils import ConfigError
from utils.schema import Config, OptimConfig, ParallelConfig, PrecisionConfig
from utils.tasks import check_pairing, task_of
from utils.tasks.registry import ENV, GROUP, MODEL_PRESETS, ORIGINS, families

CONFIG_DIR = Path(__file__).resolve().parents[2] / "config"
GROUPS = ("model", "data", "precision", "parallel", "optim", "experiment")


_STORED: dict[tuple[str | None, str], object] = {}  # (group, name) -> the schema stored under it, in this process


def _store(group: str | None, name: str, node) -> None:
    """ConfigStore's `store`, once per schema and process: storing converts the dataclass to a config (about a
    tenth of a second per composition under load, paid again by every run of a pooled or sweeping process)."""
    if _STORED.get((group, name)) is not node:
        ConfigStore.instance().store(group=group, name=name, node=node)
        _STORED[(group, name)] = node


def register_schemas() -> None:
    """The schemas, and the families' `model=` presets, in Hydra's ConfigStore; the families found first (the
    `dlscale.families` entry points and DLSCALE_FAMILIES: utils/tasks/registry.py `discover`)."""
    _store(None, "config_schema", Config)
    for spec in families().values():  # config/model/*.yaml and config/data/*.yaml start from these
        _store("model", f"{spec.arch}_schema", spec.schema)
        task = task_of(spec)
        for name, schema in task.DATA_SCHEMAS.items():  # the task's data sources, config/task/ its settings
            _store("data", f"{name}_schema", schema)
        _store("task", f"{task.TASK_SCHEMA().kind}_schema", task.TASK_SCHEMA)
    _store("precision", "precision_schema", PrecisionConfig)
    _store("parallel", "parallel_schema", ParallelConfig)
    _store("optim", "optim_schema", OptimConfig)
    files = presets("model") if MODEL_PRESETS else []
    for name, node in MODEL_PRESETS.items():
        if name in files:
            family, setting = ORIGINS[f"preset model={name}"]
            raise ConfigError(f"preset model={name} of {family} is config/model/{name}.yaml already", setting,
                              "give the preset another name in PRESETS")
        _store("model", name, node)


def presets(group: str) -> list[str]:
    """The presets a user chooses from; a file named _* is a block other presets start from (experiment/_base)."""
    return sorted(p.stem for p in (CONFIG_DIR / group).glob("*.yaml") if not p.stem.startswith("_"))


def _setting_of(message: str, argv: list[str]) -> str:
    """The command-line override an error message is about (or the whole command line)."""
    for arg in argv:
        key = arg.split("=", 1)[0].lstrip("+~")
        if f"'{key}'" in message or f" {arg}" in message or f" {key}=" in message or f"'{arg}'" in message:
            return arg
    return "command line"


def _translate(err: Exception, argv: list[str]) -> ConfigError:
    """Hydra/OmegaConf exceptions -> one-line ConfigError naming the setting and the fix."""
    message = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    setting = _setting_of(str(err), argv)
    if isinstance(err, MissingConfigException):
        group = next((g for g in GROUPS if f"'{g}/" in str(err)), None)
        if group:
            choice = setting.split("=", 1)[-1]
            if group != "model":
                return ConfigError(f"unknown {group} preset '{choice}'", setting,
                                   f"choose one of {', '.join(presets(group))}")
            return ConfigError(f"unknown {group} preset '{choice}'", setting, f"choose one of "
                               f"{', '.join(sorted([*presets(group), *MODEL_PRESETS]))}; a family out of this "
                               f"tree brings its own: {ENV}=<module> or a {GROUP} entry point (docs/architecture.md)")
        options = re.findall(r"^\t(\S+)$", str(err).split("Config search path")[0], re.M)  # Hydra's groups
        launchers = " (the submitit launchers come with `pip install .[slurm]`)" if "hydra/launcher" in message else ""
        return ConfigError(message, setting, f"choose one of {', '.join(options)}{launchers}" if options
                           else "check the preset name")
    if isinstance(err, OverrideParseException):
        return ConfigError(f"cannot parse override: {message}", setting, "write overrides as key=value")
    cause = err.__cause__ if isinstance(err, ConfigCompositionException) else err
    if cause is not None and "not in struct" in str(cause) or "Could not override" in message:
        hydra = setting.lstrip("+~").startswith("hydra")
        return ConfigError(f"unknown setting '{setting.split('=', 1)[0]}'", setting, "check the spelling; `python "
                           f"train.py {'--cfg hydra hydra/launcher=...' if hydra else '--cfg'}` prints every setting")
    if "Ambiguous value" in message:
        return ConfigError(message, setting, "add -m to run one run per value, or quote a value with commas")
    detail = str(cause).strip().splitlines()[0] if cause is not None and str(cause).strip() else message
    return ConfigError(f"bad value: {detail}", setting, "give a value of the type the setting expects")


@contextmanager
def project_hydra():
    """Hydra initialized on config/ for the compose API, also inside Hydra's app (a sweep point), whose
    GlobalHydra cannot be initialized twice: it is set aside meanwhile and put back after."""
    outer = GlobalHydra.instance().hydra
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(version_base="1.3", config_dir=str(CONFIG_DIR), job_name="train"):
            yield
    finally:
        if outer is not None:
            GlobalHydra.instance().initialize(outer)


def compose_config(argv: list[str]):
    """The composed DictConfig (with the hydra node, its runtime.choices included) for these overrides."""
    for arg in argv:
        if arg.startswith(("+", "~")) and not arg.lstrip("+~").startswith("hydra"):
            raise ConfigError(f"adding or deleting settings is not supported ('{arg}')", arg.lstrip("+~").split("=")[0],
                              "set an existing key as key=value; `python train.py --cfg` prints them")
    register_schemas()
    with project_hydra():
        try:
            return compose(config_name="config", overrides=list(argv), return_hydra_config=True)
        except (ConfigCompositionException, MissingConfigException, OverrideParseException,
                OmegaConfBaseException) as err:
            raise _translate(err, argv) from None


def typed_config(job: DictConfig, choices: Mapping, argv: list[str]) -> tuple[Config, dict[str, str], str]:
    """(typed config, chosen preset per group, YAML) of a composed config without its hydra node, given
    hydra.runtime.choices; `argv` (the overrides it was composed with) names the setting of an error."""
    try:
        cfg = OmegaConf.to_object(job)
    except OmegaConfBaseException as err:
        if isinstance(err.__cause__, ConfigError):
            raise err.__cause__ from None
        raise _translate(err, argv) from None
    check_pairing(cfg)
    return cfg, {g: str(choices.get(g)) for g in GROUPS}, OmegaConf.to_yaml(job)


def load_config(argv: list[str]) -> tuple[Config, dict[str, str], str]:
    """(typed config, chosen preset per group, resolved YAML) for these command-line overrides."""
    composed = compose_config(argv)
    choices = OmegaConf.to_container(composed.hydra.runtime.choices)
    del composed.hydra
    return typed_config(composed, choices, argv)


def sweep_points(overrides: list[str]) -> list[list[str]]:
    """The overrides of every point of a basic sweep, as Hydra's BasicSweeper expands them (a,b choice(...)
    range(...) glob(...); -m key=a,b)."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    register_schemas()
    with project_hydra():
        try:
            parser = OverridesParser.create(config_loader=GlobalHydra.instance().config_loader())
            return BasicSweeper.split_arguments(parser.parse_overrides(overrides), None)[0]
        except HydraException as err:
            raise _translate(err, overrides) from None
