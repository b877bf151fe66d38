"""The run directory: its name, safe resumption of its checkpoints, and the run facts beside them.

A default run.dir is <root>/<model>-<data>-<layout>-<precision>[-<experiment>][-<digest>][-<tag>], where
the digest (6 hex digits, composed from the presets by utils/cli/runs.py) appears when settings beyond the
presets were overridden: two runs that train different things never share a directory (and so never resume
each other's checkpoints). Before a run continues from a checkpoint, its config is compared with the one the
run directory was started with; only settings that do not change the training (logging cadence, workers,
paths, ...) may differ.

Run facts are data: beside config.yaml, rank 0 writes layout.json at each launch (`write_layout`: axis
sizes, order, world size, the ranks of every group of each axis, the axes of the grid's concepts, the
signature) and task.json (`write_task`: the model and data family, the metric a run is judged by), and the
command line writes presets.json (`preset_facts`: the preset chosen per group); tools and tests read them
(`read_layout`, `read_facts`) instead of log text. Below the engine and the command line, which both use it.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from omegaconf import OmegaConf

from utils import ConfigError, require
from utils.comm import BATCH_AXES, METRIC_AXES, REPLICA_AXES, SAME_BATCH_AXES, Grid
from utils.schema import Config

if TYPE_CHECKING:
    from utils.tasks import Task

# Settings a run may change between invocations without changing what it trains.
RESUME_SAFE = ("run.", "trainer.stop_at_step", "trainer.resume", "trainer.log_every",
               "trainer.val_every", "trainer.val_at_start", "trainer.log_images",
               "trainer.ckpt_every", "trainer.ckpt_keep", "trainer.num_workers", "trainer.worker_start",
               "trainer.preempt_deadline_s", "trainer.hang_timeout_s", "trainer.profile", "precision.compile",
               "trainer.activation_checkpointing", "trainer.ckpt_async", "trainer.grad_accum_steps", "data.root",
               "data.cache_dir", "data.sample_tokens",
               "task.eval.",  # the forecast evaluation (utils/weather/task/weather.py)
               "parallel.")  # checkpoints load under any layout (utils/checkpoints/checkpointer.py)


def flat_config(config_yaml: str) -> dict[str, object]:
    """A resolved config as {"section.key": value} (lists stay lists)."""
    def walk(node, prefix):
        if isinstance(node, dict):
            for key, value in node.items():
                yield from walk(value, f"{prefix}{key}.")
        else:
            yield prefix[:-1], node

    return dict(walk(OmegaConf.to_container(OmegaConf.create(config_yaml)), ""))


def differences(old_yaml: str, new_yaml: str) -> list[str]:
    """'key: old -> new' for every setting that changes what is trained."""
    old, new = flat_config(old_yaml), flat_config(new_yaml)
    keys = sorted(k for k in old.keys() | new.keys() if not k.startswith(RESUME_SAFE) and old.get(k) != new.get(k))
    return [f"{k}: {old.get(k)} -> {new.get(k)}" for k in keys]


# The preset groups whose choice a settings diff names first, with the sections each preset fills (a data preset
# chooses the task section too); parallel is left out: any layout resumes (RESUME_SAFE).
PRESET_SECTIONS = {"model": ("model",), "data": ("data", "task"), "precision": ("precision",), "optim": ("optim",),
                   "experiment": ()}
IDENTITY_KEYS = ("arch", "kind", "name", "mode")  # the key that names a section's family: model.arch, data.kind, ...


def shown_value(value: object, width: int = 32) -> str:
    """A setting's value, short: a long list as its length ('20 entries'), a long text cut ('...')."""
    if isinstance(value, list) and len(str(value)) > width:
        return f"{len(value)} entries"
    text = str(value)
    return text if len(text) <= width else text[:width - 3] + "..."


def changed_settings(old_yaml: str, new_yaml: str, old_presets: dict | None = None, new_presets: dict | None = None,
                     ignore: tuple[str, ...] = RESUME_SAFE) -> list[str]:
    """What tells two configs apart, most telling first: the presets chosen differently ('model=vit_tiny ->
    gpt_tiny', when both choices are known), the settings outside those presets' sections (the user's own
    overrides), then theirs; in each, the family keys (model.arch, data.kind, ...) first and the settings both
    sides have before those one side lacks.
    Long lists are counted ('data.channels: 20 of 20 entries changed'), a mapping of many changed entries is one
    item ('task.variable_weights: 13 entries changed'). Settings starting with `ignore` are left out."""
    old, new = flat_config(old_yaml), flat_config(new_yaml)
    keys = [k for k in old.keys() | new.keys() if not k.startswith(ignore) and old.get(k) != new.get(k)]
    known = old_presets is not None and new_presets is not None
    groups = [g for g in PRESET_SECTIONS if known and old_presets.get(g) != new_presets.get(g)]
    preset_sections = {s for g in groups for s in PRESET_SECTIONS[g]}
    parents: dict[str, list[str]] = {}
    for k in keys:
        if k.count(".") >= 2:
            parents.setdefault(k.rsplit(".", 1)[0], []).append(k)
    merged = {parent for parent, members in parents.items() if len(members) > 2}
    items = {k: _changed(k, old.get(k), new.get(k)) for k in keys if k.rsplit(".", 1)[0] not in merged}
    items |= {parent: f"{parent}: {len(parents[parent])} entries changed" for parent in merged}

    def rank(k: str) -> tuple:
        return (k.split(".")[0] in preset_sections, k.rsplit(".", 1)[-1] not in IDENTITY_KEYS,
                k not in old or k not in new, k)

    lead = [f"{g}={old_presets.get(g)} -> {new_presets.get(g)}" for g in groups]
    return lead + [items[k] for k in sorted(items, key=rank)]


