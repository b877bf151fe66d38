"""I/O errors on shared file systems (issue 23, item 8): a build-once cache on a mount without flock, and what
counts as a corrupt checkpoint: only a short or damaged file does. An I/O error or a failed collective
re-raises (the checkpoint may be good: falling back would let the next save's pruning delete it), and a
checkpoint found unreadable is moved aside, never deleted."""

import contextlib
import errno
import fcntl
import json
import logging
from pathlib import Path
from unittest import mock

import numpy as np
import pytest
import torch

import utils.checkpoints.sharded_state as sharded_state
from distributed.collectives import barrier
from tests.helpers import QUIET, TINY_GPT, run_main, run_ranks
from tests.test_checkpoint import resumed_step, save, saved
from tests.test_wikitext import load, write_text
from utils import ConfigError
from utils.checkpoints.damage import CheckpointLoadError


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


def test_an_io_error_while_loading_re_raises_and_the_newer_checkpoint_survives(tmp_path, monkeypatch):
    ck = saved(tmp_path)
    real = sharded_state.dcp.load

    def flaky(*args, **kwargs):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(sharded_state.dcp, "load", flaky)
    with pytest.raises(OSError, match="Input/output error"):
        resumed_step(ck)
    monkeypatch.setattr(sharded_state.dcp, "load", real)
    assert resumed_step(ck) == 3  # it was good all along
    assert [p.name for p in ck.complete_steps()] == ["step_0000003", "step_0000002", "step_0000001"]


def test_an_io_error_reading_the_state_re_raises(tmp_path, monkeypatch):
    ck = saved(tmp_path)
    real = Path.read_text

    def stale(path, *args, **kwargs):
        if path.name == "state.json" and path.parent.name == "step_0000003":
            raise OSError(errno.ESTALE, "Stale file handle")
        return real(path, *args, **kwargs)

    monkeypatch.setattr(Path, "read_text", stale)
    with pytest.raises(OSError, match="Stale file handle"):
        resumed_step(ck)
    assert (tmp_path / "checkpoints" / "step_0000003").is_dir()


def test_a_collective_failure_while_loading_is_not_corruption(tmp_path, monkeypatch):
    ck = saved(tmp_path)

    def broken(*args, **kwargs):
        raise sharded_state.CheckpointIOError("could not read the checkpoint",
                                              [torch.distributed.DistNetworkError("Connection closed by peer")])

    monkeypatch.setattr(sharded_state, "load_state", broken)
    monkeypatch.setattr("utils.checkpoints.checkpointer.load_state", broken)
    with pytest.raises(sharded_state.CheckpointIOError):
        resumed_step(ck)
    assert (tmp_path / "checkpoints" / "step_0000003").is_dir()


def test_a_truncated_checkpoint_is_moved_aside_and_never_pruned(tmp_path):
    ck = saved(tmp_path, keep=2)
    data = ck.latest() / "__0_0.distcp"
    data.write_bytes(data.read_bytes()[:16])
    assert resumed_step(ck) == 2
    aside = tmp_path / "checkpoints" / "bad_step_0000003"
    assert aside.is_dir() and not (tmp_path / "checkpoints" / "step_0000003").exists()
    save(ck, 3)
    save(ck, 4)  # prunes down to two complete checkpoints
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir() if p.is_dir()) == \
        ["bad_step_0000003", "step_0000003", "step_0000004"]


def _one_rank_cannot_read(rank: int, world_size: int, tmp_path: str) -> None:
    """Rank 0 hits an I/O error reading the newest checkpoint's state; rank 1 reads it fine."""
    from utils.checkpoints.checkpointer import Checkpointer, resume_state
    from utils.comm import init_grid
    from utils.schema import ParallelConfig

    grid = init_grid(ParallelConfig(dp=world_size))
    ck = Checkpointer(Path(tmp_path) / f"run{world_size}", grid.world, keep=3)
    for step in (1, 2):
        ck.save(step, {"w": torch.full((3,), float(step))}, {})
    if rank == 0:
        real = ck.read_meta
        ck.read_meta = lambda path: (_ for _ in ()).throw(OSError(errno.EIO, "Input/output error")) \
            if path.name == "step_0000002" else real(path)
    expected = (OSError, "Input/output error") if rank == 0 else (RuntimeError, "another rank could not read")
    with pytest.raises(expected[0], match=expected[1]):  # every rank stops; none falls back to step 1
        resume_state("auto", ck, lambda meta, path: sharded_state.View({"w": torch.empty(3)}), grid.device,
                     logging.getLogger("test"))
    assert ck.step_dir(2).is_dir()


