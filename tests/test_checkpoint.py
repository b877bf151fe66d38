"""Checkpoints: round trip, completion markers, `latest` as a hint, fallback from corrupt files, resume forms,
pruning only after a successor is complete, refusal of another model, background saves, and no unpickling
of arbitrary objects. (Resharding across layouts runs through the entry point in tests/test_layouts.py.)"""

import contextlib
import logging
import os
import pickle
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from unittest import mock

import pytest
import torch

from distributed.rng import rng_tensors, set_rng_tensors
from tests.helpers import ROOT
from utils import ConfigError
from utils.checkpoints.checkpointer import Checkpointer, choose_resume, resume_state
from utils.checkpoints.sharded_state import View, read_full
from utils.comm import Grid

WORLD = Grid.serial().world  # one process
LOG = logging.getLogger("test_checkpoint")


def save(ck: Checkpointer, step: int, background: bool = False):
    return ck.save(step, {"w": torch.full((3,), float(step))}, {"lr": [0.1, 0.2]}, background)


def saved(tmp_path, steps=(1, 2, 3), keep=3) -> Checkpointer:
    ck = Checkpointer(tmp_path, WORLD, keep=keep)
    for step in steps:
        save(ck, step)
    return ck


def destination(meta: dict, path) -> View:
    return View({"w": torch.empty(3)})


def resumed(ck: Checkpointer, resume: str = "auto") -> tuple[dict, View] | None:
    return resume_state(resume, ck, destination, torch.device("cpu"), LOG)


def resumed_step(ck: Checkpointer, resume: str = "auto") -> int | None:
    state = resumed(ck, resume)
    return None if state is None else state[0]["step"]


def test_round_trip_and_latest(tmp_path):
    ck = Checkpointer(tmp_path, WORLD, keep=2)
    assert ck.latest() is None
    for step in (10, 20, 30):
        save(ck, step)
    assert ck.latest().name == "step_0000030" and ck.pointer() == "step_0000030"
    assert sorted(p.name for p in (tmp_path / "checkpoints").glob("step_*")) == ["step_0000020", "step_0000030"]
    assert sorted(p.name for p in ck.latest().iterdir()) == [".metadata", "COMPLETE", "__0_0.distcp", "state.json"]
    meta, view = resumed(ck)
    assert meta == {"lr": [0.1, 0.2], "step": 30} and torch.equal(view.tensors["w"], torch.full((3,), 30.0))
    assert torch.equal(read_full(ck.latest())["w"], torch.full((3,), 30.0))


def test_unfinished_saves_never_count(tmp_path):
    """A save killed before its marker (or before its rename) is not a checkpoint, whatever it holds."""
    ck = saved(tmp_path, steps=(10,))
    half = tmp_path / "checkpoints" / ".tmp_step_0000020"
    os.system(f"cp -r {ck.latest()} {half} && rm {half}/COMPLETE")  # died before the marker
    no_marker = tmp_path / "checkpoints" / "step_0000030"
    os.system(f"cp -r {half} {no_marker}")  # e.g. copied by hand without its marker
    paths, why = choose_resume("auto", ck)
    assert [p.name for p in paths] == ["step_0000010"] and "step_0000010" in why
    with pytest.raises(ConfigError, match="incomplete"):
        choose_resume("step_0000030", ck)
    assert choose_resume("never", ck)[0] == []


def test_dangling_latest_resumes_the_newest_complete_and_keeps_it(tmp_path):
    """The review's C1: `latest` names a deleted folder. Resume says so, takes step 1, and the next saves
    do not delete it before their successor is complete."""
    ck = saved(tmp_path, steps=(1, 2), keep=2)
    os.system(f"rm -rf {tmp_path}/checkpoints/step_0000002")
    paths, why = choose_resume("auto", ck)
    assert [p.name for p in paths] == ["step_0000001"]
    assert "`latest` names step_0000002, which is missing" in why
    assert resumed_step(ck) == 1
    save(ck, 2)
    assert sorted(p.name for p in (tmp_path / "checkpoints").glob("step_*")) == ["step_0000001", "step_0000002"]


