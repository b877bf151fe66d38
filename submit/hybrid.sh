#!/bin/bash
# 4D: tensor x context parallelism inside a node (tp2 x cp2 on its 4 GPUs), data parallelism across nodes,
# pipeline parallelism farthest (parallel.order=tp-cp-dp-pp): dp = ranks / 8.
#   sbatch -N 4 submit/hybrid.sh data.root=...   -> tp2 x cp2 x dp2 x pp2: stage 0 on nodes 0-1, stage 1 on 2-3
#SBATCH --job-name=dlscale-hybrid
#SBATCH --ntasks-per-node=4
#SBATCH --gpus-per-node=4
#SBATCH --cpus-per-task=32
#SBATCH --time=02:00:00
#SBATCH --output=submit/logs/%x-%j.out
#SBATCH --open-mode=append
# SIGUSR1 to every rank 120 s before the time limit: each checkpoints and exits 75, and the job is requeued
#SBATCH --signal=USR1@120
#SBATCH --requeue
source "${SLURM_SUBMIT_DIR:-.}/submit/common.sh" || exit 2
run_training parallel=tp2cp2 parallel.pp=2 "$@"
