"""Shared fixtures: a synthetic ERA5 copy made once per session, and a runner for the entry points."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


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
