#!/bin/bash
# Data parallelism, one rank per GPU: sbatch -N 4 submit/data_parallel.sh experiment=bs256_opt data.root=...
#SBATCH --job-name=dlscale-dp
#SBATCH --ntasks-per-node=4
#SBATCH --gpus-per-node=4
#SBATCH --cpus-per-task=32
#SBATCH --time=02:00:00
#SBATCH --output=%x-%j.out
export MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
export MASTER_PORT=${MASTER_PORT:-29500}
export OMP_NUM_THREADS=8
srun --kill-on-bad-exit=1 python train.py parallel=dp "$@"
