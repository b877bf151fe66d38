"""Config tree: presets compose into typed dataclasses; typos, wrong types and bad values are rejected."""

import pytest

from networks.vit.model import ViTConfig
from utils import ConfigError
from utils.cli.config import load_config, presets


def test_default_composes_to_typed_dataclasses():
    cfg, choices, yaml = load_config([])
    assert isinstance(cfg.model, ViTConfig)
    assert choices["model"] == "vit_tiny" and choices["data"] == "era5_synthetic"
    assert cfg.data.synthetic and cfg.data.img_size == [32, 64]
    assert cfg.parallel.tp == 1 and cfg.precision.mode == "fp32"
    assert "embed_dim" in yaml


def test_seed_base_and_mp_models():
    base, _, _ = load_config(["model=vit_base", "data=era5"])
    assert (base.model.embed_dim, base.model.depth, base.model.num_heads, base.model.patch_size) == (384, 12, 8, 8)
    assert base.data.img_size == [360, 720] and len(base.data.channels) == 20 and base.data.channels[0] == "u10m"
    large, _, _ = load_config(["model=vit_large"])
    assert large.model.embed_dim == 1536


@pytest.mark.parametrize("name,batch,lr", [("bs16_opt", 16, 5e-4), ("bs64_opt", 64, 1e-3), ("bs1024_opt", 1024, 4e-3),
                                           ("mp", 64, 1e-3), ("mp_bs32", 32, 7.07e-4)])
def test_experiments_carry_the_seed_values(name, batch, lr):
    cfg, choices, _ = load_config([f"experiment={name}"])
    assert cfg.trainer.global_batch_size == batch and cfg.optim.lr == pytest.approx(lr)
    assert cfg.precision.mode == "fp16" and cfg.precision.compile
    assert choices["data"] == "era5"


def test_short_limits_samples():
    cfg, _, _ = load_config(["experiment=short"])
    assert (cfg.data.limit_nsamples, cfg.data.limit_nsamples_val, cfg.trainer.max_steps) == (512, 128, 128)
    patch4, _, _ = load_config(["experiment=mp_patch4"])
    assert patch4.model.patch_size == 4 and patch4.model.embed_dim == 1536


@pytest.mark.slow  # over 10 s: the fast tier's 3 minutes
def test_every_preset_composes():
    """Every preset composes with the defaults, or with the data and heads its rules between groups need."""
    needs = {"model=gpt_tiny": ["data=wikitext_sample"], "model=gpt_small": ["data=wikitext_sample"],
             "model=gpt_medium": ["data=wikitext_sample"], "parallel=tp8": ["model.num_heads=8"],
             **{f"model=llama_{size}": ["data=wikitext_sample"] for size in ("tiny", "1b", "8b")}}
    for group in ("model", "precision", "parallel", "optim", "experiment"):
        for name in presets(group):
            load_config([f"{group}={name}", *needs.get(f"{group}={name}", [])])


@pytest.mark.parametrize("overrides,setting", [
    (["model=gpt_tiny"], "data"),  # a language model on ERA5: the data that fits it named first
    (["data=wikitext_sample"], "data"),  # a ViT on text: the error names both fixes, the data first
    (["model=gpt_tiny", "data=wikitext_sample", "data.seq_len=512"], "data.seq_len"),  # > max_positions
    (["data.img_size=[32,62]"], "data.img_size"),  # not a multiple of the patch (4)
    (["parallel=tp8"], "parallel.tp"),  # 4 heads over 8 ranks
    (["run.tag=a/b"], "run.tag"),  # a tag is a name, not a path
    (["model=gpt_tiny", "data=wikitext_sample", "parallel.cp=2", "data.seq_len=30"], "data.seq_len"),  # 2cp chunks
    (["data.img_size=[4,4]", "parallel.cp=2"], "parallel.cp"),  # one patch over two ranks
    (["parallel.cp=2", "model.dropout=0.1"], "parallel.cp_attention"),  # the ring has no dropout
    (["parallel.cp_attention=striped"], "parallel.cp_attention"),
    (["parallel.cp=8", "parallel.cp_attention=alltoall"], "parallel.cp_attention"),  # 4 heads over 8 ranks
    (["parallel.cp=4", "parallel.cp_attention=hierarchical", "parallel.cp_a2a=3"], "parallel.cp_a2a"),  # 3 !| 4
    (["parallel.cp=4", "parallel.cp_attention=hierarchical", "parallel.cp_a2a=4"], "parallel.cp_a2a"),  # no ring
    (["model=llama_tiny", "data=wikitext_sample", "parallel.tp=3"], "parallel.tp"),  # 3 divides no head count
    (["model=llama_tiny", "data=wikitext_sample", "model.embed_dim=96", "model.num_heads=6", "model.num_kv_heads=3",
      "parallel.tp=2"], "parallel.tp"),  # 3 key/value heads: tp=2 neither divides them nor is a multiple
    (["parallel.dp_mode=fsdp", "parallel=pp2", "parallel.pp_schedule=zbv"], "parallel.dp_mode"),  # split backward
    (["parallel.dp_mode=fsdp", "precision=fp16"], "precision"),  # the scaler is unverified under FSDP2
    (["parallel.dp_mode=zero1"], "parallel.dp_mode"),
])
def test_rules_between_groups(overrides, setting):
    with pytest.raises(ConfigError) as info:
        load_config(overrides)
    assert info.value.setting == setting


@pytest.mark.parametrize("override,setting", [
    ("model.embed_dimm=3", "model.embed_dimm"),  # typo
    ("trainer.max_steps=abc", "trainer.max_steps"),  # wrong type
    ("model=vit_huge", "model=vit_huge"),  # unknown preset
    ("model.embed_dim=130", "model.embed_dim"),  # not divisible by heads
    ("trainer.max_steps=0", "trainer.max_steps"),
    ("trainer.global_batch_size=-4", "trainer.global_batch_size"),
    ("precision.mode=fp8", "precision.mode"),
    ("parallel.order=tp-xx", "parallel.order"),
    ("optim.name=sgd", "optim.name"),
    ("+trainer.max_stepz=5", "trainer.max_stepz"),  # appending keys is refused
])
def test_bad_settings_raise_config_error(override, setting):
    with pytest.raises(ConfigError) as info:
        load_config([override])
    assert setting in info.value.setting
    assert info.value.fix


def test_unknown_preset_lists_choices():
    with pytest.raises(ConfigError) as info:
        load_config(["model=vit_huge"])
    assert "vit_base" in info.value.fix and "schema" not in info.value.fix
