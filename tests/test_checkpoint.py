"""Checkpoints: round trip, completion markers, `latest` as a hint, fallback from corrupt files, resume forms,
pruning only after a successor is complete, and no unpickling of arbitrary objects."""

import logging
import os

import pytest
import torch

from utils.checkpoint import (Checkpointer, CorruptCheckpoint, choose_resume, resume_state, rng_state,
                              set_rng_state)
from utils.comm import Grid
from utils.errors import ConfigError

WORLD = Grid.serial().world  # one process
LOG = logging.getLogger("test_checkpoint")


def saved(tmp_path, steps=(1, 2, 3), keep=3) -> Checkpointer:
    ck = Checkpointer(tmp_path, WORLD, keep=keep)
    for step in steps:
        ck.save(step, {"step": step, "w": torch.full((3,), float(step))})
    return ck


def resumed_step(ck: Checkpointer, resume: str = "auto") -> int | None:
    state = resume_state(resume, ck, 0, torch.device("cpu"), LOG)
    return None if state is None else state["step"]


def test_round_trip_and_latest(tmp_path):
    ck = Checkpointer(tmp_path, WORLD, keep=2)
    assert ck.latest() is None
    for step in (10, 20, 30):
        ck.save(step, {"step": step, "w": torch.full((3,), float(step)), "lr": [0.1, 0.2]})
    assert ck.latest().name == "step_0000030" and ck.pointer() == "step_0000030"
    assert sorted(p.name for p in (tmp_path / "checkpoints").glob("step_*")) == ["step_0000020", "step_0000030"]
    assert sorted(p.name for p in ck.latest().iterdir()) == ["COMPLETE", "rank_00000.pt"]
    state = ck.load(ck.latest())
    assert state["step"] == 30 and torch.equal(state["w"], torch.full((3,), 30.0))


def test_unfinished_saves_never_count(tmp_path):
    """A save killed before its marker (or before its rename) is not a checkpoint, whatever it holds."""
    ck = saved(tmp_path, steps=(10,))
    half = tmp_path / "checkpoints" / ".tmp_step_0000020"
    half.mkdir()
    torch.save({"step": 20}, half / "rank_00000.pt")  # died before the marker
    no_marker = tmp_path / "checkpoints" / "step_0000030"
    no_marker.mkdir()
    torch.save({"step": 30}, no_marker / "rank_00000.pt")  # e.g. copied by hand without its marker
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
    ck.save(2, {"step": 2})
    assert sorted(p.name for p in (tmp_path / "checkpoints").glob("step_*")) == ["step_0000001", "step_0000002"]


def test_truncated_file_falls_back_to_the_previous_checkpoint(tmp_path, caplog):
    ck = saved(tmp_path)
    newest = ck.latest() / "rank_00000.pt"
    newest.write_bytes(newest.read_bytes()[:100])
    with pytest.raises(CorruptCheckpoint):
        ck.load(ck.latest())
    with caplog.at_level(logging.WARNING, logger=LOG.name):
        assert resumed_step(ck) == 2
    assert str(newest) in caplog.text and "fell back to" in caplog.text
    with pytest.raises(ConfigError, match="no readable checkpoint.*rank_00000.pt is unreadable"):
        resumed_step(ck, "3")  # asked for explicitly: no silent substitute


def test_every_file_corrupt_stops_with_one_line(tmp_path):
    ck = saved(tmp_path, steps=(1, 2))
    for path in ck.complete_steps():
        (path / "rank_00000.pt").write_bytes(b"")
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
        ck.save(2, {"step": 2, "w": torch.zeros(3)})
    monkeypatch.setattr(os, "rename", real_rename)
    assert not (tmp_path / "checkpoints" / "step_0000002").exists()
    assert resumed_step(ck) == 2


def test_a_failed_save_prunes_nothing(tmp_path, monkeypatch):
    ck = saved(tmp_path, steps=(1, 2), keep=2)
    monkeypatch.setattr(torch, "save", lambda *a, **k: (_ for _ in ()).throw(OSError(28, "No space left")))
    with pytest.raises(OSError):
        ck.save(3, {"step": 3})
    assert [p.name for p in ck.complete_steps()] == ["step_0000002", "step_0000001"]


def test_resuming_an_older_step_abandons_the_later_ones(tmp_path):
    ck = saved(tmp_path, steps=(1, 2, 3))
    assert resumed_step(ck, "1") == 1
    ck.save(2, {"step": 2})  # the new trajectory's step 2 replaces the old one; old step 3 goes
    assert [p.name for p in ck.complete_steps()] == ["step_0000002", "step_0000001"]


class Payload:
    """Stands for any pickled object whose loading would run code."""


def test_loading_refuses_arbitrary_objects(tmp_path):
    ck = Checkpointer(tmp_path, WORLD)
    path = ck.save(1, {"step": 1})
    torch.save({"step": 1, "evil": Payload()}, path / "rank_00000.pt")
    with pytest.raises(CorruptCheckpoint, match="(?i)weights_only|unsupported|global"):
        ck.load(path)


def test_rng_state_round_trip():
    state = rng_state()
    a = torch.rand(3)
    set_rng_state(state)
    assert torch.equal(torch.rand(3), a)
