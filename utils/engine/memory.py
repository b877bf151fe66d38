"""Memory as a result: each rank's device and host high-water marks, by phase of the run.

`mem/peak_gib` is the device's peak (CUDA's allocator; on the CPU the process's peak resident memory), and
`mem/host_peak_gib` the process's peak resident memory on every device: the largest rank's, agreed with the
step's verdicts in the one all-reduce a step already makes (utils/engine/trainer.py `agree_on_flags`).

`MemoryLedger` records this rank's high-water marks at the end of each phase (build, checkpoint load or
import, first step, checkpoint save, end); at the end of a run every rank's marks are gathered (counted,
through distributed/collectives.py), written to `memory.json` in the run directory (a run fact, for tools and
tests) and the largest rank's figures logged. A high-water mark never falls, so a phase's figure is the peak
up to the end of that phase: a phase that raised it is the one whose mark rose.
"""

from __future__ import annotations

import ctypes
import json
import os
import resource
from pathlib import Path

import torch

from distributed.collectives import all_gather
from utils.comm import AxisGroup

PHASES = ("build", "load", "first step", "checkpoint save", "end")
M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter (malloc.h)


def fix_mmap_threshold(mib: int) -> bool:
    """Have glibc's malloc serve every request of `mib` MiB or more with a mapping of its own, unmapped at its
    free, and keep that threshold fixed (`trainer.malloc_mmap_threshold_mib`). glibc starts at 128 KiB and
    raises the threshold to the size of each such block freed (up to 32 MiB), after which blocks below it come
    from the heap, whose freed space stays resident unless it lies at the heap's top: a run's activations and
    gathered weights, freed every step, then hold 1-2 GiB per rank beyond what it uses (docs/memory.md). True
    when set; False for 0, on a C library without mallopt, or when the environment sets
    MALLOC_MMAP_THRESHOLD_ (the user's choice, which glibc applied at start)."""
    if mib <= 0 or "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return False
    try:
        return bool(ctypes.CDLL("libc.so.6").mallopt(M_MMAP_THRESHOLD, ctypes.c_int(mib << 20)))
    except (OSError, AttributeError):  # not glibc
        return False


def host_peak_gib() -> float:
    """This process's peak resident memory since `reset_host_peak` (Linux reports ru_maxrss in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def reset_host_peak() -> None:
    """Start the high-water mark afresh at the current resident size (Linux: /proc/self/clear_refs, 5), so
    a run's figures are its own, not those of what the process ran before (a sweep's earlier runs in one
    process, a test's pooled rank). Where the kernel does not offer it, the mark stays the process's."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def peak_memory_gib(device: torch.device) -> float:
    """The device's peak allocated memory (CUDA), or the process's peak resident memory on the CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return host_peak_gib()


class MemoryLedger:
    """This rank's (host, device) high-water marks at the end of each phase it went through."""

    def __init__(self, device: torch.device):
        self.device = device
        self.marks: dict[str, tuple[float, float]] = {}

    def mark(self, phase: str) -> None:
        """Record the marks at the end of `phase` (the first time only: a phase is its first occurrence)."""
        assert phase in PHASES, phase
        self.marks.setdefault(phase, (host_peak_gib(), peak_memory_gib(self.device)))

    def gather(self, world: AxisGroup) -> dict[str, dict[str, list[float | None]]]:
        """Every rank's marks (collective: every rank calls), {"host"|"device": {phase: [GiB per rank]}}; a
        phase a rank did not go through (no checkpoint loaded) is None there."""
        self.mark("end")
        mine = torch.tensor([v for phase in PHASES for v in self.marks.get(phase, (-1.0, -1.0))],
                            dtype=torch.float64, device=self.device)
        every = mine.unsqueeze(0) if world.size == 1 else all_gather(mine.unsqueeze(0), world, 0, [1] * world.size)
        every = every.view(world.size, len(PHASES), 2).tolist()
        return {kind: {phase: [None if r[i][k] < 0 else round(r[i][k], 4) for r in every]
                       for i, phase in enumerate(PHASES) if any(r[i][k] >= 0 for r in every)}
                for k, kind in enumerate(("host", "device"))}

    def report(self, world: AxisGroup, is_main: bool, run_dir: Path, log) -> None:
        """At the end of a run (collective): every rank's marks gathered; the main rank writes memory.json and
        logs the largest rank's figures."""
        figures = self.gather(world)
        if is_main:
            log.info(self.write(run_dir, figures))

    @staticmethod
    def write(run_dir: Path, figures: dict) -> str:
        """memory.json in `run_dir`; returns the log's line (the largest rank's host figure per phase)."""
        (run_dir / "memory.json").write_text(json.dumps({"unit": "GiB", **figures}) + "\n")
        host = figures["host"]
        worst = {phase: max((v for v in values if v is not None), default=0.0) for phase, values in host.items()}
        rank = max(range(len(host["end"])), key=lambda r: host["end"][r] or 0.0)
        return (f"peak host memory {worst['end']:.2f} GiB (rank {rank} of {len(host['end'])}); the largest rank's "
                "by phase: " + ", ".join(f"{phase} {v:.2f}" for phase, v in worst.items()) + " GiB (memory.json)")
