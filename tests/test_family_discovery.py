"""Families are found, not registered by hand (utils/tasks/registry.py): an installed distribution's entry point of
group `dlscale.families`, or a module DLSCALE_FAMILIES names, brings a family module's FAMILY and PRESETS, and
`model=<its preset>` composes; a module that does not import, breaks the contract, or takes an arch or a preset
is one line naming where it was named, exit 2. tests/toy_family is such a module: DLSCALE_FAMILIES trains it.
"""

from __future__ import annotations

import json
import textwrap

import pytest

from tests.helpers import QUIET, TINY_GPT, read_scalars, run_entry, run_main
from utils import ConfigError

# An out-of-tree family: the toy decoder under another arch, in a module of its own (written to a folder on the path)
FAKE_FAMILY = """
from dataclasses import dataclass

from networks.spec import ModelSpec
from tests.toy_family.model import ToyConfig, ToyLM
from utils.language.task.language import LanguageTask


@dataclass
class {cls}(ToyConfig):
    arch: str = "{arch}"
    ARCH = "{arch}"


FAMILY = ModelSpec(arch="{arch}", name="{arch} decoder", schema={cls}, presets="model={preset}", tiny="{preset}",
                   task=LanguageTask, build=lambda cfg, task: ToyLM(cfg, task.vocab_size),
                   blocks=lambda cfg: cfg.depth)
PRESETS = {{"{preset}": {cls}(depth=1)}}
"""


@pytest.fixture
def registry():
    """The registry, Hydra's ConfigStore and the config's stored schemas as they were, after the test."""
    from hydra.core.config_store import ConfigStore

    from utils.cli import config
    from utils.tasks import registry as reg

    config.register_schemas()  # the built-in ones stored
    tables = (reg.MODELS, reg.MODEL_PRESETS, reg.ORIGINS, reg._DISCOVERED, config._STORED)
    saved = [dict(t) if isinstance(t, dict) else set(t) for t in tables]
    models = dict(ConfigStore.instance().repo["model"])
    yield reg
    for table, before in zip(tables, saved):
        table.clear()
        table.update(before)
    ConfigStore.instance().repo["model"] = models


def write_module(folder, name: str, text: str) -> None:
    (folder / f"{name}.py").write_text(textwrap.dedent(text))


def fake_distribution(folder, dist: str, entry_points: str) -> None:
    """An installed distribution as importlib.metadata finds it on sys.path: a dist-info folder, its entry points."""
    info = folder / f"{dist}-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(entry_points)


