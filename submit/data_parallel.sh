#!/bin/bash
# Data parallelism (DDP), one rank per GPU: sbatch -N 4 submit/data_parallel.sh experiment=bs256_opt data.root=...
#SBATCH --job-name=dlscale-dp
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
run_training parallel=dp "$@"
