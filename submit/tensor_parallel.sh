#!/bin/bash
# Tensor (+ sequence) parallelism inside a node, data parallelism across nodes (dp = ranks / 4):
#   sbatch -N 4 submit/tensor_parallel.sh experiment=mp data.root=...   (parallel=tp2 for 2-way)
#SBATCH --job-name=dlscale-tp
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
run_training parallel=tp4 "$@"
