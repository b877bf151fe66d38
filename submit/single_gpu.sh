#!/bin/bash
# One GPU, one rank: sbatch submit/single_gpu.sh experiment=short data.root=/path/to/era5 [key=value ...]
#SBATCH --nodes=1
#SBATCH --job-name=dlscale-1gpu
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=1
#SBATCH --cpus-per-task=32
#SBATCH --time=01:00:00
#SBATCH --output=submit/logs/%x-%j.out
#SBATCH --open-mode=append
# SIGUSR1 to every rank 120 s before the time limit: each checkpoints and exits 75, and the job is requeued
#SBATCH --signal=USR1@120
#SBATCH --requeue
source "${SLURM_SUBMIT_DIR:-.}/submit/common.sh" || exit 2
run_training parallel=single "$@"