def test_an_io_error_on_one_rank_stops_every_rank(tmp_path):
    """The verdict is agreed: rank 0's I/O error stops rank 1 too (no hang, no fallback on either)."""
    from tests.helpers import run_ranks

    run_ranks(_one_rank_cannot_read, 2, tmp_path, str(tmp_path), timeout_s=60)


# Only evidence of damage sets a checkpoint aside (the audit of issue 23's fallback): a load that fails for
# any other reason (a code bug, a torch or DCP version that cannot read the files) stops every rank with the
# one-line error and leaves every checkpoint where it is, so that the next launch, fixed, resumes from it.

def _version_skew(*args, **kwargs):
    raise RuntimeError("Unexpected key in the checkpoint's metadata (written by another DCP version?)")


def _names(run_dir: Path) -> list[str]:
    return sorted(p.name for p in (run_dir / "checkpoints").iterdir() if p.is_dir())


@pytest.mark.slow  # trains through train.py (in this process, so that the fault can be injected)
def test_a_load_error_without_damage_exits_2_and_the_fixed_launch_resumes(tmp_path, monkeypatch):
    args = [*TINY_GPT, *QUIET, "trainer.ckpt_every=2", "trainer.max_steps=6", "data.limit_eval_tokens=256",
            f"run.dir={tmp_path}"]
    code, _, err = run_main("train.py", *args, "trainer.stop_at_step=4")
    assert code == 0, err
    monkeypatch.setattr(sharded_state.dcp, "load", _version_skew)
    code, _, err = run_main("train.py", *args)
    assert code == 2 and err.startswith("error: cannot load checkpoint ") and err.count("\n") == 1, err
    assert "step_0000004" in err and "RuntimeError: Unexpected key" in err and "(trainer.resume): " in err
    assert _names(tmp_path) == ["step_0000002", "step_0000004"]  # nothing set aside, nothing lost
    monkeypatch.undo()
    code, _, err = run_main("train.py", *args)
    assert code == 0, err
    assert f"resumed from {tmp_path / 'checkpoints' / 'step_0000004'} at step 4" in (tmp_path / "train.log").read_text()


@pytest.mark.parametrize("error", [RuntimeError("Unexpected key"), AttributeError("'Metadata' object has no "
                                   "attribute 'version'"), KeyError("model/tok_embed.weight")])
def test_a_load_error_without_damage_is_refused_in_place(tmp_path, monkeypatch, error):
    ck = saved(tmp_path)
    monkeypatch.setattr(sharded_state.dcp, "load", lambda *a, **k: (_ for _ in ()).throw(error))
    what = f"step_0000003, whose files show no damage .*{type(error).__name__}"
    with pytest.raises(CheckpointLoadError, match=what) as info:
        resumed_step(ck)
    assert "\n" not in info.value.line() and info.value.setting == "trainer.resume"
    assert _names(tmp_path) == ["step_0000001", "step_0000002", "step_0000003"]
    monkeypatch.undo()
    assert resumed_step(ck) == 3


def test_a_metadata_read_error_without_damage_is_refused_in_place(tmp_path, monkeypatch):
    """`check`: DCP's metadata classes changed under a newer torch (read_shapes raises), the file as saved."""
    ck = saved(tmp_path)
    skew = AttributeError("module 'torch.distributed.checkpoint.metadata' has no attribute 'TensorProperties'")
    monkeypatch.setattr("utils.checkpoints.checkpointer.read_shapes", lambda *a: (_ for _ in ()).throw(skew))
    with pytest.raises(CheckpointLoadError, match="step_0000003, whose files show no damage .*AttributeError"):
        resumed_step(ck)
    assert _names(tmp_path) == ["step_0000001", "step_0000002", "step_0000003"]
    monkeypatch.undo()
    assert resumed_step(ck) == 3


def _flip(file: Path, at: int) -> None:
    data = bytearray(file.read_bytes())
    data[at] ^= 0xFF
    file.write_bytes(bytes(data))