def test_an_entry_point_is_discovered_and_its_preset_composes(registry, tmp_path, monkeypatch):
    from utils.cli.config import load_config

    write_module(tmp_path, "fakefam_family", FAKE_FAMILY.format(cls="FakeConfig", arch="fake", preset="fake_tiny"))
    fake_distribution(tmp_path, "fakefam", "[dlscale.families]\nfake = fakefam_family\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delenv("DLSCALE_FAMILIES", raising=False)
    registry._DISCOVERED.discard(registry.GROUP)  # a fresh process: entry points not read yet
    assert "fake" not in registry.MODELS
    cfg, choices, _ = load_config(["model=fake_tiny", *TINY_GPT[1:]])
    assert cfg.model.arch == "fake" and cfg.model.depth == 1 and choices["model"] == "fake_tiny"
    assert registry.ORIGINS["model.arch 'fake'"] == ("family 'fakefam_family'",
                                                     "entry point fake = fakefam_family (dlscale.families of fakefam)")
    registry._DISCOVERED.discard(registry.GROUP)
    registry.discover()  # found again: the same family again is no error


def test_an_entry_point_that_does_not_load_is_one_line(registry, tmp_path, monkeypatch):
    fake_distribution(tmp_path, "brokenfam", "[dlscale.families]\nbroken = brokenfam_missing:FAMILY\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    registry._DISCOVERED.discard(registry.GROUP)
    with pytest.raises(ConfigError) as info:
        registry.discover({})
    assert info.value.setting == "entry point broken = brokenfam_missing:FAMILY (dlscale.families of brokenfam)"
    assert "cannot load family 'brokenfam_missing:FAMILY'" in info.value.what
    assert "uninstall brokenfam" in info.value.fix


def test_dlscale_families_adds_a_module_once(registry, tmp_path, monkeypatch):
    write_module(tmp_path, "envfam_family", FAKE_FAMILY.format(cls="EnvConfig", arch="envfam", preset="envfam_tiny"))
    monkeypatch.syspath_prepend(str(tmp_path))
    registry.discover({"DLSCALE_FAMILIES": " envfam_family , "})
    assert "envfam" in registry.MODELS and "envfam_tiny" in registry.MODEL_PRESETS
    assert registry.ORIGINS["model.arch 'envfam'"] == ("family module 'envfam_family'", "DLSCALE_FAMILIES")
    assert registry.spec_of("envfam").name == "envfam decoder"


@pytest.mark.parametrize("module,text,what", [
    ("no_such_family_module", None, "cannot import family module 'no_such_family_module': No module named"),
    ("tests.helpers", None, "family module 'tests.helpers' defines no FAMILY or FAMILIES"),
    ("fam_not_a_spec", "FAMILY = 'gpt'\n", "family module 'fam_not_a_spec' gives a str as a family, not a"),
    ("fam_bad_preset", "from tests.toy_family import FAMILY\nPRESETS = {'toy_other': dict}\n",
     "family module 'fam_bad_preset''s preset 'toy_other' is a dict, not the schema of one of its families"),
    ("fam_taken_arch", "from dataclasses import replace\nfrom utils.tasks.registry import MODELS\n"
     "FAMILY = replace(MODELS['gpt'], name='another GPT')\n",
     "model.arch 'gpt' of family module 'fam_taken_arch' is registered already, by the built-in families"),
    ("not a module", None, "'not a module' is not a module name"),
])
def test_a_bad_family_module_is_one_line_naming_the_variable(module, text, what, registry, tmp_path, monkeypatch):
    if text is not None:
        write_module(tmp_path, module, text)
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigError) as info:
        registry.discover({"DLSCALE_FAMILIES": f"tests.toy_family,{module}"})
    assert what in info.value.what and info.value.setting == "DLSCALE_FAMILIES"
    assert registry.MODELS["gpt"].name == "GPT" and "toy_other" not in registry.MODEL_PRESETS  # nothing of it added


def test_a_preset_named_like_a_config_file_is_refused(registry, tmp_path, monkeypatch):
    from utils.cli.config import load_config

    write_module(tmp_path, "fam_gpt_tiny", FAKE_FAMILY.format(cls="Clash", arch="clash", preset="gpt_tiny"))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("DLSCALE_FAMILIES", "fam_gpt_tiny")
    with pytest.raises(ConfigError) as info:
        load_config(TINY_GPT)
    assert info.value.line() == ("error: preset model=gpt_tiny of family module 'fam_gpt_tiny' is config/model/"
                                 "gpt_tiny.yaml already (DLSCALE_FAMILIES): give the preset another name in PRESETS")


def test_the_command_exits_2_with_one_line(registry, monkeypatch):
    monkeypatch.setenv("DLSCALE_FAMILIES", "no_such_family_module")
    code, out, err = run_main("train.py", *TINY_GPT, "--cfg")
    assert code == 2 and out == "" and err.strip().splitlines() == [
        "error: cannot import family module 'no_such_family_module': No module named 'no_such_family_module' "
        "(DLSCALE_FAMILIES): put the folder holding no_such_family_module on PYTHONPATH or install it, or check "
        "the name"]


def test_an_unknown_model_preset_names_the_ways_to_add_a_family(registry):
    from utils.cli.config import load_config

    registry.add_modules(["tests.toy_family"])
    with pytest.raises(ConfigError) as info:
        load_config(["model=nope"])
    assert info.value.what == "unknown model preset 'nope'" and info.value.setting == "model=nope"
    assert "gpt_tiny" in info.value.fix and "toy_tiny" in info.value.fix  # the files' presets and the families'
    assert "DLSCALE_FAMILIES=<module> or a dlscale.families entry point" in info.value.fix


@pytest.mark.slow
def test_dlscale_families_trains_the_toy_family_through_train_py(corpus_root, tmp_path):
    """`DLSCALE_FAMILIES=tests.toy_family python train.py model=toy_tiny data=wikitext_sample`: nothing imports the
    family but the variable."""
    run = tmp_path / "run"
    proc = run_entry("train.py", "model=toy_tiny", *TINY_GPT[1:], f"data.root={corpus_root}", "trainer.max_steps=2",
                     "trainer.log_every=1", "trainer.global_batch_size=4", *QUIET, f"run.dir={run}",
                     env={"DLSCALE_FAMILIES": "tests.toy_family"}, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [step for step, _ in read_scalars(run)["train/loss"]] == [1, 2]
    assert json.loads((run / "task.json").read_text())["arch"] == "toy"
