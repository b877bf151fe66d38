#!/bin/bash
# One GPU: sbatch submit/single_gpu.sh experiment=short data.root=/path/to/era5 [key=value ...]
#SBATCH --job-name=dlscale-1gpu
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=1
#SBATCH --cpus-per-task=32
#SBATCH --time=01:00:00
#SBATCH --output=%x-%j.out
# SIGUSR1 to every task 120 s before the time limit: each rank checkpoints and exits 75
#SBATCH --signal=USR1@120
#SBATCH --requeue
export OMP_NUM_THREADS=8
srun --kill-on-bad-exit=1 python train.py "$@"
rc=$?
# 75: stopped on a signal with a complete checkpoint (time limit or preemption): queue the job again,
# and the same command resumes from that checkpoint.
if [ "$rc" -eq 75 ]; then scontrol requeue "$SLURM_JOB_ID"; fi
exit "$rc"