@pytest.mark.parametrize("where", ["record header", "metadata"])
def test_same_size_damage_is_still_damage(tmp_path, where):
    """A changed byte keeps every size: a torch.save record's zip header, or .metadata against the marker's
    digest (a whole pickle still, naming a class that does not exist), is the evidence. The checkpoint falls
    back and is set aside."""
    ck = saved(tmp_path)
    if where == "record header":
        _flip(ck.latest() / "__0_0.distcp", 1)  # the first record's local file header: b"PK\x03\x04"
    else:
        metadata = ck.latest() / ".metadata"
        metadata.write_bytes(metadata.read_bytes().replace(b"TensorStorageMetadata", b"TensorStorageMetadatX", 1))
    assert resumed_step(ck) == 2
    assert _names(tmp_path) == ["bad_step_0000003", "step_0000001", "step_0000002"]


def test_a_checkpoint_of_before_the_recorded_sizes(tmp_path, monkeypatch):
    """A marker without sizes or digest (written before them): a .metadata cut short is still damage (its pickle
    has no end), and an intact one that fails to read is refused in place."""
    ck = saved(tmp_path)
    for path in ck.complete_steps():
        marker = json.loads((path / "COMPLETE").read_text())
        (path / "COMPLETE").write_text(json.dumps({k: marker[k] for k in ("step", "format", "files")}))
    monkeypatch.setattr("utils.checkpoints.checkpointer.read_shapes", lambda *a: (_ for _ in ()).throw(TypeError("x")))
    with pytest.raises(CheckpointLoadError):
        resumed_step(ck)
    monkeypatch.undo()
    metadata = ck.latest() / ".metadata"
    metadata.write_bytes(metadata.read_bytes()[:-5])
    assert resumed_step(ck) == 2
    assert _names(tmp_path) == ["bad_step_0000003", "step_0000001", "step_0000002"]


def _load_errors_on_two_ranks(rank: int, world_size: int, tmp_path: str) -> None:
    """Each rank holds half of `w` (a Box), so each reads its own record. (1) check: rank 0's metadata read fails
    with a code error: both stop. (2) load: rank 0's read fails with a code error (DCP raises it on both ranks):
    both stop with the one line. Neither moves a checkpoint. (3) rank 1's record of step 2 has a broken header:
    only rank 1 sees the evidence, and it counts: both fall back to step 1, step 2 is set aside."""
    from utils.checkpoints.checkpointer import Checkpointer, resume_state
    from utils.comm import init_grid
    from utils.schema import ParallelConfig

    grid = init_grid(ParallelConfig(dp=world_size))
    ck = Checkpointer(Path(tmp_path) / "run", grid.world, keep=3)
    for step in (1, 2):
        ck.save(step, {"w": sharded_state.Box(torch.full((2,), float(step)), (4,), (2 * rank,))}, {})
    half = torch.empty(2)

    def resume() -> int:
        view = sharded_state.View({"w": sharded_state.Box(half, (4,), (2 * rank,))})
        meta, _ = resume_state("auto", ck, lambda meta, path: view, grid.device, logging.getLogger("test"))
        return meta["step"]

    bug = AttributeError("'Metadata' object has no attribute 'storage_meta'")
    checks = mock.patch("utils.checkpoints.checkpointer.read_shapes", side_effect=bug) if rank == 0 \
        else contextlib.nullcontext()
    with checks, pytest.raises(CheckpointLoadError if rank == 0 else ConfigError, match="checkpoint .*step_0000002"):
        resume()
    reads = mock.patch.object(sharded_state.SafeReader, "read_data", side_effect=RuntimeError("skew")) \
        if rank == 0 else contextlib.nullcontext()
    with reads, pytest.raises(CheckpointLoadError, match="step_0000002, whose files show no damage .*skew"):
        resume()
    barrier(grid.world)
    assert sorted(p.name for p in ck.dir.glob("*step_*")) == ["step_0000001", "step_0000002"]
    if rank == 1:
        _flip(ck.step_dir(2) / "__1_0.distcp", 1)
    barrier(grid.world)
    assert resume() == 1 and torch.equal(half, torch.ones(2))
    barrier(grid.world)
    assert sorted(p.name for p in ck.dir.glob("*step_*")) == ["bad_step_0000002", "step_0000001"]


def test_load_errors_are_agreed_across_ranks(tmp_path):
    run_ranks(_load_errors_on_two_ranks, 2, tmp_path, str(tmp_path), timeout_s=60)
