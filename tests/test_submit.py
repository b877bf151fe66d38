"""The sbatch scripts in submit/, run on this machine through stand-in `srun` and `scontrol`.

The stand-ins, written into a bin directory put first on PATH: `srun` starts the step's tasks here as local
processes (CPU, gloo) with SLURM_PROCID/SLURM_LOCALID/SLURM_NODEID/SLURM_NTASKS set per task (and, for
`srun -u`, a pseudo-terminal as each task's stdout, as the real srun gives), kills the others
when one exits non-zero (--kill-on-bad-exit: SIGTERM, SIGKILL 10 s later) and returns Slurm's status (a
task killed by a signal outranks exit codes: 128 + signal, else the highest exit code); `scontrol show
hostnames` answers `localhost` per node and `scontrol requeue` is recorded. hybrid.sh trains for real on
4 ranks; every other training script runs up to its srun call, which the stand-in records without starting
tasks (each trains on a real cluster in the real-Slurm tier); the checks before srun, the requeue on exit 75
and the per-job rendezvous port are checked on the scripts' own output.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.helpers import ROOT
from utils.checkpoints.run_dir import read_layout

pytestmark = pytest.mark.slow  # trains through the entry points or launches processes

SUBMIT = ROOT / "submit"
EPHEMERAL_LOW = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])  # Linux only
TINY = ["trainer.max_steps=2", "trainer.val_every=0", "trainer.ckpt_every=0", "trainer.num_workers=0",
        "trainer.global_batch_size=8", "data.limit_nsamples_val=8", "trainer.log_images=false"]

# script, overrides that scale its layout down, nodes, tasks per node (-> world size)
STRATEGIES = [
    ("single_gpu.sh", [], 1, 1),
    ("data_parallel.sh", [], 2, 1),  # two "nodes" of one task: dp=2 across nodes
    ("tensor_parallel.sh", ["parallel=tp2"], 1, 2),
    ("context_parallel.sh", ["parallel=cp2"], 1, 2),
    ("pipeline_parallel.sh", ["parallel=pp2"], 1, 2),  # vit_tiny: depth 4, 2 blocks per stage
    ("fsdp.sh", ["parallel.dp=2"], 1, 2),
    ("hybrid.sh", ["parallel.cp=1"], 2, 2),  # tp2 inside a node x pp2 across the two nodes
]
# The scripts trained through the stand-in here: hybrid.sh's two "nodes" of two tasks exercise every per-task
# variable srun sets. The others go through the stand-in up to srun, which records their call and starts nothing:
# every script trains on a real Slurm cluster, on one node and on two, in the real-Slurm tier
# (tests/slurm/test_real_slurm.py, which CI runs after this suite); training each here too cost about 4 minutes.
TRAINED_HERE = [s for s in STRATEGIES if s[0] == "hybrid.sh"]
CALLED_HERE = [s for s in STRATEGIES if s not in TRAINED_HERE]

SRUN = '''
"""Stand-in srun: the step's tasks as local processes; records each call in $STANDIN_DIR/srun.jsonl."""
import json, os, pty, signal, subprocess, sys, threading, time, tty


def copy_out(fd):
    while True:
        try:
            data = os.read(fd, 65536)
        except OSError:  # EIO: the task and its children closed the terminal
            data = b""
        if not data:
            break
        sys.stdout.buffer.write(data)
        sys.stdout.flush()
    os.close(fd)


args, opts = sys.argv[1:], {}
while args and args[0].startswith("-"):
    arg = args.pop(0)
    key, _, value = arg.partition("=")
    if not _ and key in ("-n", "-N", "-c"):
        value = args.pop(0)
    opts[key] = value
