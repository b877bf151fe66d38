"""Global batches are independent of dp and of where a run resumes."""

import pytest

from utils import ConfigError
from utils.data.batching import GlobalBatchSampler, check_batch, contiguous_part
from utils.schema import TrainerConfig


def take(sampler, n):
    it = iter(sampler)
    return [next(it) for _ in range(n)]


@pytest.mark.parametrize("dp", [2, 4])
def test_dp_ranks_split_the_same_global_batch(dp):
    serial = take(GlobalBatchSampler(50, 8, 0, 1, seed=3), 14)  # crosses epochs (6 steps per epoch)
    ranks = [take(GlobalBatchSampler(50, 8, r, dp, seed=3), 14) for r in range(dp)]
    for step in range(14):
        assert sum((ranks[r][step] for r in range(dp)), []) == serial[step]


def test_resume_continues_the_sequence_and_epochs_differ():
    full = take(GlobalBatchSampler(50, 8, 0, 1, seed=1), 20)
    assert take(GlobalBatchSampler(50, 8, 0, 1, seed=1, start_step=9), 11) == full[9:]
    assert full[0] != full[6] and len(set(full[0])) == 8
    assert take(GlobalBatchSampler(50, 8, 0, 1, seed=2), 1) != full[:1]


def test_validation_shards_cover_everything():
    parts = [list(contiguous_part(10, r, 3)) for r in range(3)]
    assert sum(parts, []) == list(range(10))


@pytest.mark.parametrize("args,setting", [((6, 4, 1, 100), "trainer.global_batch_size"),
                                          ((8, 2, 3, 100), "trainer.global_batch_size"),
                                          ((64, 1, 1, 10), "trainer.global_batch_size")])
def test_bad_batch_settings(args, setting):
    with pytest.raises(ConfigError) as info:
        check_batch(*args)
    assert info.value.setting == setting


@pytest.mark.parametrize("field", ["global_batch_size", "grad_accum_steps"])
def test_batch_signs_are_the_trainer_schemas(field):
    """Zero batches are refused once, by TrainerConfig, not again by check_batch."""
    with pytest.raises(ConfigError) as info:
        TrainerConfig(**{field: 0})
    assert info.value.setting == f"trainer.{field}"


def _work() -> None:
    pass


def test_a_forked_child_starts_its_own_forkserver(tmp_path):
    """A process that ran the forkserver (a sweep's first point) and then forks ranks (the local launcher: a tp2
    point): the parent's server is no child of the rank, whose `ensure_running` waited for it and raised
    ChildProcessError; the rank forgets it (utils/data/batching.py `_forget_parent_forkserver`) and its data
    workers start from a server of its own. Run in a subprocess: forking pytest itself is not safe."""
    import os
    import subprocess
    import sys

    from tests.helpers import ROOT

    script = tmp_path / "fork_after_server.py"
    script.write_text(
        "import multiprocessing, multiprocessing.forkserver, os\n"
        "import utils.data.batching  # noqa: F401 - its fork hook\n"
        "def work():\n    pass\n"
        "if __name__ == '__main__':\n"
        "    multiprocessing.forkserver.ensure_running()\n"
        "    pid = os.fork()\n"
        "    if pid == 0:\n"
        "        multiprocessing.forkserver.ensure_running()\n"
        "        p = multiprocessing.get_context('forkserver').Process(target=work)\n"
        "        p.start(); p.join()\n"
        "        os._exit(p.exitcode)\n"
        "    code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])\n"
        "    print('child exit', code)\n")
    proc = subprocess.run([sys.executable, str(script)], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.stdout.strip() == "child exit 0", proc.stdout + proc.stderr[-2000:]
