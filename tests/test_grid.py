"""The parallel grid: rank layout math and validation without processes; real groups on 4 ranks."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.helpers import run_ranks
from utils import ConfigError
from utils.comm import AXES, Axis, Grid, batch_parts, init_grid, parse_order, rank_layout, resolve_sizes
from utils.schema import ParallelConfig


def _layout(world: int, order: str, **sizes) -> dict[Axis, list[list[int]]]:
    cfg = ParallelConfig(order=order, **sizes)
    return rank_layout(resolve_sizes(cfg, world), parse_order(order))


def test_tp4_dp2_order_tp_dp():
    layout = _layout(8, "tp-dp", tp=4)
    assert layout[Axis.TP] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert layout[Axis.DP] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert layout[Axis.CP] == [[r] for r in range(8)] and layout[Axis.PP] == [[r] for r in range(8)]


def test_dp_nearest_when_ordered_first():
    layout = _layout(8, "dp-tp", tp=4)
    assert layout[Axis.DP] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert layout[Axis.TP] == [[0, 2, 4, 6], [1, 3, 5, 7]]


def test_cp_tp_dp():
    layout = _layout(8, "cp-tp-dp", tp=2, cp=2)
    assert layout[Axis.CP] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert layout[Axis.TP] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert layout[Axis.DP] == [[0, 4], [1, 5], [2, 6], [3, 7]]


def test_tp2_cp2_dp2_default_order():
    layout = _layout(8, ParallelConfig().order, tp=2, cp=2)
    assert layout[Axis.TP] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert layout[Axis.CP] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert layout[Axis.DP] == [[0, 4], [1, 5], [2, 6], [3, 7]]


@pytest.mark.parametrize("world,sizes", [
    (8, dict(tp=3)), (6, dict(tp=4)), (4, dict(tp=2, cp=2, pp=2)), (8, dict(tp=2, dp=2)), (2, dict(tp=4))])
def test_sizes_that_do_not_fit_raise(world, sizes):
    with pytest.raises(ConfigError) as err:
        resolve_sizes(ParallelConfig(**sizes), world)
    assert err.value.setting == "parallel" and str(world) in err.value.what


@pytest.mark.parametrize("field,value", [("tp", 0), ("cp", -1), ("pp", 0), ("dp", -2)])
def test_bad_axis_sizes_raise(field, value):
    with pytest.raises(ConfigError) as err:
        ParallelConfig(**{field: value})
    assert err.value.setting == f"parallel.{field}"


def test_parse_order_appends_missing_axes():
    assert parse_order("dp-tp") == (Axis.DP, Axis.TP, Axis.CP, Axis.PP)
    assert parse_order("tp-cp-dp-pp") == AXES


@pytest.mark.parametrize("order", ["tp-xp", "tp-tp", "tp-dp-tp", "data"])
def test_parse_order_errors(order):
    with pytest.raises(ConfigError) as err:
        parse_order(order)
    assert err.value.setting == "parallel.order"


def test_serial_grid_has_free_axes():
    grid = Grid.serial()
    for axis in AXES:
        group = grid.axis(axis)
        assert group.size == 1 and group.rank == 0 and group.group is None
    assert grid.axis("dp", "cp").size == 1 and grid.comm_bytes() == {}


def _check_groups(rank: int, world_size: int) -> None:
    grid = init_grid(ParallelConfig(tp=2, cp=2, order="tp-cp-dp"))
    layout = _layout(world_size, "tp-cp-dp", tp=2, cp=2)
    for names, groups in ((("tp",), layout[Axis.TP]), (("cp",), layout[Axis.CP]), (("dp", "cp"), layout[Axis.CP]),
                          (("tp", "cp"), [list(range(world_size))])):
        axis = grid.axis(*names)
        mine = next(g for g in groups if rank in g)
        assert axis.ranks == mine and axis.size == len(mine) and axis.rank == mine.index(rank), (names, axis)
        assert dist.get_process_group_ranks(axis.group) == mine
        total = torch.tensor([float(rank)])
        dist.all_reduce(total, group=axis.group)  # the group really connects those ranks
        assert total.item() == sum(mine)
    assert grid.axis("dp").group is None and grid.axis("dp").size == 1 and grid.frozen


def test_init_grid_groups_match_layout(tmp_path):
    run_ranks(_check_groups, 4, tmp_path)


def test_layout_command_prints_pp_groups_and_the_blocks_of_every_stage(capsys):
    from utils.plan.layout import main as layout_main

    assert layout_main(["pp=2", "dp=2", "depth=5", "pp_schedule=zbv"]) == 0
    out = capsys.readouterr().out
    assert "pp groups: [[0, 2], [1, 3]]" in out
    assert "pp rank 0: stage 0: blocks 0-1 + embedding; stage 3: block 4 + head" in out
    assert "pp rank 1: stage 1: block 2; stage 2: block 3" in out
    assert layout_main(["pp=4", "depth=3"]) == 2  # more stages than blocks: the one-line error, exit 2
    assert "(parallel.pp)" in capsys.readouterr().err


def test_the_grid_names_its_concepts_in_one_process():
    """Batch, replica, same-batch and metric groups of a serial grid are its free axes; `batch_parts` gives
    the batch group's size from the sizes alone (before any grid exists)."""
    grid = Grid.serial()
    for group in (grid.batch, grid.replicas, grid.same_batch, grid.metrics):
        assert group.size == 1 and group.rank == 0 and group.group is None
    assert batch_parts({Axis.TP: 2, Axis.CP: 3, Axis.DP: 4, Axis.PP: 5}) == 4


