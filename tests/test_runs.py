"""Run directories never mix runs; resuming refuses other settings (not another layout); unsupported layouts."""

import re
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
    with pytest.raises(ConfigError, match="optim.lr") as refused:
        check_resumable(tmp_path, other)
    assert refused.value.fix.startswith("set run.tag=<name> or run.dir=<new folder>")
    _, _, named = load_config(["optim.lr=1e-2", f"run.dir={tmp_path}"])
    with pytest.raises(ConfigError) as refused:  # run.tag names only a default run.dir: not offered
        check_resumable(tmp_path, named)
    assert refused.value.fix.startswith("set run.dir=<new folder>") and "run.tag" not in refused.value.fix


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


def refusal(tmp_path, old_args, new_args, record_presets=True) -> str:
    """check_resumable's refusal of `new_args` in a run directory with checkpoints of `old_args` (its presets.json
    written as the command line writes it, or left out as by a run from before), the new presets passed."""
    from utils.checkpoints.run_dir import PRESETS_FILE, preset_facts, write_facts

    _, old_choices, old = load_config(old_args)
    _, choices, new = load_config(new_args)
    (tmp_path / "checkpoints").mkdir(exist_ok=True)
    (tmp_path / "checkpoints" / "latest").write_text("step_0000010")
    (tmp_path / "config.yaml").write_text(old)
    (tmp_path / PRESETS_FILE).unlink(missing_ok=True)
    if record_presets:
        write_facts(tmp_path, PRESETS_FILE, preset_facts(old_choices))
    with pytest.raises(ConfigError) as refused:
        check_resumable(tmp_path, new, choices)
    assert "\n" not in refused.value.line() and refused.value.setting == "run.dir"
    return refused.value.what.split("other settings (", 1)[1]


def test_a_refused_resume_names_the_changed_presets_first(tmp_path):
    """Another model in a reused run.dir: the presets chosen differently lead, then the user's own overrides; the
    rest is counted (before: `data.attention`, `data.bpe_vocab_size`, 20 channel names, and the model behind ...)."""
    changed = refusal(tmp_path, [], ["model=gpt_tiny", "data=wikitext_sample", "optim.lr=1e-3"])
    assert changed.startswith("model=vit_tiny -> gpt_tiny; data=era5_synthetic -> wikitext_sample; "
                              "optim.lr: 0.0005 -> 0.001; "), changed
    assert re.search(r"; and \d+ more\)$", changed) and "u10m" not in changed, changed


def test_a_refused_resume_without_recorded_presets_leads_with_the_family_keys(tmp_path):
    changed = refusal(tmp_path, [], ["model=gpt_tiny", "data=wikitext_sample"], record_presets=False)
    assert changed.startswith("data.kind: era5 -> wikitext; model.arch: vit -> gpt; task.kind: weather -> "
                              "language; "), changed


def test_a_refused_resume_counts_long_lists_and_many_entries(tmp_path):
    """A list of 20 channel names is counted, not printed; the 14 loss weights a language task lacks are one item."""
    assert refusal(tmp_path, [], ["data.channels=[u10m,v10m]"]) == "data.channels: 20 entries -> ['u10m', 'v10m'])"
    from utils.checkpoints.run_dir import changed_settings

    _, _, old = load_config([])
    _, _, new = load_config(["model=gpt_tiny", "data=wikitext_sample"])
    assert "task.variable_weights: 14 entries changed" in changed_settings(old, new)
    reordered = "data.channels=[v10m,u10m,t2m,sp,msl,t850,u1000,v1000,z1000,u850,v850,z850,u500,v500,z500,t500," \
                "z50,r500,r850,tcwv]"
    assert refusal(tmp_path, [], [reordered]) == "data.channels: 2 of 20 entries changed)"
