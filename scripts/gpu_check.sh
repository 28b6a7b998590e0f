#!/usr/bin/env bash
# The prepared GPU check (scripts/gpu_check/): every section in its own process group under its
# own timeout (its budget, plus what earlier sections left), cheap ones first, under a global
# deadline (< 8 minutes on one GPU). Every section's rows, the log and the env report land in
# the results folder as each finishes, and the markdown table there is rewritten after every
# section: a run cut off still has a table.
#
#   scripts/gpu_check.sh                      # one GPU; results in out/gpu_check/ (gpu_check.md)
#   scripts/gpu_check.sh --out DIR            # elsewhere
#   scripts/gpu_check.sh --dry --out DIR      # CPU, tiny shapes, one section per code path (the test suite runs this)
#   scripts/gpu_check.sh --list               # the sections in order, each budget with its basis, the sum
#   scripts/gpu_check.sh --only env,mla_flash # some sections
# PYTHON=... picks the interpreter (default python3). Exit status: 0 when no row FAILED or MISMATCHed.
set -uo pipefail
cd "$(dirname "$0")/.."
case "${1:-}" in -h|--help) sed -n '2,13p' "$0"; exit 0 ;; esac
PYTHON="${PYTHON:-python3}"
export PYTORCH_CUDA_ALLOC_CONF="${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}"
export PYTHONPATH="$PWD:$PWD/scripts${PYTHONPATH:+:$PYTHONPATH}"
if [[ " $* " == *" --dry "* ]]; then
    export OMP_NUM_THREADS="${OMP_NUM_THREADS:-2}" TORCHINDUCTOR_COMPILE_THREADS=1
fi
exec "$PYTHON" -m gpu_check "$@"
