"""Checkpoints that survive any crash and load under any layout: one torch.distributed.checkpoint (DCP)
folder per step, a completion marker written last, all fsync'ed.

Layout under run.dir:

    checkpoints/step_0000100/.metadata, __<rank>_0.distcp ...   DCP: tensors under single-process names
                             state.json                          step, samples consumed, schedule, scaler, layout
                             COMPLETE                            written last: the step and every file's name
    checkpoints/latest            a hint: the name of the newest complete step folder

What the tensors are (model, Adam state, per-rank RNG) and how a sharded tensor carries its global shape
is in utils/checkpoints/sharded_state.py: DCP reshards by that metadata, so a checkpoint of any layout loads
under any other. Save: every rank writes its part into a temporary folder (DCP fsyncs the files), rank 0
writes state.json; once all are written rank 0 writes the COMPLETE marker (naming every file), fsyncs
the folder, renames it into place and fsyncs `checkpoints/`, then moves `latest` (write, fsync,
os.replace, fsync) and only then prunes older checkpoints beyond `ckpt_keep`. Re-saving a step that
exists renames the old folder aside and deletes it only once the new one is in place. A background save
(`trainer.ckpt_async`) writes from a thread on its own gloo group; rank 0 publishes it when its future
completes (polled after each step, waited for before the next save and at exit): one save in flight.
A crash (or kill -9, or a node loss) at any moment leaves every complete checkpoint intact.

Resume (`choose_resume`, decided by rank 0 and broadcast): `latest` is a hint, not the truth. A folder
counts only when it is complete (marker present, every file it names there); `auto` takes the newest
complete folder and says so when `latest` names something else. A checkpoint that fails to load is set
aside only on evidence of damage (`CorruptCheckpoint`: what counts is in utils/checkpoints/damage.py), and
`resume_state` falls back to the previous complete checkpoint; any other failure (a code bug, a torch or
DCP version that cannot read it) stops every rank with the one-line error and leaves it in place
(`CheckpointLoadError`), as does one of another model (a name or global shape this model does not have).
No file is unpickled beyond DCP's own metadata classes and tensors.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path

import torch

from distributed.collectives import all_reduce_, barrier, broadcast_object
from utils import ConfigError
from utils.checkpoints.damage import CheckpointLoadError, CorruptCheckpoint, file_sha256, load_failure, metadata_failure
from utils.checkpoints.sharded_state import View, load_state, read_shapes, save_state, transient
from utils.comm import AxisGroup

MARKER = "COMPLETE"
FORMAT = "dcp-1"


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


class Checkpointer:
    """Saves, finds and loads the checkpoints of one run directory (every rank holds one)."""

    def __init__(self, run_dir: Path, world: AxisGroup, keep: int = 2, background_group=None):
        """`world`: every rank of the job (saves and loads are collective over it). `background_group`:
        the gloo group background saves coordinate on (None in one process)."""
        self.dir, self.world, self.keep = Path(run_dir) / "checkpoints", world, keep
        self.rank, self.background_group = world.rank, background_group
        self.pending: tuple[int, Path, Path, Future] | None = None  # a background save in flight

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

    @staticmethod
    def marker(path: Path) -> dict | None:
        try:
            marker = json.loads((path / MARKER).read_text())
            return marker if isinstance(marker, dict) else None
        except (OSError, ValueError):
            return None

    def is_complete(self, path: Path) -> bool:
        """Marker present and every file it names there."""
        marker = self.marker(path)
        if marker is None or not isinstance(marker.get("files"), list):
            return False
        return all((path / name).is_file() for name in marker["files"])

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

    def save(self, step: int, tensors: dict[str, torch.Tensor], meta: dict, background: bool = False) -> Path:
        """Write a checkpoint of every rank's `tensors` and rank 0's `meta` (JSON) for `step` (collective).
        `background`: return once the tensors are copied to host memory; `poll`/`wait` publish it."""
        self.wait()  # one save in flight
        final, tmp = self.step_dir(step), self.dir / f".tmp_step_{step:07d}"

        def prepare() -> None:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
            write_durably(tmp / "state.json", json.dumps({**meta, "step": step}))
        self._on_rank0(prepare)
        future = save_state(tensors, tmp, self.world, background=background, background_group=self.background_group)
        if future is not None:
            self.pending = (step, tmp, final, future)
            return final
        self._on_rank0(lambda: self._publish(step, tmp, final))
        barrier(self.world)  # every rank leaves the save together (a broadcast's root may return first)
        return final

    def _on_rank0(self, action: Callable[[], None]) -> None:
        """Run rank 0's file work and tell every rank whether it failed (a disk-full rank 0 must not leave
        the others waiting in a barrier): it raises on every rank, rank 0's own error on rank 0."""
        failure: Exception | None = None
        if self.rank == 0:
            try:
                action()
            except Exception as err:
                failure = err
        verdict = broadcast_object(None if failure is None else f"{type(failure).__name__}: {failure}", self.world)
        if failure is not None:
            raise failure
        if verdict is not None:
            raise RuntimeError(f"rank 0 could not write the checkpoint ({verdict})")

    def poll(self) -> Path | None:
        """The folder of a background save that just completed (published by rank 0), else None."""
        if self.pending is None or not self.pending[3].done():
            return None
        return self.wait()

    def wait(self) -> Path | None:
        """Wait for the background save in flight, if any, and publish it; its folder."""
        if self.pending is None:
            return None
        step, tmp, final, future = self.pending
        self.pending = None
        try:
            future.result()  # raises what the save raised: the checkpoint is not published
        except BaseException as err:  # DCP's CheckpointException is a BaseException
            raise RuntimeError(f"the background save of {final.name} failed: {' '.join(str(err).split())[:600]}") \
                from None
        if self.rank == 0:  # rank 0's future completes after DCP gathered every rank's write results
            self._publish(step, tmp, final)
        return final

    def _publish(self, step: int, tmp: Path, final: Path) -> None:
        """Rank 0: marker last, folder into place, pointer moved, then (only then) the old ones pruned."""
        files = sorted(p.name for p in tmp.iterdir() if p.is_file())
        # DCP's files as saved: evidence of damage, should a load fail (state.json speaks for itself: JSON)
        sizes = {name: (tmp / name).stat().st_size for name in files if name != "state.json"}
        write_durably(tmp / MARKER, json.dumps({"step": step, "format": FORMAT, "files": files, "sizes": sizes,
                                                "sha256": {".metadata": file_sha256(tmp / ".metadata")}}))
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
            if stale.name != f".tmp_{newest.name}":  # publishing happens with no save in flight
                shutil.rmtree(stale, ignore_errors=True)

    def read_meta(self, path: Path) -> dict:
        """state.json of a checkpoint; CorruptCheckpoint when it is missing or damaged (an I/O error re-raises)."""
        try:
            meta = json.loads((Path(path) / "state.json").read_text())
            int(meta["step"])
            return meta
        except (FileNotFoundError, ValueError, KeyError, TypeError) as err:
            raise CorruptCheckpoint(Path(path) / "state.json", " ".join(str(err).split())) from None

    def check(self, path: Path, view: View) -> None:
        """Refuse (ConfigError) a checkpoint that lacks a tensor of `view` or holds it in another global
        shape: it was written by another model. Metadata that cannot be read: CorruptCheckpoint when the
        file shows damage, else CheckpointLoadError."""
        try:
            shapes = read_shapes(Path(path))
        except Exception as err:  # a damaged pickle raises anything from EOFError to TypeError, and so may a bug
            if transient(err):
                raise
            raise metadata_failure(Path(path), self.marker(Path(path)), err) from None
        for key, shape in view.global_shapes().items():
            if shapes.get(key) != shape:
                there = "is missing" if key not in shapes else f"has shape {list(shapes[key])}"
                raise ConfigError(f"checkpoint {path} was written by another model: {key} {there}, this model's "
                                  f"is {list(shape)}", "trainer.resume",
                                  "resume with the model settings that wrote it, or set trainer.resume=never")

    def load(self, path: Path, view: View) -> None:
        """Fill `view` from `path` (collective). A failure is CorruptCheckpoint only on evidence of damage (a
        short or changed file, or a broken record this rank reads), else CheckpointLoadError: a bug or a
        version skew must not cost the run its checkpoints. An I/O error (EIO, ESTALE on a parallel file
        system) or a collective's failure re-raises: the checkpoint may be good, and falling back would let the
        next save's pruning delete it."""
        try:
            load_state(view.tensors, Path(path), self.world)
        except Exception as err:  # DCP gathers every rank's read errors into one CheckpointException
            if (failure := load_failure(Path(path), self.marker(Path(path)), view.tensors, err)) is None:
                raise
            raise failure from None

    def set_aside(self, path: Path) -> Path | None:
        """Rank 0: rename a checkpoint found damaged to `bad_<name>`, out of reach of resume and pruning
        (whose `step_*` it no longer matches), so that nothing deletes what a person may still recover."""
        if self.rank != 0 or not Path(path).is_dir():
            return None
        aside = self.dir / f"bad_{Path(path).name}"
        if aside.exists():
            aside = self.dir / f"bad_{Path(path).name}.{time.time_ns()}"
        os.rename(path, aside)
        fsync_dir(self.dir)
        return aside


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
        except OSError as err:  # told to every rank, not left behind in the broadcast
            decision = (f"cannot read the checkpoints of {checkpointer.dir} ({err})", "run.dir",
                        "check that this job can read and write the run directory")
    decision = broadcast_object(decision, checkpointer.world)
    if isinstance(decision[0], str):
        raise ConfigError(*decision)
    return decision


