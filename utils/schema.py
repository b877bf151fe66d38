"""The typed config tree: one dataclass per config group, the whole `Config`, and the checks they make.

The bottom of the code: it imports the standard library, the one-line `ConfigError` (utils/__init__.py) and
the pipeline's plan arithmetic (distributed/pipeline/stage_plan.py, pure and torch-free, in the same bottom
layer), so that every layer can take a typed `cfg` without importing the command line. Each schema validates
its own fields in `__post_init__`; `Config` checks the rules that tie two groups together. The rules that need
the registry of model families (which data fits which model, the task's own rules) are `utils.tasks`'
`check_pairing`, run by utils/cli/config.py's `typed_config` right after the conversion; the schemas of the
families and of their data live beside them (`networks/`, `utils/data/`). Composition with Hydra (config/ files,
command-line overrides, one-line errors for Hydra's) is utils/cli/config.py's.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from utils import require

AXIS_NAMES = ("tp", "cp", "dp", "pp")  # the grid's axes (utils/comm/__init__.py `Axis`), in default order
CP_VARIANTS = ("ring", "allgather", "alltoall", "hierarchical")  # parallel.cp_attention: distributed/context/
PRECISION_MODES = ("fp32", "tf32", "bf16", "fp16")
OPTIMIZERS = ("adam", "adamw")
# The pipeline schedules parallel.pp_schedule chooses from: name -> (torch.distributed.pipelining's class, the
# placement of its stages: one per rank, a loop of several, or a V of two); distributed/pipeline/ runs them.
SCHEDULES = {
    "gpipe": ("ScheduleGPipe", "single"),
    "1f1b": ("Schedule1F1B", "single"),
    "interleaved_1f1b": ("ScheduleInterleaved1F1B", "loop"),
    "looped_bfs": ("ScheduleLoopedBFS", "loop"),
    "interleaved_zero_bubble": ("ScheduleInterleavedZeroBubble", "loop"),
    "zbv": ("ScheduleZBVZeroBubble", "v"),
    "dualpipev": ("ScheduleDualPipeV", "v"),
}
# Schedules that split backward into input and weight gradients; torch refuses compiled stages there.
SPLIT_BACKWARD = ("interleaved_zero_bubble", "zbv", "dualpipev")

LR_SCHEDULES = ("cosine", "constant")
WORKER_STARTS = ("forkserver", "spawn", "fork")  # multiprocessing start methods for data workers
MISSING = "???"  # a required value (OmegaConf's MISSING): config/ files fill it


def order_names(order: str) -> tuple[str, ...]:
    """'tp-cp-dp-pp' -> axis names nearest first; missing axes are appended in default order."""
    names = [n for n in order.split("-") if n]
    for n in names:
        require(n in AXIS_NAMES, f"unknown axis '{n}' in order '{order}'", "parallel.order",
                f"use a '-'-separated permutation of {'-'.join(AXIS_NAMES)}")
    require(len(set(names)) == len(names), f"axis repeated in order '{order}'", "parallel.order",
            "name each axis at most once")
    return tuple(names) + tuple(a for a in AXIS_NAMES if a not in names)


@dataclass
class PrecisionConfig:
    """Schema of `precision=`: compute precision of the train step."""

    mode: str = "fp32"  # fp32 | tf32 (fp32 storage, TF32 matmuls on GPU) | bf16 | fp16 (autocast)
    compile: bool = False  # compile each transformer block with torch.compile

    def __post_init__(self):
        require(self.mode in PRECISION_MODES, f"unknown precision mode '{self.mode}'", "precision.mode",
                f"choose one of {', '.join(PRECISION_MODES)}")


@dataclass
class ParallelConfig:
    """Schema of `parallel=`: the grid of ranks. dp = world / (tp*cp*pp) unless set."""

    tp: int = 1  # tensor-parallel degree: attention heads and MLP hidden split over tp ranks
    cp: int = 1  # context-parallel degree: the sequence (patches/tokens) split over cp ranks
    pp: int = 1  # pipeline-parallel degree: consecutive blocks on pp ranks
    dp: int = 0  # data-parallel degree; 0 = derive from the world size
    order: str = "tp-cp-dp-pp"  # axes from nearest ranks to farthest (leftmost share a node)
    sequence_parallel: bool | None = None  # Megatron sequence parallelism under tp; None: on with GPUs, off on CPU
    sp_keep_gathered: bool = False  # SP: column-parallel layers keep the gathered input (t x memory, 1 gather less)
    cp_attention: str = "ring"  # ring | allgather | alltoall | hierarchical: how attention reaches other cp ranks' K/V
    cp_a2a: int = 2  # hierarchical: cp ranks per all-to-all group (nearest ranks of the cp axis), joined by a ring
    pp_schedule: str = "1f1b"  # gpipe|1f1b|interleaved_1f1b|looped_bfs|interleaved_zero_bubble|zbv|dualpipev
    pp_microbatches: int = 0  # microbatches per pipeline step (per grad_accum step); 0 = one per stage
    pp_stages_per_rank: int = 0  # stages per pp rank: 1 for gpipe/1f1b, 2 for zbv/dualpipev; 0 = that (2 for loops)
    dp_mode: str = "ddp"  # ddp (full replicas) | fsdp (FSDP2: weights, gradients, Adam state sharded over dp x cp)
    fsdp_reshard_after_forward: bool = True  # fsdp: free gathered weights after forward (ZeRO-3), else keep (ZeRO-2)
    # fsdp with several micro-batches per step: false, reduce-scatter once, in the last backward (each unit keeps its
    # unsharded gradient until then); true, every micro-batch (gradients stay sharded; k x the reduce-scatter bytes)
    fsdp_reduce_every_microbatch: bool = False
    init_timeout_s: int = 600  # timeout of collectives: a missing rank fails the job, never hangs

    def __post_init__(self):
        for name in ("tp", "cp", "pp"):
            value = getattr(self, name)
            require(isinstance(value, int) and value >= 1, f"{name} must be a positive integer, got {value}",
                    f"parallel.{name}", f"set parallel.{name}=1 or more")
        require(self.dp >= 0, f"dp must be >= 0, got {self.dp}", "parallel.dp", "use 0: dp from the world size")
        order_names(self.order)
        require(self.cp_attention in CP_VARIANTS, f"unknown cp_attention {self.cp_attention!r}",
                "parallel.cp_attention", "choose " + ", ".join(CP_VARIANTS))
        groups_fit = 1 < self.cp_a2a < self.cp and self.cp % self.cp_a2a == 0  # plant: hierarchical_accepts_one_group
        require(self.cp_attention != "hierarchical" or self.cp == 1 or groups_fit, "parallel.cp_attention=hierarchical"
                f" needs groups of parallel.cp_a2a={self.cp_a2a} ranks dividing parallel.cp={self.cp} into two or more",
                "parallel.cp_a2a",
                "set parallel.cp_a2a to a divisor of parallel.cp between 2 and cp/2 (e.g. the GPUs of a node)")
        require(self.pp_schedule in SCHEDULES, f"unknown pipeline schedule {self.pp_schedule!r}",
                "parallel.pp_schedule", "choose one of " + ", ".join(SCHEDULES))
        for name in ("pp_microbatches", "pp_stages_per_rank"):
            require(getattr(self, name) >= 0, f"{name} must be >= 0, got {getattr(self, name)}", f"parallel.{name}",
                    "set 0 (the default) or a positive integer")
        require(self.dp_mode in ("ddp", "fsdp"), f"unknown {self.dp_mode!r}", "parallel.dp_mode", "choose ddp or fsdp")
        require(self.init_timeout_s > 0, "timeout must be positive", "parallel.init_timeout_s", "set seconds")


@dataclass
class OptimConfig:
    """Schema of `optim=`: optimizer, learning rate and its schedule."""

    name: str = "adam"  # adam | adamw (decoupled weight decay)
    lr: float = 5e-4  # peak learning rate (after warmup)
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])  # Adam (beta1, beta2)
    eps: float = 1e-8  # Adam epsilon
    weight_decay: float = 0.0  # L2 (adam) or decoupled (adamw) weight decay
    schedule: str = "cosine"  # cosine | constant, after warmup
    warmup_steps: int = 0  # linear warmup from 0 to lr over this many steps
    min_lr_ratio: float = 0.0  # cosine floor as a fraction of lr
    grad_clip: float = 0.0  # clip the global gradient norm to this value; 0 = no clipping
    fused: bool = True  # fused Adam kernels (CPU and GPU; skips a non-finite step on the device), else foreach

    def __post_init__(self):
        require(self.name in OPTIMIZERS, f"unknown optimizer '{self.name}'", "optim.name",
                f"choose one of {OPTIMIZERS}")
        require(self.schedule in LR_SCHEDULES, f"unknown schedule '{self.schedule}'", "optim.schedule",
                f"choose one of {LR_SCHEDULES}")
        require(self.lr > 0, f"lr must be positive, got {self.lr}", "optim.lr", "set a positive learning rate")
        require(len(self.betas) == 2 and all(0 <= b < 1 for b in self.betas), f"bad betas {self.betas}",
                "optim.betas", "give two values in [0, 1), e.g. [0.9,0.95]")
        require(self.warmup_steps >= 0, "warmup_steps must be >= 0", "optim.warmup_steps", "set 0 or more")
        require(self.grad_clip >= 0, "grad_clip must be >= 0", "optim.grad_clip", "set 0 (off) or a positive norm")


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
    init_from: str | None = None  # fine-tuning: a run directory or step_* folder (any layout; a run directory: its
    # newest complete step) or a Hugging Face folder whose model weights a new run
    # starts from, its optimizer, schedule and step afresh (ignored once the run has checkpoints of its own)
    num_workers: int = 2  # DataLoader worker processes per rank
    worker_start: str = "forkserver"  # forkserver | spawn | fork: how data workers start (see utils/data/batching)
    grad_accum_steps: int = 1  # micro-batches per optimizer step (gradient accumulation)
    activation_checkpointing: bool = False  # recompute each block's activations in backward
    stop_at_step: int | None = None  # end this invocation after this step with a checkpoint (job time limits)
    preempt_deadline_s: float = 120.0  # after SIGTERM/SIGUSR1: seconds to finish the step and checkpoint
    nonfinite: str = "stop"  # stop | skip: a non-finite loss or grad norm ends the run, or skips the update
    max_skipped_steps: int = 10  # with nonfinite=skip: stop after this many consecutive skipped steps
    # auto: a GPU per local rank (refused with fewer GPUs than ranks), or the CPU without GPUs | cpu
    device: str = "auto"
    hang_timeout_s: float = 1800.0  # a rank with no progress this long dumps its stacks and exits; 0 = off
    # >0: glibc's malloc maps blocks of at least this many MiB on their own and unmaps them at free, a fixed
    # threshold (glibc's own moves up to 32 MiB and keeps freed activations resident); 1 bounds a rank's host
    # memory at a cost in CPU step time (docs/memory.md: the figures); 0 = glibc's own
    malloc_mmap_threshold_mib: int = 0
    ckpt_async: bool = False  # write checkpoints from a background thread (one in flight) while training goes on
    profile: bool = False  # torch.profiler trace and top-operator table of profile_steps (utils/engine/profiling.py)
    profile_steps: list[int] = field(default_factory=lambda: [3, 5])  # [start, end], steps counted from 1
    profile_memory: bool = False  # CUDA allocator history, written at the end step and on out-of-memory
    log_images: bool = True  # the validation and rollout figures as TensorBoard images (matplotlib, rank 0;
    # each figure costs CPU time on the host at every validation); false: scalars and text only
    fingerprint_steps: int = 0  # first steps whose per-parameter gradient and update statistics go to
    # run.dir/fingerprints.json, for `python -m utils.compare --diverge` (utils/engine/fingerprints.py); 0 = off

    def __post_init__(self):
        for name in ("max_steps", "global_batch_size", "log_every", "grad_accum_steps", "ckpt_keep"):
            value = getattr(self, name)
            require(value > 0, f"{name} must be positive, got {value}", f"trainer.{name}", "set a positive integer")
        for name in ("val_every", "ckpt_every", "num_workers", "fingerprint_steps", "malloc_mmap_threshold_mib"):
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
    groups together are checked here, once, when the config is converted (the pairing of model and data,
    which needs the registry of families: `utils.tasks.check_pairing`, right after)."""

    model: Any = MISSING  # a family's schema (utils/tasks/registry.py; config/model/)
    data: Any = MISSING  # the data schema of that family (config/data/)
    task: Any = MISSING  # the settings of that family's task (config/task/, chosen by the data preset)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    run: RunConfig = field(default_factory=RunConfig)

    def __post_init__(self):
        model, cp = self.model, self.parallel.cp
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

    def check_pipeline(self) -> None:
        """What the schedule refuses with these settings; the split of the family's blocks into stages is checked
        with the family (utils.tasks `pipeline_plan`)."""
        schedule = self.parallel.pp_schedule
        require(not (self.precision.compile and schedule in SPLIT_BACKWARD),
                f"pp_schedule={schedule} splits backward into input and weight gradients, which torch cannot "
                "do for compiled blocks (pytorch#161904)", "precision.compile",
                "set precision.compile=false, or use pp_schedule=gpipe, 1f1b, interleaved_1f1b or looped_bfs")
