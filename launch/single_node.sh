#!/usr/bin/env bash
# Train on every device of this machine.
#   launch/single_node.sh --train.max_steps=100
#   RECIPE=recipes/llama-3.2-1b/sft.yaml DS_CONFIG=zero3.json launch/single_node.sh
# Knobs (besides those in launch/common.sh):
#   NPROC_PER_NODE  ranks to start      default: the GPUs, or 2 on a CPU-only machine
#   MASTER_PORT     rendezvous port     default: 29500
#   MAX_RESTARTS    restarts after a failure, each resuming   default: 3  (see launch/common.sh)
set -euo pipefail
# shellcheck source=launch/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
MASTER_PORT=${MASTER_PORT:-29500}

run_with_retries "$PYTHON" -m deepspeed.launcher.runner --num_gpus "$NPROC_PER_NODE" --master_port "$MASTER_PORT" \
  train.py "${TRAIN_ARGS[@]}" "$@"
