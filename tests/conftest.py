"""Pytest's hooks and the session fixtures (a synthetic ERA5 copy and a sample corpus, made once); the
helpers tests share are in tests/helpers.py."""

from __future__ import annotations

import gc
import os
import sys
from pathlib import Path

import pytest

# One intra-op thread per test process: the suite runs two xdist workers on two cores, and a process with two
# OpenMP threads beside the other worker's spins at every barrier (the launcher gives each local rank its share
# of the cores already: utils/cli/launch.py). Set before any test module imports torch; children inherit it.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Bytecode: the suite starts hundreds of interpreters (ranks, launches, tools). Where PYTHONDONTWRITEBYTECODE is
# set (this machine's environment sets it, and so may a CI image), each of them compiled this project's modules
# from source again: about 1 s of CPU per process on 2 cores. The test processes and their children write
# __pycache__ (git-ignored).
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
sys.dont_write_bytecode = False

# The files that take longest, started first: xdist hands out whole files (--dist loadfile) in the order they
# are collected (--no-loadscope-reorder; its default orders by the number of tests, which put the long files of
# few tests last and left one worker idle while the other finished them). Seconds summed over each file's
# tests, `pytest --durations=0`, 2-core Intel Xeon AVX-512, 2026-11-27 (a loaded machine: the order matters).
LONGEST_FIRST = {"test_matrix.py": 487, "test_layouts.py": 410, "test_submit.py": 395, "test_train_e2e.py": 373,
                 "test_launch.py": 101, "test_sweep.py": 67, "test_forecast.py": 66, "test_exit_paths.py": 63,
                 "test_precision.py": 63, "test_compile.py": 60, "test_config_presets.py": 45,
                 "test_doctor_campaign.py": 38, "test_fsdp_pipeline.py": 38, "test_rank_pool.py": 37}


def pytest_collection_modifyitems(config, items):
    """Long files first (a stable sort: the rest keep their order)."""
    items.sort(key=lambda item: -LONGEST_FIRST.get(item.path.name, 0))


def pytest_collection_finish(session):
    """Every test module, torch and the trainer imported: the collector skips them from here on, as it does
    under train.py (utils/startup.py). Without it, each full collection of a test process traversed about
    half a million objects (490,000 after collection), and collection took a seventh of the test processes' CPU."""
    if not gc.get_freeze_count():  # once per process: a nested session (pytester) would pin the garbage of the moment
        gc.freeze()

pytest_plugins = ["pytester"]  # tests/test_planted_bugs.py runs the plant harness's plugin in a nested pytest


# The fast tier, `python -m pytest -m "not slow" tests` (at most 3 minutes on 2 cores), for edit-test loops:
# it leaves out the tests marked `slow` where they are defined (`pytestmark` for whole files): those that train
# through the entry points, launch processes as users do (train_mp, torchrun, sbatch, Hydra launchers),
# compile, or run the combination matrix's training cases. The default suite (the README's command) runs all.


def pytest_addoption(parser):
    group = parser.getgroup("matrix", "the combination matrix (tests/test_matrix.py)")
    group.addoption("--matrix-seed", type=int, default=0, help="seed of the random matrix cases")
    group.addoption("--matrix-cases", type=int, default=0, help="random matrix cases to run (0: none)")


@pytest.fixture(scope="session")
def era5_root(tmp_path_factory) -> Path:
    from utils.weather.data.era5_synthetic import ensure_synthetic

    return ensure_synthetic(tmp_path_factory.mktemp("era5") / "synthetic")


@pytest.fixture(scope="session")
def corpus_root(tmp_path_factory) -> Path:
    from utils.language.data.corpus import ensure_sample_corpus

    return ensure_sample_corpus(tmp_path_factory.mktemp("wikitext") / "sample")
