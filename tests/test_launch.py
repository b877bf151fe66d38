"""Bad launches end the job: a grid that does not fit exits 2 at once; one failing rank stops the rest;
stop signals reach every rank and no rank outlives its launcher."""

import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.helpers import NARROW, ROOT, run_entry
from utils.cli.launch import free_port
from utils.cli.local_launch import supervise

pytestmark = pytest.mark.slow  # trains through the entry points or launches processes


def test_one_local_launch_composes_its_config_once(monkeypatch, tmp_path):
    """train.py as one process for a layout of 2 ranks: the config it composed is the one the launcher plans with
    (composed once in this process); the ranks it starts compose their own."""
    from utils.cli import config, local_launch

    composed, planned = [], []
    real = config.compose_config
    monkeypatch.setattr(config, "compose_config", lambda argv: (composed.append(list(argv)), real(argv))[1])
    monkeypatch.setattr(local_launch, "launch", lambda argv, world, gpus: planned.append((world, gpus)) or 0)
    monkeypatch.setenv("TRAIN_MP_ERRORS", "")
    argv = ["parallel=tp2", "trainer.device=cpu", f"run.dir={tmp_path}/run"]
    assert local_launch.run_command(argv) == 0
    assert planned == [(2, False)] and composed == [argv]  # run_digest composes the presets alone, not the config


def test_train_mp_rejects_a_grid_that_does_not_fit():
    proc = run_entry("train_mp.py", "parallel=tp2", "--nproc", "3", timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.startswith("error: world size 3 does not fit tp=2") and "Traceback" not in proc.stderr


@pytest.mark.parametrize("case", ["batch", "resume", "data"])
def test_a_bad_input_of_a_local_launch_is_printed_once(case, tmp_path):
    """`python train.py parallel.tp=2 parallel.dp=3` said "launching 6 ranks" and then printed the same error 6 times:
    the split of the global batch over the grid, and the run directory's checkpoints, are checked before any rank
    starts; a data error, which each rank finds, is printed by the first rank that finds it."""
    from utils.cli.config import load_config

    args, expected = {
        "batch": (["parallel.tp=2", "parallel.dp=3"], "error: global_batch_size 16 is not divisible by dp=3 x "
                  "grad_accum_steps=1 (trainer.global_batch_size): use a multiple of 3"),
        "resume": (["parallel=tp2", "optim.lr=1e-2"], f"error: {tmp_path / 'run'} holds checkpoints of a run with "
                   "other settings (optim.lr: 0.0005 -> 0.01) (run.dir): "),
        "data": (["parallel=tp2", "data=era5", "data.root=/nonexistent/era5"], "error: data folder /nonexistent/era5 "
                 "does not exist (data.root): ")}[case]
    if case == "resume":
        (tmp_path / "run" / "checkpoints").mkdir(parents=True)
        (tmp_path / "run" / "checkpoints" / "latest").write_text("step_0000004")
        (tmp_path / "run" / "config.yaml").write_text(load_config([])[2])
    (tmp_path / "tmp").mkdir()
    proc = run_entry("train.py", f"run.dir={tmp_path / 'run'}", *args, timeout=120,
                     env={"TMPDIR": str(tmp_path / "tmp")})
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith(expected), proc.stderr
    assert ("launching 2 ranks" in proc.stdout) == (case == "data"), proc.stdout
    assert not list((tmp_path / "tmp").iterdir())  # the launcher's file of its ranks' error lines: unlinked


def test_an_error_line_is_told_once_per_launch(tmp_path):
    """The ranks of one launch share the launcher's unlinked file: the first to tell a line prints it; a descriptor
    that is not that file (a stale variable in a process that did not inherit it) is never written to."""
    import tempfile

    from utils.cli.local_launch import ERRORS_ENV, first_to_tell

    with tempfile.TemporaryFile() as told, (tmp_path / "other").open("w+b") as other:
        stat = os.fstat(told.fileno())
        env = {ERRORS_ENV: f"{told.fileno()}:{stat.st_dev}:{stat.st_ino}"}
        assert first_to_tell("error: a", env) and not first_to_tell("error: a", env) and first_to_tell("error: b", env)
        child = os.fork()
        if child == 0:  # a forked rank: the same file, the same open description
            os._exit(0 if not first_to_tell("error: b", env) and first_to_tell("error: c", env) else 1)
        assert os.waitstatus_to_exitcode(os.waitpid(child, 0)[1]) == 0 and not first_to_tell("error: c", env)
        stale = {ERRORS_ENV: f"{other.fileno()}:{stat.st_dev}:{stat.st_ino}"}
        assert first_to_tell("error: a", stale) and first_to_tell("error: a", stale) and first_to_tell("x", {})
        assert other.read() == b""


def test_supervisor_stops_the_other_ranks_when_one_fails():
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    failing = subprocess.Popen([sys.executable, "-c", "import sys; sys.exit(3)"])
    start = time.time()
    assert supervise([sleeper, failing]) == 3
    assert sleeper.poll() is not None and time.time() - start < 20


def test_a_rank_killed_by_a_signal_fails_the_job_with_128_plus_its_number():
    """As a shell reports it (sys.exit of Popen's -9 would be 247): Slurm and scripts read 137 as SIGKILL."""
    import signal

    sleep = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_DFL); print(flush=True); time.sleep(60)"
    for sig in (signal.SIGKILL, signal.SIGTERM):
        sleeper, killed = (subprocess.Popen([sys.executable, "-c", sleep], stdout=subprocess.PIPE) for _ in range(2))
        killed.stdout.readline()  # its SIGTERM handler is the default one now
        killed.send_signal(sig)
        assert supervise([sleeper, killed]) == 128 + sig
        assert sleeper.poll() is not None


