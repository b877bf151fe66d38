#!/bin/bash
# The doctor on the node a job will use, with the job's layout, before the long job (docs/doctor.md):
#   sbatch submit/doctor.sh model=vit_base parallel=tp4 precision=bf16 [--steps N ...]
# One task: the doctor starts one rank per GPU of the node itself, as train_mp.py does (or forked CPU ranks on
# gloo with --gpus-per-node=0). Several nodes (inter-node bandwidth): see docs/doctor.md. Exit status 0 when
# every check passed, else the sum of the failing classes (4 environment, 8 bandwidth, 16 mappings, 32 layers,
# 64 layout); the report lands in outputs/doctor/<layout>-<time>/ (report.md, report.json, and bandwidths.json
# for the planner), or --out DIR.
#SBATCH --job-name=dlscale-doctor
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=4
#SBATCH --cpus-per-task=32
#SBATCH --time=00:20:00
#SBATCH --output=submit/logs/%x-%j.out
#SBATCH --open-mode=append
source "${SLURM_SUBMIT_DIR:-.}/submit/common.sh" || exit 2
nodes=${SLURM_JOB_NUM_NODES:-${SLURM_NNODES:-1}}
if [ "$nodes" -ne 1 ]; then
    echo "error: submit/doctor.sh checks one node, the job has $nodes (--nodes): sbatch -N 1 submit/doctor.sh ...," \
         "or start one doctor rank per GPU on every node as docs/doctor.md shows" >&2
    exit "$EXIT_BAD_INPUT"
fi
export HDF5_USE_FILE_LOCKING=FALSE
export OMP_NUM_THREADS=${SLURM_CPUS_PER_TASK:-${OMP_NUM_THREADS:-1}}
echo "job $SLURM_JOB_ID: doctor on $(hostname), $(gpus_on_node) GPU(s): python -m utils.doctor $*"
python -m utils.doctor "$@"
exit $?
