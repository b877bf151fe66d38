"""trainer.profile: a Chrome trace and an operator table of the chosen steps, per rank, from the real loop."""

from __future__ import annotations

import json

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from tests.test_precision import make_trainer
from utils import ConfigError
from utils.cli.config import load_config


@pytest.mark.slow
def test_profile_of_steps_2_to_3(tmp_path, era5_root):
    run_dir = tmp_path / "run"
    trainer = make_trainer(run_dir, f"data.root={era5_root}", "trainer.global_batch_size=8", "trainer.max_steps=4",
                           "trainer.val_every=0", "trainer.ckpt_every=0", "trainer.profile=true",
                           "trainer.profile_steps=[2,3]")
    assert trainer.fit() == 0
    trace = json.loads((run_dir / "profile" / "rank0_steps2-3.json").read_text())
    names = [e.get("name") for e in trace["traceEvents"]]
    # two steps, each a ProfilerStep range numbered as logged, with the loop's named ranges and the real
    # kernels inside them, and no third step
    assert [n for n in names if n.startswith("ProfilerStep#")] == ["ProfilerStep#2", "ProfilerStep#3"]
    steps = {e["name"]: e for e in trace["traceEvents"] if e.get("name", "").startswith("ProfilerStep#")}
    assert names.count("forward_backward") == 2 and names.count("optimizer") == 2 and names.count("data") == 2
    for event in trace["traceEvents"]:  # every named range lies inside one of the two steps
        if event.get("name") in ("data", "forward_backward", "optimizer") and event.get("ph") == "X":
            assert any(s["ts"] <= event["ts"] and event["ts"] + event["dur"] <= s["ts"] + s["dur"]
                       for s in steps.values()), event
    assert "aten::mm" in names or "aten::addmm" in names
    table = (run_dir / "profile" / "rank0_steps2-3_top_ops.txt").read_text()
    assert "Self CPU" in table and "aten::" in table
    log = (run_dir / "train.log").read_text()
    assert "profile of steps 2-3 (rank 0)" in log and "ui.perfetto.dev" in log and "Self CPU" in log
    events = EventAccumulator(str(run_dir), size_guidance={"tensors": 0}).Reload()
    assert "profile/top_ops/text_summary" in events.Tags()["tensors"]


@pytest.mark.parametrize("override,setting", [("trainer.profile_steps=[0,2]", "trainer.profile_steps"),
                                              ("trainer.profile_steps=[5,3]", "trainer.profile_steps"),
                                              ("trainer.profile_steps=[5]", "trainer.profile_steps")])
def test_bad_profile_steps_are_refused(override, setting):
    with pytest.raises(ConfigError) as info:
        load_config([override])
    assert info.value.setting == setting


def test_memory_snapshots_need_cuda(tmp_path, era5_root):
    with pytest.raises(ConfigError) as info:
        make_trainer(tmp_path / "run", f"data.root={era5_root}", "trainer.profile_memory=true")
    assert info.value.setting == "trainer.profile_memory"