def test_a_rank_whose_partner_failed_its_checks_does_not_hang(tmp_path, era5_root):
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE="2")
    args = [sys.executable, str(ROOT / "train.py"), "parallel.dp=2", "parallel.init_timeout_s=5",
            f"run.dir={tmp_path}"]
    bad = subprocess.run(args + ["data=era5", "data.root=/nonexistent"], env=dict(env, RANK="1"),
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2
    start = time.time()
    good = subprocess.run(args + [f"data.root={era5_root}"], env=dict(env, RANK="0"), capture_output=True,
                          text=True, timeout=120)
    assert good.returncode == 2 and "(parallel.init_timeout_s)" in good.stderr, good.stderr[-2000:]
    assert len(good.stderr.strip().splitlines()) == 1 and time.time() - start < 60


def test_the_local_rendezvous_port_is_below_the_ephemeral_range(tmp_path, monkeypatch):
    """The kernel gives ports of its ephemeral range to listeners on port 0 and outgoing connections (another
    job's gloo): free_port picks below it, at random (not from the global generator a seeded run repeats), a
    port nothing listens on, and the kernel's own choice where too few ports lie below the range."""
    import random

    import utils.cli.launch as launch

    low = int(launch.EPHEMERAL_RANGE.read_text().split()[0])
    runs = []
    for _ in range(2):  # two seeded processes (two pooled ranks, two launchers seeded alike) part ways
        random.seed(0)
        runs.append([free_port() for _ in range(10)])
    assert runs[0] != runs[1] and all(launch.LOWEST_PORT <= port < low for port in runs[0] + runs[1]), (low, runs)
    narrow = tmp_path / "range"
    narrow.write_text(f"{launch.LOWEST_PORT + 100}\t60999\n")
    assert free_port(narrow) >= low  # the kernel's choice: from its own range
    with socket.socket() as taken:  # a port something listens on is passed over
        busy = free_port()
        taken.bind(("", busy))
        taken.listen()
        picks = iter([busy, busy + 1 if busy + 1 < low else busy - 1])

        class Picks:
            def randrange(self, start: int, stop: int) -> int:
                return next(picks)

        monkeypatch.setattr(launch.random, "SystemRandom", Picks)
        assert free_port() != busy


def test_launch_environments():
    import pytest

    from utils import ConfigError
    from utils.launch_env import launch_env

    assert launch_env({}).world_size == 1
    torchrun = launch_env({"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1"})
    assert (torchrun.rank, torchrun.world_size, torchrun.local_rank, torchrun.source) == (3, 8, 1, "torchrun")
    slurm = launch_env({"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1", "MASTER_ADDR": "node0",
                        "MASTER_PORT": "29500"})
    assert (slurm.rank, slurm.world_size, slurm.local_rank, slurm.source) == (5, 8, 1, "slurm")
    assert launch_env({"SLURM_PROCID": "0", "SLURM_NTASKS": "1"}).source == "single"  # an salloc shell
    with pytest.raises(ConfigError) as info:
        launch_env({"SLURM_PROCID": "0", "SLURM_NTASKS": "4"})
    assert info.value.setting == "MASTER_ADDR"
    from utils.launch_env import restart_warning

    shared = {"TORCHELASTIC_MAX_RESTARTS": "2", "TORCHELASTIC_USE_AGENT_STORE": "True"}
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in restart_warning(shared)
    assert restart_warning(dict(shared, TORCHELASTIC_USE_AGENT_STORE="False")) is None  # the fix is set
    assert restart_warning(dict(shared, TORCHELASTIC_MAX_RESTARTS="0")) is None  # no restarts asked for


def test_each_rank_finds_its_gpu(monkeypatch):
    """One GPU per local rank when the node's GPUs are all visible; the one visible GPU under Slurm's
    per-task binding; too few GPUs is the one-line error (CUDA mocked: this machine has none)."""
    import pytest
    import torch

    from utils import ConfigError
    from utils.launch_env import pick_device

    chosen = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    assert pick_device(3) == torch.device("cuda", 3) and chosen == [3]
    with pytest.raises(ConfigError):
        pick_device(4)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)  # --gpus-per-task=1: each task sees its own
    assert pick_device(3) == torch.device("cuda", 0) and chosen[-1] == 0


