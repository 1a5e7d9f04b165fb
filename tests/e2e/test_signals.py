"""Stopping a run by hand stops every rank gracefully (issue 16 defect 2, issue 29 items 1 and 2): `kill` of
DeepSpeed's runner (reaped at once, as a shell reaps it; and killed while the ranks still start up), SIGTERM and
SIGKILL to torchrun's agent, SIGTERM to launch/single_node.sh (what `docker stop` sends to the image's CMD) and
Ctrl-C (SIGINT to the whole process group, wandb's service process included, with wandb on) each reach every rank,
which checkpoint at the next step and exit 75, with no traceback.

The launcher is reaped the moment it exits, as a shell or init would: a launcher left a zombie (pytest's child that
nobody waits for) still answers psutil's questions, and that hid the watch thread's death (issue 29 item 1)."""
import json
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from tests.helpers import BIN, ROOT, env, free_port, kill_tree, metrics, tracebacks

STEPS = 400  # far more than the test waits for: the stop must come from the signal, not the end
ARGS = [f"--train.max_steps={STEPS}", "--train.micro_batch_size=2", "--train.seq_len=32", "--eval.every=0",
        "--checkpoint.every=0", "--log.progress_bar=false", "--log.plot=false",
        "--train.precision=fp32", "--ds_config", "zero2.json"]

CASES = {  # name: (launcher, wandb on, stop while the ranks still start up)
    "kill the deepspeed runner": ("deepspeed", False, False),
    "kill the deepspeed runner during start-up": ("deepspeed", False, True),
    "SIGTERM to launch/single_node.sh": ("script", False, False),
    "Ctrl-C to launch/single_node.sh": ("script", False, False),
    "Ctrl-C": ("deepspeed", False, False),
    "Ctrl-C with wandb on": ("deepspeed", True, False),
    "SIGTERM to torchrun's agent": ("torchrun", False, False),
    "Ctrl-C to torchrun": ("torchrun", False, False),
    "SIGKILL to torchrun's agent": ("torchrun", False, False),
}
# What the shell sees (issue 54 item 6; the table in docs/runs.md): every rank exits 75 after its checkpoint, but
# only launch/*.sh wait for the ranks and pass 75 on. DeepSpeed's runner dies of the signal at once (the shell
# shows 128 + the signal: 130 for Ctrl-C, 143 for kill) and torchrun's agent turns SIGTERM into 1; the ranks
# finish their checkpoint after the prompt is back. (Popen's returncode: minus the signal that killed it.)
SHELL_SEES = {"kill the deepspeed runner": -15, "kill the deepspeed runner during start-up": -15,
              "SIGTERM to launch/single_node.sh": 75, "Ctrl-C to launch/single_node.sh": 75, "Ctrl-C": -2,
              "Ctrl-C with wandb on": -2, "SIGTERM to torchrun's agent": 1, "Ctrl-C to torchrun": 1, "SIGKILL to torchrun's agent": -9}


