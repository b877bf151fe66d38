"""Evidence of damage: what a checkpoint's files show when a load of it fails, and the verdict it decides.

The rule: a checkpoint is set aside (renamed `bad_step_*` by `trainer.resume=auto`) and resume falls back to
the previous complete one only on evidence that its files are damaged (`CorruptCheckpoint`); any other load
error (a code bug, a torch or DCP version that cannot read it) exits 2 and leaves the checkpoint in place
(`CheckpointLoadError`, a ConfigError). Why: a bug or a version skew fails on every checkpoint alike, so
falling back on it would set the run's good checkpoints aside one after another; left in place, the
checkpoint is resumed from once the cause is fixed. `load_failure` and `metadata_failure` apply the rule.

What counts as damage, each judged from the files alone:

    truncated_files    a data file missing or shorter than DCP's metadata says
    file_damage        that, or a file whose size differs from the one the COMPLETE marker records
    metadata_damage    DCP's .metadata missing, with another SHA-256 than the marker records, or (a marker of
                       before digests) bytes that are no whole pickle, as its opcodes show
    damaged_records    a torch.save record this rank reads whose zip headers do not parse or whose CRC-32 does
                       not match its bytes (each rank checks only what its load reads)

(a damaged state.json is found where it is read: `Checkpointer.read_meta`). None of these builds an object
from the bytes it checks beyond DCP's own metadata classes (`SafeReader`). An I/O or collective error is no
evidence either way (`sharded_state.transient`): it re-raises, and the checkpoint stays.
"""

from __future__ import annotations

import hashlib
import io
import pickletools
import zipfile
from pathlib import Path

import torch
from torch.distributed.checkpoint.default_planner import create_default_local_load_plan
from torch.distributed.checkpoint.planner import LoadItemType

from utils import ConfigError
from utils.checkpoints.sharded_state import SafeReader, transient


class CorruptCheckpoint(Exception):
    """A checkpoint whose files show damage (missing, short, changed since the save, a broken record): the only
    failure that sets a checkpoint aside and falls back to an older one."""

    def __init__(self, file: Path, reason: str):
        self.file, self.reason = file, reason
        super().__init__(f"{file}: {reason}")


class CheckpointLoadError(ConfigError):
    """A checkpoint that fails to load while its files show no damage (a code bug, a torch or DCP version that
    cannot read it): every rank stops with the one-line error and the checkpoint stays where it is."""

    def __init__(self, path: Path, err: BaseException):
        detail = " ".join(f"{type(err).__name__}: {err}".split())[:600]
        super().__init__(f"cannot load checkpoint {path}, whose files show no damage ({detail})", "trainer.resume",
                         "it is left in place: fix the cause (a code change, the torch version that wrote it) and "
                         "relaunch, or resume from another step, or set trainer.resume=never")


def load_failure(path: Path, marker: dict | None, tensors: dict[str, torch.Tensor],
                 err: Exception) -> Exception | None:
    """What a failed load of `path` into `tensors` raises, given `marker` (None: unreadable) and the load's
    error `err`: CorruptCheckpoint on evidence of damage (a short or changed file, or a broken record this rank
    reads); None, re-raise `err`, for an I/O or collective error without it (the checkpoint may be good, and
    falling back would let the next save's pruning delete it); else CheckpointLoadError."""
    if (damage := file_damage(path, marker)) is not None:
        return CorruptCheckpoint(path, damage)
    if any(transient(cause) for cause in getattr(err, "causes", [err])):
        return None
    if broken := damaged_records(path, tensors):
        return CorruptCheckpoint(path, f"damaged: {'; '.join(broken)}")
    return CheckpointLoadError(path, err)


def metadata_failure(path: Path, marker: dict | None, err: Exception) -> Exception:
    """What a failed read of DCP's .metadata of `path` raises (an I/O error re-raises before): CorruptCheckpoint
    when the file shows damage, else CheckpointLoadError."""
    if (damage := metadata_damage(path, marker)) is not None:
        return CorruptCheckpoint(path / ".metadata", f"{damage}; {' '.join(str(err).split())}")
    return CheckpointLoadError(path, err)


def file_sha256(path: Path) -> str:
    """The digest the marker records of DCP's .metadata, and `metadata_damage` compares."""
    return hashlib.sha256(path.read_bytes()).hexdigest()


