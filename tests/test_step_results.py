"""A training step never waits for the device: nothing in it reads a device value, a non-finite step is
skipped on the device, and the host reads a step's scalars `lag` steps later (1 on CUDA) with every rank
taking the same decision at the same step."""

from __future__ import annotations

import math
import os
import signal

import pytest
import torch

from tests.helpers import read_scalars, run_ranks
from tests.test_precision import make_trainer
from utils.engine.preemption import EXIT_PREEMPTED
from utils.engine.step_results import StepResult, StepResults
from utils.signals import SIGNALS

READS = ("item", "tolist", "__bool__", "__float__", "__int__", "__index__", "numpy")


class HostRead(AssertionError):
    pass


def _forbid_reads(monkeypatch) -> None:
    """Every way Python code can read a tensor's value raises (CPU tensors too: the CPU stands in here
    for the device, which a real read would wait for)."""
    for name in READS:
        def refuse(self, *args, _name=name, **kwargs):
            raise HostRead(f"Tensor.{_name} called inside the training step")
        monkeypatch.setattr(torch.Tensor, name, refuse)


def test_step_results_arrive_lag_steps_late_in_order():
    results = StepResults(torch.device("cpu"), lag=1)
    for step in (1, 2, 3):
        results.push(StepResult(step, 1e-3, 0.0, 0.0), torch.tensor([step / 10, 2.0, float(step == 2), 0.0, 1.5]))
        due = results.pop()
        assert [r.step for r in due] == ([] if step == 1 else [step - 1])
    assert [(r.step, r.loss, r.bad) for r in results.pop(flush=True)] == [(3, pytest.approx(0.3), False)]
    assert results.pop(flush=True) == [] and StepResults(torch.device("cpu")).lag == 0


def _train_steps_without_reads(rank, world_size, run_dir, era5_root, parallel):
    trainer = make_trainer(run_dir, f"data.root={era5_root}", f"parallel={parallel}", "trainer.global_batch_size=8")
    assert trainer.optimizer.defaults["fused"]
    batches = trainer.train_batches()
    trainer.train_step(*next(batches))  # the first step builds DDP buckets and Adam state
    hook = trainer.raw_model.head.weight.register_hook(lambda g: torch.full_like(g, math.nan) if rank == 0 else g)
    before = [p.detach().clone() for p in trainer.raw_model.parameters()]
    x, y = next(batches)
    with pytest.MonkeyPatch.context() as mp:
        _forbid_reads(mp)
        trainer.train_step(x, y)  # skipped on every rank: the NaN of rank 0 is agreed on the device
    assert trainer.skipped and all(torch.equal(a, p) for a, p in zip(before, trainer.raw_model.parameters()))
    hook.remove()
    x, y = next(batches)
    with pytest.MonkeyPatch.context() as mp:
        _forbid_reads(mp)
        trainer.train_step(x, y)
    assert not trainer.skipped and not all(torch.equal(a, p) for a, p in zip(before, trainer.raw_model.parameters()))


@pytest.mark.parametrize("parallel,world", [("single", 1), ("tp2", 2)])
def test_a_training_step_reads_nothing_from_the_device(parallel, world, tmp_path, era5_root):
    run_ranks(_train_steps_without_reads, world, tmp_path, str(tmp_path / "run"), str(era5_root), parallel,
              timeout_s=120)


@pytest.mark.parametrize("lag", [0, 1])
def test_a_stop_signal_is_acted_on_lag_steps_later(lag, tmp_path, era5_root):
    """SIGUSR1 during step 3: the checkpoint is that of step 3 + lag, and every step up to it is logged."""
    run_dir = tmp_path / f"lag{lag}"
    trainer = make_trainer(run_dir, f"data.root={era5_root}", "trainer.global_batch_size=8", "trainer.max_steps=8",
                           "trainer.val_every=0", "trainer.val_at_start=false", "trainer.ckpt_every=0",
                           "trainer.log_every=1")  # no validation forward before the steps the hook counts
    trainer.results = StepResults(trainer.device, lag=lag)
    calls = []

    def signal_in_step_3(module, args):
        calls.append(None)
        if len(calls) == 3:
            os.kill(os.getpid(), signal.SIGUSR1)

    trainer.raw_model.register_forward_pre_hook(signal_in_step_3)
    handlers = {sig: signal.getsignal(sig) for sig in SIGNALS}  # a stop leaves them ignored: put them back
    try:
        assert trainer.fit() == EXIT_PREEMPTED
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    # the signal arrives while step 3 runs: step 4 is the first to begin with it
    assert (run_dir / "checkpoints" / "latest").read_text() == f"step_{4 + lag:07d}"
    assert [s for s, _ in read_scalars(run_dir)["train/loss"]] == list(range(1, 5 + lag))
