"""The stop-signal handler: every stop signal is a request, a second Ctrl-C interrupts, the deadline exits 76."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from tests.helpers import ROOT
from utils.engine.preemption import EARLY_SIGNALS, EXIT_LATE, StopRequest, record_stop_signals, take_early_stop
from utils.signals import SIGNALS


@pytest.fixture
def handlers_kept():
    """The stop signals' handlers as they were before the test, put back after it."""
    before = {sig: signal.getsignal(sig) for sig in SIGNALS}
    yield before
    for sig, handler in before.items():
        signal.signal(sig, handler)


@pytest.mark.parametrize("sig", SIGNALS, ids=[s.name for s in SIGNALS])
def test_each_stop_signal_is_recorded_and_then_ignored(sig, handlers_kept):
    with StopRequest(60) as request:
        assert not request.requested
        os.kill(os.getpid(), sig)
        time.sleep(0.05)  # delivered between bytecodes
        assert request.signum == sig
        os.kill(os.getpid(), signal.SIGTERM)  # a second non-interrupt signal changes nothing
        time.sleep(0.05)
        assert request.signum == sig
    # stopping: SIGTERM (srun's, once a partner rank exited 75) must not kill the process on its way out
    for other in SIGNALS:
        assert signal.getsignal(other) == (handlers_kept[other] if other == signal.SIGINT else signal.SIG_IGN)
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(0.05)  # still alive


def test_handlers_restored_without_a_stop(handlers_kept):
    with StopRequest(60) as request:
        assert signal.getsignal(signal.SIGTERM) == request._handle
    assert {sig: signal.getsignal(sig) for sig in SIGNALS} == handlers_kept


def test_a_request_installed_in_set_up_is_entered_again_by_fit(handlers_kept):
    """build_run installs the request, fit enters the same one: a signal between the two is kept, and the
    exit puts back the handlers from before set-up (utils/engine/build.py, utils/engine/trainer.py)."""
    request = StopRequest(60).__enter__()
    os.kill(os.getpid(), signal.SIGUSR1)  # during set-up
    time.sleep(0.05)
    with request:
        assert request.signum == signal.SIGUSR1 and signal.getsignal(signal.SIGTERM) == request._handle
    assert signal.getsignal(signal.SIGINT) == handlers_kept[signal.SIGINT]
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_IGN  # stopping: srun's SIGTERM must not kill it


def test_a_second_ctrl_c_interrupts_at_once(handlers_kept):
    with pytest.raises(KeyboardInterrupt), StopRequest(60) as request:
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.05)
        assert request.requested
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(1)


def test_no_checkpoint_within_the_deadline_exits_76():
    code = ("import os, signal, time\nfrom utils.engine.preemption import StopRequest\n"
            "with StopRequest(0.5):\n    os.kill(os.getpid(), signal.SIGTERM)\n    time.sleep(30)\n")
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=30)
    assert proc.returncode == EXIT_LATE and time.monotonic() - start < 10
    assert "no checkpoint within trainer.preempt_deadline_s=0.5 s of SIGTERM" in proc.stderr


def test_a_signal_before_set_up_is_recorded_and_taken_over_by_the_request(handlers_kept):
    """What the entry points install on their first lines (before torch is imported): a stop signal is recorded,
    not fatal, and the run's StopRequest takes it over, its deadline counted from the signal's arrival; Ctrl-C
    keeps its default until set-up (nothing to save yet)."""
    record_stop_signals()
    assert signal.getsignal(signal.SIGINT) == handlers_kept[signal.SIGINT]
    assert signal.SIGUSR2 in EARLY_SIGNALS and signal.SIGINT not in EARLY_SIGNALS
    os.kill(os.getpid(), signal.SIGUSR2)  # submitit's time-limit signal, while "importing torch"
    time.sleep(0.3)
    os.kill(os.getpid(), signal.SIGTERM)  # a later one does not replace the first
    time.sleep(0.05)
    with StopRequest(60) as request:
        assert request.signum == signal.SIGUSR2
        assert 59.0 < request._timer.interval < 59.8  # 60 s from the arrival, not from set-up
    assert take_early_stop() is None  # taken once


def test_a_launchers_early_stop_reaches_its_ranks_in_their_environment(handlers_kept, monkeypatch):
    """train_mp.py hands a stop signal it received before starting the ranks to each rank in its environment (a
    signal sent to a rank just forked can be lost: CPython clears a fork's pending signals, issue 9535): the
    rank's StopRequest takes it over as if it had come there, its deadline counted from the launcher's receipt."""
    from utils.engine.preemption import early_stop_env, inherit_early_stop

    monkeypatch.setattr(os, "environ", {**os.environ, **early_stop_env((signal.SIGTERM, time.monotonic() - 0.5))})
    inherit_early_stop()
    with StopRequest(60) as request:
        assert request.signum == signal.SIGTERM
        assert 59.0 < request._timer.interval < 59.6
    assert take_early_stop() is None
    monkeypatch.setattr(os, "environ", {})
    inherit_early_stop()  # a rank whose launcher had no early signal
    assert take_early_stop() is None
