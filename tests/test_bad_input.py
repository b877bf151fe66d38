"""Bad input: exit 2, one line `error: <what> (<setting>): <fix>` on stderr, no traceback, no training.

Most cases call train.py's `main` in this process (the command's code, without an interpreter start per
case); `test_config_error_through_the_command` and the launch cases run the command itself.
"""

import pytest

from tests.helpers import run_entry, run_main


def check_error(args, setting, tmp_path):
    code, out, err = run_main("train.py", f"run.dir={tmp_path / 'run'}", *args)
    lines = err.strip().splitlines()
    assert code == 2, err
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert f"({setting}" in lines[0], lines[0]
    assert "Traceback" not in err + out
    assert not (tmp_path / "run" / "checkpoints").exists()
    return lines[0]


def test_config_error_through_the_command(tmp_path):
    proc = run_entry("train.py", f"run.dir={tmp_path / 'run'}", "model.embed_dim=130", timeout=60)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and "(model.embed_dim" in lines[0], proc.stderr
    assert lines[0].startswith("error: ") and "Traceback" not in proc.stderr + proc.stdout


@pytest.mark.parametrize("args,setting", [
    (["data=era5"], "data.root"),
    (["data=era5", "data.root=/nonexistent/era5"], "data.root"),
    (["model.embed_dim=130"], "model.embed_dim"),
    (["model=nope"], "model=nope"),
    (["trainer.max_steps=-1"], "trainer.max_steps"),
    (["trainer.global_batch_size=0"], "trainer.global_batch_size"),
    (["model.depthh=3"], "model.depthh"),
])
def test_config_errors(args, setting, tmp_path):
    check_error(args, setting, tmp_path)


def test_data_errors(tmp_path, era5_root):
    root = f"data.root={era5_root}"
    check_error([root, "data.img_size=[64,64]"], "data.img_size", tmp_path)
    check_error([root, "data.img_size=[30,64]"], "data.img_size", tmp_path)
    check_error([root, "data.channels=[u10m,v10m]"], "data.channels", tmp_path)
    empty = tmp_path / "empty"
    (empty / "train").mkdir(parents=True)
    check_error([f"data.root={empty}", "data=era5"], "data.root", tmp_path)


def test_truncated_file(tmp_path, era5_root):
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(era5_root, copy)
    path = copy / "train" / "2017.h5"
    path.write_bytes(path.read_bytes()[:100_000])
    line = check_error([f"data.root={copy}"], "data.root", tmp_path)
    assert "2017.h5" in line


def test_world_size_that_does_not_fit(tmp_path):
    proc = run_entry("train.py", "parallel.tp=2", env={"RANK": "0", "WORLD_SIZE": "3", "MASTER_ADDR": "127.0.0.1",
                                                       "MASTER_PORT": "1"}, timeout=60)
    assert proc.returncode == 2 and proc.stderr.startswith("error: world size 3 does not fit tp=2"), proc.stderr


@pytest.mark.parametrize("kind,setting", [("unreachable", "run.dir"), ("a file", "run.dir"), ("tag", "run.tag"),
                                          ("resume", "trainer.resume")])
def test_paths_are_bad_input_too(kind, setting, tmp_path):
    """An unusable run directory, a tag that would escape run.root, a missing checkpoint: one line, exit 2."""
    (tmp_path / "file").write_text("not a folder")
    args = {"unreachable": ["run.dir=/proc/dlscale/run"], "a file": [f"run.dir={tmp_path / 'file'}"],
            "tag": [f"run.root={tmp_path}", "run.tag=../../escaped"],
            "resume": [f"run.dir={tmp_path / 'run'}", "trainer.resume=step_0000010"]}[kind]
    code, out, err = run_main("train.py", *args)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and f"({setting})" in lines[0], err
    assert "Traceback" not in err + out
    assert not (tmp_path.parent / "escaped").exists()


def test_an_older_torch_is_refused_in_one_line(tmp_path, monkeypatch):
    """A torch older than utils.MIN_TORCH (an image's own, or a bare `pip install torch` gone wrong) is refused by
    train.py before anything imports it, naming the version found and the one needed; none at all too."""
    from importlib import metadata

    from utils import ConfigError, require_torch

    require_torch("2.13.0+cpu")
    require_torch("2.14.1")
    monkeypatch.setattr(metadata, "version", lambda name: "2.9.1+cu128")
    line = check_error([], "torch", tmp_path)
    assert line.startswith("error: torch 2.9.1+cu128 is installed, this code needs torch>=2.13 (torch): "), line

    def missing(name):
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(metadata, "version", missing)
    with pytest.raises(ConfigError, match="torch is not installed"):
        require_torch()


@pytest.mark.parametrize("script,args", [("train.py", ["model=gpt_tiny"]),
                                         ("utils.plan.cost_model", ["model=llama_8b", "parallel.tp=8"])])
def test_a_language_model_without_data_names_the_data_that_fits_it(script, args, tmp_path):
    """data= left out gives a language model the default ERA5 data: the one line names the data presets that fit
    the model (not only the weather models), for train.py and the planner alike."""
    run_dir = [f"run.dir={tmp_path / 'run'}"] if script == "train.py" else []
    code, out, err = run_main(script, *run_dir, *args)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "Traceback" not in err + out, err
    assert lines[0].startswith("error: the ") and "(data): use data=wikitext_sample, data=wikitext or data=tokens" \
        in lines[0], lines[0]
    assert not (tmp_path / "run").exists()


def test_the_data_presets_an_error_offers_are_config_datas():
    """The tasks' DATA_PRESETS (what the pairing error offers per data kind) are config/data/, preset for preset."""
    import re

    from tests.helpers import ROOT
    from utils.tasks import tasks

    kinds = {}
    for preset in sorted((ROOT / "config" / "data").glob("*.yaml")):
        (kind,) = re.findall(r"^\s*- (\w+)_schema$", preset.read_text(), re.M)
        kinds.setdefault(kind, set()).add(preset.stem)
    offered = {kind: set(presets) for task in tasks().values() for kind, presets in task.DATA_PRESETS.items()}
    assert offered == kinds
