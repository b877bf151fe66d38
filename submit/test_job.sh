#!/bin/bash
# The multi-rank tests on one GPU node: sbatch submit/test_job.sh [pytest arguments, e.g. tests/test_layouts.py -x]
# One task: each test starts its own gloo ranks (and the entry-point tests their own train_mp.py ranks),
# so more tasks would only repeat them. The tests marked `gpu` (pytest -m gpu) run here; without CUDA they skip.
#SBATCH --job-name=dlscale-tests
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=4
#SBATCH --cpus-per-task=32
#SBATCH --time=01:00:00
#SBATCH --output=submit/logs/%x-%j.out
#SBATCH --open-mode=append
source "${SLURM_SUBMIT_DIR:-.}/submit/common.sh" || exit 2
MULTI_RANK_TESTS=(
    tests/test_mappings.py tests/test_layers.py tests/test_grid.py tests/test_parallelize.py
    tests/test_data_parallel.py tests/test_context_parallel.py tests/test_cp_ring.py tests/test_pipeline.py
    tests/test_checkpoint.py tests/test_nonfinite.py tests/test_precision.py tests/test_step_results.py
    tests/test_comm_compile.py tests/test_compile.py tests/test_launch.py tests/test_layouts.py
)
[ $# -gt 0 ] || set -- "${MULTI_RANK_TESTS[@]}"
run_tests "$@"
