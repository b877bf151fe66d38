"""Build-once caches on shared file systems: the first finished copy wins, other ranks wait and reuse it.

Tokenizers and token ids (utils/language/data/wikitext.py) are cached beside the data, or in a per-corpus user
cache folder when the data folder is read-only; the synthetic datasets are generated into the user
cache (`user_cache_dir`).
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path

from utils import ConfigError


def user_cache_dir() -> Path:
    """$XDG_CACHE_HOME (or ~/.cache)/dlscale: where generated data and fallback caches go."""
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "dlscale"


def cache_folders(data_folder: Path, cache_dir: str | None) -> list[Path]:
    """Where caches are looked up, in order: beside the data, then a per-corpus user cache folder."""
    base = Path(cache_dir).expanduser() if cache_dir else user_cache_dir() / "wikitext"
    tag = hashlib.sha1(str(data_folder.resolve()).encode()).hexdigest()[:12]
    return [data_folder, base / f"{data_folder.name}-{tag}"]


def cached(name: str, folders: list[Path], build: Callable[[Path], None]) -> Path:
    """Path of cache file `name`: an existing one, else built by `build(tmp)` in the first writable folder.

    The file is written under a temporary name and hard-linked into place, so readers never see half a
    file and, when processes race, the first finished copy wins and everyone reads that one. A lock file
    makes the ranks of a job that share a file system wait for the first builder instead of all
    tokenizing the corpus at once; where the file system has no flock, they build unlocked (see `_lock`).
    """
    for folder in folders:
        if (folder / name).is_file():
            return folder / name
    for folder in folders:
        try:
            folder.mkdir(parents=True, exist_ok=True)
            lock = open(folder / f".{name}.lock", "w")  # noqa: SIM115 (held until the build is done)
        except OSError:
            continue  # read-only: try the next folder
        with lock:
            _lock(lock)
            if (folder / name).is_file():  # another rank built it while we waited
                return folder / name
            try:
                fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{name}.", suffix=".tmp")
            except OSError:
                continue  # not writable after all: try the next folder
            os.close(fd)
            return _build_into(folder, name, build, Path(tmp))
    raise ConfigError(f"no writable cache folder among {', '.join(map(str, folders))}", "data.cache_dir",
                      "set data.cache_dir to a writable folder")


def _lock(lock) -> None:
    """Wait for the build lock on `lock`, or go on without it where the file system refuses flock (Lustre
    or GPFS mounted without it: ENOSYS, NFS without a lock daemon: ENOLCK). Unlocked ranks may all build
    the same file, which costs time but stays correct: each writes its own temporary file and the first
    finished copy wins (`_build_into`)."""
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)
    except OSError as err:
        warnings.warn(f"no file lock on {lock.name} ({err.strerror or err}): building the cache without one, "
                      "ranks that share this folder may each build it once", stacklevel=3)


def _build_into(folder: Path, name: str, build: Callable[[Path], None], tmp: Path) -> Path:
    """build(tmp) under its temporary name, then link it into place (first finished copy wins)."""
    try:
        build(tmp)
        os.chmod(tmp, 0o644)  # mkstemp makes it private; a shared data folder needs it readable
        try:
            os.link(tmp, folder / name)
        except FileExistsError:
            pass
        except OSError:  # no hard links on this file system: last writer wins
            os.replace(tmp, folder / name)
    finally:
        tmp.unlink(missing_ok=True)
    return folder / name
