"""Shared fixtures: a synthetic ERA5 copy made once per session, and a runner for the entry points."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


# The fast tier, `python -m pytest -m "not slow" tests` (at most 3 minutes on 2 cores), for edit-test loops:
# it leaves out the tests that train through the entry points, launch processes as users do (train_mp,
# torchrun, sbatch, Hydra launchers), compile, or run the combination matrix's training cases. The default
# suite (the README's command) runs everything.
SLOW_FILES = {"test_layouts", "test_train_e2e", "test_lm_e2e", "test_submit", "test_sweep", "test_launch",
              "test_compile", "test_comm_compile", "test_tensorboard", "test_exit_paths", "test_fsdp_pipeline"}
SLOW_TESTS = {"test_compiled_training_follows_eager", "test_a_nan_on_one_rank_is_handled_alike_on_every_rank",
              "test_the_tutorial_vit_is_timed_at_the_same_shape", "test_accepted_combination_follows_the_single_process_run",
              "test_refused_combination_exits_2_with_one_line", "test_table_values_are_those_of_the_events",
              "test_out_writes_the_table_csv_and_figures", "test_a_glob_expands_sorted", "test_profile_of_steps_2_to_3"}


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.path.stem in SLOW_FILES or item.originalname in SLOW_TESTS:
            item.add_marker(pytest.mark.slow)


def pytest_addoption(parser):
    group = parser.getgroup("matrix", "the combination matrix (tests/test_matrix.py)")
    group.addoption("--matrix-seed", type=int, default=0, help="seed of the random matrix cases")
    group.addoption("--matrix-cases", type=int, default=0, help="random matrix cases to run (0: none)")


@pytest.fixture(scope="session")
def era5_root(tmp_path_factory) -> Path:
    from utils.data.era5_synthetic import ensure_synthetic

    return ensure_synthetic(tmp_path_factory.mktemp("era5") / "synthetic")


def run_entry(script: str, *args: str, timeout: float = 240, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run an entry point (train.py, train_mp.py) as users do, with a bounded time."""
    full_env = dict(os.environ, PYTHONUNBUFFERED="1")
    full_env.update(env or {})
    return subprocess.run([sys.executable, str(ROOT / script), *args], cwd=ROOT, env=full_env,
                          capture_output=True, text=True, timeout=timeout)


def run_main(script: str, *args: str) -> tuple[int, str, str]:
    """An entry point's `main(args)` in this process, for checks that end before any training (bad input):
    (exit status, stdout, stderr). The status of `sys.exit` counts as returned."""
    import contextlib
    import importlib
    import io

    module = importlib.import_module(Path(script).stem)
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = module.main(list(args))
        except SystemExit as exit_:
            code = exit_.code
    return code, out.getvalue(), err.getvalue()


def read_tags(run_dir: Path) -> dict[str, list[str]]:
    """Tag names of a run's TensorBoard events by kind (scalars, images, tensors for text)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir), size_guidance={"scalars": 0, "images": 0, "tensors": 0})
    acc.Reload()
    return acc.Tags()


def read_scalars(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar tag of a run's TensorBoard events: tag -> [(step, value)]."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir), size_guidance={"scalars": 0, "images": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


@pytest.fixture(scope="session")
def corpus_root(tmp_path_factory) -> Path:
    from utils.data.corpus import ensure_sample_corpus

    return ensure_sample_corpus(tmp_path_factory.mktemp("wikitext") / "sample")
