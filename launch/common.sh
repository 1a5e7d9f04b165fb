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

# CPU ranks share the cores. (glibc's MALLOC_MMAP_THRESHOLD_ is left alone: a low one makes CPU ranks' RSS honest
# and their steps 1.5x slower, docs/planning.md)
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(( $(nproc) / NPROC_PER_NODE > 0 ? $(nproc) / NPROC_PER_NODE : 1 ))}
export TOKENIZERS_PARALLELISM=${TOKENIZERS_PARALLELISM:-false}

# Retries: a run that fails (a dead rank, a lost node, a hang the watchdog ended) starts again, up to
# MAX_RESTARTS times, RESTART_DELAY seconds apart; each attempt resumes from the newest complete
# checkpoint (--resume auto). Not retried: success (0), bad input (2), a checkpoint that could not be
# written (74: a full disk stays full), a requested stop (75: SIGTERM/SIGUSR1/STOP file), steps that were
# not finite (65: the same data and weights fail the same way), Ctrl-C before
# the first step (130).
MAX_RESTARTS=${MAX_RESTARTS:-3}
RESTART_DELAY=${RESTART_DELAY:-10}
final_status() { case "$1" in 0|2|65|74|75|130) return 0;; *) return 1;; esac; }

# SIGTERM or SIGINT to this script (`docker stop`, a scheduler, `kill`, Ctrl-C) reaches the training ranks, which
# checkpoint at the next step and exit 75; the launcher is left alone, since DeepSpeed's runner dies on SIGTERM
# without passing it on, and its launch.py kills the ranks 30 s after forwarding one.
LAUNCHER_PID=
stop_ranks() {
  # no rank below the launcher (pdsh: they run under sshd on each node): the launcher's own handler passes it on
  if [[ -n "$LAUNCHER_PID" ]]; then "$PYTHON" -m dstrain.run.preempt "$LAUNCHER_PID" || kill -TERM "$LAUNCHER_PID" || true; fi
}
# Bash runs a trap only between commands, so a launcher or a job step runs in the background and is waited for
# here, through the trap's interruptions (wait returns 128+signal early); sets STATUS to its exit status.
wait_step() {
  while true; do
    wait "$1" && STATUS=0 || STATUS=$?
    if kill -0 "$1" 2>/dev/null; then continue; fi  # a trap interrupted wait; the step still runs
    wait "$1" 2>/dev/null && STATUS=0 || STATUS=$?
    break
  done
}
# Run a launcher in the background (so a trapped signal is handled while it runs) and return its exit status.
# Its own session: Ctrl-C in a terminal reaches only this script, which passes one SIGTERM to each rank
# (the terminal's SIGINT to every process would also kill DeepSpeed's runner and make launch.py kill the ranks).
run_launcher() {
  setsid "$@" &
  LAUNCHER_PID=$!
  trap stop_ranks TERM INT
  wait_step "$LAUNCHER_PID"
  trap - TERM INT
  LAUNCHER_PID=
  return "$STATUS"
}
run_with_retries() {
  local attempt=0 status extra=()
  while true; do
    run_launcher "$@" "${extra[@]}" && status=0 || status=$?
    if final_status "$status"; then return "$status"; fi
    if (( attempt >= MAX_RESTARTS )); then
      echo "launch: exit $status after $attempt restart(s); giving up (MAX_RESTARTS=$MAX_RESTARTS)" >&2
      return "$status"
    fi
    attempt=$((attempt + 1))
    echo "launch: exit $status; restart $attempt of $MAX_RESTARTS in ${RESTART_DELAY}s from the newest complete checkpoint" >&2
    sleep "$RESTART_DELAY"
    extra=(--resume auto)
  done
}

# Copy a prepared data directory to every node's local disk of a SLURM allocation, once: skipped on a node whose
# copy has the source's manifest, which is copied last, so a copy cut short is redone.
stage_data() {
  # shellcheck disable=SC2016  # expanded by the bash that srun starts on each node
  srun --ntasks-per-node=1 bash -c 'src=$1 dst=$2; cmp -s "$src/manifest.json" "$dst/manifest.json" && exit 0
    mkdir -p "$dst" && rsync -a --exclude manifest.json "$src/" "$dst/" && cp "$src/manifest.json" "$dst/"' \
    _ "$1" "$2"
}

# SLURM batch scripts (slurm.sbatch, slurm_elastic.sbatch). USR1 (SLURM's warning before the time limit, a
# preemption, `scancel --signal=USR1 --batch`) or TERM asks train.py to checkpoint and stop through the run
# directory's STOP file: `trap slurm_on_signal USR1 TERM`.
PREEMPTED=0
# shellcheck disable=SC2317  # called by the batch scripts' trap
slurm_on_signal() {
  echo "job $SLURM_JOB_ID: signalled; asking train.py to checkpoint and stop"
  PREEMPTED=1
  touch "$OUTPUT_DIR/STOP"
}
# The job's end: a checkpointed stop (75), or a signalled step that did not finish, requeues the job, which
# resumes from that checkpoint; anything else exits with the step's status.
requeue_or_exit() {
  if [[ "$STATUS" == 75 || ( "$PREEMPTED" == 1 && "$STATUS" != 0 ) ]]; then
    echo "job $SLURM_JOB_ID: checkpoint saved (exit $STATUS); requeueing to resume"
    scontrol requeue "$SLURM_JOB_ID"
    exit 0
  fi
  exit "$STATUS"
}