# A rank's verdict on a checkpoint; the worst one counts. A load error with no evidence ranks below damage: DCP
# raises every rank's failure on every rank, and only the rank that reads a broken record sees its evidence.
READABLE, UNEXPLAINED, CORRUPT, REFUSED, FAILED = 0, 1, 2, 3, 4


def _attempt(action: Callable[[], None]) -> tuple[int, Exception | None]:
    """This rank's verdict on one step of reading a checkpoint, and its error."""
    try:
        action()
        return READABLE, None
    except CorruptCheckpoint as err:
        return CORRUPT, err
    except CheckpointLoadError as err:
        return UNEXPLAINED, err
    except ConfigError as err:
        return REFUSED, err
    except Exception as err:  # noqa: BLE001 - I/O or a collective: every rank stops, none falls back
        return FAILED, err


def resume_state(resume: str, checkpointer: Checkpointer, make_view: Callable[[dict, Path], View],
                 device: torch.device, log: logging.Logger) -> tuple[dict, View] | None:
    """(state.json, the filled view) of the checkpoint to resume from, read by every rank from the same
    checkpoint; None: start at step 0. `make_view(meta, path)`: this rank's destination tensors.

    Rank 0 chooses (see choose_resume). Every rank reads the state and checks the checkpoint against its
    view; the verdicts are max-reduced, so all go on together: a checkpoint some rank finds damaged moves
    every rank to the previous complete one, named in a warning (auto moves it aside); one that fails to load
    with no evidence of damage, one refused outright (another model) or nothing readable left stops every rank
    with the one-line error, touching nothing; an I/O or collective error stops every rank with that error.
    """
    paths, why = _agreed_choice(resume, checkpointer)
    log.info(why)
    problem: Exception | None = None
    for path in paths:
        state: dict = {}

        def read() -> None:
            state["meta"] = checkpointer.read_meta(path)
            state["view"] = make_view(state["meta"], path)
            checkpointer.check(path, state["view"])

        flag, problem = _attempt(read)
        verdict = int(all_reduce_(torch.tensor(flag, device=device), checkpointer.world, "max"))
        if verdict == READABLE:
            flag, problem = _attempt(lambda: checkpointer.load(path, state["view"]))
            verdict = int(all_reduce_(torch.tensor(flag, device=device), checkpointer.world, "max"))
        if verdict == READABLE:
            if path != paths[0]:
                log.warning(f"fell back to {path}: a newer checkpoint cannot be read")
            log.info(f"resumed from {path} at step {state['meta']['step']}")
            return state["meta"], state["view"]
        if verdict == FAILED:
            raise problem if flag == FAILED else RuntimeError(
                f"another rank could not read checkpoint {path} (see its error); not falling back")
        if verdict in (REFUSED, UNEXPLAINED):
            raise problem if flag == verdict else ConfigError(
                f"another rank cannot use checkpoint {path}", "trainer.resume", "see that rank's error line")
        if isinstance(problem, CorruptCheckpoint):
            log.warning(f"rank {checkpointer.rank}: unreadable checkpoint {problem.file} ({problem.reason[:300]})")
        elif problem is not None:  # another rank's evidence of damage explains this rank's failure
            log.warning(f"rank {checkpointer.rank}: {problem}")
        if resume == "auto" and (aside := checkpointer.set_aside(path)) is not None:
            log.warning(f"moved the unreadable checkpoint {path} aside to {aside} (kept, never pruned)")
    if paths:
        bad = f" ({problem.file} is unreadable)" if isinstance(problem, CorruptCheckpoint) else ""
        raise ConfigError(f"no readable checkpoint among {', '.join(p.name for p in paths)}{bad}", "trainer.resume",
                          "restore the files, resume from an earlier step, or set trainer.resume=never")
    return None
