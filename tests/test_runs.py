"""Run directories never mix runs; resuming refuses other settings (not another layout); unsupported layouts."""

from pathlib import Path

import pytest

from tests.helpers import run_entry
from utils import ConfigError
from utils.checkpoints.run_dir import check_resumable, differences, run_dir_for
from utils.cli.config import load_config
from utils.cli.runs import run_digest


def default_dir(*overrides):
    cfg, choices, yaml = load_config(list(overrides))
    return run_dir_for(cfg, choices, "single", run_digest(cfg, choices, yaml)).name


def test_default_names_are_readable_and_distinct():
    assert default_dir() == "vit_tiny-era5_synthetic-single-fp32"
    assert default_dir("experiment=bs16_opt") == "vit_base-era5-single-fp16-bs16_opt"
    assert default_dir("experiment=bs32_opt") != default_dir("experiment=bs16_opt")
    changed = default_dir("model.embed_dim=64")
    assert changed.startswith("vit_tiny-era5_synthetic-single-fp32-") and changed != default_dir()
    assert default_dir("trainer.log_every=3", "trainer.num_workers=0", "trainer.worker_start=fork",
                       "trainer.hang_timeout_s=60", "parallel.cp_attention=allgather", "precision.compile=true",
                       "trainer.activation_checkpointing=true") == default_dir()  # the same training
    assert default_dir("run.tag=x").endswith("-x")


def test_resume_refuses_other_settings(tmp_path):
    _, _, yaml = load_config([])
    _, _, other = load_config(["optim.lr=1e-2", "trainer.log_every=3"])
    assert differences(yaml, other) == ["optim.lr: 0.0005 -> 0.01"]
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "latest").write_text("step_0000010")
    (tmp_path / "config.yaml").write_text(yaml)
    check_resumable(tmp_path, yaml)
    with pytest.raises(ConfigError, match="optim.lr"):
        check_resumable(tmp_path, other)


def test_resume_accepts_another_layout():
    """Checkpoints load under any layout (tests/test_layouts.py): the layout, the pipeline schedule and the
    accumulation split of the same global batch do not change what is trained."""
    _, _, yaml = load_config([])
    _, _, other = load_config(["parallel=pp2", "parallel.tp=2", "parallel.pp_schedule=gpipe",
                               "trainer.grad_accum_steps=2", "trainer.ckpt_async=true"])
    assert differences(yaml, other) == []


@pytest.mark.parametrize("args,setting", [(["parallel.cp=2", "model.dropout=0.1"], "parallel.cp_attention"),
                                          (["parallel.pp=8"], "parallel.pp"),  # 8 stages for 4 blocks
                                          (["parallel.tp=3"], "parallel.tp")])
def test_unsupported_layouts_stop_before_any_work(args, setting, tmp_path):
    proc = run_entry("train_mp.py", f"run.root={tmp_path}", *args, timeout=120)
    assert proc.returncode == 2 and f"({setting})" in proc.stderr, proc.stderr
    assert not any(Path(tmp_path).iterdir())  # no run directory was made
