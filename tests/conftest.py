"""Pytest's hooks and the session fixtures (a synthetic ERA5 copy and a sample corpus, made once); the
helpers tests share are in tests/helpers.py."""

from __future__ import annotations

from pathlib import Path

import pytest

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
    from utils.data.era5_synthetic import ensure_synthetic

    return ensure_synthetic(tmp_path_factory.mktemp("era5") / "synthetic")


@pytest.fixture(scope="session")
def corpus_root(tmp_path_factory) -> Path:
    from utils.data.corpus import ensure_sample_corpus

    return ensure_sample_corpus(tmp_path_factory.mktemp("wikitext") / "sample")
