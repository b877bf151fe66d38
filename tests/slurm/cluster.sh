#!/usr/bin/env bash
# A throw-away Slurm cluster on this machine for the real-Slurm tier (tests/slurm/test_real_slurm.py):
# Debian's slurmctld, slurmd and munge, started by hand (no systemd needed), no cgroups, no accounting.
#
#   tests/slurm/cluster.sh check             exit 0 when this machine can run it; else one line why, exit 3
#   tests/slurm/cluster.sh up DIR [NODES]    install the packages when missing, start munge (unless one runs),
#                                            slurmctld and NODES (1 or 2) slurmd on this host, wait until the
#                                            nodes are idle; config, state, logs and pids under DIR
#   tests/slurm/cluster.sh down DIR          stop the daemons `up` started, by the pids it wrote in DIR
#
# Clients (sbatch, squeue, scontrol, srun) read the cluster's config from SLURM_CONF=DIR/slurm.conf; nothing
# is written under /etc/slurm. Two nodes on one host are two slurmd (-N NAME) on their own ports whose names
# both resolve to this host (the scripts' MASTER_ADDR is a node name). Every node declares more CPUs than the
# machine has (SlurmdParameters=config_overrides), so several small jobs run at once.
set -uo pipefail

PACKAGES=(slurmctld slurmd slurm-client munge)

why_not() {  # prints why this machine cannot run the cluster, or nothing
    [ "$(id -u)" -eq 0 ] || { echo "not root (the daemons and the package install need root)"; return; }
    if ! command -v slurmctld >/dev/null || ! command -v slurmd >/dev/null || ! command -v munged >/dev/null; then
        command -v apt-get >/dev/null || { echo "no slurm packages and no apt-get to install them"; return; }
        DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${PACKAGES[@]}" >/dev/null 2>&1 \
            || { apt-get update -q >/dev/null 2>&1
                 DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${PACKAGES[@]}" \
                     >/dev/null 2>&1; } \
            || { echo "the packages ${PACKAGES[*]} could not be installed (apt-get failed: no network or mirror?)"; return; }
    fi
    getent hosts "$(hostname -s)" >/dev/null || echo "the host name $(hostname -s) does not resolve"
}

node_names() {  # this host's name, then (two nodes) a second name that resolves to this machine too
    local host
    host=$(hostname -s)
    echo "$host"
    [ "${1:-1}" -eq 2 ] && echo "localhost"
}

write_config() {  # DIR NODES
    local dir=$1 nodes=$2 host names=() port=6818 name
    host=$(hostname -s)
    mapfile -t names < <(node_names "$nodes")
    cat > "$dir/slurm.conf" <<EOF
ClusterName=dlscaletest
# job ids unlike an earlier cluster's (slurmctld -c starts again from here): job logs are appended to by id
FirstJobId=$(( $(date +%s) % 100000 * 10 + 1 ))
SlurmctldHost=$host
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CryptoType=crypto/munge
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SwitchType=switch/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
SlurmdParameters=config_overrides
ReturnToService=2
StateSaveLocation=$dir/state/ctld
SlurmdSpoolDir=$dir/state/d-%n
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd-%n.pid
SlurmctldLogFile=$dir/log/slurmctld.log
SlurmdLogFile=$dir/log/slurmd-%n.log
SlurmctldPort=6817
SlurmdPort=6818
KillWait=10
MinJobAge=600
InactiveLimit=0
Waittime=0
# a requeued job may start again after this many seconds (Slurm's default, 120, would dominate the tier)
AuthInfo=cred_expire=10
EOF
    for name in "${names[@]}"; do
        echo "NodeName=$name NodeHostname=$host NodeAddr=127.0.0.1 Port=$port CPUs=8 Boards=1 SocketsPerBoard=1" \
             "CoresPerSocket=8 ThreadsPerCore=1 RealMemory=8000 State=UNKNOWN" >> "$dir/slurm.conf"
        port=$((port + 1))
    done
    echo "PartitionName=cpu Nodes=$(IFS=,; echo "${names[*]}") Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO" \
        >> "$dir/slurm.conf"
}

up() {  # DIR NODES
    local dir=$1 nodes=${2:-1} reason name
    reason=$(why_not)
    [ -z "$reason" ] || { echo "$reason" >&2; return 3; }
    mkdir -p "$dir/state/ctld" "$dir/log"
    write_config "$dir" "$nodes"
    export SLURM_CONF=$dir/slurm.conf
    if [ ! -S /run/munge/munge.socket.2 ] || ! munge -n >/dev/null 2>&1; then
        mkdir -p /run/munge && chown munge:munge /run/munge && chmod 755 /run/munge
        if [ ! -s /etc/munge/munge.key ]; then
            /usr/sbin/mungekey --create >/dev/null 2>&1 \
                || dd if=/dev/urandom bs=1 count=1024 of=/etc/munge/munge.key status=none
            chown munge:munge /etc/munge/munge.key && chmod 400 /etc/munge/munge.key
        fi
        runuser -u munge -- /usr/sbin/munged --pid-file=/run/munge/munged.pid || return 1
        cp /run/munge/munged.pid "$dir/munged.pid"  # ours to stop; a munged that was running is left alone
    fi
    /usr/sbin/slurmctld -c -f "$SLURM_CONF" || return 1  # -c: a clean state, no jobs of an earlier cluster
    for name in $(node_names "$nodes"); do
        mkdir -p "$dir/state/d-$name"
        /usr/sbin/slurmd -f "$SLURM_CONF" -N "$name" || return 1
    done
    for _ in $(seq 120); do
        [ "$(sinfo -h -o %T 2>/dev/null | grep -c -E '^idle')" -ge 1 ] \
            && [ "$(sinfo -h -N -o %T 2>/dev/null | grep -c -E '^idle')" -eq "$nodes" ] && return 0
        sleep 0.5
    done
    echo "the nodes did not become idle within 60 s (see $dir/log)" >&2
    return 1
}

down() {  # DIR: SIGTERM to each daemon up started (pid files in DIR), SIGKILL to one still there 10 s later
    local dir=$1 pidfile pids=() pid
    for pidfile in "$dir"/slurmd-*.pid "$dir/slurmctld.pid" "$dir/munged.pid"; do
        [ -s "$pidfile" ] && pids+=("$(cat "$pidfile")")
    done
    for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null; done
    for _ in $(seq 100); do
        local alive=0
        for pid in "${pids[@]}"; do kill -0 "$pid" 2>/dev/null && alive=1; done
        [ "$alive" -eq 0 ] && break
        sleep 0.1
    done
    for pid in "${pids[@]}"; do kill -9 "$pid" 2>/dev/null; done
    rm -f "$dir"/slurmd-*.pid "$dir/slurmctld.pid" "$dir/munged.pid"
    return 0
}

case "${1:-}" in
    check) reason=$(why_not); [ -z "$reason" ] || { echo "$reason"; exit 3; } ;;
    up) up "${2:?DIR}" "${3:-1}" ;;
    down) down "${2:?DIR}" ;;
    *) echo "usage: $0 check | up DIR [1|2] | down DIR" >&2; exit 2 ;;
esac
