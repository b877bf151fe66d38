"""Hydra multirun and launchers as Hydra users type them: `python train.py -m key=a,b ...`.

Every command runs in an empty working folder, which must stay empty: Hydra makes no outputs/ or
multirun/ folders, no .hydra/ and no log files of its own.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from tests.helpers import ROOT, read_scalars, run_main
from utils.checkpoints.run_dir import PRESETS_FILE, read_facts, read_layout
from utils.cli.hydra_app import SUBMITIT_MAX_NUM_TIMEOUT, is_hydra_command, with_launcher_defaults, with_sweep_subdir

pytestmark = pytest.mark.slow  # trains through the entry points or launches processes

TINY = ["trainer.max_steps=1", "trainer.val_every=0", "trainer.ckpt_every=0", "trainer.num_workers=0",
        "trainer.global_batch_size=4", "model.depth=1", "data.limit_nsamples_val=8", "trainer.log_images=false"]


def train(cwd: Path, *args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    """`python train.py ARGS` from the folder `cwd`, which must stay empty."""
    cwd.mkdir(exist_ok=True)
    proc = subprocess.run([sys.executable, str(ROOT / "train.py"), *args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    assert not list(cwd.iterdir()), f"left in the working folder: {list(cwd.iterdir())}"
    return proc


def refuse(cwd: Path, monkeypatch, *args: str) -> tuple[int, list[str]]:
    """`python train.py ARGS` from the empty folder `cwd` for a command refused before anything runs, through
    train.py's `main` in this process (its exit status and stderr's lines; no interpreter started to import). Hydra's
    app sets sys.argv and PYTHONPATH once past its checks: put back after the test, should a refusal regress."""
    cwd.mkdir(exist_ok=True)
    monkeypatch.chdir(cwd)
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    monkeypatch.setenv("PYTHONPATH", os.environ.get("PYTHONPATH", ""))
    code, _, err = run_main("train.py", *args)
    assert not list(cwd.iterdir()), f"left in the working folder: {list(cwd.iterdir())}"
    return code, err.strip().splitlines()


def single_run_dir(*args: str) -> Path:
    """run.dir of `python train.py ARGS` as one run (checkpoints/run_dir.py naming, its layout on as many ranks)."""
    from utils.checkpoints.run_dir import run_dir_for
    from utils.cli.config import load_config
    from utils.cli.launch import ranks_needed
    from utils.cli.runs import run_digest
    from utils.comm import check_grid, layout_name, parse_order
    from utils.launch_env import LaunchEnv

    cfg, choices, config_yaml = load_config(list(args))
    sizes = check_grid(cfg.parallel, LaunchEnv(world_size=ranks_needed(cfg.parallel)))
    return run_dir_for(cfg, choices, layout_name(sizes, parse_order(cfg.parallel.order)),
                       run_digest(cfg, choices, config_yaml))


def check_trained(run_dir: Path, steps: int = 1) -> None:
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == f"step_{steps:07d}"
    assert [s for s, _ in read_scalars(run_dir)["train/loss"]] == list(range(1, steps + 1))


@pytest.mark.parametrize("argv,hydra", [
    (["model=vit_base", "--cfg"], False), (["--cfg", "job"], True), (["--cfg=hydra"], True), (["-c", "all"], True),
    (["-m", "optim.lr=1,2"], True), (["--multirun"], True), (["--info"], True), (["--info", "plugins"], True),
    (["hydra.run.dir=x"], True), (["hydra/launcher=submitit_local"], True), (["-cn", "config"], True),
    (["--config-path=x"], True), (["run.tag=hydra.x", "trainer.max_steps=3"], False), ([], False),
])
def test_which_command_lines_go_to_hydra(argv, hydra):
    assert is_hydra_command(argv) == hydra


def test_a_sweep_dir_gets_hydras_subdirs():
    overrides = ["a=1,2", "hydra.sweep.dir=d"]
    assert with_sweep_subdir(["-m", *overrides, "--info"], overrides) == [
        "-m", *overrides, "hydra.sweep.subdir=${hydra.job.num}", "--info"]
    chosen = ["hydra.sweep.dir=d", "hydra.sweep.subdir=x"]
    assert with_sweep_subdir(["-m", *chosen], chosen) == ["-m", *chosen]
    assert with_sweep_subdir(["-m", "a=1,2"], ["a=1,2"]) == ["-m", "a=1,2"]


def test_basic_sweep_runs_each_point_as_its_single_run(tmp_path, era5_root):
    """Two points one after another in this process, each in the run.dir the same single run gets (its
    overrides give it its own digest); no multirun.yaml or other Hydra file beside them."""
    common = [f"data.root={era5_root}", *TINY, f"run.root={tmp_path / 'runs'}"]
    proc = train(tmp_path / "cwd", "-m", "optim.lr=1e-3,2e-3", *common)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "#1 : optim.lr=0.002" in proc.stdout  # the launcher's lines
    expected = {single_run_dir("optim.lr=1e-3", *common), single_run_dir("optim.lr=2e-3", *common)}
    assert len(expected) == 2 and set((tmp_path / "runs").iterdir()) == expected
    for run_dir in expected:
        check_trained(run_dir)
        assert not (run_dir / ".hydra").exists()


def test_submitit_local_sweep_into_a_sweep_dir(tmp_path, era5_root):
    """hydra.sweep.dir=DIR: each point's run.dir is Hydra's job folder DIR/<job number>, the launcher's files
    stay in DIR/.submitit; the tp2 point's job starts its two local ranks as `train.py parallel=tp2` does."""
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher")
    sweep = tmp_path / "sweep"
    proc = train(tmp_path / "cwd", "-m", "parallel=single,tp2", f"data.root={era5_root}", *TINY,
                 f"run.root={tmp_path / 'runs'}", "hydra/launcher=submitit_local", "hydra.launcher.timeout_min=5",
                 f"hydra.sweep.dir={sweep}")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "#1 : parallel=tp2" in proc.stdout
    for num, tp in ((0, 1), (1, 2)):
        check_trained(sweep / str(num))
        assert read_layout(sweep / str(num))["sizes"]["tp"] == tp
    assert not (tmp_path / "runs").exists()


