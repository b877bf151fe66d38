"""Checkpoints that survive any crash: one file per rank, a completion marker written last, all fsync'ed.

Layout under run.dir:

    checkpoints/step_0000100/rank_00000.pt ... rank_<n-1>.pt, layout.txt, COMPLETE
    checkpoints/latest            a hint: the name of the newest complete step folder

Save: every rank writes its file into a temporary folder and fsyncs it; after a barrier rank 0 writes
layout.txt and then the COMPLETE marker (step and number of rank files), fsyncs the folder, renames it
into place and fsyncs `checkpoints/`, then moves `latest` (write, fsync, os.replace, fsync) and only
then prunes older checkpoints beyond `ckpt_keep`. Re-saving a step that exists renames the old folder
aside and deletes it only once the new one is in place. A crash (or kill -9, or a node loss) at any
moment leaves every complete checkpoint intact.

Resume (`choose_resume`, decided by rank 0 and broadcast): `latest` is a hint, not the truth. A folder
counts only when it is complete (marker present, every rank file there); `auto` takes the newest complete
folder and says so when `latest` names something else. Files hold tensors and plain Python values and
are read with torch.load(weights_only=True); an unreadable file raises `CorruptCheckpoint`, and the
caller (utils/build.py) falls back to the previous complete checkpoint.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import random
import shutil
import zipfile
from pathlib import Path

import torch

from distributed.collectives import all_reduce_, barrier, broadcast_object
from utils.comm import AxisGroup
from utils.errors import ConfigError

MARKER = "COMPLETE"


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


def fsync_dir(path: Path) -> None:
    """Make a folder's entries (new files, renames) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_durably(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


class CorruptCheckpoint(Exception):
    """A rank file that cannot be read back (truncated, damaged, or holding forbidden objects)."""

    def __init__(self, file: Path, reason: str):
        self.file, self.reason = file, reason
        super().__init__(f"{file}: {reason}")


