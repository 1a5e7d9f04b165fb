#!/usr/bin/env bash
# Elastic training on torch's elastic agent (torchrun): run the same command on every node. A node that dies
# ends its ranks; the agents left meet again (a new rendezvous round, as long as at least MIN_NODES remain) and
# train.py resumes on the new world from the newest checkpoint, converting it for the new data-parallel size
# and keeping the global batch (grad_accum_steps re-derived). No person in the loop, no job resubmitted.
#
#   RDZV_ENDPOINT=10.0.0.1:29400 NNODES=1:4 launch/elastic.sh --recipe recipes/llama-3.1-8b/pretrain_multinode.yaml
#
# The DeepSpeed runner (pdsh, launch/multi_node.sh) has no elastic agent: a lost node ends its job, and
# MAX_RESTARTS there restarts the whole job on the same hostfile. Use this script where nodes come and go.
#
# Knobs (besides those in launch/common.sh):
#   RDZV_ENDPOINT  host:port of the rendezvous store (c10d: the first agent started there hosts it; pick a node
#                  that outlives the others, or an etcd endpoint with RDZV_BACKEND=etcd-v2)   required
#   NNODES         MIN:MAX nodes the job runs on (MIN alone: a fixed size)                      default: 1:2
#   RDZV_BACKEND   c10d, or etcd-v2 with an etcd server (python-etcd installed)                 default: c10d
#   RDZV_ID        the job's name, the same on every node                                       default: dstrain
#   MAX_RESTARTS   rendezvous rounds after a failure (a lost node, a dead rank); each resumes  default: 10
#   MONITOR_INTERVAL  seconds between the agent's checks of its ranks                           default: 1
#   RDZV_CONF      the rendezvous' settings: last_call_timeout is how long a round waits for more nodes once
#                  MIN_NODES are there (torch's default is 30 s)                                default: last_call_timeout=5
#   NODE_ADDR      this node's address as the others reach it (--local-addr)                   default: unset
#   DSTRAIN_EXIT_BARRIER_TIMEOUT  seconds an agent waits at the end for the others, which may be gone
#                  (torchrun's own is 300; the agent runs as python -m dstrain.run.elastic_run)     default: 30
set -euo pipefail
# shellcheck source=launch/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
: "${RDZV_ENDPOINT:?set RDZV_ENDPOINT=host:port of the rendezvous (a node that outlives the others, or etcd)}"
NNODES=${NNODES:-1:2}
RDZV_BACKEND=${RDZV_BACKEND:-c10d}
RDZV_ID=${RDZV_ID:-dstrain}
MONITOR_INTERVAL=${MONITOR_INTERVAL:-1}
RDZV_CONF=${RDZV_CONF:-last_call_timeout=5}
# torchrun restarts and re-rendezvouses by itself: run_with_retries' own loop stays off, or both would retry
MAX_RESTARTS_AGENT=${MAX_RESTARTS:-10}
MAX_RESTARTS=0

# A node that comes back (or a new one) joins at the next round: torchrun stops the ranks (SIGTERM: train.py saves
# a checkpoint and exits), and the agents meet again. With the c10d backend's shared TCP store (torch's default),
# that round hangs until a 60 s timeout (pytorch/pytorch#147064): an agent that was rank 0 before keeps its old
# bootstrap facts and never publishes MASTER_ADDR for the round, which the newcomer waits for. Torch's own opt-out
# rebuilds them every round.
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=${TORCH_DISABLE_SHARE_RDZV_TCP_STORE:-1}

agent_args=(--nnodes "$NNODES" --nproc-per-node "$NPROC_PER_NODE" --rdzv-backend "$RDZV_BACKEND"
            --rdzv-endpoint "$RDZV_ENDPOINT" --rdzv-id "$RDZV_ID" --max-restarts "$MAX_RESTARTS_AGENT"
            --monitor-interval "$MONITOR_INTERVAL" --rdzv-conf "$RDZV_CONF")
if [[ -n "${NODE_ADDR:-}" ]]; then agent_args+=(--local-addr "$NODE_ADDR"); fi

run_with_retries "$PYTHON" -m dstrain.run.elastic_run "${agent_args[@]}" train.py "${TRAIN_ARGS[@]}" "$@"
