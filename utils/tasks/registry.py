"""The registry of model families: `model.arch` -> its `networks.spec.ModelSpec`, and the presets they bring.

One way in, `add_family(module, ...)`, for every family: a family module (or any object) follows one contract,

    FAMILY = ModelSpec(...)                 # or FAMILIES = [ModelSpec(...), ...]
    PRESETS = {"toy_tiny": ToyConfig}       # optional: `model=` presets, each its schema (the dataclass) or an
                                            # instance of it, stored in Hydra's ConfigStore group `model`

and nothing happens when it is imported: the registry reads it. The built-in families are the folders of
networks/, found by a scan of that package: each of its packages is a family (their presets are
config/model/*.yaml). The others are found too, not listed here:
`discover()` adds the families of installed distributions' entry points of group `dlscale.families`
(`[project.entry-points."dlscale.families"] toy = "mypkg.family"`) and of the modules DLSCALE_FAMILIES names
(`DLSCALE_FAMILIES=tests.toy_family python train.py model=toy_tiny data=wikitext_sample`, comma-separated, for
a family on the path but not installed). It runs before the config is composed (utils/cli/config.py
`register_schemas`) and where a run's config is read back (`families()`): once per process, and again only
for names added to DLSCALE_FAMILIES since; no module is imported unless an entry point or the variable names it.
A module that does not import or breaks the contract, or an arch or preset that is taken, is a one-line error
naming DLSCALE_FAMILIES or the entry point.

The config registers each family's schema and presets from here (utils/cli/config.py), checks the pairing of
model and data (`utils.tasks.check_pairing`) and builds the task and its model (`utils.tasks.build_task`,
`Task.build_model`) through it.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import pkgutil
import re
from collections.abc import Mapping

import networks
from networks.spec import ModelSpec
from utils import ConfigError, require

ENV = "DLSCALE_FAMILIES"  # comma-separated importable family modules
GROUP = "dlscale.families"  # the entry-point group of installed families
CONTRACT = ("define FAMILY = ModelSpec(...) (or FAMILIES = [ModelSpec(...), ...]) and PRESETS = {name: its schema "
            "or an instance of it} in it (docs/architecture.md)")

MODELS: dict[str, ModelSpec] = {}
MODEL_PRESETS: dict[str, object] = {}  # `model=` presets the families bring (config/model/*.yaml are the others)
# "model.arch 'toy'" or "preset model=toy_tiny" -> (the family module that brought it, where it was named)
ORIGINS: dict[str, tuple[str, str]] = {}
_DISCOVERED: set[str] = set()  # GROUP once its entry points are added, and each module of ENV added


def add_family(module: object, setting: str, name: str | None = None) -> tuple[ModelSpec, ...]:
    """Register the families and presets of a family module (see the module docstring): the same ones again are a
    no-op; a broken contract, or an arch or preset another module registered, is a ConfigError on `setting` (where
    the module was named: DLSCALE_FAMILIES, an entry point), registering nothing."""
    name = name or f"family module {getattr(module, '__name__', module)!r}"
    specs = _specs_of(module, setting, name)
    presets = _presets_of(module, specs, setting, name)
    entries = [(MODELS, spec.arch, spec, f"model.arch {spec.arch!r}") for spec in specs]
    entries += [(MODEL_PRESETS, preset, node, f"preset model={preset}") for preset, node in presets.items()]
    for table, key, new, kind in entries:
        if key in table and table[key] != new:
            rename = "the family another arch (its ModelSpec's and its schema's)" if table is MODELS else \
                "the preset another name in PRESETS"
            raise ConfigError(f"{kind} of {name} is registered already, by {ORIGINS[kind][0]}", setting,
                              f"give {rename}, or leave one of the two out")
    for table, key, new, kind in entries:
        table[key], ORIGINS[kind] = new, ORIGINS.get(kind, (name, setting))
    return specs


def _specs_of(module: object, setting: str, name: str) -> tuple[ModelSpec, ...]:
    """The contract's FAMILY or FAMILIES, checked: ModelSpecs of distinct archs."""
    require(hasattr(module, "FAMILY") or hasattr(module, "FAMILIES"), f"{name} defines no FAMILY or FAMILIES",
            setting, CONTRACT)
    specs = (module.FAMILY,) if hasattr(module, "FAMILY") else module.FAMILIES
    require(isinstance(specs, (list, tuple)) and len(specs) > 0, f"{name}'s FAMILIES is not a non-empty list",
            setting, CONTRACT)
    for spec in specs:
        require(isinstance(spec, ModelSpec), f"{name} gives a {type(spec).__name__} as a family, not a "
                "networks.spec.ModelSpec", setting, CONTRACT)
    archs = [spec.arch for spec in specs]
    require(len(set(archs)) == len(archs), f"{name} gives model.arch {archs} twice", setting,
            "give each family of the module its own arch")
    return tuple(specs)


