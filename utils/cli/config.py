"""The config tree: typed schemas registered with Hydra, composition from the command line, errors.

`load_config(argv)` composes config/config.yaml with the command-line overrides (Hydra's compose API,
version_base pinned), and `typed_config` converts once to dataclasses with OmegaConf.to_object (which
runs every schema's __post_init__ validation); every Hydra/OmegaConf failure becomes a one-line
ConfigError. Hydra's app (utils/cli/hydra_app.py) hands `typed_config` the config it composed for a sweep
point. Below the entry point nothing sees a DictConfig.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hydra import compose, initialize_config_dir
from hydra.core.config_store import ConfigStore
from hydra.core.global_hydra import GlobalHydra
from hydra.errors import ConfigCompositionException, MissingConfigException, OverrideParseException
from omegaconf import MISSING, DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from distributed.pipeline.stage_plan import SPLIT_BACKWARD, resolve_plan
from utils import ConfigError, require
from utils.comm import ParallelConfig
from utils.data.batching import WORKER_STARTS
from utils.engine.optim import OptimConfig
from utils.engine.precision import PrecisionConfig
from utils.tasks import MODELS, check_pairing

CONFIG_DIR = Path(__file__).resolve().parents[2] / "config"
GROUPS = ("model", "data", "precision", "parallel", "optim", "experiment")


@dataclass
class TrainerConfig:
    """Schema of the `trainer` section: how long, how big, how often."""

    max_steps: int = 300  # optimizer steps of the whole run (the schedule spans them)
    global_batch_size: int = 16  # samples per optimizer step, over all data-parallel ranks
    seed: int = 0  # seeds weights, data order and dropout; same seed = same run in any layout
    log_every: int = 10  # steps between log lines (TensorBoard gets every step)
    val_every: int = 100  # steps between validations (0 = only at the end)
    val_at_start: bool = True  # also validate before the first step, so val curves start where training does
    ckpt_every: int = 100  # steps between checkpoints (0 = only at the end)
    ckpt_keep: int = 2  # checkpoints kept on disk
    resume: str = "auto"  # auto (latest of run.dir) | never | PATH to a step_* folder
    init_from: str | None = None  # fine-tuning: a step_* folder (any layout) whose model weights a new run
    # starts from, its optimizer, schedule and step afresh (ignored once the run has checkpoints of its own)
    num_workers: int = 2  # DataLoader worker processes per rank
    worker_start: str = "forkserver"  # forkserver | spawn | fork: how data workers start (see utils/data/batching)
    grad_accum_steps: int = 1  # micro-batches per optimizer step (gradient accumulation)
    activation_checkpointing: bool = False  # recompute each block's activations in backward
    rollout_every: int = 0  # ERA5: steps between rollout evaluations, and one at the end (0 = none)
    rollout_steps: int = 20  # ERA5: autoregressive steps of data.dt per rollout (20 x 6 h = 5 days)
    rollout_inits: int = 8  # ERA5: initial times of the validation split, evenly spaced
    rollout_train_steps: int = 1  # ERA5: predicted steps per training sample, the loss their mean (1 = one-step)
    rollout_train_every: int = 0  # ERA5 curriculum: K = min(rollout_train_steps, 1 + step // this) (0: K at once)
    stop_at_step: int | None = None  # end this invocation after this step with a checkpoint (job time limits)
    preempt_deadline_s: float = 120.0  # after SIGTERM/SIGUSR1: seconds to finish the step and checkpoint
    nonfinite: str = "stop"  # stop | skip: a non-finite loss or grad norm ends the run, or skips the update
    max_skipped_steps: int = 10  # with nonfinite=skip: stop after this many consecutive skipped steps
    # auto: a GPU per local rank (refused with fewer GPUs than ranks), or the CPU without GPUs | cpu
    device: str = "auto"
    hang_timeout_s: float = 1800.0  # a rank with no progress this long dumps its stacks and exits; 0 = off
    ckpt_async: bool = False  # write checkpoints from a background thread (one in flight) while training goes on
    profile: bool = False  # torch.profiler trace and top-operator table of profile_steps (utils/engine/profiling.py)
    profile_steps: list[int] = field(default_factory=lambda: [3, 5])  # [start, end], steps counted from 1
    profile_memory: bool = False  # CUDA allocator history, written at the end step and on out-of-memory
    fingerprint_steps: int = 0  # first steps whose per-parameter gradient and update statistics go to
    # run.dir/fingerprints.json, for `python -m utils.compare --diverge` (utils/engine/fingerprints.py); 0 = off

    def __post_init__(self):
        for name in ("max_steps", "global_batch_size", "log_every", "grad_accum_steps", "ckpt_keep"):
            value = getattr(self, name)
            require(value > 0, f"{name} must be positive, got {value}", f"trainer.{name}", "set a positive integer")
        for name in ("rollout_steps", "rollout_inits", "rollout_train_steps"):
            require(getattr(self, name) > 0, f"{name} must be positive", f"trainer.{name}", "set a positive integer")
        for name in ("val_every", "ckpt_every", "num_workers", "rollout_every", "rollout_train_every",
                     "fingerprint_steps"):
            require(getattr(self, name) >= 0, f"{name} must be >= 0", f"trainer.{name}", "set 0 or more")
        require(self.stop_at_step is None or self.stop_at_step > 0, "stop_at_step must be positive",
                "trainer.stop_at_step", "set null or a positive step")
        require(bool(self.resume), "resume is empty", "trainer.resume", "use auto, never or a checkpoint path")
        require(self.worker_start in WORKER_STARTS, f"unknown worker start method {self.worker_start!r}",
                "trainer.worker_start", "choose " + ", ".join(WORKER_STARTS))
        require(self.nonfinite in ("stop", "skip"), f"unknown nonfinite policy {self.nonfinite!r}",
                "trainer.nonfinite", "choose stop or skip")
        require(self.max_skipped_steps > 0, "max_skipped_steps must be positive", "trainer.max_skipped_steps",
                "set a positive number of steps")
        require(self.device in ("auto", "cpu"), f"unknown device {self.device!r}", "trainer.device",
                "choose auto or cpu")
        require(self.hang_timeout_s >= 0, "hang_timeout_s must be >= 0", "trainer.hang_timeout_s",
                "set 0 (off) or the seconds a step, validation or checkpoint may take at most")
        steps = self.profile_steps
        require(len(steps) == 2 and 1 <= steps[0] <= steps[1], f"bad profile_steps {list(steps)}",
                "trainer.profile_steps", "give [start,end] with 1 <= start <= end, e.g. [5,7]")
        require(self.preempt_deadline_s > 0, "preempt_deadline_s must be positive", "trainer.preempt_deadline_s",
                "set the seconds a stop signal leaves to finish the step and write the checkpoint")


@dataclass
class RunConfig:
    """Schema of the `run` section: where a run writes."""

    dir: str | None = None  # everything a run writes; None = <root>/<model>-<data>-<layout>-<precision>[-<tag>]
    root: str = "outputs"  # parent of default run directories (`tensorboard --logdir outputs`)
    tag: str = ""  # appended to the default run directory name, to tell runs apart

    def __post_init__(self):
        require(re.fullmatch(r"[A-Za-z0-9_.+=-]*", self.tag) is not None and self.tag not in (".", ".."),
                f"run.tag {self.tag!r} is not a plain name", "run.tag",
                "use letters, digits and . _ - + = only (no /), or set run.dir for a folder of your own")


@dataclass
class Config:
    """The whole configuration of a run. Each group validates its own fields; the rules that tie two
    groups together are checked here, once, when the config is converted."""

    model: Any = MISSING  # a family's schema (utils/tasks/registry.py; config/model/)
    data: Any = MISSING  # the data schema of that family (config/data/)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    run: RunConfig = field(default_factory=RunConfig)

    def __post_init__(self):
        model, tp, cp = self.model, self.parallel.tp, self.parallel.cp
        check_pairing(self)  # the registry of model families (utils/tasks/)
        require(model.dropout == 0 or cp == 1 or self.parallel.cp_attention in ("allgather", "alltoall"),
                f"model.dropout={model.dropout} with parallel.cp={cp}: ring attention has no dropout",
                "parallel.cp_attention", "use parallel.cp_attention=allgather or alltoall, or model.dropout=0")
        if self.parallel.pp > 1:
            self.check_pipeline()
        if self.parallel.dp_mode == "fsdp":
            require(self.parallel.pp == 1 or self.parallel.pp_schedule not in SPLIT_BACKWARD,
                    f"parallel.dp_mode=fsdp with pp_schedule={self.parallel.pp_schedule}, which splits backward into "
                    "input and weight gradients around FSDP's gradient hooks", "parallel.dp_mode",
                    "use parallel.dp_mode=ddp, or pp_schedule=gpipe, 1f1b, interleaved_1f1b or looped_bfs")
            require(self.precision.mode != "fp16", "parallel.dp_mode=fsdp with precision=fp16: the loss scaler is not "
                    "verified with FSDP2's sharded gradients", "precision", "use precision=bf16 (or fp32) with fsdp")
        require(model.num_heads % tp == 0, f"model.num_heads={model.num_heads} is not divisible by parallel.tp={tp}",
                "parallel.tp", f"choose a parallel.tp that divides {model.num_heads}, or model.num_heads a "
                "multiple of parallel.tp")
        split = {"alltoall": cp, "hierarchical": self.parallel.cp_a2a}.get(self.parallel.cp_attention, 1)
        require(cp == 1 or model.num_heads % (tp * split) == 0,
                f"parallel.cp_attention={self.parallel.cp_attention} splits each tp rank's "
                f"{model.num_heads // tp} heads over {split} ranks", "parallel.cp_attention",
                f"use a model.num_heads that is a multiple of {tp * split}, or parallel.cp_attention=ring or allgather")


    def check_pipeline(self) -> None:
        par = self.parallel
        plan = resolve_plan(par.pp_schedule, par.pp, par.pp_stages_per_rank, par.pp_microbatches, self.model.depth)
        require(not (self.precision.compile and plan.schedule in SPLIT_BACKWARD),
                f"pp_schedule={plan.schedule} splits backward into input and weight gradients, which torch cannot "
                "do for compiled blocks (pytorch#161904)", "precision.compile",
                "set precision.compile=false, or use pp_schedule=gpipe, 1f1b, interleaved_1f1b or looped_bfs")


def register_schemas() -> None:
    cs = ConfigStore.instance()
    cs.store(name="config_schema", node=Config)
    for spec in MODELS.values():  # config/model/*.yaml and config/data/*.yaml start from these
        cs.store(group="model", name=f"{spec.arch}_schema", node=spec.schema)
        cs.store(group="data", name=f"{spec.task.DATA_KIND}_schema", node=spec.task.DATA_SCHEMA)
    cs.store(group="precision", name="precision_schema", node=PrecisionConfig)
    cs.store(group="parallel", name="parallel_schema", node=ParallelConfig)
    cs.store(group="optim", name="optim_schema", node=OptimConfig)


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
            return ConfigError(f"unknown {group} preset '{choice}'", setting,
                               f"choose one of {', '.join(presets(group))}")
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
