"""End to end through train.py: TensorBoard tags, a real loss drop, exact resume, bad input."""

import pytest

from tests.helpers import read_scalars, read_tags, run_entry

pytestmark = pytest.mark.slow  # trains through the entry points or launches processes

# One data worker, forked (the fastest start; the default forkserver start costs seconds per launch and
# is exercised where it matters: the job-wide SIGUSR1 below and tests/test_launch.py).
TINY = ["trainer.log_every=10", "trainer.num_workers=1", "trainer.worker_start=fork", "trainer.global_batch_size=8",
        "data.limit_nsamples_val=8", "trainer.log_images=false"]  # the first test draws the figures


def train(tmp_path, era5_root, name, *args):
    run_dir = tmp_path / name
    proc = run_entry("train.py", f"data.root={era5_root}", f"run.dir={run_dir}", *TINY, *args)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return run_dir, proc


def test_trains_logs_and_resumes_exactly(tmp_path, era5_root):
    # dropout on: the resumed run must restore the RNG stream exactly; stop at a validation step
    common = ["trainer.max_steps=40", "trainer.val_every=20", "trainer.ckpt_every=0", "model.dropout=0.1",
              "trainer.log_images=true"]
    full, proc = train(tmp_path, era5_root, "full", *common)
    scalars = read_scalars(full)
    for tag in ("train/loss", "train/lr", "train/grad_norm", "val/loss", "val/rmse/u10m", "val/rmse/tcwv",
                "perf/samples_per_sec", "perf/step_time_ms", "perf/data_wait_ms", "mem/peak_gib"):
        assert tag in scalars, tag
    assert "val/u10m_pred_vs_target" in read_tags(full)["images"]
    losses = [v for _, v in scalars["train/loss"]]
    assert len(losses) == 40
    assert sum(losses[-5:]) / 5 < 0.6 * sum(losses[:5]) / 5, losses
    assert (full / "config.yaml").is_file() and (full / "train.log").is_file()
    assert (full / "checkpoints" / "latest").read_text() == "step_0000040"
    lrs = scalars["train/lr"]
    assert lrs[0] == (1, pytest.approx(5e-4)) and lrs[-1][1] > 0  # the lr each step used, steps counted from 1

    part, _ = train(tmp_path, era5_root, "part", *common, "trainer.stop_at_step=20")
    assert (part / "checkpoints" / "latest").read_text() == "step_0000020"
    _, proc = train(tmp_path, era5_root, "part", *common)
    assert "resumed from" in proc.stdout
    resumed = read_scalars(part)
    assert [v for _, v in resumed["train/loss"]] == losses  # bitwise: same floats at every step
    assert [s for s, _ in resumed["val/loss"]] == [0, 20, 40]  # the validations before the resume step are kept


def test_finished_run_does_nothing_and_never_starts_over(tmp_path, era5_root):
    args = ["trainer.max_steps=3", "trainer.val_every=0"]
    train(tmp_path, era5_root, "run", *args)
    _, proc = train(tmp_path, era5_root, "run", *args)
    assert "nothing to do" in proc.stdout
    _, proc = train(tmp_path, era5_root, "run", *args, "trainer.resume=never")
    assert "resumed" not in proc.stdout and "step 3/3" in proc.stdout


def test_era5_files_written_elsewhere(tmp_path):
    """data=era5 trains on files in the NERSC layout that our generator did not write."""
    from tests.test_era5 import write_layout

    root = write_layout(tmp_path / "era5", steps=6, channels=20)
    run_dir = tmp_path / "run"
    proc = run_entry("train.py", "data=era5", f"data.root={root}", "data.img_size=[12,20]", "model.patch_size=4",
                     f"run.dir={run_dir}", "trainer.max_steps=3", "trainer.global_batch_size=2",
                     "trainer.num_workers=0", "trainer.val_every=0")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert len(read_scalars(run_dir)["train/loss"]) == 3