nodes = int(opts.get("--nodes", opts.get("-N", os.environ.get("SLURM_NNODES", "1"))))
ntasks = int(opts.get("--ntasks", opts.get("-n", os.environ.get("SLURM_NTASKS", "1"))))
per_node = int(opts.get("--ntasks-per-node", -(-ntasks // nodes)))
watched = ("MASTER_ADDR", "MASTER_PORT", "OMP_NUM_THREADS", "HDF5_USE_FILE_LOCKING", "NVIDIA_TF32_OVERRIDE")
with open(os.path.join(os.environ["STANDIN_DIR"], "srun.jsonl"), "a") as f:
    f.write(json.dumps({"opts": opts, "command": args, "ntasks": ntasks, "per_node": per_node,
                        "env": {k: os.environ.get(k) for k in watched}}) + "\\n")
if os.environ.get("STANDIN_RECORD_ONLY"):
    sys.exit(0)
procs, copies = [], []
for rank in range(ntasks):
    env = dict(os.environ, SLURM_PROCID=str(rank), SLURM_LOCALID=str(rank % per_node), SLURM_STEP_ID="0",
               SLURM_NODEID=str(rank // per_node), SLURM_NTASKS=str(ntasks), SLURM_STEP_NUM_TASKS=str(ntasks))
    if "-u" not in opts:
        procs.append(subprocess.Popen(args, env=env))
        continue
    # srun -u (--unbuffered) gives each task a pseudo-terminal for its stdout, copied into the job log
    main_fd, task_fd = pty.openpty()
    tty.setraw(task_fd)  # what the task writes reaches the log unchanged
    procs.append(subprocess.Popen(args, env=env, stdout=task_fd))
    os.close(task_fd)
    copies.append(threading.Thread(target=copy_out, args=(main_fd,)))
    copies[-1].start()
with open(os.path.join(os.environ["STANDIN_DIR"], "srun.pids"), "w") as f:
    f.write(" ".join(str(p.pid) for p in procs))
kill_at = None
while any(p.poll() is None for p in procs):
    bad = [p for p in procs if p.returncode not in (None, 0)]
    if bad and kill_at is None and opts.get("--kill-on-bad-exit", "0") != "0":
        kill_at = time.monotonic() + 10  # Slurm's KillWait
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
    if kill_at is not None and time.monotonic() > kill_at:
        for p in procs:
            if p.poll() is None:
                p.kill()
    time.sleep(0.005)  # react within milliseconds, as a real srun can
for copy in copies:
    copy.join(timeout=10)
codes = [p.returncode for p in procs]
signals = [-c for c in codes if c < 0]
sys.exit(128 + max(signals) if signals else max(codes))
'''

SCONTROL = '''
"""Stand-in scontrol: `show hostnames LIST` (localhost per node), `requeue ID` (recorded; refused as Slurm
refuses a job submitted with --no-requeue when STANDIN_NO_REQUEUE is set)."""
import os, sys

if sys.argv[1:3] == ["show", "hostnames"]:
    print("\\n".join(["localhost"] * int(os.environ.get("SLURM_NNODES", "1"))))
elif sys.argv[1] == "requeue" and os.environ.get("STANDIN_NO_REQUEUE"):
    sys.exit(f"Requested operation is presently disabled for job {sys.argv[2]}")
elif sys.argv[1] == "requeue":
    with open(os.path.join(os.environ["STANDIN_DIR"], "requeue"), "a") as f:
        f.write(" ".join(sys.argv[2:]) + "\\n")
else:
    sys.exit("stand-in scontrol: unexpected " + " ".join(sys.argv[1:]))
'''


def make_standin(directory: Path) -> Path:
    """`directory`, with the stand-ins (and `python`, this interpreter) in bin/; they record calls there."""
    bin_dir = directory / "bin"
    bin_dir.mkdir()
    for name, body in (("srun", SRUN), ("scontrol", SCONTROL)):
        (bin_dir / name).write_text(f"#!{sys.executable}\n{textwrap.dedent(body)}")
        (bin_dir / name).chmod(0o755)
    (bin_dir / "python").symlink_to(sys.executable)
    return directory


@pytest.fixture
def standin(tmp_path) -> Path:
    return make_standin(tmp_path)


def rendezvous_port(job_id: int) -> int:
    """submit/common.sh's port for a job on this machine: 15000 + id modulo the ports below the ephemeral range."""
    return 15000 + job_id % (EPHEMERAL_LOW - 15000)


def free_job_id() -> int:
    """A job id whose rendezvous port is free now."""
    while True:
        job_id = random.randrange(1000, 10**6)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", rendezvous_port(job_id)))
                return job_id
            except OSError:
                continue


def sbatch(standin: Path, script: str, *overrides: str, nodes: int = 1, per_node: int = 1,
           job_id: int | None = None, env: dict | None = None, timeout: float = 120):
    """Run a submit/ script as sbatch's batch step would on a CPU-only allocation of `nodes` x `per_node`
    tasks; (the completed process, the srun calls recorded)."""
    full_env = {k: v for k, v in os.environ.items()
                if not k.startswith(("SLURM_", "MASTER_", "TORCHELASTIC_")) and k not in
                ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "OMP_NUM_THREADS")}
    full_env.update(PATH=f"{standin / 'bin'}{os.pathsep}{os.environ['PATH']}", STANDIN_DIR=str(standin),
                    PYTHONUNBUFFERED="1", SLURM_SUBMIT_DIR=str(ROOT), SLURM_JOB_ID=str(job_id or free_job_id()),
                    SLURM_JOB_NODELIST="localhost" if nodes == 1 else f"node[0-{nodes - 1}]",
                    SLURM_NNODES=str(nodes), SLURM_JOB_NUM_NODES=str(nodes), SLURM_NTASKS=str(nodes * per_node),
                    SLURM_NTASKS_PER_NODE=str(per_node), SLURM_CPUS_PER_TASK="1")
    full_env.update(env or {})
    proc = subprocess.Popen(["bash", str(SUBMIT / script), *overrides], cwd=ROOT, env=full_env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # its session: no task outlives the test
    log = standin / "srun.jsonl"
    calls = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err), calls


def test_every_script_parses_and_shares_one_helper():
    scripts = sorted(SUBMIT.glob("*.sh"))
    assert {p.name for p in scripts} >= {s for s, *_ in STRATEGIES} | {"common.sh", "test_job.sh"}
    for path in scripts:
        proc = subprocess.run(["bash", "-n", str(path)], check=False, capture_output=True, text=True)
        assert proc.returncode == 0, f"{path.name}: {proc.stderr}"
        if path.name != "common.sh":
            text = path.read_text()
            assert 'source "${SLURM_SUBMIT_DIR:-.}/submit/common.sh"' in text and "srun" not in text, path.name
    for script, *_ in STRATEGIES:
        text = (SUBMIT / script).read_text()
        assert "#SBATCH --signal=USR1@120" in text and "#SBATCH --requeue" in text, script
    for path in scripts:  # a requeued job's log keeps its first attempt; logs in a folder git ignores
        if path.name != "common.sh":
            text = path.read_text()
            assert "#SBATCH --output=submit/logs/%x-%j.out" in text and "#SBATCH --open-mode=append" in text, path.name
    ignored = subprocess.run(["git", "check-ignore", "-q", "submit/logs/dlscale-dp-12.out"], cwd=ROOT, check=False)
    kept = subprocess.run(["git", "ls-files", "--error-unmatch", "submit/logs/.gitignore"], cwd=ROOT, check=False,
                          capture_output=True)
    assert ignored.returncode == 0 and kept.returncode == 0  # Slurm does not create --output's folder
    test_job = (SUBMIT / "test_job.sh").read_text()
    listed = [w for w in test_job.split() if w.startswith("tests/test_")]
    assert listed and all((ROOT / p).is_file() for p in listed), [p for p in listed if not (ROOT / p).is_file()]


@pytest.fixture(scope="module")
def strategy_jobs(request, tmp_path_factory, era5_root):
    """The selected strategies' jobs, run two at a time in the background as soon as the first is asked
    for (each is mostly process startup on one or two cores): script -> (stand-in dir, job id, future)."""
    selected = {item.callspec.params["script"] for item in request.session.items
                if getattr(item, "originalname", "") == "test_each_strategy_trains_through_srun"}
    jobs = {}
    with ThreadPoolExecutor(max_workers=2) as pool:
        for script, layout, nodes, per_node in TRAINED_HERE:
            if script in selected:
                base = make_standin(tmp_path_factory.mktemp(script.removesuffix(".sh")))
                job_id = free_job_id()
                jobs[script] = base, job_id, pool.submit(
                    sbatch, base, script, f"data.root={era5_root}", *TINY, f"run.dir={base / 'run'}", *layout,
                    nodes=nodes, per_node=per_node, job_id=job_id, timeout=300)
        yield jobs


@pytest.mark.parametrize("script,layout,nodes,per_node", TRAINED_HERE, ids=[s[0] for s in TRAINED_HERE])
def test_each_strategy_trains_through_srun(strategy_jobs, script, layout, nodes, per_node):
    base, job_id, future = strategy_jobs[script]
    proc, calls = future.result()
    run_dir, world = base / "run", nodes * per_node
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert_one_srun_call(calls, layout, nodes, per_node, job_id)
    step = run_dir / "checkpoints" / "step_0000002"
    assert (step / "COMPLETE").is_file() and (run_dir / "checkpoints" / "latest").read_text() == step.name
    assert read_layout(run_dir)["world_size"] == world  # the run's own facts, not its log
    assert not (base / "requeue").exists()
    # rank 0's stdout is a terminal under srun -u: no live status line in the job log, a line per log_every
    # (text mode reads a "\r" as a line end: the live line would be a bare "step 1/2 ..." instead of the log line)
    assert proc.stdout.count("step 1/2") == 1 and " INFO step 1/2 " in proc.stdout, proc.stdout[-2000:]
    assert "broadcast_buffers" not in proc.stderr  # torch's DDP deprecation warning, once per rank before


def assert_one_srun_call(calls: list[dict], layout: list[str], nodes: int, per_node: int, job_id: int) -> None:
    """The job ran one srun step of nodes x per_node tasks, each `python train.py ... <layout>`, killed on a bad
    exit, unbuffered, with the job's rendezvous and environment."""
    [call] = calls
    assert call["ntasks"] == nodes * per_node and call["per_node"] == per_node
    assert call["opts"]["--kill-on-bad-exit"] == "1" and "-u" in call["opts"]
    command = call["command"]  # the ranks run `python train.py <script defaults> <overrides>`
    assert command[command.index("train.py") - 1] == "python" and command[len(command) - len(layout):] == layout
    assert call["env"] == {"MASTER_ADDR": "localhost", "MASTER_PORT": str(rendezvous_port(job_id)),
                           "OMP_NUM_THREADS": "1", "HDF5_USE_FILE_LOCKING": "FALSE", "NVIDIA_TF32_OVERRIDE": None}


@pytest.mark.parametrize("script,layout,nodes,per_node", CALLED_HERE, ids=[s[0] for s in CALLED_HERE])
def test_each_other_strategy_calls_srun_for_its_layout(standin, tmp_path, script, layout, nodes, per_node):
    """Up to srun, as trained above: the checks before it pass and its one call asks for the layout's tasks."""
    job_id = free_job_id()
    proc, calls = sbatch(standin, script, f"data.root={tmp_path}", *TINY, f"run.dir={tmp_path / 'run'}", *layout,
                         nodes=nodes, per_node=per_node, job_id=job_id, env={"STANDIN_RECORD_ONLY": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert_one_srun_call(calls, layout, nodes, per_node, job_id)


def bash_with_helper(standin: Path, snippet: str, **env: str) -> str:
    """The output of `snippet` run after sourcing submit/common.sh, in a job environment of `env` only."""
    base = {"PATH": f"{standin / 'bin'}{os.pathsep}{os.environ['PATH']}", "STANDIN_DIR": str(standin)}
    proc = subprocess.run(["bash", "-c", f"source submit/common.sh && {snippet}"], cwd=ROOT, env=base | env,
                          check=False, capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip()


def test_one_rank_per_gpu_else_the_tasks_slurm_gives(standin):
    cases = [({"SLURM_GPUS_ON_NODE": "4", "SLURM_NTASKS_PER_NODE": "1"}, "4"),  # the GPUs win
             ({"SLURM_GPUS_PER_NODE": "a100:2"}, "2"),
             ({"SLURM_NTASKS_PER_NODE": "3"}, "3"),  # CPU-only
             ({"SLURM_GPUS_PER_NODE": "0", "SLURM_NTASKS_PER_NODE": "2"}, "2"),  # --gpus-per-node=0
             ({"SLURM_NTASKS": "8", "SLURM_JOB_NUM_NODES": "2"}, "4"),
             ({}, "1")]
    for env, expected in cases:
        assert bash_with_helper(standin, "tasks_per_node", **env) == expected, env


def test_each_job_gets_its_own_rendezvous_port(standin):
    show = "export_environment && echo $MASTER_ADDR $MASTER_PORT $OMP_NUM_THREADS $HDF5_USE_FILE_LOCKING"
    job = {"SLURM_JOB_NODELIST": "nid[001-002]", "SLURM_NNODES": "2", "SLURM_CPUS_PER_TASK": "8"}
    assert bash_with_helper(standin, show, SLURM_JOB_ID="1234", **job) == "localhost 16234 8 FALSE"
    assert bash_with_helper(standin, show, SLURM_JOB_ID="1234", MASTER_PORT="29999", **job).split()[1] == "29999"
    ports = {int(bash_with_helper(standin, "rendezvous_port", SLURM_JOB_ID=str(job_id)))
             for job_id in range(952820, 952830)}  # 952826 took 32826 in CI: gloo of a job beside it had it
    assert len(ports) == 10 and max(ports) < EPHEMERAL_LOW, ports


def test_the_rendezvous_port_stays_out_of_the_kernels_ephemeral_range(standin, tmp_path):
    """The kernel hands its ephemeral ports to outgoing connections and to listeners on port 0 (gloo, NCCL): a
    store port among them can be taken. Below the range when it starts high, above it when it starts low."""
    range_file = tmp_path / "ip_local_port_range"
    for low, high, job_id, expected in [(32768, 60999, 952826, 15000 + 952826 % 17768),
                                        (20000, 60999, 7, 15007),
                                        (1024, 40000, 952826, 40001 + 952826 % 25535)]:
        range_file.write_text(f"{low}\t{high}\n")
        port = int(bash_with_helper(standin, "rendezvous_port", SLURM_JOB_ID=str(job_id),
                                    PORT_RANGE_FILE=str(range_file)))
        assert port == expected and not low <= port <= high, (low, high, port)
    range_file.write_text("1024\t65535\n")  # every port ephemeral: no safe choice, still one per job
    assert bash_with_helper(standin, "rendezvous_port", SLURM_JOB_ID="7", PORT_RANGE_FILE=str(range_file)) == "15007"


def test_a_layout_the_allocation_cannot_hold_stops_before_any_rank_starts(standin, tmp_path):
    # 1 node whose 4 GPUs give 4 ranks (the GPUs outrank --ntasks-per-node=1); tp4 x dp2 needs 8
    proc, calls = sbatch(standin, "tensor_parallel.sh", "parallel.dp=2", f"run.dir={tmp_path / 'run'}",
                         per_node=1, env={"SLURM_GPUS_ON_NODE": "4"})
    assert proc.returncode == 2 and not calls and not (tmp_path / "run").exists()
    assert proc.stderr == ("error: 1 node(s) x 4 tasks = 4 ranks but tp=4 cp=1 pp=1 dp=2 needs 8 (parallel.dp): "
                           "sbatch -N 2 ... or set parallel.dp=1\n")


def test_ranks_stopped_with_a_checkpoint_requeue_the_job(standin, tmp_path, era5_root):
    """SIGUSR1 to every rank (what --signal=USR1@120 does): both checkpoint and exit 75, and the script
    requeues the job. The first rank out makes srun SIGTERM the other while it still exits: unless a
    rank ignores SIGTERM once it has stopped (utils/engine/preemption.py), it can die of it (143, outranking the
    75) and nothing is requeued (5 of 7 tries here before they ignored it)."""
    run_dir = tmp_path / "run"
    job_id = free_job_id()
    args = [f"data.root={era5_root}", f"run.dir={run_dir}", *TINY, "trainer.max_steps=200", "trainer.log_every=1"]
    result = {}
    job = threading.Thread(target=lambda: result.update(
        run=sbatch(standin, "data_parallel.sh", *args, per_node=2, job_id=job_id)))
    job.start()
    log, deadline = run_dir / "train.log", time.monotonic() + 300  # a loaded machine starts the ranks slowly
    while not (log.exists() and "step 2/" in log.read_text()):
        assert job.is_alive() and time.monotonic() < deadline, result
        time.sleep(0.1)
    for pid in (standin / "srun.pids").read_text().split():
        os.kill(int(pid), signal.SIGUSR1)
    job.join(timeout=150)
    proc, _ = result["run"]
    assert proc.returncode == 75, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert (standin / "requeue").read_text() == f"{job_id}\n"
    latest = run_dir / "checkpoints" / (run_dir / "checkpoints" / "latest").read_text()
    assert (latest / "COMPLETE").is_file() and f"job {job_id} requeued" in proc.stdout


def test_a_refused_requeue_is_said_as_it_is(standin):
    """A job submitted with --no-requeue (or JobRequeue=0): Slurm refuses, and the script says so and how to
    continue, instead of announcing a requeue (before: 'requeueing job N' next to Slurm's refusal)."""
    job = {"SLURM_JOB_ID": "46"}
    assert "job 46 requeued" in bash_with_helper(standin, "requeue_job 2>&1", **job)
    refused = bash_with_helper(standin, "requeue_job 2>&1", STANDIN_NO_REQUEUE="1", **job)
    assert refused == ("ranks stopped with a checkpoint (exit 75): job 46 not requeued (scontrol requeue: "
                       "Requested operation is presently disabled for job 46): "
                       "submit the same command again to continue")
    assert (standin / "requeue").read_text() == "46\n"  # the first, accepted one only


@pytest.mark.parametrize("gpus,hint", [("0", "--ntasks-per-node=2 --gpus-per-node=0 --cpus-per-task=1 ..."),
                                       ("4", "--ntasks-per-node=2 --gpus-per-node=2 ...")], ids=["cpu", "gpu"])
def test_the_fix_for_a_layout_that_does_not_fit_asks_for_what_the_job_uses(standin, tmp_path, gpus, hint):
    """On a CPU-only allocation (--gpus-per-node=0 makes Slurm export SLURM_GPUS_PER_NODE=0) the hint asks for
    tasks and CPUs; asking a CPU-only cluster for GPUs is refused by sbatch (before: --gpus-per-node=2)."""
    proc, calls = sbatch(standin, "tensor_parallel.sh", "parallel=tp2", "parallel.dp=1", f"run.dir={tmp_path / 'r'}",
                         per_node=4, env={"SLURM_GPUS_PER_NODE": gpus, "SLURM_GPUS_ON_NODE": gpus})
    assert proc.returncode == 2 and not calls
    assert proc.stderr.endswith(f"needs 2 (parallel.dp): sbatch -N 1 {hint} or set parallel.dp=2\n"), proc.stderr


def test_test_job_runs_pytest_in_one_task(standin):
    quick = "tests/test_submit.py::test_every_script_parses_and_shares_one_helper"
    # one process (-n0): two xdist workers would each import torch and collect the suite to run one test
    proc, calls = sbatch(standin, "test_job.sh", "-n0", "-p", "no:cacheprovider", quick, per_node=1)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    [call] = calls
    assert call["ntasks"] == 1 and call["command"][:4] == ["python", "-m", "pytest", "-q"]
    assert call["env"]["NVIDIA_TF32_OVERRIDE"] == "0" and "[100%]" in proc.stdout
