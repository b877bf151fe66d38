"""Profiles of chosen training steps: `trainer.profile=true trainer.profile_steps=[start,end]`.

torch.profiler records steps start..end (counted from 1, as logged) on every rank and writes
run.dir/profile/rank<r>_steps<start>-<end>.json, a Chrome trace: open it at https://ui.perfetto.dev
(or chrome://tracing). Each rank also writes its table of the operators that took the most time
(self time, on the device when there is one) to rank<r>_steps<start>-<end>_top_ops.txt; rank 0 logs its
table and adds it to TensorBoard as text (profile/top_ops). Each step is a range ProfilerStep#<step> in
the trace, and the trainer's phases in it (data, forward_backward, optimizer) are named ranges too.

`trainer.profile_memory=true` (CUDA only) records the allocator's history from the start of the run and
writes run.dir/profile/rank<r>_memory.pickle at the end step and when a step runs out of memory; open it
at https://pytorch.org/memory_viz. The TensorBoard profiler plugin is deprecated: it is not used.
"""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path

import torch
from torch.profiler import ProfilerAction, ProfilerActivity, profile

from utils import require
from utils.schema import TrainerConfig

TOP_OPS = 25  # rows of the operator table




class StepProfiler:
    """Starts torch.profiler before step `start` and writes its trace and table after step `end`."""

    def __init__(self, tc: TrainerConfig, run_dir: Path, rank: int, is_main: bool, device: torch.device,
                 log: logging.Logger):
        require(not tc.profile_memory or device.type == "cuda", "memory snapshots record the CUDA caching allocator",
                "trainer.profile_memory", "set trainer.profile_memory=false on the CPU")
        self.enabled, self.memory = tc.profile, tc.profile_memory
        self.start, self.end = tc.profile_steps
        self.dir, self.rank, self.is_main, self.device, self.log = run_dir / "profile", rank, is_main, device, log
        self.prof: profile | None = None
        if self.memory:
            torch.cuda.memory._record_memory_history(max_entries=200_000)

    @contextlib.contextmanager
    def step(self, step: int, tb):
        """Around step `step` (counted from 1): start the profiler before the start step; after the end
        step write the trace and the table (and a memory snapshot); on out-of-memory, the snapshot."""
        if self.enabled and step == self.start:
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device.type == "cuda" else [])
            # a schedule that records every step makes torch mark each one as a ProfilerStep#<n> range
            self.prof = profile(activities=activities, record_shapes=True, schedule=lambda _: ProfilerAction.RECORD)
            self.prof.step_num = step  # ranges numbered as the log counts steps
            self.prof.start()
        try:
            yield
        except torch.OutOfMemoryError:
            if self.memory:
                self.snapshot("_oom")
            raise
        if self.prof is not None and step == self.end:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            self.prof.stop()
            self.write(tb)
            self.prof = None
        elif self.prof is not None:
            self.prof.step()
        if self.memory and step == self.end:
            self.snapshot()

    def write(self, tb) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        name = f"rank{self.rank}_steps{self.start}-{self.end}"
        self.prof.export_chrome_trace(str(self.dir / f"{name}.json"))
        sort = "self_cuda_time_total" if self.device.type == "cuda" else "self_cpu_time_total"
        table = self.prof.key_averages().table(sort_by=sort, row_limit=TOP_OPS)
        (self.dir / f"{name}_top_ops.txt").write_text(table)
        if self.is_main:
            self.log.info(f"profile of steps {self.start}-{self.end} (rank 0): {self.dir / name}.json "
                          f"(open it at https://ui.perfetto.dev); top operators by self time:\n{table}")
            tb.text("profile/top_ops", "```\n" + table + "\n```", self.end)

    def snapshot(self, reason: str = "") -> Path:
        """Write the CUDA allocator's recorded history (see the module docstring)."""
        self.dir.mkdir(parents=True, exist_ok=True)
        path = self.dir / f"rank{self.rank}_memory{reason}.pickle"
        torch.cuda.memory._dump_snapshot(str(path))
        self.log.info(f"CUDA memory snapshot: {path} (open it at https://pytorch.org/memory_viz)")
        return path