def _presets_of(module: object, specs: tuple[ModelSpec, ...], setting: str, name: str) -> dict[str, object]:
    """The contract's PRESETS, checked: names a `model=` override can spell, each a schema of its families."""
    presets = getattr(module, "PRESETS", {})
    require(isinstance(presets, Mapping), f"{name}'s PRESETS is a {type(presets).__name__}, not a dict", setting,
            CONTRACT)
    schemas = tuple(spec.schema for spec in specs)
    for preset, node in presets.items():
        require(isinstance(preset, str) and re.fullmatch(r"[A-Za-z_][\w-]*", preset) is not None, f"{name}'s "
                f"preset name {preset!r} is not a name model= takes", setting, "name presets as words (toy_tiny)")
        cls = node if isinstance(node, type) else type(node)
        require(dataclasses.is_dataclass(node) and issubclass(cls, schemas), f"{name}'s preset {preset!r} is a "
                f"{cls.__name__}, not the schema of one of its families ({', '.join(s.__name__ for s in schemas)})",
                setting, "give the schema (the dataclass) or an instance of it")
    return dict(presets)


def discover(environ: Mapping[str, str] = os.environ) -> None:
    """Add the families of the `dlscale.families` entry points (once per process) and of the modules DLSCALE_FAMILIES
    names that are not added yet."""
    if GROUP not in _DISCOVERED:
        from importlib.metadata import entry_points

        for point in entry_points(group=GROUP):
            dist = point.dist.name if point.dist is not None else None
            setting = f"entry point {point.name} = {point.value} ({GROUP}{f' of {dist}' if dist else ''})"
            try:
                module = point.load()
            except (ImportError, AttributeError) as err:
                raise ConfigError(f"cannot load family {point.value!r}: {_first_line(err)}", setting,
                                  f"install what it needs, or uninstall {dist or 'the distribution declaring it'}") \
                    from None
            add_family(module, setting, f"family {point.value!r}")
        _DISCOVERED.add(GROUP)
    names = [n.strip() for n in environ.get(ENV, "").split(",") if n.strip()]
    add_modules([n for n in names if n not in _DISCOVERED])


def add_modules(names: list[str], setting: str = ENV) -> None:
    """Import and add family modules by name (what DLSCALE_FAMILIES does; tests call it in their process)."""
    for name in names:
        require(re.fullmatch(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*", name) is not None, f"{name!r} is not a module name",
                setting, f"give importable module names, comma-separated ({ENV}=mypkg.family,other.family)")
        try:
            module = importlib.import_module(name)
        except ImportError as err:
            missing = isinstance(err, ModuleNotFoundError) and err.name and (name + ".").startswith(err.name + ".")
            raise ConfigError(f"cannot import family module {name!r}: {_first_line(err)}", setting,
                              f"put the folder holding {name.split('.')[0]} on PYTHONPATH or install it, or check "
                              "the name" if missing else "install what it imports") from None
        add_family(module, setting)
        _DISCOVERED.add(name)


def families() -> dict[str, ModelSpec]:
    """Every registered family, those discovery finds included (`discover`)."""
    discover()
    return MODELS


def spec_of(arch: str) -> ModelSpec:
    """The family of `model.arch` (a one-line error naming the registered ones)."""
    if arch not in MODELS:
        discover()
    if arch not in MODELS:
        raise ConfigError(f"no model family {arch!r} is registered", "model.arch",
                          f"choose one of {', '.join(MODELS)}, or add its family ({ENV}=<module> or a {GROUP} "
                          "entry point)")
    return MODELS[arch]


def _first_line(err: Exception) -> str:
    return (str(err).strip().splitlines() or [type(err).__name__])[0]


def _scan() -> tuple[str, ...]:
    """Add the built-in families: each package of networks/ (a package scan, nothing listed; its modules are the
    building blocks the families share)."""
    archs = []
    for info in sorted(pkgutil.iter_modules(networks.__path__), key=lambda i: i.name):
        if info.ispkg:
            module = importlib.import_module(f"networks.{info.name}")
            archs += [spec.arch for spec in add_family(module, f"networks/{info.name}/",
                                                       "the built-in families")]
    return tuple(archs)


BUILT_IN = _scan()  # the archs of networks/'s packages (the combination matrix's families)