def test_hydra_run_dir_is_the_run_dir(tmp_path, era5_root):
    run_dir = tmp_path / "my run"
    proc = train(tmp_path / "cwd", f"hydra.run.dir={run_dir}", f"data.root={era5_root}", *TINY,
                 f"run.root={tmp_path / 'runs'}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    check_trained(run_dir)
    saved = OmegaConf.load(run_dir / "config.yaml")  # parsed: YAML folds a long path over two lines
    assert saved.run.dir == str(run_dir) and not (tmp_path / "runs").exists()


def test_hydra_flags_print_and_exit(tmp_path):
    job = train(tmp_path / "cwd", "--cfg", "job", "trainer.max_steps=7", f"run.root={tmp_path / 'runs'}")
    assert job.returncode == 0 and "max_steps: 7" in job.stdout and "hydra:" not in job.stdout, job.stderr
    info = train(tmp_path / "cwd", "--info", "defaults")
    assert info.returncode == 0 and "model/vit_tiny" in info.stdout, info.stdout + info.stderr
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("args,setting", [(["optim.lr=abc,1e-3"], "optim.lr=abc"),
                                          (["optim.lr=1e-3,2e-3", "model=nope"], "model=nope")])
def test_a_bad_point_stops_the_sweep_before_any_trains(args, setting, tmp_path, monkeypatch):
    code, lines = refuse(tmp_path / "cwd", monkeypatch, "-m", *args, f"run.root={tmp_path / 'runs'}")
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), lines
    assert f"({setting}" in lines[0] and not (tmp_path / "runs").exists()


def test_a_point_that_does_not_fit_the_launchers_tasks_is_refused_before_submission(tmp_path, monkeypatch):
    """hydra.launcher.nodes x tasks_per_node ranks per point: a tp4 point on 2 tasks is refused with one line and
    exit 2 before any job is submitted (no sbatch here: it would fail otherwise); before, each of its ranks failed
    inside its job and Slurm showed the job COMPLETED."""
    code, lines = refuse(tmp_path / "cwd", monkeypatch, "-m", "parallel=tp2,tp4", "hydra/launcher=submitit_slurm",
                         "hydra.launcher.tasks_per_node=2", f"run.root={tmp_path / 'runs'}")
    assert code == 2 and len(lines) == 1, lines
    assert lines[0].startswith("error: sweep point #1 (parallel=tp4 ") and ") would run on hydra.launcher.nodes x " \
        "tasks_per_node = 1 x 2 = 2 ranks, but world size 2 does not fit tp=4" in lines[0], lines[0]
    assert "(hydra.launcher.tasks_per_node): " in lines[0] and not (tmp_path / "runs").exists()


def test_submitit_slurm_requeues_a_timed_out_point_unless_told_otherwise():
    """Hydra's plugin defaults hydra.launcher.max_num_timeout to 0 (a point stopped at its time limit is never
    requeued); the sweep gets submitit's own default unless the command line sets it."""
    argv = ["-m", "hydra/launcher=submitit_slurm", "optim.lr=1,2"]
    assert with_launcher_defaults(argv, argv[1:]) == [
        *argv, f"hydra.launcher.max_num_timeout={SUBMITIT_MAX_NUM_TIMEOUT}"]
    given = [*argv, "hydra.launcher.max_num_timeout=0"]
    assert with_launcher_defaults(given, given[1:]) == given
    local = ["-m", "hydra/launcher=submitit_local", "optim.lr=1,2"]
    assert with_launcher_defaults(local, local[1:]) == local