@pytest.mark.parametrize("name", ["__0_0.distcp", ".metadata", "state.json"])
def test_truncated_file_falls_back_to_the_previous_checkpoint(tmp_path, caplog, name):
    ck = saved(tmp_path)
    newest = ck.latest() / name
    newest.write_bytes(newest.read_bytes()[:len(newest.read_bytes()) // 2])
    with pytest.raises(ConfigError, match="no readable checkpoint.*step_0000003.* is unreadable"):
        resumed_step(ck, "3")  # asked for explicitly: no silent substitute, and the folder stays
    with caplog.at_level(logging.WARNING, logger=LOG.name):
        assert resumed_step(ck) == 2
    assert "step_0000003" in caplog.text and "unreadable" in caplog.text and "fell back to" in caplog.text
    assert "moved the unreadable checkpoint" in caplog.text  # auto's fallback sets it aside (bad_step_*)


def test_every_file_corrupt_stops_with_one_line(tmp_path):
    ck = saved(tmp_path, steps=(1, 2))
    for path in ck.complete_steps():
        (path / "__0_0.distcp").write_bytes(b"")
    with pytest.raises(ConfigError) as info:
        resumed_step(ck)
    assert info.value.setting == "trainer.resume" and "\n" not in str(info.value)


@pytest.mark.parametrize("form", ["2", "step_0000002", "PATH"])
def test_resume_forms(tmp_path, form):
    ck = saved(tmp_path)
    resume = str(tmp_path / "checkpoints" / "step_0000002") if form == "PATH" else form
    assert resumed_step(ck, resume) == 2
    with pytest.raises(ConfigError, match="no checkpoint folder"):
        resumed_step(ck, "7")


def test_resave_that_dies_between_renames_is_recovered(tmp_path, monkeypatch):
    """Re-saving step 2 moves the old folder aside first; a crash before the new one is in place must not
    lose step 2: the next resume puts the old folder back."""
    ck = saved(tmp_path, steps=(1, 2))
    real_rename = os.rename

    def crash_on_publish(src, dst):
        if str(src).endswith(".tmp_step_0000002"):
            raise KeyboardInterrupt("killed")
        real_rename(src, dst)
    monkeypatch.setattr(os, "rename", crash_on_publish)
    with pytest.raises(KeyboardInterrupt):
        save(ck, 2)
    monkeypatch.setattr(os, "rename", real_rename)
    assert not (tmp_path / "checkpoints" / "step_0000002").exists()
    assert resumed_step(ck) == 2


def test_a_failed_save_prunes_nothing(tmp_path, monkeypatch):
    ck = saved(tmp_path, steps=(1, 2), keep=2)
    monkeypatch.setattr("utils.checkpoints.checkpointer.save_state",
                        lambda *a, **k: (_ for _ in ()).throw(OSError(28, "No space left")))
    with pytest.raises(OSError):
        save(ck, 3)
    assert [p.name for p in ck.complete_steps()] == ["step_0000002", "step_0000001"]


def test_resuming_an_older_step_abandons_the_later_ones(tmp_path):
    ck = saved(tmp_path, steps=(1, 2, 3))
    assert resumed_step(ck, "1") == 1
    save(ck, 2)  # the new trajectory's step 2 replaces the old one; old step 3 goes
    assert [p.name for p in ck.complete_steps()] == ["step_0000002", "step_0000001"]


class Payload:
    """Stands for any pickled object whose loading would run code."""

    def __reduce__(self):
        return (os.system, ("touch pwned",))


def test_loading_refuses_arbitrary_objects(tmp_path):
    """DCP's metadata is a pickle: one naming anything but DCP's own classes is refused unread."""
    ck = saved(tmp_path, steps=(1,))
    (ck.latest() / ".metadata").write_bytes(pickle.dumps(Payload()))
    with pytest.raises(ConfigError, match="no readable checkpoint.*metadata is unreadable"):
        resumed_step(ck, "1")
    assert not (tmp_path / "pwned").exists() and not (ROOT / "pwned").exists()


def test_dotted_names_cannot_reach_past_the_allowed_classes(tmp_path):
    """pickle resolves `module.a.b` attribute by attribute: an allowed module must not lend its imports
    (here torch.distributed.checkpoint.filesystem's `os`) to a crafted checkpoint."""
    module = b"torch.distributed.checkpoint.filesystem"
    command = f"touch {tmp_path / 'pwned'}".encode()
    payload = (b"\x80\x04\x8c" + bytes([len(module)]) + module + b"\x8c\x09os.system\x93"
               + b"\x8c" + bytes([len(command)]) + command + b"\x85R.")
    ck = saved(tmp_path, steps=(1,))
    (ck.latest() / ".metadata").write_bytes(payload)
    with pytest.raises(ConfigError, match="no readable checkpoint.*metadata is unreadable"):
        resumed_step(ck, "1")
    assert not (tmp_path / "pwned").exists()


def test_another_model_is_refused(tmp_path):
    ck = saved(tmp_path, steps=(1,))
    for view, what in ((View({"w": torch.empty(4)}), r"w has shape \[3\], this model's is \[4\]"),
                       (View({"w": torch.empty(3), "b": torch.empty(2)}), "b is missing")):
        with pytest.raises(ConfigError, match="written by another model: " + what):
            resume_state("auto", ck, lambda meta, path, v=view: v, torch.device("cpu"), LOG)


def test_background_save_copies_first_and_publishes_when_done(tmp_path):
    ck = Checkpointer(tmp_path, WORLD)
    w = torch.ones(1000)
    ck.save(1, {"w": w}, {}, background=True)
    w.mul_(5)  # the next optimizer step, while the background thread writes
    assert ck.pending is not None
    assert ck.wait() == ck.step_dir(1) and ck.pending is None and ck.latest() == ck.step_dir(1)
    assert torch.equal(read_full(ck.latest())["w"], torch.ones(1000))


KILLED_DURING_BACKGROUND_SAVE = """
import os, signal, sys, torch
from utils.checkpoints.checkpointer import Checkpointer
from utils.comm import Grid
ck = Checkpointer(sys.argv[1], Grid.serial().world)
ck.save(1, {"w": torch.ones(3)}, {})
ck.save(2, {"w": torch.zeros(2**26)}, {}, background=True)  # 256 MiB: still writing when killed
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_kill_during_a_background_save_leaves_the_previous_checkpoint(tmp_path):
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(KILLED_DURING_BACKGROUND_SAVE), str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    ck = Checkpointer(tmp_path, WORLD)
    assert (tmp_path / "checkpoints" / ".tmp_step_0000002").is_dir()  # what the kill left
    assert [p.name for p in ck.complete_steps()] == ["step_0000001"] and resumed_step(ck) == 1


def test_rng_state_round_trip():
    state = rng_tensors("rng/0/")
    a = torch.rand(3)
    set_rng_tensors(state, "rng/0/")
    assert torch.equal(torch.rand(3), a)


def _rank0_disk_full(rank: int, world_size: int, tmp_path) -> None:
    from utils.comm import init_grid
    from utils.schema import ParallelConfig

    grid = init_grid(ParallelConfig(dp=world_size))
    ck = Checkpointer(tmp_path, grid.world)
    ck.save(1, {"w": torch.full((4,), float(rank))}, {})
    # rank 0 alone cannot write the next checkpoint's state file; the patch is undone also when the save does
    # not raise (this process is the pool's: a Path.mkdir left broken would fail the next cases)
    disk_full = (mock.patch.object(Path, "mkdir", side_effect=OSError(28, "No space left on device")) if rank == 0
                 else contextlib.nullcontext())
    with disk_full, pytest.raises((OSError, RuntimeError), match="No space left on device"):
        ck.save(2, {"w": torch.full((4,), float(rank))}, {})
    assert [p.name for p in ck.complete_steps()] == ["step_0000001"]


@pytest.mark.slow  # over 10 s: the fast tier's 3 minutes
def test_rank0_failing_to_write_stops_every_rank(tmp_path):
    """A disk-full rank 0 raises on every rank (the others are told, not left in a barrier)."""
    from tests.helpers import run_ranks

    run_ranks(_rank0_disk_full, 2, tmp_path, tmp_path, timeout_s=60)
