"""Checkpoints: round trip, atomic `latest`, pruning, and no unpickling of arbitrary objects."""

import pytest
import torch

from utils.checkpoint import Checkpointer, resolve_resume, rng_state, set_rng_state
from utils.comm import Grid
from utils.errors import ConfigError

WORLD = Grid.serial().world  # one process


def test_round_trip_and_latest(tmp_path):
    ck = Checkpointer(tmp_path, WORLD, keep=2)
    assert ck.latest() is None
    for step in (10, 20, 30):
        ck.save(step, {"step": step, "w": torch.full((3,), float(step)), "lr": [0.1, 0.2]})
    assert ck.latest().name == "step_0000030"
    assert sorted(p.name for p in (tmp_path / "checkpoints").glob("step_*")) == ["step_0000020", "step_0000030"]
    state = ck.load(ck.latest())
    assert state["step"] == 30 and torch.equal(state["w"], torch.full((3,), 30.0))


def test_crash_mid_save_leaves_latest_complete(tmp_path):
    ck = Checkpointer(tmp_path, WORLD)
    ck.save(10, {"step": 10})
    (tmp_path / "checkpoints" / ".tmp_step_0000020").mkdir()  # a save that died before the rename
    assert resolve_resume("auto", ck).name == "step_0000010"
    assert resolve_resume("never", ck) is None
    with pytest.raises(ConfigError):
        resolve_resume(str(tmp_path / "nowhere"), ck)


class Payload:
    """Stands for any pickled object whose loading would run code."""


def test_loading_refuses_arbitrary_objects(tmp_path):
    ck = Checkpointer(tmp_path, WORLD)
    path = ck.save(1, {"step": 1})
    torch.save({"step": 1, "evil": Payload()}, path / "rank_00000.pt")
    with pytest.raises(Exception, match="(?i)weights_only|unsupported|global"):
        ck.load(path)


def test_rng_state_round_trip():
    state = rng_state()
    a = torch.rand(3)
    set_rng_state(state)
    assert torch.equal(torch.rand(3), a)
