#!/usr/bin/env bash
# Launch training on this node with torchrun.
#   ./run_train.sh                                   # Llama 3 debug model, all local GPUs (or 1 CPU process)
#   ./run_train.sh --config llama8b.toml --training.steps 20
#   NGPU=8 ./run_train.sh --config llama_debug_3d.toml   # 8 processes (CPU: gloo)
# Env: NGPU / NPROC  processes (default: local GPU count, or 1 without GPUs)
#      LOG_RANK      comma-separated ranks whose output is shown (default 0)
#      CONFIG_FILE   config used when no --config is given (default llama_debug.toml)
#      TORCHRUN      launcher command (default: python -m trainer.launch, a torchrun that forwards
#                    SIGUSR1/SIGTERM to the trainer so preemption saves a checkpoint)
set -euo pipefail
cd "$(dirname "$0")"

if [ -z "${NGPU:-}" ] && [ -z "${NPROC:-}" ]; then
  NGPU=$(python -c 'import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 1)' 2>/dev/null || echo 1)
fi
NPROC=${NPROC:-${NGPU}}
LOG_RANK=${LOG_RANK:-0}
CONFIG_FILE=${CONFIG_FILE:-llama_debug.toml}

args=("$@")
have_config=0
for a in "${args[@]}"; do
  case "$a" in --config|--config=*|--job.config_file|--job.config_file=*) have_config=1 ;; esac
done
[ "$have_config" = 1 ] || args=(--config "$CONFIG_FILE" "${args[@]}")

for a in "${args[@]}"; do
  case "$a" in -h|--help) exec python -m trainer.train "${args[@]}" ;; esac
done
# Check the config once, before any process starts: a bad key or layout fails in one line
# instead of behind torchrun's failure report.
TITAN_CHECK_WORLD_SIZE="$NPROC" python -m trainer.launch --check-config "${args[@]}" > /dev/null || exit $?

# CPU runs: one thread per process unless told otherwise, so ranks do not oversubscribe cores.
if ! python -c 'import torch,sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(( $(nproc) / NPROC > 0 ? $(nproc) / NPROC : 1 ))}
fi
export TORCHINDUCTOR_COMPILE_THREADS=${TORCHINDUCTOR_COMPILE_THREADS:-1}

LAUNCHER=${TORCHRUN:-python -m trainer.launch}
exec $LAUNCHER --standalone --nnodes 1 --nproc-per-node "$NPROC" --local-ranks-filter "$LOG_RANK" \
  --tee 3 -m trainer.train "${args[@]}"