def _changed(key: str, old: object, new: object) -> str:
    if isinstance(old, list) and isinstance(new, list) and len(old) == len(new) and len(str(old)) > 32:
        return f"{key}: {sum(a != b for a, b in zip(old, new))} of {len(old)} entries changed"
    return f"{key}: {shown_value(old)} -> {shown_value(new)}"


def summary(items: list[str], shown: int = 4) -> str:
    """The first `shown` items of a settings diff, '; '-joined, and how many more there are."""
    more = len(items) - shown
    return "; ".join(items[:shown]) + (f"; and {more} more" if more > 0 else "")


def run_dir_for(cfg: Config, choices: dict[str, str], layout: str, digest: str) -> Path:
    """run.dir, or the default name, derived identically on every rank; `digest` names the settings overridden
    beyond the presets (utils/cli/runs.py `run_digest`, '' when none are)."""
    if cfg.run.dir:
        return Path(cfg.run.dir)
    parts = [choices["model"], choices["data"], layout, cfg.precision.mode]
    if choices.get("experiment") not in (None, "None", "null"):
        parts.append(choices["experiment"])
    parts += [p for p in (digest, cfg.run.tag) if p]
    return Path(cfg.run.root) / "-".join(parts)


def prepare_run_dir(run_dir: Path) -> None:
    """Create run.dir and check that this rank can write there (every rank, before any work)."""
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=run_dir, prefix=".write_test"):
            pass
    except OSError as err:
        raise ConfigError(f"run directory {run_dir} cannot be used ({err.strerror or err})", "run.dir",
                          "choose a folder this job can create and write, or another run.root") from None


def check_resumable(run_dir: Path, config_yaml: str, presets: dict[str, str] | None = None) -> None:
    """Refuse to continue a run directory's checkpoints under a config that trains something else. `presets`: the
    new run's chosen preset per group, which the diff names first when the run directory recorded its own
    (presets.json)."""
    saved = run_dir / "config.yaml"
    if not (saved.is_file() and (run_dir / "checkpoints" / "latest").is_file()):
        return
    old = saved.read_text()
    if differences(old, config_yaml):
        recorded = read_facts(run_dir, PRESETS_FILE)
        changed = changed_settings(old, config_yaml, recorded, presets and preset_facts(presets))
        named = flat_config(config_yaml).get("run.dir") is not None  # run.tag names only a default run.dir
        raise ConfigError(f"{run_dir} holds checkpoints of a run with other settings ({summary(changed)})", "run.dir",
                          ("set" if named else "set run.tag=<name> or") + " run.dir=<new folder>, or "
                          "trainer.resume=never to start it over")


LAYOUT_FILE = "layout.json"  # the resolved layout of a run's last launch, beside config.yaml
TASK_FILE = "task.json"  # the workload of the run: model and data family, quality metric
PRESETS_FILE = "presets.json"  # the preset chosen per group ({"model": "vit_tiny", ..., "experiment": null})


def preset_facts(choices: dict[str, str]) -> dict[str, str | None]:
    """What presets.json holds: the command line's choice per group (Hydra's 'None' for none as null)."""
    return {group: None if choice in (None, "None", "null") else str(choice) for group, choice in choices.items()}


def layout_facts(grid: Grid) -> dict[str, object]:
    """The resolved layout as plain data: what layout.json holds."""
    axes = lambda group: [a.value for a in group]  # noqa: E731
    return {"world_size": grid.world_size, "order": axes(grid.order),
            "sizes": {a.value: grid.sizes[a] for a in grid.order}, "name": grid.name, "signature": grid.signature,
            "groups": {a.value: grid.layout[a] for a in grid.order},  # the ranks of every group of each axis
            "concepts": {"batch": axes(BATCH_AXES), "replicas": axes(REPLICA_AXES),
                         "same_batch": axes(SAME_BATCH_AXES), "metrics": axes(METRIC_AXES)}}


def write_facts(run_dir: Path, name: str, facts: dict[str, object]) -> Path:
    """Write a run fact file into run.dir atomically (a reader sees the old file or the new one, never a part)."""
    path = Path(run_dir) / name
    partial = path.with_name(f".{name}.{os.getpid()}")  # same folder: the rename is atomic
    partial.write_text(json.dumps(facts, indent=1) + "\n")
    os.replace(partial, path)
    return path


def read_facts(run_dir: Path, name: str) -> dict[str, object] | None:
    """A run fact file, or None for a run directory without one (written before it existed)."""
    path = Path(run_dir) / name
    return json.loads(path.read_text()) if path.is_file() else None


