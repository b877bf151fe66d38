#!/bin/bash
# Tensor (+ data) parallelism: sbatch -N 4 submit/model_parallel.sh experiment=mp parallel=tp4 data.root=...
# dp = world / (tp * cp * pp); keep tp inside a node (parallel.order=tp-cp-dp-pp, the default).
#SBATCH --job-name=dlscale-mp
#SBATCH --ntasks-per-node=4
#SBATCH --gpus-per-node=4
#SBATCH --cpus-per-task=32
#SBATCH --time=02:00:00
#SBATCH --output=%x-%j.out
export MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
export MASTER_PORT=${MASTER_PORT:-29500}
export OMP_NUM_THREADS=8
srun --kill-on-bad-exit=1 python train.py "$@"
