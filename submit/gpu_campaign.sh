#!/bin/bash
# The GPU campaign on one node, whenever a GPU node is at hand (docs/gpu_campaign.md):
#   sbatch submit/gpu_campaign.sh [--seed-dir PATH] [--out DIR]
# One task; the campaign starts what it needs (the doctor's ranks, one per GPU). In at most 10 minutes: the
# environment, `pytest -m gpu`, the doctor, utils.bench for vit_base and gpt_small in bf16 with and without
# compile; the report lands in outputs/campaign/<UTC time>/ (campaign.md, campaign.json), or --out DIR.
#SBATCH --job-name=dlscale-gpu-campaign
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=4
#SBATCH --cpus-per-task=32
#SBATCH --time=00:15:00
#SBATCH --output=submit/logs/%x-%j.out
#SBATCH --open-mode=append
source "${SLURM_SUBMIT_DIR:-.}/submit/common.sh" || exit 2
export HDF5_USE_FILE_LOCKING=FALSE
export OMP_NUM_THREADS=${SLURM_CPUS_PER_TASK:-${OMP_NUM_THREADS:-1}}
echo "job ${SLURM_JOB_ID:-none}: GPU campaign on $(hostname), $(gpus_on_node) GPU(s): python -m utils.doctor --campaign $*"
python -m utils.doctor --campaign "$@"
exit $?