def write_layout(run_dir: Path, grid: Grid) -> Path:
    return write_facts(run_dir, LAYOUT_FILE, layout_facts(grid))


def task_facts(cfg: Config, task: Task) -> dict[str, object]:
    """What task.json holds: the model family, the data family, the metric a run is judged by, and the
    vocabulary size of a language model (export to Hugging Face drops the padding rows by it)."""
    facts = {"arch": cfg.model.arch, "data": cfg.data.kind, "quality_metric": task.quality_metric,
             "tokens_per_sample": task.tokens_per_sample()}
    vocab = getattr(task, "vocab_size", None)  # the language models: the tokenizer's (unpadded) vocabulary
    return facts if vocab is None else {**facts, "vocab_size": vocab}


def write_task(run_dir: Path, cfg: Config, task: Task) -> Path:
    return write_facts(run_dir, TASK_FILE, task_facts(cfg, task))


def read_layout(run_dir: Path) -> dict[str, object] | None:
    """A run's layout.json (see `layout_facts`), or None for a run directory without one."""
    return read_facts(run_dir, LAYOUT_FILE)

def complete_step(folder: Path) -> bool:
    """A step folder whose COMPLETE marker is present and names only files that are there."""
    from utils.checkpoints.checkpointer import Checkpointer

    marker = Checkpointer.marker(folder) if folder.is_dir() else None
    return marker is not None and isinstance(marker.get("files"), list) and all(
        (folder / name).is_file() for name in marker["files"])


def resolve_step(path: Path, setting: str, also: str = "") -> Path:
    """The step folder a tool should read for what a user has in hand: a step_* folder itself, a run
    directory or its checkpoints/ folder (the newest complete step), or checkpoints/latest (the step it
    names). Anything else is refused in one line that lists the complete steps that do exist nearby; `also`:
    what else the caller takes, named in the fix ("a Hugging Face model folder") unless steps are listed."""
    path = Path(path)
    if path.name == "latest" and path.is_file():
        path = path.parent / path.read_text().strip()
    if complete_step(path):
        return path
    folder = path / "checkpoints" if (path / "checkpoints").is_dir() else path
    if not path.name.startswith("step_") and folder.is_dir():
        steps = sorted((p for p in folder.glob("step_*") if complete_step(p)), reverse=True)
        require(bool(steps), f"{path} holds no complete checkpoint", setting,
                "train the run until it saves one (trainer.ckpt_every), or give a step_* folder"
                + (f", or {also}" if also else ""))
        return steps[0]
    nearby = path.parent if path.parent.name == "checkpoints" else folder / "checkpoints"
    steps = sorted(p.name for p in nearby.glob("step_*") if complete_step(p)) if nearby.is_dir() else []
    what = "is not a complete checkpoint" if path.is_dir() else "does not exist"
    fix = f"pick one of the complete steps in {nearby}: {', '.join(steps)}" if steps else \
        "give a run directory, its checkpoints/ folder or a step_* folder" + (f", or {also}" if also else "")
    raise ConfigError(f"{path} {what}", setting, fix)


def load_run(checkpoint: Path, data_kind: str, data_overrides: list[str] = ()):
    """(family, model config, data config) of the run a step folder belongs to (its run directory's
    config.yaml, through the family registry), for tools that read a checkpoint in one process. The run
    must train on `data_kind`; `data_overrides` ('data.KEY=VALUE') change where the data is read from."""
    from utils.tasks import task_of
    from utils.tasks.registry import families

    config = Path(checkpoint).parent.parent / "config.yaml"
    require(config.is_file(), f"{checkpoint} is not a step folder of a run directory (no {config})", "CHECKPOINT",
            "give run.dir/checkpoints/step_NNNNNNN of a run train.py wrote")
    raw = OmegaConf.load(config)
    family = families().get(raw.model.arch)  # a discovered family's run too (DLSCALE_FAMILIES, entry points)
    fits = [f.name for f in families().values() if task_of(f).DATA_KIND == data_kind]
    require(family is not None and task_of(family).DATA_KIND == data_kind, f"{checkpoint} is a checkpoint of the "
            f"{raw.model.arch} model, not of a {' or '.join(fits)} model", "CHECKPOINT",
            f"give a checkpoint of a {' or '.join(fits)} run")
    require(all(a.startswith("data.") and "=" in a for a in data_overrides), f"bad settings {data_overrides}",
            "data.KEY=VALUE", "give only data settings, e.g. data.root=/path/to/data")
    extra = OmegaConf.from_dotlist(list(data_overrides)).get("data", {})
    try:
        model = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(family.schema), raw.model))
        task = task_of(family)
        schema = task.DATA_SCHEMAS[raw.data.get("kind", task.DATA_KIND)]
        data = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(schema), raw.data, extra))
    except Exception as err:  # OmegaConf's validation errors, or a schema's own ConfigError
        if isinstance(err, ConfigError):
            raise
        raise ConfigError(f"the run's config does not fit this version ({err})", "CHECKPOINT",
                          "use the version of the project that trained it") from None
    return family, model, data
