#!/usr/bin/env bash
# The prepared GPU check (scripts/gpu_check.py): every section in its own process under its own
# timeout, so a hang (e.g. an empty expert group in the CUDA grouped GEMM backward) becomes a row
# of the table instead of a stuck job. Under 8 minutes on one GPU; writes one markdown table.
#
#   scripts/gpu_check.sh                      # one GPU; table in gpu_check.md
#   scripts/gpu_check.sh --out /tmp/table.md  # elsewhere
#   scripts/gpu_check.sh --dry                # CPU, tiny shapes (the test suite runs this)
set -uo pipefail
cd "$(dirname "$0")/.."

DRY=""
OUT="gpu_check.md"
while [ $# -gt 0 ]; do
    case "$1" in
        --dry) DRY="--dry" ;;
        --out) OUT="${2:?--out needs a file}"; shift ;;
        -h|--help) sed -n '2,9p' "$0"; exit 0 ;;
        *) echo "gpu_check.sh: unknown argument $1 (use --dry, --out FILE)" >&2; exit 2 ;;
    esac
    shift
done

# section:timeout seconds[:budget seconds, when the section stops starting new configs].
# Sum of the timeouts: 460 s, under the 8 minutes with start-up to spare. unpadded_groups is a
# diagnostic (do empty groups still hang this torch build?), last, so a hang costs nothing else.
SECTIONS="empty_groups:30 mla_flash:25 chunked_ce:45 llama:265:245 deepseek:80:65 unpadded_groups:15"
# --dry on a (shared, 2-core) CPU: the same sections, tiny shapes, 4x the time.
SCALE=1
export PYTORCH_CUDA_ALLOC_CONF="${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if [ -n "$DRY" ]; then
    export OMP_NUM_THREADS="${OMP_NUM_THREADS:-2}" TORCHINDUCTOR_COMPILE_THREADS=1
    SCALE=4
fi

WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
problems=()
for entry in $SECTIONS; do
    IFS=: read -r name limit budget <<< "$entry"
    limit=$((limit * SCALE))
    budget=$(( ${budget:-0} * SCALE ))
    [ "$budget" -gt 0 ] || budget=$limit
    echo "== $name (timeout ${limit} s)" >&2
    timeout --kill-after=5 "$limit" python scripts/gpu_check.py "$name" --json "$WORK/$name.json" $DRY \
        --budget-s "$budget" >&2
    rc=$?
    if [ $rc -eq 124 ] || [ $rc -eq 137 ]; then
        problems+=("\"$name\": \"timed out after $limit s\"")
    elif [ $rc -ne 0 ]; then
        problems+=("\"$name\": \"exited with status $rc (see the log above)\"")
    fi
done
PROBLEMS="{$(IFS=,; echo "${problems[*]}")}"
# Exit status 1 when any row failed, timed out or mismatched.
python scripts/gpu_check.py report "$WORK" --out "$OUT" $DRY --problems "$PROBLEMS"
rc=$?
echo "table written to $OUT" >&2
exit $rc