class Checkpointer:
    """Saves, finds and loads the checkpoints of one run directory for this rank."""

    def __init__(self, run_dir: Path, world: AxisGroup, keep: int = 2, layout: str | None = None):
        """`world`: every rank of the job (this rank's file is rank_<world.rank>.pt; saves wait for all).
        `layout`: the grid's signature; recorded with each checkpoint and required to match on load
        (rank files hold shards: another layout or rank order would load the wrong ones)."""
        self.dir, self.world, self.keep, self.layout = Path(run_dir) / "checkpoints", world, keep, layout
        self.rank = world.rank

    def step_dir(self, step: int) -> Path:
        return self.dir / f"step_{step:07d}"

    def latest(self) -> Path | None:
        """The newest complete checkpoint (None when there is none)."""
        complete = self.complete_steps()
        return complete[0] if complete else None

    def pointer(self) -> str | None:
        """The folder name `latest` holds, if any (a hint)."""
        pointer = self.dir / "latest"
        return pointer.read_text().strip() if pointer.is_file() else None

    def is_complete(self, path: Path) -> bool:
        """Marker present and every rank file it announces there. Folders written before markers existed
        count when `latest` names them (it moved only after a complete save)."""
        marker = path / MARKER
        if not marker.is_file():
            return path.is_dir() and path.name == self.pointer() and (path / f"rank_{0:05d}.pt").is_file()
        try:
            ranks = int(json.loads(marker.read_text())["ranks"])
        except (ValueError, KeyError, TypeError):
            return False
        return all((path / f"rank_{r:05d}.pt").is_file() for r in range(ranks))

    def complete_steps(self) -> list[Path]:
        """Complete step folders, newest first."""
        return [p for p in sorted(self.dir.glob("step_*"), reverse=True) if self.is_complete(p)]

    def recover(self) -> None:
        """Rank 0, before choosing: a re-save that died between its two renames left the old folder
        aside (.old_step_*) and none in place; put it back."""
        for aside in self.dir.glob(".old_step_*"):
            final = self.dir / aside.name.removeprefix(".old_")
            if not final.exists():
                os.rename(aside, final)

    def save(self, step: int, state: dict) -> Path:
        final, tmp = self.step_dir(step), self.dir / f".tmp_step_{step:07d}"
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        barrier(self.world)
        with open(tmp / f"rank_{self.rank:05d}.pt", "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        barrier(self.world)
        if self.rank == 0:
            self._publish(step, tmp, final)
        barrier(self.world)
        return final

    def _publish(self, step: int, tmp: Path, final: Path) -> None:
        """Rank 0: marker last, folder into place, pointer moved, then (only then) the old ones pruned."""
        if self.layout:
            write_durably(tmp / "layout.txt", self.layout)
        write_durably(tmp / MARKER, json.dumps({"step": step, "ranks": self.world.size}))
        fsync_dir(tmp)
        aside = self.dir / f".old_step_{step:07d}"
        if final.exists():  # re-saving a step (e.g. after resuming an older one): keep it until replaced
            shutil.rmtree(aside, ignore_errors=True)
            os.rename(final, aside)
        os.rename(tmp, final)
        fsync_dir(self.dir)
        write_durably(self.dir / ".latest.tmp", final.name)
        os.replace(self.dir / ".latest.tmp", self.dir / "latest")
        fsync_dir(self.dir)
        shutil.rmtree(aside, ignore_errors=True)
        self._prune(final)

    def _prune(self, newest: Path) -> None:
        """Keep `keep` complete checkpoints up to `newest` (included); drop incomplete ones, and later steps
        (a trajectory abandoned by resuming an older step or by trainer.resume=never)."""
        kept = 1
        for old in sorted(self.dir.glob("step_*"), reverse=True):
            if old.name == newest.name:
                continue
            if old.name < newest.name and kept < self.keep and self.is_complete(old):
                kept += 1
            else:
                shutil.rmtree(old, ignore_errors=True)
        for stale in self.dir.glob(".tmp_step_*"):
            if stale.name != f".tmp_{newest.name}":
                shutil.rmtree(stale, ignore_errors=True)

    def load(self, path: Path, replica_source: int | None = None) -> dict:
        """This rank's state; what it did not write (weights, optimizer: data-parallel replicas share them)
        comes from the file of rank `replica_source` (dp rank 0 of its replica group).
        Raises CorruptCheckpoint for a file that cannot be read back."""
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
        try:
            return torch.load(file, map_location="cpu", weights_only=True)
        except (RuntimeError, EOFError, OSError, ValueError, pickle.UnpicklingError, zipfile.BadZipFile) as err:
            raise CorruptCheckpoint(file, " ".join(str(err).split())) from None


def choose_resume(resume: str, checkpointer: Checkpointer) -> tuple[list[Path], str]:
    """(Checkpoints to try in order, a log line saying why) for `trainer.resume`; decided on rank 0.

    auto: every complete checkpoint, newest first (an unreadable one falls back to the next); never: none;
    a step number (20), a step_* name or a PATH: exactly that checkpoint, which must be complete.
    """
    if resume == "never":
        return [], "trainer.resume=never: starting from step 0"
    if resume == "auto":
        checkpointer.recover()
        return _choose_auto(checkpointer)
    path = _resolve_named(resume, checkpointer)
    if not path.is_dir():
        raise ConfigError(f"no checkpoint folder at {path}", "trainer.resume",
                          "use auto, never, a step number, a step_* name or a checkpoint folder")
    if not checkpointer.is_complete(path):
        raise ConfigError(f"checkpoint {path} is incomplete (a save that did not finish)", "trainer.resume",
                          "resume from another step, or use trainer.resume=auto (the newest complete one)")
    return [path], f"resuming from {path} (trainer.resume={resume})"


def names_own_step(resume: str) -> bool:
    """Whether trainer.resume names a checkpoint of this run's own folder (a step number or a step_* name)
    rather than a path."""
    return resume.isdigit() or (resume.startswith("step_") and os.sep not in resume)


def _resolve_named(resume: str, checkpointer: Checkpointer) -> Path:
    if not names_own_step(resume):
        return Path(resume).expanduser()
    return checkpointer.step_dir(int(resume)) if resume.isdigit() else checkpointer.dir / resume


def _choose_auto(checkpointer: Checkpointer) -> tuple[list[Path], str]:
    complete = checkpointer.complete_steps()
    hint = checkpointer.pointer()
    if not complete:
        partial = ", ".join(sorted(p.name for p in checkpointer.dir.glob("step_*")))
        if not partial and hint is None:
            return [], "starting from step 0"
        why = f"no complete checkpoint in {checkpointer.dir} (incomplete: {partial or 'none'}, `latest`: {hint})"
        return [], why + ": starting from step 0"
    why = f"resuming from {complete[0]}, the newest complete checkpoint"
    if hint is not None and hint != complete[0].name:
        state = "incomplete" if (checkpointer.dir / hint).is_dir() else "missing"
        why += f" (`latest` names {hint}, which is {state})"
    return complete, why


def _agreed_choice(resume: str, checkpointer: Checkpointer) -> tuple[list[Path], str]:
    """Rank 0's choose_resume, on every rank; its ConfigError, if any, raised on every rank."""
    decision = None
    if checkpointer.rank == 0:
        try:
            decision = choose_resume(resume, checkpointer)
        except ConfigError as err:
            decision = (err.what, err.setting, err.fix)
    decision = broadcast_object(decision, checkpointer.world)
    if isinstance(decision[0], str):
        raise ConfigError(*decision)
    return decision


def resume_state(resume: str, checkpointer: Checkpointer, replica_source: int, device: torch.device,
                 log: logging.Logger) -> dict | None:
    """The state to resume from, read by every rank from the same checkpoint (None: start at step 0).

    Rank 0 chooses (see choose_resume). When some rank cannot read its file, every rank learns it (a
    max-reduced flag) and all move on to the previous complete checkpoint, the bad file named in a
    warning; a checkpoint refused outright (another layout, a missing rank file) or nothing readable
    left stops every rank with the one-line error.
    """
    paths, why = _agreed_choice(resume, checkpointer)
    log.info(why)
    problem: Exception | None = None
    for path in paths:
        state, flag = None, 0
        try:
            state = checkpointer.load(path, replica_source=replica_source)
        except CorruptCheckpoint as err:
            problem, flag = err, 1
            log.warning(f"rank {checkpointer.rank}: unreadable checkpoint file {err.file} ({err.reason[:200]})")
        except ConfigError as err:
            problem, flag = err, 2
        verdict = int(all_reduce_(torch.tensor(flag, device=device), checkpointer.world, "max"))
        if verdict == 0:
            if path != paths[0]:
                log.warning(f"fell back to {path}: a newer checkpoint has an unreadable file")
            log.info(f"resumed from {path} at step {state['step']}")
            return state
        if verdict == 2:
            raise problem if isinstance(problem, ConfigError) else ConfigError(
                f"another rank cannot use checkpoint {path}", "trainer.resume", "see that rank's error line")
    if paths:
        bad = f" ({problem.file} is unreadable)" if isinstance(problem, CorruptCheckpoint) else ""
        raise ConfigError(f"no readable checkpoint among {', '.join(p.name for p in paths)}{bad}", "trainer.resume",
                          "restore the files, resume from an earlier step, or set trainer.resume=never")
    return None
