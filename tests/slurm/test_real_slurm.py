"""The real-Slurm tier: submit/*.sh and the submitit sweeps on a real Slurm cluster started on this machine.

Not part of `pytest tests` (skipped with one line): tests/slurm/run.sh starts it where the machine allows it
(root, Debian's slurm packages installed or installable), as .ci/run does after the README's test command.
The cluster (tests/slurm/cluster.sh) declares 8 CPUs per node and no GPUs, so every job asks for the CPU-only
partition's resources: `sbatch --gpus-per-node=0 --cpus-per-task=1`. Jobs are watched by polling
`scontrol show job` (no accounting, so no sacct; `sbatch --wait` backs off by tens of seconds).

Cases: every strategy script on one node and on two nodes (tiny ViT, 4 steps, the same losses in every
layout); SIGUSR1 (what `--signal=USR1@120` sends) in the loop: checkpoint, 75, requeue, and the resumed job's
losses equal an uninterrupted run's; SIGUSR1 while the ranks still start up: 75, requeue, resume; a submitit
sweep point at its time limit: checkpoint at SIGUSR2, requeued by submitit, resumed from that checkpoint.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import ROOT, read_scalars

pytestmark = pytest.mark.skipif(os.environ.get("DLSCALE_SLURM_TIER") != "1",
                                reason="the real-Slurm tier runs with tests/slurm/run.sh (root, Debian's slurm)")

CLUSTER = Path(__file__).with_name("cluster.sh")
LOGS = ROOT / "submit" / "logs"
CPU_JOB = ["--gpus-per-node=0", "--cpus-per-task=1"]
TINY = ["trainer.max_steps=4", "trainer.global_batch_size=4", "trainer.val_every=1000", "trainer.num_workers=0",
        "data.limit_nsamples_val=8", "trainer.log_every=1"]
# script, overrides that scale its layout down, tasks per node: on one node, and on two nodes
ONE_NODE = [("single_gpu.sh", [], 1), ("data_parallel.sh", [], 2), ("tensor_parallel.sh", ["parallel=tp2"], 2),
            ("context_parallel.sh", ["parallel=cp2"], 2), ("pipeline_parallel.sh", ["parallel=pp2"], 2),
            ("fsdp.sh", ["parallel.dp=2"], 2), ("hybrid.sh", ["parallel.cp=1"], 4)]
TWO_NODES = [("data_parallel.sh", [], 1), ("tensor_parallel.sh", ["parallel=tp2"], 1),
             ("context_parallel.sh", ["parallel=cp2"], 1), ("pipeline_parallel.sh", ["parallel=pp2"], 1),
             ("fsdp.sh", ["parallel.dp=2"], 1), ("hybrid.sh", ["parallel.cp=1"], 2)]
TIMES: dict[str, str] = {}  # case -> what it took, printed at the end (the tier's figures)


class Cluster:
    """The cluster of one or two nodes, started on first use and restarted when the other size is asked for."""

    def __init__(self, state: Path):
        self.state, self.nodes, self.jobs = state, 0, []
        self.env = dict(os.environ, SLURM_CONF=str(state / "slurm.conf"), PYTHONUNBUFFERED="1")
        for var in [v for v in self.env if v.startswith(("SLURM_", "SUBMITIT_")) and v != "SLURM_CONF"]:
            del self.env[var]

    def use(self, nodes: int) -> Cluster:
        if nodes != self.nodes:
            self.down()
            t0 = time.monotonic()
            proc = subprocess.run(["bash", str(CLUSTER), "up", str(self.state), str(nodes)], capture_output=True,
                                  text=True, timeout=600)
            assert proc.returncode == 0, proc.stdout + proc.stderr
            self.nodes = nodes
            TIMES[f"cluster up, {nodes} node(s)"] = f"{time.monotonic() - t0:.1f} s"
        return self

    def down(self) -> None:
        if self.nodes:
            subprocess.run(["bash", str(CLUSTER), "down", str(self.state)], timeout=120, check=False)
            self.nodes = 0

    def run(self, *command: str, check: bool = True, **kwargs) -> subprocess.CompletedProcess:
        proc = subprocess.run(list(command), cwd=ROOT, env=self.env, capture_output=True, text=True, timeout=120,
                              **kwargs)
        assert not check or proc.returncode == 0, f"{command}: {proc.stdout}{proc.stderr}"
        return proc

    def sbatch(self, script: str, *overrides: str, nodes: int = 1, per_node: int = 1, extra=()) -> str:
        """Submit submit/<script> from the repository root, as a user does; the job id."""
        proc = self.run("sbatch", "--parsable", f"--nodes={nodes}", f"--ntasks-per-node={per_node}", *CPU_JOB,
                        *extra, f"submit/{script}", *overrides)
        job_id = proc.stdout.strip().split(";")[0]
        self.jobs.append(job_id)
        return job_id

    def job(self, job_id: str) -> dict[str, str]:
        """`scontrol show job` as a dict (JobState, ExitCode, Restarts, ...)."""
        proc = self.run("scontrol", "-o", "show", "job", job_id, check=False)
        if proc.returncode != 0:  # not known yet: submitit writes its files before sbatch returns
            return {"JobState": "NOT_YET"}
        return dict(re.findall(r"(\w+)=(\S*)", proc.stdout))

    def wait(self, job_id: str, states=("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL"),
             timeout: float = 300, when=None) -> dict[str, str]:
        """Poll the job once a second until it is in one of `states` (or `when(info)` holds); its last view."""
        deadline = time.monotonic() + timeout
        while True:
            info = self.job(job_id)
            if (when(info) if when else info.get("JobState") in states):
                return info
            assert time.monotonic() < deadline, f"job {job_id} still {info.get('JobState')} after {timeout} s: {info}"
            time.sleep(1)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    state = Path(os.environ.get("DLSCALE_SLURM_STATE", tmp_path_factory.mktemp("slurm")))
    made = Cluster(state)
    t0 = time.monotonic()
    yield made
    made.down()
    for job_id in made.jobs:  # the jobs' logs (git ignores them; the next cluster's ids differ anyway)
        for log in LOGS.glob(f"*-{job_id}.out"):
            log.unlink()
    print(f"\nreal-Slurm tier ({time.monotonic() - t0:.0f} s with the cluster):")
    for case, took in TIMES.items():
        print(f"  {case}: {took}")


def job_log(name: str, job_id: str) -> str:
    path = LOGS / f"{name}-{job_id}.out"
    return path.read_bytes().decode(errors="replace") if path.exists() else ""  # bytes: "\r" kept as it is


def losses(run_dir: Path) -> list[tuple[int, float]]:
    return read_scalars(run_dir)["train/loss"]


def script_name(script: str) -> str:
    """The job name (#SBATCH --job-name), which names the job's log."""
    return re.search(r"--job-name=(\S+)", (ROOT / "submit" / script).read_text()).group(1)


def run_strategies(cluster: Cluster, cases, nodes: int, era5_root: Path, runs: Path) -> None:
    """Submit every case at once (Slurm runs what fits), then check each: COMPLETED 0:0, the layout's world,
    a complete step-4 checkpoint, the same losses in every layout, and a log without the live status line."""
    t0 = time.monotonic()
    jobs = {}
    for script, layout, per_node in cases:
        run_dir = runs / f"{nodes}n-{script.removesuffix('.sh')}"
        jobs[script] = cluster.sbatch(script, f"data.root={era5_root}", f"run.dir={run_dir}", *TINY, *layout,
                                      nodes=nodes, per_node=per_node), run_dir
    curves = {}
    for script, (job_id, run_dir) in jobs.items():
        info = cluster.wait(job_id, timeout=600)
        log = job_log(script_name(script), job_id)
        assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), f"{script}: {info}\n{log[-3000:]}"
        assert (run_dir / "checkpoints" / "latest").read_text() == "step_0000004"
        assert "\r" not in log and log.count("step 4/4") == 1, log[-2000:]  # log_every lines, no live line
        assert "FutureWarning" not in log, log[-2000:]
        curves[script] = [round(v, 4) for _, v in losses(run_dir)]
    assert len({tuple(c) for c in curves.values()}) == 1, curves  # one model, whatever the layout
    TIMES[f"{len(cases)} strategy jobs on {nodes} node(s)"] = f"{time.monotonic() - t0:.0f} s, all COMPLETED 0:0"


