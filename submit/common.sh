# Sourced by the sbatch scripts in submit/ (never run on its own): what every job shares. A strategy
# script sets its #SBATCH header and its default overrides, then hands over:
#
#   source "${SLURM_SUBMIT_DIR:-.}/submit/common.sh" || exit 2
#   run_training parallel=tp4 "$@"
#
# run_training: one rank per GPU (the tasks Slurm gives on a CPU-only allocation); stops with exit 2 and
# a one-line error before any rank starts when nodes x tasks per node does not fit the layout; sets the
# rendezvous (MASTER_ADDR, MASTER_PORT) and the environment; runs `srun python train.py` so that one
# failed rank ends the job; requeues a job whose ranks stopped on a signal with a complete checkpoint
# (and says so, or that Slurm refused). Job logs go to submit/logs/ (the scripts' --output; appended to
# across requeues with --open-mode=append). On a CPU-only partition: sbatch --gpus-per-node=0 --cpus-per-task=N.
# run_tests: the test suite in one task (the multi-rank tests start their own ranks).
# Both run from the directory sbatch was called in: the repository root.

EXIT_BAD_INPUT=2  # utils/__init__.py: bad input, nothing started
EXIT_PREEMPTED=75  # utils/engine/preemption.py: stopped on a signal with a complete checkpoint; run again to continue