def test_points_that_would_share_a_run_dir_are_refused_before_any_trains(tmp_path, monkeypatch):
    """`-m optim.lr=5e-4,1e-3 run.dir=X` trained point 0 and then refused point 1 in X (other settings); now one line
    names both points and the fix, before either trains. Default names collide too where the points differ in
    settings that do not rename a run (an optimizer preset): a run.tag interpolating the swept setting is the fix."""
    shared = tmp_path / "shared"
    code, lines = refuse(tmp_path / "cwd", monkeypatch, "-m", "optim.lr=5e-4,1e-3", f"run.dir={shared}",
                         "trainer.max_steps=4", f"run.root={tmp_path / 'runs'}")
    assert code == 2 and len(lines) == 1, lines
    assert lines[0].startswith(f"error: sweep points #0 (optim.lr=0.0005) and #1 (optim.lr=0.001) would train in one "
                               f"run directory {shared} with other settings (optim.lr: 0.0005 -> 0.001) (run.dir): "
                               "drop run.dir= "), lines[0]
    assert "'run.tag=lr${optim.lr}'" in lines[0] and not shared.exists()
    code, lines = refuse(tmp_path / "cwd", monkeypatch, "-m", "optim=adam,adamw", f"run.root={tmp_path / 'runs'}")
    assert code == 2 and len(lines) == 1, lines
    assert lines[0].startswith("error: sweep points #0 (optim=adam) and #1 (optim=adamw) would train in one run "
                               "directory ") and "(optim=adam -> adamw; " in lines[0], lines[0]
    assert "(run.tag): name each point's folder apart with 'run.tag=${optim.name}'" in lines[0]
    assert not (tmp_path / "runs").exists()


def test_a_point_whose_run_dir_holds_other_settings_is_refused_before_any_trains(tmp_path, monkeypatch):
    """Point 1's folder holds checkpoints of another depth: refused before point 0 trains (before, point 0 trained
    and the sweep stopped at point 1)."""
    from utils.cli.config import load_config

    common = [f"run.root={tmp_path / 'runs'}", "run.tag=lr${optim.lr}", "trainer.max_steps=4"]
    second = single_run_dir("optim.lr=1e-3", *common)
    (second / "checkpoints").mkdir(parents=True)
    (second / "checkpoints" / "latest").write_text("step_0000004")
    (second / "config.yaml").write_text(load_config(["optim.lr=1e-3", "model.depth=2", *common])[2])
    code, lines = refuse(tmp_path / "cwd", monkeypatch, "-m", "optim.lr=5e-4,1e-3", *common)
    assert code == 2 and len(lines) == 1, lines
    assert lines[0].startswith("error: sweep point #1 (optim.lr=0.001 ") and \
        f": {second} holds checkpoints of a run with other settings (model.depth: 2 -> 4) (run.dir): " in lines[0]
    assert list((tmp_path / "runs").iterdir()) == [second]


def test_the_documented_tagged_sweep_names_each_point_and_compare_shows_the_lr(tmp_path, era5_root, capsys):
    """docs/configuration.md's sweep with `'run.tag=lr${optim.lr}'` and its compare command, at tiny settings: each
    point's folder ends with its lr, records its presets, and compare's table has an optim.lr column."""
    from utils.compare.report import main as compare

    lines = (ROOT / "docs" / "configuration.md").read_text().splitlines()
    sweep = shlex.split(next(line for line in lines if line.startswith("python train.py -m optim.lr=5e-4,1e-3 ")))
    glob = shlex.split(next(line for line in lines if line.startswith("python -m utils.compare 'outputs/")))[3]
    runs = tmp_path / "runs"
    proc = train(tmp_path / "cwd", *sweep[2:], f"data.root={era5_root}", *TINY, f"run.root={runs}")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    trained = sorted(runs.iterdir(), key=lambda d: d.name.rsplit("-", 1)[-1])
    assert [d.name.rsplit("-", 1)[-1] for d in trained] == ["lr0.0005", "lr0.001"]
    for run_dir in trained:
        check_trained(run_dir)
        assert read_facts(run_dir, PRESETS_FILE) == {"model": "vit_tiny", "data": "era5_synthetic", "precision": "fp32",
                                                     "parallel": "single", "optim": "adam", "experiment": None}
    assert compare([glob.replace("outputs/", f"{runs}/", 1)]) == 0
    table = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    assert table[0].startswith("| run | optim.lr | layout |"), table
    assert sorted(line.split(" | ")[1] for line in table[1:]) == ["0.0005", "0.001"], table
