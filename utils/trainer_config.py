"""Schema of the `trainer` section of the config (checked when the config is composed).

Its defaults are the only ones: config/config.yaml does not repeat them (one source of truth per default).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from utils.data.batching import WORKER_STARTS
from utils.errors import require


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
    num_workers: int = 2  # DataLoader worker processes per rank
    worker_start: str = "forkserver"  # forkserver | spawn | fork: how data workers start (see utils/data/batching)
    grad_accum_steps: int = 1  # micro-batches per optimizer step (gradient accumulation)
    activation_checkpointing: bool = False  # recompute each block's activations in backward
    stop_at_step: int | None = None  # end this invocation after this step with a checkpoint (job time limits)
    preempt_deadline_s: float = 120.0  # after SIGTERM/SIGUSR1: seconds to finish the step and checkpoint
    nonfinite: str = "stop"  # stop | skip: a non-finite loss or grad norm ends the run, or skips the update
    max_skipped_steps: int = 10  # with nonfinite=skip: stop after this many consecutive skipped steps
    hang_timeout_s: float = 1800.0  # a rank with no progress this long dumps its stacks and exits; 0 = off
    ckpt_async: bool = False  # write checkpoints from a background thread (one in flight) while training goes on
    profile: bool = False  # torch.profiler trace and top-operator table of profile_steps (utils/profiling.py)
    profile_steps: list[int] = field(default_factory=lambda: [3, 5])  # [start, end], steps counted from 1
    profile_memory: bool = False  # CUDA allocator history, written at the end step and on out-of-memory

    def __post_init__(self):
        for name in ("max_steps", "global_batch_size", "log_every", "grad_accum_steps", "ckpt_keep"):
            value = getattr(self, name)
            require(value > 0, f"{name} must be positive, got {value}", f"trainer.{name}", "set a positive integer")
        for name in ("val_every", "ckpt_every", "num_workers"):
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
        require(self.hang_timeout_s >= 0, "hang_timeout_s must be >= 0", "trainer.hang_timeout_s",
                "set 0 (off) or the seconds a step, validation or checkpoint may take at most")
        steps = self.profile_steps
        require(len(steps) == 2 and 1 <= steps[0] <= steps[1], f"bad profile_steps {list(steps)}",
                "trainer.profile_steps", "give [start,end] with 1 <= start <= end, e.g. [5,7]")
        require(self.preempt_deadline_s > 0, "preempt_deadline_s must be positive", "trainer.preempt_deadline_s",
                "set the seconds a stop signal leaves to finish the step and write the checkpoint")
