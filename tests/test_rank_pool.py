"""The test harness's pool of rank processes (tests/rank_pool.py): a pooled process that the C library kills
(SIGABRT here, as glibc does on a corrupted heap) costs the case one rerun in fresh processes, not a failure;
a second such death is a failure, like any other."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from tests.rank_pool import pool


def _abort_on_rank_1(rank: int, world: int, marker: str, times: int) -> int:
    """Rank 1 aborts the first `times` runs (counted in `marker`); every rank returns its rank."""
    if rank == 1:
        path = Path(marker)
        done = int(path.read_text()) if path.exists() else 0
        if done < times:
            path.write_text(str(done + 1))
            os.kill(os.getpid(), signal.SIGABRT)
    return rank


@pytest.mark.slow
def test_a_crashed_pooled_rank_is_rerun_once(tmp_path, capfd):
    results = pool().run(_abort_on_rank_1, 2, str(tmp_path / "once"), 1, timeout_s=60)
    assert [r.value for r in results] == [0, 1]
    assert "pooled rank 1 died of signal 6; the case runs again" in capfd.readouterr().err

    with pytest.raises(RuntimeError, match=r"pooled rank 1 died \(exit code -6\)"):
        pool().run(_abort_on_rank_1, 2, str(tmp_path / "twice"), 2, timeout_s=60)
