#!/usr/bin/env bash
# Train across the nodes of a hostfile (DeepSpeed's format, see launch/hostfile.example).
#
# With ssh between nodes (default): run once, on the first host; pdsh starts the other nodes.
#   HOSTFILE=launch/hostfile launch/multi_node.sh --recipe recipes/llama-3.1-8b/pretrain_multinode.yaml
# Without ssh (NO_SSH=1): run on every node, with NODE_RANK=0..N-1 (launch/slurm.sbatch does this).
#   NO_SSH=1 NODE_RANK=1 MASTER_ADDR=10.0.0.1 HOSTFILE=launch/hostfile launch/multi_node.sh ...
#
# Knobs (besides those in launch/common.sh):
#   HOSTFILE     hostfile                               default: launch/hostfile
#   MASTER_ADDR  address of the first node, as others reach it   default: the hostfile's first host
#   MASTER_PORT  rendezvous port                        default: 29500
#   SSH_PORT     sshd port on the nodes                 default: 22
#   NO_SSH       1: start only this node (no pdsh)      default: 0
#   NODE_RANK    this node's index with NO_SSH=1        default: SLURM_NODEID, else 0
#   MAX_RESTARTS restarts after a failure, each resuming from the newest checkpoint   default: 3
#                (with NO_SSH=1 every node retries by itself; launch/slurm.sbatch retries the whole step)
#   CHECK        1: run the cluster check first (python -m dstrain.cluster)   default: 1
#   FORWARD_ENV  regex of variables to pass to every rank through DeepSpeed's .deepspeed_env
#                default: NCCL_*, HF_*, TRANSFORMERS_*, DSTRAIN_*, WANDB_*, TORCH_*, CUDA_*, FI_*,
#                OMP_NUM_THREADS, MALLOC_*, TOKENIZERS_*, PATH, LD_LIBRARY_PATH
#                (with NO_SSH=1 every rank inherits this shell's environment instead)
set -euo pipefail
# shellcheck source=launch/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
HOSTFILE=${HOSTFILE:-launch/hostfile}
MASTER_ADDR=${MASTER_ADDR:-$(awk '{sub(/#.*/, "")} NF {print $1; exit}' "$HOSTFILE" 2>/dev/null || true)}
MASTER_PORT=${MASTER_PORT:-29500}
SSH_PORT=${SSH_PORT:-22}
NO_SSH=${NO_SSH:-0}
NODE_RANK=${NODE_RANK:-${SLURM_NODEID:-0}}
CHECK=${CHECK:-1}
FORWARD_ENV=${FORWARD_ENV:-'^(NCCL_|HF_|TRANSFORMERS_|DSTRAIN_|WANDB_|TORCH_|CUDA_|FI_|MALLOC_|TOKENIZERS_|OMP_NUM_THREADS=|PATH=|LD_LIBRARY_PATH=)'}

if [[ "$CHECK" == 1 && ( "$NO_SSH" != 1 || "$NODE_RANK" == 0 ) ]]; then
  check_args=(--hostfile "$HOSTFILE" --ssh_port "$SSH_PORT")
  if [[ "$NO_SSH" == 1 ]]; then check_args+=(--no_ssh); fi
  "$PYTHON" -m dstrain.cluster "${check_args[@]}" "${TRAIN_ARGS[@]}" "$@"
fi

launcher_args=(--hostfile "$HOSTFILE" --master_addr "$MASTER_ADDR" --master_port "$MASTER_PORT")
if [[ "$NO_SSH" == 1 ]]; then
  launcher_args+=(--no_ssh --node_rank "$NODE_RANK")
else
  # DeepSpeed exports each line of the file named by DS_ENV_FILE on every node before starting ranks.
  # The user's own .deepspeed_env (home, then this directory) comes first, then the forwarded variables.
  DS_ENV_FILE=$(mktemp "${TMPDIR:-/tmp}/deepspeed_env.XXXXXX")
  export DS_ENV_FILE
  trap 'rm -f "$DS_ENV_FILE"' EXIT
  cat ~/.deepspeed_env ./.deepspeed_env 2>/dev/null >> "$DS_ENV_FILE" || true
  while IFS= read -r name; do
    printf '%s=%q\n' "$name" "${!name}" >> "$DS_ENV_FILE"
  done < <(env | grep -E "$FORWARD_ENV" | cut -d= -f1 | sort -u)
  launcher_args+=(--launcher pdsh --ssh_port "$SSH_PORT")
fi

run_with_retries "$PYTHON" -m deepspeed.launcher.runner "${launcher_args[@]}" train.py "${TRAIN_ARGS[@]}" "$@"
