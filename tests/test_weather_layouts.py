"""Training from a WeatherBench 2-layout zarr store written here, with GraphCast's weighted loss, under tensor,
context, pipeline and fully sharded data parallelism: every layout follows the single-process curve (fp32,
relative 1e-4), its rollout evaluation included (the forecast skill and the spectra's blurring figure read through
the zarr reader)."""

from __future__ import annotations

import pytest

from tests.helpers import NARROW, QUIET, read_scalars
from tests.rank_pool import run_entry_ranks
from utils.weather.data import stats
from utils.weather.data.era5_zarr_synthetic import write_store

pytestmark = pytest.mark.slow  # trains through the entry point

SPLITS = {"train": ["2016-01-01", "2016-01-06T18"], "valid": ["2016-01-07", "2016-01-10T18"]}
RANGES = [f"data.{k}=[{a},{b}]" for k, (a, b) in SPLITS.items()]
RUN = [*QUIET, *NARROW, "data=era5_zarr", "data.img_size=[16,32]", "data.limit_nsamples_val=4",
       "data.variables=[2m_temperature,10m_u_component_of_wind,geopotential@500,temperature@850]", *RANGES,
       "task.loss=weighted_mse", "trainer.max_steps=3", "trainer.log_every=1", "trainer.global_batch_size=4",
       "task.eval.every=3", "task.eval.steps=2", "task.eval.inits=2"]


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """A 16 x 32 store of 40 six-hourly times (latitudes ascending, as WB2's) and its statistics."""
    path = write_store(tmp_path_factory.mktemp("zarr") / "era5.zarr", shape=(16, 32), levels=(500, 850),
                       num_times=40)
    assert stats.main([f"data.root={path}", "--all", *RANGES]) == 0
    return path


def curves(run_dir) -> dict[str, list[float]]:
    scalars = read_scalars(run_dir)
    return {tag: [v for _, v in values] for tag, values in scalars.items()
            if tag in ("train/loss", "train/grad_norm", "val/loss")
            or tag.startswith(("rollout/rmse/", "rollout/blurring/"))}  # blurring: the spectra's figure


@pytest.fixture(scope="module")
def single(store, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("weather") / "single"
    results = run_entry_ranks([*RUN, f"data.root={store}", f"run.dir={run_dir}"], 1)
    assert [r.value for r in results] == [0], results[0].error or results[0].stderr[-2000:]
    return curves(run_dir)


def test_the_single_process_run_learns_with_the_weighted_loss(single):
    assert len(single["train/loss"]) == 3 and single["train/loss"][-1] < single["train/loss"][0]
    assert {"rollout/rmse/geopotential@500/6h", "rollout/rmse/2m_temperature/12h",
            "rollout/blurring/2m_temperature/12h"} <= single.keys()


@pytest.mark.parametrize("layout", [["parallel.tp=2"], ["parallel.dp=2", "parallel.dp_mode=fsdp"],
                                    ["parallel.cp=2"], ["parallel.pp=2"]],
                         ids=lambda layout: "-".join(s.split(".")[1] for s in layout))
def test_every_layout_follows_the_single_process_curve(layout, store, single, tmp_path):
    run_dir = tmp_path / "run"
    results = run_entry_ranks([*RUN, f"data.root={store}", f"run.dir={run_dir}", *layout])
    assert {r.value for r in results} == {0}, [r.error or r.stderr[-2000:] for r in results]
    got = curves(run_dir)
    assert got.keys() == single.keys()
    for tag, values in single.items():
        assert got[tag] == pytest.approx(values, rel=1e-4), tag
