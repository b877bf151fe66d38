"""Run facts are data: each launch writes its resolved layout as run.dir/layout.json (checkpoints/run_dir.py), which
tools (utils/compare/report.py) and tests read instead of log text."""

from __future__ import annotations

import json

from tests.helpers import QUIET
from tests.rank_pool import run_entry_ranks
from utils.checkpoints.run_dir import LAYOUT_FILE, TASK_FILE, layout_facts, read_facts, read_layout, write_layout
from utils.comm import Axis, Grid, parse_order, rank_layout, resolve_sizes
from utils.compare.report import layout_of
from utils.schema import ParallelConfig


def _grid(world: int, order: str, **sizes) -> Grid:
    return Grid(resolve_sizes(ParallelConfig(order=order, **sizes), world), parse_order(order))


def test_layout_facts_are_the_grids():
    grid = _grid(8, "dp-tp-pp", tp=2, pp=2)
    facts = layout_facts(grid)
    assert facts["world_size"] == 8 and facts["order"] == ["dp", "tp", "pp", "cp"]
    assert facts["sizes"] == {"dp": 2, "tp": 2, "pp": 2, "cp": 1}
    assert facts["name"] == "dp2-tp2-pp2" and facts["signature"] == grid.signature
    layout = rank_layout(grid.sizes, grid.order)
    assert facts["groups"] == {axis.value: layout[axis] for axis in grid.order}
    assert facts["groups"]["dp"] == [[0, 1], [2, 3], [4, 5], [6, 7]]  # dp nearest
    assert facts["concepts"] == {"batch": ["dp"], "replicas": ["dp", "cp"], "same_batch": ["tp", "cp"],
                                 "metrics": ["dp", "pp"]}
    assert json.loads(json.dumps(facts)) == facts  # plain data


def test_write_layout_replaces_the_file_whole(tmp_path):
    assert read_layout(tmp_path) is None  # a run directory from before layout.json
    write_layout(tmp_path, _grid(4, "tp-cp-dp-pp", tp=2))
    write_layout(tmp_path, _grid(8, "tp-cp-dp-pp", tp=2))  # a relaunch under another world size
    assert read_layout(tmp_path) == layout_facts(_grid(8, "tp-cp-dp-pp", tp=2))
    assert sorted(p.name for p in tmp_path.iterdir()) == [LAYOUT_FILE]  # no partial file left behind


def test_a_run_writes_its_resolved_layout_beside_its_config(tmp_path, era5_root):
    """Two torchrun-style ranks with parallel.dp derived (0 in config.yaml): layout.json says dp=2, and
    compare reads the layout from it."""
    run_dir = tmp_path / "run"
    argv = [*QUIET, f"data.root={era5_root}", f"run.dir={run_dir}", "trainer.max_steps=1",
            "trainer.global_batch_size=4", "data.limit_nsamples_val=4"]
    results = run_entry_ranks(argv, world=2)
    assert [r.value for r in results] == [0, 0], [r.error or r.stderr[-2000:] for r in results]
    assert (run_dir / "config.yaml").is_file()
    facts = read_layout(run_dir)
    assert facts == layout_facts(Grid({Axis.TP: 1, Axis.CP: 1, Axis.DP: 2, Axis.PP: 1}, parse_order("tp-cp-dp-pp")))
    assert facts["groups"]["dp"] == [[0, 1]] and facts["world_size"] == 2
    assert layout_of(run_dir, {"dp": 0}) == ("dp2", 2)
    assert read_facts(run_dir, TASK_FILE) == {"arch": "vit", "data": "era5", "quality_metric": "val/rmse/u10m",
                                              "tokens_per_sample": 128}  # vit_tiny: 32x64 in 4x4 patches
