"""I/O errors on shared file systems: a build-once cache on a mount without flock."""

import errno
import fcntl

import numpy as np
import pytest

from tests.test_wikitext import load, write_text
from utils.data import cache as data_cache


def test_cache_builds_without_flock(tmp_path, monkeypatch):
    """Lustre or GPFS mounted without flock raise ENOSYS: the WikiText caches still build, the same as
    with a lock, and the next load reuses them."""
    reference = load(write_text(tmp_path / "locked"))

    def no_flock(*args, **kwargs):
        raise OSError(errno.ENOSYS, "Function not implemented")
    monkeypatch.setattr(fcntl, "flock", no_flock)
    with pytest.warns(UserWarning, match="no file lock"):
        data = load(write_text(tmp_path / "unlocked"))
    for split in ("train", "valid", "test"):
        np.testing.assert_array_equal(getattr(data, split), getattr(reference, split))
    assert data.tokenizer.words == reference.tokenizer.words
    assert len(list((tmp_path / "unlocked").glob("*.npy"))) == 3
    assert not list((tmp_path / "unlocked").glob("*.tmp"))  # no temporary file left behind
    np.testing.assert_array_equal(load(tmp_path / "unlocked").train, reference.train)  # reused
