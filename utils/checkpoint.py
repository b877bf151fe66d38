"""Atomic checkpoints of the whole training state, one file per rank, loaded without unpickling code.

Layout under run.dir:  checkpoints/step_000100/rank_00000.pt ... and checkpoints/latest (a text file
naming the newest complete step folder). Every rank writes into a temporary folder; after a barrier,
rank 0 renames it into place and only then rewrites `latest` (write + os.replace), so a crash at any
moment leaves `latest` pointing at a complete checkpoint. Files hold tensors and plain Python values
only and are read with torch.load(weights_only=True).
"""

from __future__ import annotations

import os
import random
import shutil
from pathlib import Path

import torch

from distributed.collectives import barrier
from utils.comm import AxisGroup
from utils.errors import ConfigError


def rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "python": list(random.getstate()[1]),
             "python_version": random.getstate()[0], "python_gauss": random.getstate()[2]}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate((state["python_version"], tuple(state["python"]), state["python_gauss"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


class Checkpointer:
    """Saves and finds checkpoints of one run directory for this rank."""

    def __init__(self, run_dir: Path, world: AxisGroup, keep: int = 2, layout: str | None = None):
        """`world`: every rank of the job (this rank's file is rank_<world.rank>.pt; saves wait for all).
        `layout`: the grid's signature; recorded with each checkpoint and required to match on load
        (rank files hold shards: another layout or rank order would load the wrong ones)."""
        self.dir, self.world, self.keep, self.layout = Path(run_dir) / "checkpoints", world, keep, layout
        self.rank = world.rank

    def step_dir(self, step: int) -> Path:
        return self.dir / f"step_{step:07d}"

    def latest(self) -> Path | None:
        pointer = self.dir / "latest"
        if not pointer.is_file():
            return None
        path = self.dir / pointer.read_text().strip()
        return path if path.is_dir() else None

    def save(self, step: int, state: dict) -> Path:
        final, tmp = self.step_dir(step), self.dir / f".tmp_step_{step:07d}"
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
            if self.layout:
                (tmp / "layout.txt").write_text(self.layout)
        barrier(self.world)
        torch.save(state, tmp / f"rank_{self.rank:05d}.pt")
        barrier(self.world)
        if self.rank == 0:
            shutil.rmtree(final, ignore_errors=True)
            os.rename(tmp, final)
            pointer_tmp = self.dir / ".latest.tmp"
            pointer_tmp.write_text(final.name)
            os.replace(pointer_tmp, self.dir / "latest")
            self._prune(final)
        barrier(self.world)
        return final

    def _prune(self, newest: Path) -> None:
        olds = sorted(p for p in self.dir.glob("step_*") if p != newest)
        for old in olds[:max(0, len(olds) - (self.keep - 1))]:
            shutil.rmtree(old, ignore_errors=True)

    def load(self, path: Path, replica_source: int | None = None) -> dict:
        """This rank's state; what it did not write (weights, optimizer: data-parallel replicas share them)
        comes from the file of rank `replica_source` (dp rank 0 of its replica group)."""
        state = self._load_file(Path(path), self.rank)
        if "model" not in state and replica_source is not None:
            shared = self._load_file(Path(path), replica_source)
            state.update({k: v for k, v in shared.items() if k not in state})
        return state

    def _load_file(self, path: Path, rank: int) -> dict:
        recorded = Path(path) / "layout.txt"
        if self.layout and recorded.is_file() and recorded.read_text() != self.layout:
            raise ConfigError(f"checkpoint {path} was written by the layout '{recorded.read_text()}', not "
                              f"'{self.layout}'", "trainer.resume",
                              "resume with the layout that wrote it, or set trainer.resume=never")
        file = path / f"rank_{rank:05d}.pt"
        if not file.is_file():
            raise ConfigError(f"checkpoint {path} has no file for rank {rank}", "trainer.resume",
                              "resume with the layout that wrote it, or set trainer.resume=never")
        return torch.load(file, map_location="cpu", weights_only=True)


def resolve_resume(resume: str, checkpointer: Checkpointer) -> Path | None:
    """auto -> latest checkpoint of the run (or None); never -> None; a PATH -> that folder."""
    if resume == "never":
        return None
    if resume == "auto":
        return checkpointer.latest()
    path = Path(resume)
    if not path.is_dir():
        raise ConfigError(f"no checkpoint folder at {path}", "trainer.resume", "use auto, never or a step_* folder")
    return path