def test_every_strategy_on_one_node(cluster, era5_root, tmp_path):
    run_strategies(cluster.use(1), ONE_NODE, 1, era5_root, tmp_path)


def wait_for_line(path: Path, text: str, job_id: str, cluster: Cluster, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not (path.exists() and text in path.read_text(errors="replace")):
        info = cluster.job(job_id)
        assert info["JobState"] in ("NOT_YET", "PENDING", "RUNNING", "CONFIGURING", "COMPLETING", "REQUEUED") \
            and time.monotonic() < deadline, info
        time.sleep(0.2)


def test_usr1_in_the_loop_checkpoints_requeues_and_resumes_exactly(cluster, era5_root, tmp_path):
    """SIGUSR1 to the ranks (what --signal=USR1@120 sends) at step ~10 of 30: checkpoint, 75, the script
    requeues the job, the requeued job resumes, and its losses equal an uninterrupted run's, bitwise."""
    cluster.use(1)
    t0 = time.monotonic()
    args = [f"data.root={era5_root}", *TINY, "trainer.max_steps=30"]
    reference = cluster.sbatch("data_parallel.sh", *args, f"run.dir={tmp_path / 'reference'}", per_node=2)
    job_id = cluster.sbatch("data_parallel.sh", *args, f"run.dir={tmp_path / 'run'}", per_node=2)
    wait_for_line(tmp_path / "run" / "train.log", "step 10/", job_id, cluster)
    cluster.run("scancel", "--signal=USR1", job_id)
    info = cluster.wait(job_id, when=lambda i: i["JobState"] == "PENDING" and i.get("Restarts") == "1")
    info = cluster.wait(job_id, timeout=300)
    log = job_log("dlscale-dp", job_id)
    assert (info["JobState"], info["ExitCode"], info["Restarts"]) == ("COMPLETED", "0:0", "1"), f"{info}\n{log[-3000:]}"
    assert f"job {job_id} requeued" in log and "stop signal received" in log, log[-3000:]  # both attempts kept
    train_log = (tmp_path / "run" / "train.log").read_text()
    stopped = int(re.search(r"saved checkpoint \S+step_(\d+)", train_log).group(1))
    assert 10 <= stopped < 30 and "resumed from" in train_log
    assert cluster.wait(reference)["JobState"] == "COMPLETED"
    assert losses(tmp_path / "run") == losses(tmp_path / "reference")  # every step once, bitwise equal
    TIMES["USR1 in the loop"] = (f"stopped at step {stopped}, 75, requeued, resumed: COMPLETED 0:0 Restarts=1, "
                                 f"losses equal the uninterrupted run's; {time.monotonic() - t0:.0f} s")


def test_a_signal_during_start_up_ends_in_75_and_the_requeued_job_resumes(cluster, era5_root, tmp_path):
    """SIGUSR1 while the ranks still import torch (Slurm's --signal can come up to 60 s early, e.g. into a
    requeued job's start): 75 with a step-0 checkpoint, requeued, and the job then trains to the end (before:
    the ranks died of the signal, FAILED 138, not requeued)."""
    cluster.use(1)
    t0 = time.monotonic()
    job_id = cluster.sbatch("data_parallel.sh", f"data.root={era5_root}", *TINY, f"run.dir={tmp_path / 'run'}",
                            per_node=2)
    log_path = LOGS / f"dlscale-dp-{job_id}.out"
    wait_for_line(log_path, "rendezvous", job_id, cluster)  # the line before srun: the ranks are starting
    time.sleep(0.5)
    cluster.run("scancel", "--signal=USR1", job_id)
    cluster.wait(job_id, when=lambda i: i["JobState"] == "PENDING" and i.get("Restarts") == "1")
    info = cluster.wait(job_id, timeout=300)
    log = job_log("dlscale-dp", job_id)
    assert (info["JobState"], info["ExitCode"], info["Restarts"]) == ("COMPLETED", "0:0", "1"), f"{info}\n{log[-3000:]}"
    train_log = (tmp_path / "run" / "train.log").read_text()
    first = train_log.split("resumed from")[0]
    assert "saved checkpoint" in first and "step_0000000" in first and "step 1/" not in first, train_log[-3000:]
    assert (tmp_path / "run" / "checkpoints" / "latest").read_text() == "step_0000004"
    TIMES["USR1 during start-up"] = (f"75 with the step-0 checkpoint, requeued, resumed: COMPLETED 0:0 Restarts=1; "
                                     f"{time.monotonic() - t0:.0f} s")


def submit_sweep(cluster: Cluster, tmp_path: Path, era5_root: Path, *launcher: str) -> tuple[subprocess.Popen, str]:
    """`python train.py -m parallel=dp ...` on submitit_slurm, one point of two tasks that trains for long;
    (the sweep's process, the point's job id) once submitted."""
    run_dir, sweep = tmp_path / "point", tmp_path / "sweep"
    driver = subprocess.Popen(
        [sys.executable, str(ROOT / "train.py"), "-m", "parallel=dp", f"data.root={era5_root}", *TINY,
         "trainer.max_steps=1000000", "trainer.ckpt_every=0", "trainer.log_every=20", f"run.dir={run_dir}",
         f"hydra.sweep.dir={sweep}", "hydra/launcher=submitit_slurm", "hydra.launcher.tasks_per_node=2",
         "hydra.launcher.cpus_per_task=1", "hydra.launcher.partition=cpu", *launcher],
        cwd=tmp_path, env=cluster.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 120
    while not (found := list((sweep / ".submitit").rglob("*_submission.sh"))):
        assert driver.poll() is None and time.monotonic() < deadline, driver.stdout.read()
        time.sleep(0.5)
    return driver, re.match(r"\d+", found[0].name).group(0)  # one point: a plain job, not an array


def test_a_submitit_point_at_its_time_limit_checkpoints_is_requeued_and_resumes(cluster, era5_root, tmp_path):
    """A sweep point of two tasks with a 2-minute limit: submitit's SIGUSR2 (30 s ahead, or up to 60 s
    earlier) makes both ranks checkpoint and end with 75, submitit requeues the job (not COMPLETED), and the
    requeued job resumes from that checkpoint (before: no checkpoint, COMPLETED 0:0, the steps lost)."""
    cluster.use(1)
    t0 = time.monotonic()
    run_dir = tmp_path / "point"
    driver, job_id = submit_sweep(cluster, tmp_path, era5_root, "hydra.launcher.timeout_min=2",
                                  "hydra.launcher.signal_delay_s=30")
    try:
        info = cluster.wait(job_id, timeout=240, when=lambda i: i.get("Restarts") == "1")
        assert info["JobState"] in ("COMPLETING", "PENDING", "REQUEUED", "RUNNING", "CONFIGURING"), info
        train_log = (run_dir / "train.log").read_text()
        stopped = int(re.findall(r"saved checkpoint \S+step_(\d+)", train_log)[-1])
        assert "stop signal received" in train_log and stopped > 0, train_log[-3000:]
        # the requeued attempt: with time to train on (an operator's scontrol)
        cluster.run("scontrol", "update", f"JobId={job_id}", "TimeLimit=10")
        wait_for_line(run_dir / "train.log", "resumed from", job_id, cluster)
        deadline = time.monotonic() + 180  # a step logged after the resume (log_every=20: steps 1, 21, 41, ...)
        while not re.search(r"INFO step \d+/", (run_dir / "train.log").read_text().split("resumed from", 1)[1]):
            assert time.monotonic() < deadline and cluster.job(job_id)["JobState"] in ("PENDING", "RUNNING"), \
                (run_dir / "train.log").read_text()[-3000:]
            time.sleep(1)
        resumed = (run_dir / "train.log").read_text().split("resumed from", 1)[1]
        first = int(re.search(r"INFO step (\d+)/", resumed).group(1))
        assert stopped < first <= stopped + 20, resumed[:3000]  # on from the checkpoint, not from step 1
        assert f"step_{stopped:07d}" in resumed.split("\n")[0] + resumed.split("\n")[1], resumed[:2000]
    finally:
        cluster.run("scancel", job_id.split("_")[0], check=False)  # the point would train on for long
        driver.kill()  # a cancelled job writes no result, and without accounting the sweep would wait for one
        driver.wait()
    TIMES["submitit time limit"] = (f"SIGUSR2 before the 2-min limit: checkpoint at step {stopped}, requeued by "
                                    f"submitit (Restarts=1), resumed from it; {time.monotonic() - t0:.0f} s")


def test_a_submitit_point_not_requeued_is_a_failed_job(cluster, era5_root, tmp_path):
    """hydra.launcher.max_num_timeout=0: at the time-limit signal the point still checkpoints, submitit does not
    requeue it, and Slurm shows the job FAILED 75 (before: COMPLETED 0:0); the sweep says why and fails."""
    cluster.use(1)
    t0 = time.monotonic()
    driver, job_id = submit_sweep(cluster, tmp_path, era5_root, "hydra.launcher.timeout_min=10",
                                  "hydra.launcher.max_num_timeout=0")
    try:
        wait_for_line(tmp_path / "point" / "train.log", "step 21/", job_id, cluster)
        cluster.run("scancel", "--signal=USR2", job_id)  # what Slurm sends at signal_delay_s before the limit
        info = cluster.wait(job_id, timeout=180)
        out, _ = driver.communicate(timeout=180)
    finally:
        if driver.poll() is None:
            driver.kill()
    assert (info["JobState"], info["ExitCode"], info["Restarts"]) == ("FAILED", "75:0", "0"), info
    assert driver.returncode != 0 and "was not requeued (Job not requeued because: timed-out too many times" in out, \
        out[-3000:]
    assert "stop signal received" in (tmp_path / "point" / "train.log").read_text()
    TIMES["submitit, not requeued"] = (f"checkpoint, FAILED 75:0, the sweep fails saying why; "
                                       f"{time.monotonic() - t0:.0f} s")


def test_every_strategy_on_two_nodes(cluster, era5_root, tmp_path):
    run_strategies(cluster.use(2), TWO_NODES, 2, era5_root, tmp_path)
