"""Stopping the launcher stops training gracefully (issue 16, defect 2): `kill -TERM` of DeepSpeed's runner,
SIGTERM to launch/single_node.sh (what `docker stop` sends to the image's CMD) and Ctrl-C (SIGINT to the
whole process group) each reach every rank, which checkpoint at the next step and exit 75."""
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from tests.helpers import BIN, ROOT, env, free_port, kill_tree, metrics

STEPS = 400  # far more than the test waits for: the stop must come from the signal, not the end
ARGS = [f"--train.max_steps={STEPS}", "--train.micro_batch_size=2", "--train.seq_len=32", "--eval.every=0",
        "--checkpoint.every=0", "--log.wandb=false", "--log.progress_bar=false", "--log.plot=false",
        "--train.precision=fp32", "--ds_config", "zero2.json"]


def _start(cmd, run, cache, **extra):
    return subprocess.Popen(cmd, cwd=ROOT, env=env(cache, **extra), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)


def _wait_for_steps(proc, run, steps=2):
    deadline = time.time() + 300
    while not (run / "metrics.jsonl").exists() or len(metrics(run)[0]) < steps:
        assert proc.poll() is None and time.time() < deadline, proc.communicate()
        time.sleep(0.1)


@pytest.mark.parametrize("how", ["kill the deepspeed runner", "SIGTERM to launch/single_node.sh", "Ctrl-C"])
def test_stopping_the_launcher_checkpoints_every_rank_and_exits_75(tmp_path, cache, tiny_llama, how):
    run = tmp_path / "run"
    args = ARGS + [f"--model.name_or_path={tiny_llama}"]
    if how.startswith("SIGTERM"):
        proc = _start(["launch/single_node.sh", *args], run, cache, NPROC_PER_NODE="2", PYTHON=sys.executable,
                      MASTER_PORT=str(free_port()), OUTPUT_DIR=str(run), MAX_RESTARTS="0")
    else:
        proc = _start([str(BIN / "deepspeed"), "--num_gpus", "2", "--master_port", str(free_port()), "train.py",
                       *args, "--output_dir", str(run)], run, cache)
    try:
        _wait_for_steps(proc, run)
        below = psutil.Process(proc.pid).children(recursive=True)
        ranks = [p for p in below if "train.py" in p.cmdline() and any("--local_rank" in a for a in p.cmdline())]
        assert len(ranks) == 2
        if how == "Ctrl-C":
            os.killpg(proc.pid, signal.SIGINT)  # what a terminal sends to the foreground job
        else:
            proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=300)  # the ranks hold the pipes: this returns when they are gone
        gone, alive = psutil.wait_procs(ranks, timeout=60)
        assert not alive, "a rank kept running after its launcher was stopped"
    finally:
        kill_tree(proc.pid)
    if how.startswith("SIGTERM"):
        assert proc.returncode == 75, err[-4000:]
        assert "asked 2 rank(s)" in err
    stopped_at = len(metrics(run)[0])
    assert 2 <= stopped_at < STEPS, err[-4000:]
    assert f"stopped at step {stopped_at}" in err, err[-4000:]
    assert (run / "checkpoints" / f"step_{stopped_at:08d}" / "complete.json").exists()
    assert not (run / "stacks").exists(), "a graceful stop must not look like a crash"
    trained = [line for line in err.splitlines() if "train.py" in line and "Traceback" in line]
    assert "KeyboardInterrupt" not in "\n".join(err.splitlines()[-60:]) or how == "Ctrl-C"
    assert not trained
