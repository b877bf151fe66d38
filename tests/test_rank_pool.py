"""The test harness's pool of rank processes (tests/rank_pool.py): a pooled process that the C library kills
(SIGABRT here, as glibc does on a corrupted heap) costs the case one rerun in fresh processes, not a failure;
a second such death is a failure, like any other; and the ranks, forked by a fork server, die with the test
process."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import ROOT
from tests.rank_pool import pool
from tests.test_exit_paths import parent_of


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


POOL_HOLDER = """import os, sys, time
from tests.rank_pool import pool

def pid_of(rank, world):
    return os.getpid()

if __name__ == "__main__":
    print(*(r.value for r in pool().run(pid_of, 2)), flush=True)
    time.sleep(300)
"""


@pytest.mark.slow
def test_pooled_ranks_die_with_a_killed_test_process(tmp_path):
    """The pooled ranks' parent is the fork server, not the test process: a test process killed by SIGKILL (a
    CI timeout) must still leave no rank and no server behind."""
    script = tmp_path / "hold_pool.py"
    script.write_text(POOL_HOLDER)
    holder = subprocess.Popen([sys.executable, str(script)], cwd=ROOT, stdout=subprocess.PIPE, text=True,
                              env=dict(os.environ, PYTHONPATH=str(ROOT)))
    ranks = [int(pid) for pid in holder.stdout.readline().split()]
    server = {parent_of(pid) for pid in ranks}
    assert len(ranks) == 2 and server != {holder.pid}, (ranks, server)  # forked by a server, as in the suite
    holder.kill()
    holder.wait()
    deadline = time.monotonic() + 20
    while (alive := [pid for pid in [*ranks, *server] if is_alive(pid)]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive, f"processes {alive} outlived the killed test process"


def is_alive(pid: int) -> bool:
    """Running and not a zombie (a zombie's parent has not reaped it yet: it runs nothing)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in "ZX"
    except OSError:
        return False