def test_layout_command_prints_groups_without_launching():
    proc = subprocess.run([sys.executable, "-m", "utils.comm", "tp=4", "dp=2", "order=tp-dp"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0
    assert "tp groups: [[0, 1, 2, 3], [4, 5, 6, 7]]" in proc.stdout
    assert "dp groups: [[0, 4], [1, 5], [2, 6], [3, 7]]" in proc.stdout
    bad = subprocess.run([sys.executable, "-m", "utils.plan.layout", "tp=3", "world=8"], cwd=ROOT, capture_output=True,
                         text=True, timeout=60)
    assert bad.returncode == 2 and bad.stderr.startswith("error: world size 8 does not fit tp=3")


def ranks_of(run_dir) -> list[int]:
    """PIDs of live processes whose command line names this run directory."""
    out = subprocess.run(["pgrep", "-f", f"run.dir={run_dir}"], capture_output=True, text=True).stdout
    return [int(pid) for pid in out.split()]


def launched_ranks(launcher_pid: int) -> list[int]:
    """PIDs of the ranks train_mp.py started, in rank order: its children, by start time (ranks are started
    in rank order; on a CPU machine they are forks, whose /proc environ is still the launcher's)."""
    children = []
    for pid in ranks_of_parent(launcher_pid):
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        children.append((int(fields[19]), pid))  # starttime (field 22 of stat; 2 fields precede this split)
    return [pid for _, pid in sorted(children)]


def ranks_of_parent(parent: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(parent)], capture_output=True, text=True).stdout
    return [int(pid) for pid in out.split()]


def test_launcher_forwards_stop_signals_and_never_leaves_a_rank_behind(tmp_path, era5_root):
    """SIGTERM to train_mp.py reaches both tp ranks: one complete checkpoint of both, status 75. SIGKILL
    of the launcher (nothing to forward) still ends its ranks, with a checkpoint."""
    import signal

    from tests.test_train_e2e import run_until_signalled
    from utils.engine.preemption import EXIT_PREEMPTED

    for sig, name in ((signal.SIGTERM, "term"), (signal.SIGKILL, "kill")):
        run_dir = tmp_path / name
        args = [f"data.root={era5_root}", f"run.dir={run_dir}", "parallel=tp2", "trainer.max_steps=200",
                "trainer.val_every=0", "trainer.ckpt_every=0", "trainer.num_workers=1"]
        status, seconds, out = run_until_signalled(args, 3, sig, script="train_mp.py")
        assert status == (EXIT_PREEMPTED if sig == signal.SIGTERM else -signal.SIGKILL), out[-2000:]
        deadline = time.time() + 30
        while ranks_of(run_dir) and time.time() < deadline:
            time.sleep(0.2)
        assert not ranks_of(run_dir), "a rank outlived its launcher"
        step_dir = run_dir / "checkpoints" / (run_dir / "checkpoints" / "latest").read_text()
        assert sorted(p.name for p in step_dir.iterdir()) == [".metadata", "COMPLETE", "__0_0.distcp",
                                                             "__1_0.distcp", "state.json"]


def test_a_stopped_rank_does_not_leave_the_job_waiting(tmp_path, era5_root):
    """SIGSTOP rank 1 of a dp=2 job: rank 0 waits in a collective, its watchdog dumps the stacks and exits
    77 naming the phase, and train_mp.py stops the rest (the stopped rank included) well within
    trainer.hang_timeout_s + 30 s."""
    import signal

    from utils.engine.watchdog import EXIT_HANG

    run_dir = tmp_path / "run"
    args = [sys.executable, str(ROOT / "train_mp.py"), f"data.root={era5_root}", f"run.dir={run_dir}",
            "parallel.dp=2", "trainer.max_steps=500", "trainer.val_every=0", "trainer.ckpt_every=0",
            "trainer.num_workers=0", "trainer.log_every=1", "trainer.hang_timeout_s=5"]
    proc = subprocess.Popen(args, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while not (run_dir / "train.log").is_file() or "step 3/" not in (run_dir / "train.log").read_text():
        assert proc.poll() is None and time.time() < deadline, proc.stderr.read()[-2000:]
        time.sleep(0.2)
    rank1 = launched_ranks(proc.pid)[1]
    os.kill(rank1, signal.SIGSTOP)
    stopped = time.time()
    status = proc.wait(timeout=60)
    assert status == EXIT_HANG and time.time() - stopped < 5 + 30
    _, err = proc.communicate()
    assert re.search(r"error: rank 0 made no progress for \d+ s in phase '(forward/backward|optimizer)'", err), err
    assert "Thread" in (run_dir / "hang_rank0.txt").read_text()
    time.sleep(1)
    assert not ranks_of(run_dir), "a rank outlived the job"


def _rank_pid(run_dir, rank: int) -> int | None:
    """PID of the process of `rank` (by its RANK variable) of the run in `run_dir`, if alive."""
    for pid in ranks_of(run_dir):
        try:
            if f"\0RANK={rank}\0" in "\0" + open(f"/proc/{pid}/environ").read():
                return pid
        except OSError:
            continue
    return None


def test_torchrun_restart_resumes_and_ends_with_the_uninterrupted_weights(tmp_path, era5_root):
    """torchrun --max-restarts=1, dp=2: SIGKILL rank 1 after step 7 (checkpoints every 3 steps); torchrun
    restarts both ranks, they resume from the newest complete checkpoint (step 6) and the final weights
    and the whole loss curve equal an uninterrupted run's bitwise. The uninterrupted run is the same command
    on the rank pool's two ranks (tests/rank_pool.py: train.main as torchrun's ranks run it, one thread
    each), while torchrun restarts: a second torchrun job cost its three interpreters' start (docs/measurements.md)."""
    import signal
    import threading

    import torch

    from tests.helpers import read_scalars
    from tests.rank_pool import run_entry_ranks
    from utils.checkpoints.sharded_state import read_full

    def command(name: str) -> list[str]:
        return [f"data.root={era5_root}", f"run.dir={tmp_path / name}", "parallel.dp=2", "trainer.max_steps=12",
                "trainer.val_every=0", "trainer.ckpt_every=3", "trainer.num_workers=0", "trainer.log_every=1",
                *NARROW, "trainer.val_at_start=false", "data.limit_nsamples_val=8"]

    args = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "--max-restarts=1",
            "--monitor-interval=0.2", str(ROOT / "train.py"), *command("killed")]
    killed = subprocess.Popen(args, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
                                       TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1"))
    out: list[str] = []
    threading.Thread(target=lambda: out.extend(iter(killed.stdout.readline, "")), daemon=True).start()
    deadline = time.time() + 120
    while not any("step 7/" in line for line in list(out)):
        assert killed.poll() is None and time.time() < deadline, "".join(out[-30:])
        time.sleep(0.05)
    os.kill(_rank_pid(tmp_path / "killed", 1), signal.SIGKILL)
    killed_at = time.time()
    saved = [line.split("step_")[-1].strip() for line in list(out) if "saved checkpoint" in line]
    full = run_entry_ranks(command("full"), 2)  # the reference, meanwhile
    status = killed.wait(timeout=180)  # the job ends before any assertion, the reference's included
    (tmp_path / "torchrun_out.txt").write_text("".join(out))  # the job's output, kept beside its run directories
    assert [r.value for r in full] == [0, 0], [r.error or r.stderr[-2000:] for r in full]
    assert status == 0, "".join(out[-40:])
    print(f"torchrun restart: rank 1 killed after step 7, job finished {time.time() - killed_at:.1f} s later")
    text = "".join(out)
    resumed = text[text.index("resumed from"):].split("\n")[0]  # step 6, or 9 when its save beat the kill
    assert resumed.startswith(f"resumed from {tmp_path / 'killed' / 'checkpoints' / f'step_{saved[-1]}'}"), \
        text[-3000:]
    ckpts = [tmp_path / name / "checkpoints" / "step_0000012" for name in ("full", "killed")]
    ref, got = (read_full(p) for p in ckpts)  # model, Adam state and every rank's RNG
    assert ref.keys() == got.keys()
    for key in ref:
        torch.testing.assert_close(got[key], ref[key], rtol=0, atol=0, msg=key)
    losses = [[v for _, v in read_scalars(tmp_path / name)["train/loss"]] for name in ("full", "killed")]
    assert losses[1] == losses[0]  # TensorBoard keeps the re-run steps' values (out-of-order events purged)


def test_train_py_as_one_process_launches_the_ranks_of_the_layout(tmp_path):
    """The mission's command as typed: `python train.py parallel=tp2 ...` starts two ranks by itself."""
    from tests.helpers import read_scalars

    proc = run_entry("train.py", "parallel=tp2", "trainer.max_steps=3", "trainer.val_every=0", "trainer.num_workers=0",
                     f"run.dir={tmp_path}", timeout=180)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "train_mp: launching 2 ranks on CPU (gloo)" in proc.stdout
    assert "INFO grid: world=2 tp=2 " in proc.stdout, proc.stdout
    scalars = read_scalars(tmp_path)
    assert [step for step, _ in scalars["comm/tp_bytes"]] == [1, 2, 3]
    assert all(v > 0 for _, v in scalars["comm/tp_bytes"])
    # one rank of the tp group read each batch and broadcast it: (x, y) of a per-rank batch
    from utils.cli.config import load_config
    from utils.tasks import build_task

    cfg, _, _ = load_config(["parallel=tp2"])
    x, y = build_task(cfg, load_data=False).example_batch(cfg.trainer.global_batch_size, torch.device("cpu"))
    assert [v for _, v in scalars["data/shared_bytes"]] == [x.nbytes + y.nbytes] * 3
    assert "training batches read by one rank of each tp x cp group of 2" in proc.stdout


def _project_imports(path: Path) -> set[str]:
    """Modules of this project that a file imports, at the top or inside a function."""
    import ast

    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
    return {n for n in names if n.split(".")[0] in ("train", "train_mp", "utils", "distributed", "networks")}


def test_no_library_module_imports_a_script_and_the_entry_modules_form_no_circle():
    """train.py and train_mp.py are scripts over utils/cli/entry.py and utils/cli/local_launch.py: nothing imports them
    (tests aside), and the entry modules (with the Hydra app) import each other one way only."""
    library = [p for d in ("utils", "distributed", "networks") for p in sorted((ROOT / d).rglob("*.py"))]
    scripts = [ROOT / "train.py", ROOT / "train_mp.py"]
    offenders = {str(p.relative_to(ROOT)): found for p in library + scripts
                 if (found := sorted(n for n in _project_imports(p) if n.split(".")[0] in ("train", "train_mp")))}
    assert not offenders, offenders
    entry = {"utils.cli.entry": "utils/cli/entry.py", "utils.cli.hydra_app": "utils/cli/hydra_app.py",
             "utils.cli.local_launch": "utils/cli/local_launch.py"}
    edges = {m: {n for n in entry if n != m and n in _project_imports(ROOT / f)} for m, f in entry.items()}
    assert edges == {"utils.cli.entry": {"utils.cli.hydra_app", "utils.cli.local_launch"},
                     "utils.cli.hydra_app": {"utils.cli.local_launch"}, "utils.cli.local_launch": set()}, edges