def run_until_signalled(args: list[str], at_step: int, sig: int, script: str = "train.py",
                        group: bool = False) -> tuple[int, float, str]:
    """Start an entry point, send `sig` once it logs step `at_step` (to every process it started when
    `group`, as Slurm signals every process of a job step); (its exit status, seconds from the signal
    to its exit, output so far). Output is drained by a thread, so children that outlive the entry point
    (and keep its stdout open) cannot make this wait for them."""
    import os
    import subprocess
    import sys
    import threading
    import time

    from tests.helpers import ROOT

    proc = subprocess.Popen([sys.executable, str(ROOT / script), *args, "trainer.log_every=1"], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(iter(proc.stdout.readline, "")), daemon=True).start()
    deadline = time.monotonic() + 120
    while not any(f"step {at_step}/" in line for line in list(lines)):
        assert proc.poll() is None and time.monotonic() < deadline, "".join(lines[-20:])
        time.sleep(0.05)
    if group:
        os.killpg(proc.pid, sig)
    else:
        proc.send_signal(sig)
    sent = time.monotonic()
    status = proc.wait(timeout=120)
    return status, time.monotonic() - sent, "".join(lines)


@pytest.fixture(scope="module")
def uninterrupted_losses(tmp_path_factory, era5_root) -> list[float]:
    """The 12 losses every interrupted run below must reproduce (checkpoint cadence and data workers do
    not change them)."""
    full, _ = train(tmp_path_factory.mktemp("full"), era5_root, "full", "trainer.max_steps=12", "trainer.val_every=0",
                    "trainer.ckpt_every=0")
    return [v for _, v in read_scalars(full)["train/loss"]]


@pytest.mark.parametrize("signame,group", [("SIGTERM", False), ("SIGUSR1", True)])
def test_stop_signal_checkpoints_and_resume_continues_exactly(signame, group, tmp_path, era5_root,
                                                              uninterrupted_losses):
    """Slurm's SIGTERM (or SIGUSR1 ahead of the limit, sent to every process: the data worker too):
    finish the step, checkpoint it, exit 75; the same command then continues and reproduces the
    uninterrupted losses bitwise."""
    import signal

    from utils.engine.preemption import EXIT_PREEMPTED

    common = ["trainer.max_steps=12", "trainer.val_every=0", "trainer.ckpt_every=0"]
    run_dir = tmp_path / "stopped"
    args = [f"data.root={era5_root}", f"run.dir={run_dir}", *TINY, *common]
    if group:  # the default start: the forkserver and its worker must survive a signal to every process
        args.append("trainer.worker_start=forkserver")
    status, seconds, out = run_until_signalled(args, 4, getattr(signal, signame), group=group)
    assert status == EXIT_PREEMPTED and seconds < 30, out[-2000:]
    step = int((run_dir / "checkpoints" / "latest").read_text().removeprefix("step_"))
    assert 4 <= step < 12 and (run_dir / "checkpoints" / f"step_{step:07d}" / "COMPLETE").is_file()
    _, proc = train(tmp_path, era5_root, "stopped", *common)
    assert f"resumed from {run_dir / 'checkpoints' / f'step_{step:07d}'}" in proc.stdout
    assert [v for _, v in read_scalars(run_dir)["train/loss"]] == uninterrupted_losses


def test_kill_9_around_saves_then_resume_reproduces_the_run(tmp_path, era5_root, uninterrupted_losses):
    """A checkpoint every step and SIGKILL three times just as a step's save begins: the same command then
    finishes from the newest complete checkpoint, and the losses equal the uninterrupted run's bitwise."""
    import signal

    common = ["trainer.max_steps=12", "trainer.val_every=0", "trainer.ckpt_every=1",
              "trainer.num_workers=0"]  # four launches: the data workers are exercised by the tests above
    run_dir = tmp_path / "killed"
    args = [f"data.root={era5_root}", f"run.dir={run_dir}", *TINY, *common]
    resumed_from = []
    for at_step in (3, 6, 9):
        status, _, out = run_until_signalled(args, at_step, signal.SIGKILL, group=True)
        assert status == -signal.SIGKILL, out[-2000:]
        resumed_from += [line for line in out.splitlines() if "resumed from" in line]
    assert len(resumed_from) == 2  # the second and third runs resumed
    _, proc = train(tmp_path, era5_root, "killed", *common)
    assert "resumed from" in proc.stdout
    assert [v for _, v in read_scalars(run_dir)["train/loss"]] == uninterrupted_losses
    assert not list((run_dir / "checkpoints").glob(".tmp_step_*"))  # leftovers of killed saves are cleaned
