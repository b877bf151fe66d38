"""Every preset and experiment resolves to the config it resolved to when the golden file was made.

tests/data/resolved_configs.json maps each command line (its overrides joined by spaces; "" is the default
config) to what `load_config` makes of it: the chosen preset per group, the resolved YAML, and the default
run-directory name (whose digest names the settings beyond the presets, utils/cli/runs.py). Moving a default
between the YAML and the schemas, or sharing a block between presets, must leave all three unchanged.

The golden file records intended behaviour: regenerate it (`python -m tests.test_config_presets`) only for
a change that is meant to change a resolved config, and say so in the commit.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from utils.cli.config import compose_config, load_config, presets

GOLDEN = Path(__file__).resolve().parent / "data" / "resolved_configs.json"
GROUPS = ("model", "data", "precision", "parallel", "optim", "experiment")
# What a preset needs beside it to pass the rules between groups.
NEEDS = {"model=gpt_tiny": ["data=wikitext_sample"], "model=gpt_small": ["data=wikitext_sample"],
         "model=gpt_medium": ["data=wikitext_sample"],
         **{f"model=llama_{size}": ["data=wikitext_sample"] for size in ("tiny", "1b", "8b")},
         "data=wikitext": ["model=gpt_tiny"], "data=wikitext_sample": ["model=gpt_tiny"],
         "data=tokens": ["model=gpt_tiny"],
         "parallel=tp8": ["model.num_heads=8"]}
# Combinations: command-line groups and keys over an experiment, settings beyond the presets (a digest).
COMBINATIONS = [
    ["experiment=short", "precision=bf16"], ["experiment=short_opt", "parallel=dp"],
    ["experiment=mp", "model=vit_base"], ["experiment=mp_patch4", "model.patch_size=8"],
    ["experiment=bs64_opt", "optim=adamw"], ["experiment=bs256_opt", "trainer.max_steps=100"],
    ["experiment=short", "model=vit_tiny", "data=era5_synthetic"], ["experiment=bs16_opt", "precision=fp32"],
    ["experiment=opt", "parallel=tp2", "precision.compile=false"], ["parallel=dp", "parallel.tp=2"],
    ["parallel=single", "parallel.dp_mode=fsdp", "precision=bf16"], ["model.embed_dim=64"],
    ["trainer.log_every=3", "trainer.num_workers=0"], ["run.tag=x"], ["trainer.max_steps=300"],
    ["model=gpt_small", "data=wikitext", "optim=adamw", "precision=bf16", "parallel=tp2cp2"],
    ["model=vit_large", "data=era5", "parallel=pp4", "parallel.pp_schedule=gpipe"],
]
# Hydra's own settings that config/config.yaml makes (the app writes nothing of its own).
HYDRA_KEYS = ("output_subdir", "job.name", "job.chdir", "run.dir", "sweep.dir", "sweep.subdir", "hydra_logging",
              "job_logging", "runtime.choices")


def cases() -> list[list[str]]:
    """The default config, every preset of every group (with what it needs), and the combinations."""
    single = [[f"{g}={name}", *NEEDS.get(f"{g}={name}", [])] for g in GROUPS for name in presets(g)]
    return [[], *single, *COMBINATIONS]


def resolve(overrides: list[str]) -> dict:
    """Chosen presets, resolved YAML and default run-directory name (layout part fixed) of a command line."""
    from utils.checkpoints.run_dir import run_dir_for
    from utils.cli.runs import run_digest

    cfg, choices, yaml = load_config(overrides)
    run_dir = run_dir_for(cfg, choices, "LAYOUT", run_digest(cfg, choices, yaml))
    result = {"choices": choices, "config": yaml, "run_dir": run_dir.name}
    if not overrides or overrides == ["experiment=short"]:
        composed = compose_config(overrides)
        result["hydra"] = {k: OmegaConf.to_container(OmegaConf.create({"v": OmegaConf.select(composed.hydra, k)}),
                                                     resolve=True)["v"] for k in HYDRA_KEYS}
        result["hydra"]["sweep.dir"] = str(OmegaConf.select(composed, "hydra.sweep.dir"))  # ${run.root}, resolved
    return result


def key(overrides: list[str]) -> str:
    return " ".join(overrides)


@pytest.fixture(scope="module")
def golden() -> dict:
    return json.loads(GOLDEN.read_text())


def test_every_preset_is_recorded(golden):
    """No preset is lost or added without a golden entry (a new preset: regenerate, see the docstring)."""
    assert sorted(key(c) for c in cases()) == sorted(golden)


@pytest.mark.parametrize("overrides", cases(), ids=key)
def test_resolved_config_is_unchanged(overrides, golden):
    expected = golden.get(key(overrides))
    assert expected is not None, f"no golden entry for {key(overrides)!r}"
    actual = resolve(overrides)
    assert actual["choices"] == expected["choices"]
    assert actual["config"] == expected["config"]
    assert actual["run_dir"] == expected["run_dir"]
    assert actual.get("hydra") == expected.get("hydra")


if __name__ == "__main__":
    GOLDEN.parent.mkdir(exist_ok=True)
    GOLDEN.write_text(json.dumps({key(c): resolve(c) for c in cases()}, indent=1, sort_keys=True) + "\n")
    print(f"wrote {GOLDEN}")
