"""Run logging: a log file and console lines, a live progress line on terminals, TensorBoard events.

Only rank 0 writes; other ranks get a logger that drops everything except warnings.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch


def setup_logging(run_dir: Path | None, is_main: bool) -> logging.Logger:
    """Logger 'dlscale' (console + run.dir/train.log) and its child 'dlscale.file' (the file only)."""
    log, file_log = logging.getLogger("dlscale"), logging.getLogger("dlscale.file")
    fmt = logging.Formatter("%(asctime)s %(levelname)s %(message)s", "%Y-%m-%d %H:%M:%S")
    for logger in (log, file_log):
        logger.handlers.clear()
        logger.propagate = False
        logger.setLevel(logging.INFO if is_main else logging.WARNING)
    console = logging.StreamHandler(sys.stdout)
    console.setFormatter(fmt)
    log.addHandler(console)
    if is_main and run_dir is not None:
        file = logging.FileHandler(Path(run_dir) / "train.log")
        file.setFormatter(fmt)
        log.addHandler(file)
        file_log.addHandler(file)
    return log


def is_person_terminal(stream=None, environ=None) -> bool:
    """Whether `stream` (sys.stdout as it is now) is a terminal a person watches: not under Slurm or submitit,
    whose `srun -u` (`--unbuffered`) gives every task a pseudo-terminal that ends up in the job log."""
    stream, environ = stream or sys.stdout, os.environ if environ is None else environ
    under_scheduler = any(var in environ for var in ("SLURM_JOB_ID", "SLURM_STEP_ID", "SUBMITIT_EXECUTOR"))
    return stream.isatty() and not under_scheduler


class Progress:
    """A live status line (step, loss, samples/s, ETA) on a person's terminal; plain log lines otherwise
    (every `trainer.log_every` steps: a pipe, a file, a Slurm job log). `work(step)`: model calls per sample
    at optimizer step `step` (0-based; the rollout curriculum's K, `Task.rollout_length`): the line shows K
    when it is not 1, and the ETA weighs the steps left by it, timed from the end of the first step taken."""

    def __init__(self, log: logging.Logger, max_steps: int, log_every: int, is_main: bool,
                 work: Callable[[int], int] = lambda step: 1):
        self.log, self.max_steps, self.log_every, self.work = log, max_steps, log_every, work
        self.live = is_main and is_person_terminal()
        self.enabled = is_main
        self.start = time.perf_counter()
        self.start_step: int | None = None
        self.done_work: list[int] | None = None  # [i]: the work of steps 1..i (counted from 1)

    def work_until(self, step: int) -> int:
        """The work of the steps 1..`step` (counted from 1, as `update` counts them)."""
        if self.done_work is None:
            self.done_work = [0]
            for i in range(self.max_steps):
                self.done_work.append(self.done_work[-1] + self.work(i))
        return self.done_work[min(step, self.max_steps)]

    def update(self, step: int, loss: float, samples_per_sec: float, lr: float) -> None:
        """`step`: optimizer steps completed, counting this one."""
        if not self.enabled:
            return
        if self.start_step is None:  # the first step taken (compilation, warm-up) does not time the rest
            self.start_step, self.start = step, time.perf_counter()
        done = self.work_until(step) - self.work_until(self.start_step)
        per_work = (time.perf_counter() - self.start) / done if done else None
        left = self.work_until(self.max_steps) - self.work_until(step)
        eta = "?" if per_work is None else f"{per_work * left:.0f}s"
        rollout = f"K={self.work(step - 1)} " if self.work_until(self.max_steps) != self.max_steps else ""
        text = (f"step {step}/{self.max_steps} loss {loss:.5f} lr {lr:.3g} {rollout}"
                f"{samples_per_sec:.1f} samples/s ETA {eta}")
        if self.live:
            sys.stdout.write("\r" + text + " " * 8)
            sys.stdout.flush()
            if step == self.max_steps:
                sys.stdout.write("\n")
        if self.is_log_step(step):
            (logging.getLogger("dlscale.file") if self.live else self.log).info(text)

    def is_log_step(self, step: int) -> bool:
        """Whether step `step` (counted from 1) gets a log line: the first of every log_every, and the last."""
        return (step - 1) % self.log_every == 0 or step == self.max_steps

    def message(self, text: str) -> None:
        """A log line that does not collide with the live status line."""
        if self.live:
            sys.stdout.write("\r")
        self.log.info(text)

    def first_step_notice(self, step: int, after_s: float = 10.0) -> threading.Timer | None:
        """A line `after_s` seconds into the first step of a run if it is still running (cancel the returned
        timer when the step ends): long steps (big models on CPU, compilation) must not look frozen."""
        if not self.enabled:
            return None
        timer = threading.Timer(after_s, self.message, [f"step {step} still running after {after_s:.0f} s (the first "
                                                        "step also warms up, and compiles with precision.compile)"])
        timer.daemon = True
        timer.start()
        return timer


# TensorBoard's Time Series dashboard (its first tab) sorts tag groups (a tag's part before the first '/')
# by comparing characters, capitals before lower case, and expands the first two: without these copies a
# user lands on comm/ and data/ with train/ and val/ collapsed. Each tag on the left is also written under
# the name on the right, so the groups that open are Loss and Throughput.
FIRST_SCREEN = {"train/loss": "Loss/train", "val/loss": "Loss/val",
                "perf/samples_per_sec": "Throughput/samples_per_sec",
                "perf/tokens_per_sec": "Throughput/tokens_per_sec", "perf/mfu": "Throughput/mfu"}

# The Custom Scalars tab: train and validation loss on one chart, and the throughput.
CUSTOM_SCALARS = {"Overview": {"loss (train and val)": ["Multiline", [r"^train/loss$", r"^val/loss$"]],
                               "samples per second": ["Multiline", [r"^perf/samples_per_sec$"]],
                               "tokens per second": ["Multiline", [r"^perf/tokens_per_sec$"]]}}


def hparam_values(flat: dict[str, object]) -> dict[str, int | float | str]:
    """Flat settings ({"section.key": value}, utils/cli/runs.py: flat_config) as HParams takes them: numbers and
    strings as they are; booleans and lists as text (HParams would show a bool as 0 or 1); None left out."""
    return {key: str(value).lower() if isinstance(value, bool) else value if isinstance(value, (int, float, str))
            else str(value) for key, value in flat.items() if value is not None}


EVENT_FILES = "events.out.tfevents.*"  # then the second it was made, host, pid, a counter: TensorBoard's names


def wait_for_a_later_second(run_dir: Path, limit_s: float = 2.0) -> None:
    """Wait until the clock's second is past every event file's in run_dir, so that this launch's file sorts
    after them: TensorBoard reads a directory's files in name order, and two launches in one second (a resume
    after a quick stop) would otherwise be ordered by pid and counter as text ('100' before '99'), the resumed
    steps read first and the purge applied the wrong way. A wait longer than limit_s (a file stamped well
    ahead, by another host's clock) is skipped."""
    stamps = [int(part) for path in Path(run_dir).glob(EVENT_FILES)
              if (part := path.name.split(".")[3]).isdigit()]
    wait = max(stamps, default=0) + 1 - time.time()
    if 0 < wait <= limit_s:
        time.sleep(wait)


class TensorBoard:
    """One TensorBoard event stream per run (rank 0 only)."""

    def __init__(self, run_dir: Path, is_main: bool, start_step: int = 0, images: bool = True):
        self.run_dir, self.is_main, self.start_step, self.images = run_dir, is_main, start_step, images
        self._writer = None
        self._session_end = None  # HParams' end-of-session summary, written by close(finished=True)

    @property
    def writer(self):
        """The SummaryWriter, created at the first event (a run with nothing to log writes no file)."""
        if self._writer is None and self.is_main:
            # Imported here: only rank 0 ever writes, and importing tensorboard takes about a second.
            from torch.utils.tensorboard import SummaryWriter

            # purge_step hides events a crashed run wrote after the checkpoint we resume from (steps are
            # counted as completed steps, so the validation at the checkpoint's step stays)
            wait_for_a_later_second(self.run_dir)
            self._writer = SummaryWriter(log_dir=str(self.run_dir),
                                         purge_step=self.start_step + 1 if self.start_step else None)
        return self._writer

    @property
    def draws_images(self) -> bool:
        """Whether this rank draws the figures (rank 0, unless trainer.log_images=false): others need not."""
        return self.is_main and self.images

    def scalars(self, values: dict[str, float], step: int) -> None:
        if self.writer:
            for tag, value in values.items():
                self.writer.add_scalar(tag, value, step)
                if tag in FIRST_SCREEN:
                    self.writer.add_scalar(FIRST_SCREEN[tag], value, step)

    def run_header(self, config_yaml: str, settings: dict, metrics: list[str], notes: list[str], step: int) -> None:
        """What a run is, written when it starts (and again at each resume, at the step it resumes from):
        the resolved config as text (tag config), the settings and `metrics` as HParams (so runs can be
        filtered and compared by setting), the Custom Scalars layout, and `notes` as text (tag notes)."""
        if not self.writer:
            return
        from torch.utils.tensorboard.summary import hparams

        indented = "\n".join("    " + line for line in config_yaml.splitlines())  # a markdown code block
        self.writer.add_text("config", indented, step)
        experiment, start, self._session_end = hparams(settings, dict.fromkeys(metrics, 0.0))
        for summary in (experiment, start):
            self.writer.file_writer.add_summary(summary, step)
        self.writer.add_custom_scalars(CUSTOM_SCALARS)
        for note in notes:
            self.writer.add_text("notes", note, step)

    def image(self, tag: str, image: torch.Tensor, step: int) -> None:
        """`image`: (3, H, W) float in [0, 1]."""
        if self.writer:
            self.writer.add_image(tag, image, step)

    def text(self, tag: str, text: str, step: int) -> None:
        if self.writer:
            self.writer.add_text(tag, text, step)

    def flush(self) -> None:
        if self._writer:
            self._writer.flush()

    def close(self, finished: bool = False) -> None:
        """`finished`: the run reached max_steps (HParams marks its session as ended successfully)."""
        if self._writer:
            if finished and self._session_end is not None:
                self._writer.file_writer.add_summary(self._session_end)
            self._writer.close()
