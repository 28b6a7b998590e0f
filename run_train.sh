#!/usr/bin/env bash
# Launch training on this node with torchrun.
#   ./run_train.sh                                   # Llama 3 debug model, all local GPUs (or 1 CPU process)
#   ./run_train.sh --config llama8b.toml --training.steps 20
#   NGPU=8 ./run_train.sh --config llama_debug_3d.toml   # 8 processes (CPU: gloo)
#   ./run_train.sh --config llama405b.toml --dry-run     # no torchrun: layout checked against the world
#                                                        # the config implies (or NGPU), model summary
# Env: NGPU / NPROC  processes (default: local GPU count, or 1 without GPUs)
#      LOG_RANK      comma-separated ranks whose output is shown (default 0)
#      CONFIG_FILE   config used when no --config is given (default llama_debug.toml)
#      TORCHRUN      launcher command (default: python -m trainer.launch, a torchrun that forwards
#                    SIGUSR1/SIGTERM to the trainer so preemption saves a checkpoint, and reports a
#                    worker's bad-input error as its one line)
# Sets, unless already set: PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (less fragmentation on
# GPUs), and on CPU-only runs OMP_NUM_THREADS (cores / processes) and TORCHINDUCTOR_COMPILE_THREADS=1
# (compile workers would steal the cores the ranks use).
set -euo pipefail
cd "$(dirname "$0")"

fail() { echo "run_train.sh: $*" >&2; exit 2; }
is_count() { [[ $1 =~ ^[0-9]+$ ]] && (( 10#$1 >= 1 )); }

if [ -n "${NGPU:-}" ] && ! is_count "$NGPU"; then
  fail "NGPU: expected a positive whole number of processes, got '$NGPU'"
fi
if [ -n "${NPROC:-}" ] && ! is_count "$NPROC"; then
  fail "NPROC: expected a positive whole number of processes, got '$NPROC'"
fi
USER_NPROC=${NPROC:-${NGPU:-}}
USER_NPROC=${USER_NPROC:+$((10#$USER_NPROC))}
LOG_RANK=${LOG_RANK:-0}
CONFIG_FILE=${CONFIG_FILE:-llama_debug.toml}

args=("$@")
have_config=0
dry_run=0
for a in "${args[@]}"; do
  case "$a" in
    --config|--config=*|--job.config_file|--job.config_file=*) have_config=1 ;;
    --dry-run|--dry_run|--job.dry_run|--job.dry_run=true|--dry-run=true) dry_run=1 ;;
  esac
done
[ "$have_config" = 1 ] || args=(--config "$CONFIG_FILE" "${args[@]}")

for a in "${args[@]}"; do
  case "$a" in -h|--help) exec python -m trainer.train "${args[@]}" ;; esac
done
# A dry run starts no workers: one process checks the layout against the world size the config
# implies (or NGPU/NPROC) and prints it with the model summary.
if [ "$dry_run" = 1 ]; then
  TITAN_CHECK_WORLD_SIZE="$USER_NPROC" exec python -m trainer.launch --dry-run "${args[@]}"
fi

# Check the config once, before any process starts (one Python start-up): a bad key, layout,
# tokenizer, device or output folder fails in one line, exit 2. It also answers NPROC (default:
# local GPU count, or 1) and HAS_CUDA.
plan=$(TITAN_CHECK_WORLD_SIZE="$USER_NPROC" python -m trainer.launch --check-config --shell "${args[@]}") || exit $?
NPROC=$(sed -n 's/^NPROC=\([0-9]*\)$/\1/p' <<<"$plan")
HAS_CUDA=$(sed -n 's/^HAS_CUDA=\([01]\)$/\1/p' <<<"$plan")
[ -n "$NPROC" ] && [ -n "$HAS_CUDA" ] || fail "internal error: the config check answered '$plan'"

IFS=',' read -r -a shown <<<"$LOG_RANK"
[ "${#shown[@]}" -gt 0 ] || fail "LOG_RANK: expected comma-separated ranks below $NPROC, got '$LOG_RANK'"
for r in "${shown[@]}"; do
  [[ $r =~ ^[0-9]+$ ]] && (( 10#$r < NPROC )) || \
    fail "LOG_RANK: expected comma-separated ranks below $NPROC (NPROC), got '$LOG_RANK'"
done

# (torch reads PYTORCH_ALLOC_CONF first, then PYTORCH_CUDA_ALLOC_CONF: a user's value of either wins)
if [ -z "${PYTORCH_CUDA_ALLOC_CONF+set}" ] && [ -z "${PYTORCH_ALLOC_CONF+set}" ]; then
  export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
fi
if [ "$HAS_CUDA" = 0 ]; then
  # CPU runs: one thread per process unless told otherwise, so ranks do not oversubscribe cores.
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(( $(nproc) / NPROC > 0 ? $(nproc) / NPROC : 1 ))}
  export TORCHINDUCTOR_COMPILE_THREADS=${TORCHINDUCTOR_COMPILE_THREADS:-1}
fi

# fault_tolerance.enable without a lighthouse address: start torchft's lighthouse here (one group on this
# machine). It exits with the launcher (--parent-pid: exec below keeps this shell's pid).
FT_LIGHTHOUSE=$(sed -n 's/^FT_LIGHTHOUSE=\([0-9]*\)$/\1/p' <<<"$plan")
if [ "${FT_LIGHTHOUSE:-0}" -gt 0 ]; then
  lh_file=$(mktemp -u "${TMPDIR:-/tmp}/titan-lighthouse.XXXXXX")
  python -m trainer.fault_tolerance.lighthouse --port 0 --min-replicas "$FT_LIGHTHOUSE" --address-file "$lh_file" \
    --parent-pid $$ &
  for _ in $(seq 1 300); do [ -s "$lh_file" ] && break; sleep 0.1; done
  [ -s "$lh_file" ] || fail "fault_tolerance: the lighthouse did not start within 30 s"
  args+=(--fault_tolerance.lighthouse "$(cat "$lh_file")")
  rm -f "$lh_file"
fi

LAUNCHER=${TORCHRUN:-python -m trainer.launch}
exec $LAUNCHER --standalone --nnodes 1 --nproc-per-node "$NPROC" --local-ranks-filter "$LOG_RANK" \
  --tee 3 -m trainer.train "${args[@]}"
