#!/bin/bash
# Data parallelism, one rank per GPU: sbatch -N 4 submit/data_parallel.sh experiment=bs256_opt data.root=...
#SBATCH --job-name=dlscale-dp
#SBATCH --ntasks-per-node=4
#SBATCH --gpus-per-node=4
#SBATCH --cpus-per-task=32
#SBATCH --time=02:00:00
#SBATCH --output=%x-%j.out
# SIGUSR1 to every task 120 s before the time limit: each rank checkpoints and exits 75
#SBATCH --signal=USR1@120
#SBATCH --requeue
export MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
# A port per job: jobs sharing a node must not meet on one rendezvous port
export MASTER_PORT=${MASTER_PORT:-$((20000 + SLURM_JOB_ID % 20000))}
export OMP_NUM_THREADS=8
srun --kill-on-bad-exit=1 python train.py parallel=dp "$@"
rc=$?
# 75: stopped on a signal with a complete checkpoint (time limit or preemption): queue the job again,
# and the same command resumes from that checkpoint.
if [ "$rc" -eq 75 ]; then scontrol requeue "$SLURM_JOB_ID"; fi
exit "$rc"
