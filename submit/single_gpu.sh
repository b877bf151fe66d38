#!/bin/bash
# One GPU: sbatch submit/single_gpu.sh experiment=short data.root=/path/to/era5 [key=value ...]
#SBATCH --job-name=dlscale-1gpu
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=1
#SBATCH --cpus-per-task=32
#SBATCH --time=01:00:00
#SBATCH --output=%x-%j.out
export OMP_NUM_THREADS=8
srun --kill-on-bad-exit=1 python train.py "$@"