def _as_a_shell_starts_a_job() -> None:
    """A shell's foreground job starts with SIGINT and SIGTERM at their defaults, neither ignored nor blocked. The
    pytest worker's own may not be (in 2 of this file's in-suite runs of 2026-12-06 Ctrl-C never reached the job: the
    single_node.sh case trained its 400 steps, the runner exited 1 instead of dying of SIGINT; alone they passed),
    and children inherit an ignored or blocked signal through exec."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM})


def _start(cmd, cache, **extra):
    return subprocess.Popen(cmd, cwd=ROOT, env=env(cache, **extra), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True, preexec_fn=_as_a_shell_starts_a_job)


def _ranks(proc) -> list[psutil.Process]:
    below = psutil.Process(proc.pid).children(recursive=True)
    return [p for p in below if "train.py" in p.cmdline() and "LOCAL_RANK" in p.environ()
            and "LOCAL_RANK" not in p.parent().environ()]


# The launchers' own reaction to a signal, which no rank can prevent: DeepSpeed's runner has no SIGINT handler on
# one node (KeyboardInterrupt in its result.wait()), torchrun's agent turns SIGTERM into a SignalException.
LAUNCHER_FRAMES = ("deepspeed/launcher/runner.py", "bin/deepspeed", "bin/torchrun", "torch/distributed/run.py",
                   "torch/distributed/elastic/", "subprocess.py", "torch/distributed/launcher/")


def _launchers_own(block: str) -> bool:
    frames = [line for line in block.splitlines() if line.lstrip().startswith('File "')]
    return bool(frames) and all(any(part in frame for part in LAUNCHER_FRAMES) for frame in frames)


def _wait_for(proc, ready):
    deadline = time.time() + 300
    while not ready():
        assert proc.poll() is None and time.time() < deadline, proc.communicate()
        time.sleep(0.1)


@pytest.mark.parametrize("how", list(CASES))
def test_stopping_by_hand_checkpoints_every_rank_and_exits_75(tmp_path, cache, tiny_llama, how):
    launcher, wandb_on, early = CASES[how]
    run = tmp_path / "run"
    args = ARGS + [f"--model.name_or_path={tiny_llama}", f"--log.wandb={str(wandb_on).lower()}"]
    port = str(free_port())
    if launcher == "script":
        proc = _start(["launch/single_node.sh", *args], cache, NPROC_PER_NODE="2", PYTHON=sys.executable,
                      MASTER_PORT=port, OUTPUT_DIR=str(run), MAX_RESTARTS="0")
    elif launcher == "torchrun":
        proc = _start([str(BIN / "torchrun"), "--nproc_per_node", "2", "--master_port", port, "train.py", *args,
                       "--output_dir", str(run)], cache)
    else:
        proc = _start([str(BIN / "deepspeed"), "--num_gpus", "2", "--master_port", port, "train.py", *args,
                       "--output_dir", str(run)], cache)
    ranks = []
    try:
        if early:  # both ranks exist but have not trained a step: they are importing and building
            _wait_for(proc, lambda: len(_ranks(proc)) == 2)
        else:
            _wait_for(proc, lambda: (run / "metrics.jsonl").exists() and len(metrics(run)[0]) >= 2)
        ranks = _ranks(proc)
        assert len(ranks) == 2
        target = proc.pid if launcher != "script" else None
        if how.startswith("Ctrl-C"):
            os.killpg(proc.pid, signal.SIGINT)  # what a terminal sends to the foreground job
        elif how.startswith("SIGKILL"):
            os.kill(target, signal.SIGKILL)
        else:
            proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=120)  # reaped at once, as a shell does: from here on the launcher has no /proc entry
        out, err = proc.communicate(timeout=300)  # the ranks hold the pipes: this returns when they are gone
        gone, alive = psutil.wait_procs(ranks, timeout=60)
        assert not alive, f"a rank kept running after the stop ({how})\n{err[-4000:]}"
    finally:
        kill_tree(proc.pid)
        for rank in ranks:
            try:
                rank.kill()
            except psutil.Error:
                pass
    assert proc.returncode == SHELL_SEES[how], err[-4000:]
    if launcher == "script":
        assert "asked 2 rank(s)" in err
    ours = [block for block in tracebacks(err) if not _launchers_own(block)]
    assert not ours, f"a traceback from a rank ({how}):\n" + "\n".join(ours)[-6000:]
    stopped_at = len(metrics(run)[0])
    assert (1 if early else 2) <= stopped_at < STEPS, err[-4000:]
    assert f"stopped at step {stopped_at}" in err, err[-4000:]
    assert (run / "checkpoints" / f"step_{stopped_at:08d}" / "complete.json").exists(), err[-4000:]
    assert not (run / "stacks").exists(), "a graceful stop must not look like a crash"
    if wandb_on:
        assert list((run / "wandb").glob("offline-run-*")), "wandb was on: its offline run should exist"
    if how == "Ctrl-C":  # issue 54 item 7: the same command again, one step: a resume, not a fault
        again = subprocess.run([str(BIN / "deepspeed"), "--num_gpus", "2", "--master_port", str(free_port()),
                                "train.py", *args, "--output_dir", str(run), f"--train.exit_at_step={stopped_at + 1}"],
                               cwd=ROOT, env=env(cache), capture_output=True, text=True, timeout=600)
        assert again.returncode == 0, again.stderr[-4000:]
        said = [line for line in again.stderr.splitlines() if line.startswith("resumed after a stop (")]
        assert len(said) == 1 and said[0].endswith(f"at step {stopped_at}; nothing recomputed"), again.stderr[-4000:]
        assert "membership changed" not in again.stderr and " lost" not in again.stderr, again.stderr[-4000:]
        rows = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]
        assert [r["event"] for r in rows] == ["start", "stop", "start", "stop"]
        assert rows[2]["seconds_lost"] == 0.0 and rows[2]["after_stop"] == rows[1]["reason"]
