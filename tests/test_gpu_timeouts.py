"""Every process group carries `parallel.init_timeout_s`, and the step watchdog fires before the backend's own.

Checked on gloo, where a group's timeout is read back from its backend's options as on NCCL: the groups
init_grid makes (the DeviceMesh's dims, their flattened products, `new_group`s) hold
`parallel.init_timeout_s`, not the backend's default (30 min on gloo, 10 on NCCL); while the training loop runs
the step watchdog raises them above `trainer.hang_timeout_s` and puts them back after it.
"""

from __future__ import annotations

import datetime

import pytest
import torch.distributed as dist

from tests.helpers import run_ranks
from utils.comm import init_grid
from utils.comm.timeouts import WATCHDOG_MARGIN_S, group_timeouts, set_group_timeouts, watchdog_safe_timeout
from utils.engine.watchdog import StepWatchdog
from utils.schema import ParallelConfig


@pytest.fixture
def one_rank(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'init'}", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=77))
    yield
    dist.destroy_process_group()


def test_set_group_timeouts_reaches_groups_made_later(one_rank):
    dist.new_group([0])  # a group made after init: the backend's default, not init's
    assert sorted(group_timeouts().values()) == [77.0, 1800.0]
    before = set_group_timeouts(42)
    assert sorted(before.values()) == [77.0, 1800.0] and set(group_timeouts().values()) == {42.0}


def test_step_watchdog_outlasts_the_backend_timeout_while_the_loop_runs(one_rank, tmp_path):
    set_group_timeouts(60)
    with StepWatchdog(300, tmp_path, 0):
        assert set(group_timeouts().values()) == {300 + WATCHDOG_MARGIN_S} == {watchdog_safe_timeout(300)}
    assert set(group_timeouts().values()) == {60.0}
    with StepWatchdog(0, tmp_path, 0):  # off: the groups keep parallel.init_timeout_s
        assert set(group_timeouts().values()) == {60.0}


def _grid_groups(rank: int, world_size: int) -> None:
    grid = init_grid(ParallelConfig(tp=2, dp=2, init_timeout_s=123))
    timeouts = group_timeouts()
    assert len(timeouts) >= 4 and set(timeouts.values()) == {123.0}, timeouts  # world, tp, dp, tp x dp, ...
    assert grid.axis("tp").group is not None


@pytest.mark.slow
def test_init_grid_gives_every_group_the_init_timeout(tmp_path):
    run_ranks(_grid_groups, 4, tmp_path)