def _check_concepts(rank: int, world_size: int) -> None:
    grid = init_grid(ParallelConfig(cp=2, order="dp-cp"))  # dp2 x cp2, dp nearest
    layout = _layout(world_size, "dp-cp", cp=2)
    mine = lambda groups: next(g for g in groups if rank in g)  # noqa: E731
    assert grid.batch is grid.axis(Axis.DP) and grid.batch.ranks == mine(layout[Axis.DP])
    assert grid.replicas is grid.axis(Axis.DP, Axis.CP) and grid.replicas.ranks == list(range(world_size))
    assert grid.same_batch is grid.axis(Axis.TP, Axis.CP) and grid.same_batch.ranks == mine(layout[Axis.CP])
    assert grid.metrics is grid.axis(Axis.DP, Axis.PP) and grid.metrics.ranks == mine(layout[Axis.DP])
    mesh = grid.replica_mesh  # FSDP's 1-D mesh over the replicas: the same ranks, in the same order
    assert mesh.ndim == 1 and dist.get_process_group_ranks(mesh.get_group()) == grid.replicas.ranks


def test_init_grid_concepts_are_the_groups_their_rules_name(tmp_path):
    run_ranks(_check_concepts, 4, tmp_path)


def test_a_taken_rendezvous_port_is_one_line_naming_master_port(monkeypatch):
    """Rank 0's store cannot listen on a port another process holds (EADDRINUSE: CI's real-Slurm tier once, a
    job beside it on the port): one line naming MASTER_PORT and the fix, not torch's C++ traceback."""
    import socket

    with socket.socket() as taken:
        taken.bind(("", 0))
        taken.listen()
        port = taken.getsockname()[1]
        launch = {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        for name, value in launch.items():
            monkeypatch.setenv(name, value)
        with pytest.raises(ConfigError) as info:
            init_grid(ParallelConfig(dp=2, init_timeout_s=5))
    assert info.value.setting == "MASTER_PORT" and f"port {port} is in use" in info.value.what, info.value
    assert not dist.is_initialized()


def test_a_torch_lacking_one_of_dtensors_caches_still_ends_the_run(monkeypatch):
    """destroy_grid empties DTensor's two sharding-propagation caches (Python's and the C++ fast path's); on a
    torch lacking either (another version: a device image's) it skips that one instead of failing the exit."""
    import torch.distributed.tensor._api as api

    from utils.comm import _clear_dtensor_caches

    propagator, cleared = api.DTensor._op_dispatcher.sharding_propagator, []

    class Cache:
        def cache_clear(self):
            cleared.append("python")

    monkeypatch.setattr(propagator, "propagate_op_sharding", Cache())
    monkeypatch.setattr(torch._C, "_clear_DTensor_sharding_propagator_cache", lambda: cleared.append("c++"),
                        raising=False)
    _clear_dtensor_caches()
    assert cleared == ["python", "c++"]
    monkeypatch.setattr(propagator, "propagate_op_sharding", lambda *args: None)  # a cache without cache_clear
    monkeypatch.delattr(torch._C, "_clear_DTensor_sharding_propagator_cache")
    _clear_dtensor_caches()  # raises nothing, empties nothing
    assert cleared == ["python", "c++"]
