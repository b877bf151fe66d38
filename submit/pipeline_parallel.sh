#!/bin/bash
# Pipeline parallelism: 4 stages, one per node (pp is the farthest axis of parallel.order), dp inside a node:
#   sbatch -N 4 submit/pipeline_parallel.sh data.root=...   (model.depth a multiple of 4; parallel.pp_schedule=...)
#SBATCH --job-name=dlscale-pp
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
run_training parallel=pp4 "$@"