# The GPUs Slurm gives this node (0 on a CPU-only allocation: no --gpus-per-node, or --gpus-per-node=0).
gpus_on_node() {
    local gpus=${SLURM_GPUS_ON_NODE:-${SLURM_GPUS_PER_NODE:-0}}
    gpus=${gpus##*:}  # --gpus-per-node=a100:4 -> 4
    if [ "$gpus" -gt 0 ] 2>/dev/null; then echo "$gpus"; else echo 0; fi
}

# Ranks per node: one per GPU Slurm gives this node, else (CPU-only) the tasks per node it gives.
tasks_per_node() {
    local gpus
    gpus=$(gpus_on_node)
    if [ "$gpus" -gt 0 ]; then
        echo "$gpus"
    elif [ -n "${SLURM_NTASKS_PER_NODE:-}" ]; then
        echo "$SLURM_NTASKS_PER_NODE"
    else
        echo $(( ${SLURM_NTASKS:-1} / ${SLURM_JOB_NUM_NODES:-${SLURM_NNODES:-1}} ))
    fi
}

# "ranks dp tp=.. cp=.. pp=..": the ranks the layout of these overrides needs (dp given) or a multiple of
# which it needs (dp=0, derived from the world size): utils.cli.launch.ranks_needed, from the composed config.
# A bad override prints train.py's own one-line error and returns 2.
layout_of() {
    python -c '
import sys
from utils.cli.config import load_config
from utils import ConfigError, exit_bad_input
from utils.cli.launch import ranks_needed
try:
    p = load_config(sys.argv[1:])[0].parallel
except ConfigError as err:
    exit_bad_input(err)
print(ranks_needed(p), p.dp, f"tp={p.tp} cp={p.cp} pp={p.pp}")' "$@" | tail -n 1
    return "${PIPESTATUS[0]}"
}

# Returns 0 when `nodes` x `per_node` ranks fit the layout, else prints the one-line error and returns 2.
check_layout() {
    local nodes=$1 per_node=$2 layout needed dp sizes fix
    shift 2
    layout=$(layout_of "$@") || return $?
    read -r needed dp sizes <<<"$layout"
    local ranks=$(( nodes * per_node ))
    local have="$nodes node(s) x $per_node tasks = $ranks ranks"
    if [ "$dp" -gt 0 ]; then
        [ "$ranks" -eq "$needed" ] && return 0
        fix="sbatch -N $(( (needed + per_node - 1) / per_node )) ..."
        if [ $(( needed % per_node )) -ne 0 ]; then
            fix="sbatch -N 1 --ntasks-per-node=$needed"
            # a GPU job asks for one GPU per rank; a CPU-only job for tasks (and the CPUs each one gets)
            if [ "$(gpus_on_node)" -gt 0 ]; then
                fix="$fix --gpus-per-node=$needed"
            else
                fix="$fix --gpus-per-node=0 --cpus-per-task=${SLURM_CPUS_PER_TASK:-1}"
            fi
            fix="$fix ..."
        fi
        [ $(( ranks % (needed / dp) )) -eq 0 ] && fix="$fix or set parallel.dp=$(( ranks / (needed / dp) ))"
        echo "error: $have but $sizes dp=$dp needs $needed (parallel.dp): $fix" >&2
    else
        [ $(( ranks % needed )) -eq 0 ] && return 0
        local gcd=$needed rest=$per_node tmp
        while [ "$rest" -gt 0 ]; do tmp=$(( gcd % rest )); gcd=$rest; rest=$tmp; done
        echo "error: $have but $sizes needs a multiple of $needed (parallel): sbatch -N $(( needed / gcd )) ..." \
             "or change the parallel sizes" >&2
    fi
    return "$EXIT_BAD_INPUT"
}

# The network interface for gloo, the same NCCL uses: NCCL_SOCKET_IFNAME when it names interfaces (an exact
# name, `=name`, or a prefix such as `ib`: the node's first interface that starts with it), else the interface
# of the route to the rendezvous host (MASTER_ADDR). Torch's gloo side group (asynchronous checkpoints, the CPU
# path) otherwise binds to whatever the host name resolves to, which on many clusters is the management
# Ethernet, not the fabric NCCL picked (or an address other nodes cannot reach). Prints nothing when unknown.
gloo_ifname() {
    local want=${NCCL_SOCKET_IFNAME:-} name
    want=${want#=}
    want=${want%%,*}  # gloo takes one interface: the first NCCL lists
    if [ -n "$want" ] && [ "${want#^}" = "$want" ]; then  # `^name` excludes interfaces: nothing to follow
        if [ -e "/sys/class/net/$want" ]; then echo "$want"; return 0; fi
        for name in /sys/class/net/"$want"*; do
            [ -e "$name" ] && { basename "$name"; return 0; }
        done
    fi
    [ -n "${MASTER_ADDR:-}" ] && ip -o route get "$(getent hosts "$MASTER_ADDR" | awk '{print $1; exit}')" 2>/dev/null \
        | awk '{for (i = 1; i < NF; i++) if ($i == "dev") {print $(i + 1); exit}}'
    return 0
}

# A rendezvous port per job, below the kernel's ephemeral range: the ports the kernel hands out for outgoing
# connections and for gloo's and NCCL's own listeners (bound to port 0) come from that range, so a store port
# inside it can be taken by another job on the node (EADDRINUSE: CI, job 952826, port 32826).
rendezvous_port() {
    local low=32768 high=60999 range=${PORT_RANGE_FILE:-/proc/sys/net/ipv4/ip_local_port_range}  # (tests set it)
    [ -r "$range" ] && read -r low high < "$range"
    if (( low > 16000 )); then
        echo $(( 15000 + SLURM_JOB_ID % (low - 15000) ))
    elif (( high < 65535 )); then  # an ephemeral range from low ports up: above it
        echo $(( high + 1 + SLURM_JOB_ID % (65535 - high) ))
    else
        echo $(( 15000 + SLURM_JOB_ID % 20000 ))  # the kernel may hand out any port: no safe choice
    fi
}

# The environment every rank inherits through srun.
export_environment() {
    # the rendezvous: the first node of the job, a port per job (jobs sharing a node never meet on one port)
    MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
    export MASTER_ADDR
    MASTER_PORT=${MASTER_PORT:-$(rendezvous_port)}
    export MASTER_PORT
    # gloo across nodes on NCCL's interface (a setting of the user's own is kept)
    GLOO_SOCKET_IFNAME=${GLOO_SOCKET_IFNAME:-$(gloo_ifname)}
    [ -n "$GLOO_SOCKET_IFNAME" ] && export GLOO_SOCKET_IFNAME
    export HDF5_USE_FILE_LOCKING=FALSE  # ERA5's HDF5 files on Lustre/GPFS: flock is absent or slow there
    # the task's cores for the trainer's CPU threads (DataLoader workers run one thread each)
    export OMP_NUM_THREADS=${SLURM_CPUS_PER_TASK:-${OMP_NUM_THREADS:-1}}
    # No CUDA_VISIBLE_DEVICES here: a rank that sees all of its node's GPUs takes GPU SLURM_LOCALID, a rank
    # bound to one (--gpus-per-task=1, --gpu-bind=single:1) takes that one (utils/cli/launch.py pick_device).
}

# srun the command on `nodes` x `per_node` tasks; requeue the job when the ranks stopped with a checkpoint.
srun_and_requeue() {
    local nodes=$1 per_node=$2 rc
    shift 2
    # --kill-on-bad-exit: one failed rank ends the others. That includes a rank that stopped with 75 while
    # its partners, stopped at the same step, still exit: srun's SIGTERM must not kill them (143 would hide
    # the 75). The trainer leaves SIGTERM ignored once it has stopped with a checkpoint (utils/engine/preemption.py);
    # past KillWait srun's SIGKILL still ends a rank that does not exit.
    srun -u --kill-on-bad-exit=1 --nodes="$nodes" --ntasks-per-node="$per_node" --ntasks=$(( nodes * per_node )) \
        ${SLURM_CPUS_PER_TASK:+--cpus-per-task="$SLURM_CPUS_PER_TASK"} "$@"
    rc=$?
    [ "$rc" -eq "$EXIT_PREEMPTED" ] && requeue_job
    return "$rc"
}

# Ask Slurm to requeue this job (it continues from the checkpoint its ranks wrote) and say what Slurm
# answered: a job submitted with --no-requeue, or a cluster with JobRequeue=0, is refused.
requeue_job() {
    local answer
    if answer=$(scontrol requeue "$SLURM_JOB_ID" 2>&1); then
        echo "ranks stopped with a checkpoint (exit $EXIT_PREEMPTED): job $SLURM_JOB_ID requeued, it continues from" \
             "that checkpoint when Slurm starts it again"
    else
        echo "ranks stopped with a checkpoint (exit $EXIT_PREEMPTED): job $SLURM_JOB_ID not requeued" \
             "(scontrol requeue: ${answer:-no answer}): submit the same command again to continue" >&2
    fi
}

# Train with these overrides on every node of the job.
run_training() {
    local nodes=${SLURM_JOB_NUM_NODES:-${SLURM_NNODES:-1}} per_node
    per_node=$(tasks_per_node)
    check_layout "$nodes" "$per_node" "$@" || exit $?
    export_environment
    echo "job $SLURM_JOB_ID: $nodes node(s) x $per_node tasks, rendezvous $MASTER_ADDR:$MASTER_PORT," \
         "OMP_NUM_THREADS=$OMP_NUM_THREADS: python train.py $*"
    srun_and_requeue "$nodes" "$per_node" python train.py "$@"
    exit $?
}

# The test suite (default: the multi-rank tests) in one task on one node: those tests spawn their own
# gloo ranks, and several pytest processes on one node would only repeat them.
run_tests() {
    export HDF5_USE_FILE_LOCKING=FALSE
    export OMP_NUM_THREADS=${SLURM_CPUS_PER_TASK:-${OMP_NUM_THREADS:-1}}
    export NVIDIA_TF32_OVERRIDE=0  # fp32 comparisons on GPU: no TF32 behind the tests' back
    srun -u --kill-on-bad-exit=1 --nodes=1 --ntasks=1 \
        ${SLURM_CPUS_PER_TASK:+--cpus-per-task="$SLURM_CPUS_PER_TASK"} python -m pytest -q "$@"
    exit $?
}
