# shellcheck shell=bash
# Sourced by every launch/ script. Knobs are environment variables with defaults:
#   RECIPE      recipe YAML (recipes/... or a path)           default: the tiny default recipe
#   DS_CONFIG   DeepSpeed JSON (ds_configs/... or a path)     default: the recipe's
#   OUTPUT_DIR  run directory                                 default: runs/<recipe name>
#   PYTHON      interpreter with deepspeed installed          default: the repo's .venv, else python3
# Arguments after the script name go to train.py unchanged (--train.max_steps=100, --ds.<key>=...).

REPO_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$REPO_ROOT" || exit 1

if [[ -z "${PYTHON:-}" ]]; then
  if [[ -x "$REPO_ROOT/.venv/bin/python" ]]; then PYTHON="$REPO_ROOT/.venv/bin/python"; else PYTHON=$(command -v python3); fi
fi
RECIPE=${RECIPE:-recipes/tiny/pretrain.yaml}
DS_CONFIG=${DS_CONFIG:-}
OUTPUT_DIR=${OUTPUT_DIR:-}

TRAIN_ARGS=(--recipe "$RECIPE")
if [[ -n "$DS_CONFIG" ]]; then TRAIN_ARGS+=(--ds_config "$DS_CONFIG"); fi
if [[ -n "$OUTPUT_DIR" ]]; then TRAIN_ARGS+=(--output_dir "$OUTPUT_DIR"); fi

# Devices on this node: the GPUs, or 2 CPU ranks on a machine without one (as `make train` does).
local_devices() {
  local n
  n=$(nvidia-smi -L 2>/dev/null | wc -l || true)
  if [[ "$n" -gt 0 ]]; then echo "$n"; else echo 2; fi
}
NPROC_PER_NODE=${NPROC_PER_NODE:-$(local_devices)}

# CPU ranks share the cores; glibc's mmap threshold keeps freed large tensors from inflating RSS.
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(( $(nproc) / NPROC_PER_NODE > 0 ? $(nproc) / NPROC_PER_NODE : 1 ))}
export TOKENIZERS_PARALLELISM=${TOKENIZERS_PARALLELISM:-false}
export MALLOC_MMAP_THRESHOLD_=${MALLOC_MMAP_THRESHOLD_:-131072}