def file_damage(path: Path, marker: dict | None) -> str | None:
    """What shows a checkpoint's files damaged, cheaply (None: nothing): a data file shorter than DCP's
    metadata says, or a file whose size differs from the one the marker (`marker`, None: unreadable) records."""
    if short := truncated_files(path):
        return f"truncated: {', '.join(short)}"
    recorded = (marker or {}).get("sizes", {})
    sizes = {name: (path / name).stat().st_size if (path / name).is_file() else None for name in recorded}
    changed = [f"{name} ({sizes[name]} bytes, saved {n})" for name, n in sorted(recorded.items())
               if sizes[name] != n]
    return f"changed since the save: {', '.join(changed)}" if changed else None


def metadata_damage(path: Path, marker: dict | None) -> str | None:
    """What shows DCP's .metadata damaged (None: nothing): missing, another digest than the marker records,
    or (a marker of before digests) bytes that are no whole pickle: cut short or garbled, as its opcodes
    show (read without building any object; a version skew still writes a whole pickle)."""
    file = path / ".metadata"
    if not file.is_file():
        return "missing"
    recorded = (marker or {}).get("sha256", {}).get(".metadata")
    if recorded is not None:
        return None if file_sha256(file) == recorded else "its bytes differ from the saved ones (sha256)"
    try:
        for _ in pickletools.genops(file.read_bytes()):
            pass
    except ValueError as err:  # an unknown opcode, or bytes that end before the pickle does
        return f"not a whole pickle ({' '.join(str(err).split())[:200]})"
    return None


def truncated_files(folder: Path) -> list[str]:
    """'name (have of needed bytes)' for each data file shorter than the metadata says (or missing)."""
    needed: dict[str, int] = {}
    for info in SafeReader(folder).read_metadata().storage_data.values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    sizes = {name: (Path(folder) / name).stat().st_size if (Path(folder) / name).is_file() else 0 for name in needed}
    return [f"{name} ({sizes[name]} of {n} bytes)" for name, n in sorted(needed.items()) if sizes[name] < n]


def damaged_records(folder: Path, tensors: dict[str, torch.Tensor]) -> list[str]:
    """'file at offset: what' for each tensor record this rank reads into `tensors` whose torch.save archive is
    broken: a zip header or directory that does not parse, or a CRC-32 that does not match its bytes. Evidence
    of damage that sizes miss; each rank checks only what it reads (the load's own plan)."""
    metadata = SafeReader(folder).read_metadata()
    plan = create_default_local_load_plan(tensors, metadata, strict=False)
    records = {(info.relative_path, info.offset): info for info in (
        metadata.storage_data[item.storage_index] for item in plan.items if item.type == LoadItemType.TENSOR)}
    found = []
    for _, info in sorted(records.items()):
        if info.transform_descriptors:  # a transformed (e.g. compressed) record is no plain archive
            continue
        with open(Path(folder) / info.relative_path, "rb") as file:
            if (problem := _archive_problem(_Slice(file, info.offset, info.length))) is not None:
                found.append(f"{info.relative_path} at {info.offset}: {problem}")
    return found


def _archive_problem(record: io.RawIOBase) -> str | None:
    """What is wrong with one torch.save archive (None: its headers parse and its CRCs match)."""
    try:
        with zipfile.ZipFile(record) as archive:
            for member in archive.infolist():
                with archive.open(member) as stream:  # reads and checks the member's local header
                    while member.CRC and stream.read(1 << 24):  # CRC 0: written without CRCs, nothing to check
                        pass  # a mismatch raises at the member's end
    except (zipfile.BadZipFile, NotImplementedError, ValueError, EOFError) as err:  # what a garbled header raises
        return " ".join(str(err).split())[:200]
    return None


class _Slice(io.RawIOBase):
    """The bytes [start, start + length) of an open file as a seekable file of their own (one DCP record)."""

    def __init__(self, file, start: int, length: int):
        super().__init__()
        self.file, self.start, self.length, self.pos = file, start, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = (0, self.pos, self.length)[whence]
        self.pos = min(max(base + offset, 0), self.length)
        return self.pos

    def tell(self) -> int:
        return self.pos

    def readinto(self, buffer) -> int:
        self.file.seek(self.start + self.pos)
        got = self.file.readinto(memoryview(buffer)[:self.length - self.pos])
        self.pos += got
        return got
