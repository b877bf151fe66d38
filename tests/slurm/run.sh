#!/usr/bin/env bash
# The real-Slurm tier (tests/slurm/test_real_slurm.py) on a cluster started on this machine and stopped after
# it; skipped with one line where the machine does not allow it (not root, no slurm packages and none
# installable). .ci/run calls it after the README's test command. Extra arguments go to pytest (e.g. -k two_nodes).
set -uo pipefail
cd "$(dirname "$0")/../.."
if ! reason=$(bash tests/slurm/cluster.sh check); then
    echo "real-Slurm tier skipped: $reason"
    exit 0
fi
state=$(mktemp -d /tmp/dlscale-slurm.XXXXXX)
trap 'bash tests/slurm/cluster.sh down "$state"' EXIT
start=$(date +%s)
DLSCALE_SLURM_TIER=1 DLSCALE_SLURM_STATE=$state timeout 1200 \
    python -m pytest -q -n0 -s -p no:cacheprovider tests/slurm/test_real_slurm.py "$@"
rc=$?
echo "real-Slurm tier: $(( $(date +%s) - start )) s in all (cluster start and stop included), pytest status $rc"
exit "$rc"
