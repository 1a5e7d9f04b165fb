"""Nothing lost when things fail: every test breaks a real run and compares the outcome with what an
uninterrupted run computes: the plain single-process PyTorch loop (tests/helpers.py: reference_losses, losses per
step and final weights), an independent reference that costs no launch."""
from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from tests.helpers import (
    ROOT,
    env,
    free_port,
    kill_tree,
    launch,
    metrics,
    processes_below,
    reference_losses,
    tracebacks,
)

ARGS = ["--train.max_steps=12", "--train.lr=3e-3", "--train.warmup_steps=3", "--train.micro_batch_size=4",
        "--train.grad_accum_steps=2", "--train.seq_len=64", "--train.precision=fp32", "--eval.every=0",
        "--eval.max_batches=2", "--log.wandb=false", "--log.progress_bar=false", "--ds_config", "zero1.json",
        "--fault.heartbeat_interval=0.5"]


def losses(run: Path) -> list[float]:
    return metrics(run)[0]


def steps_logged(run: Path) -> int:
    try:
        return len(losses(run))
    except (FileNotFoundError, json.JSONDecodeError):
        return 0


def weights(run: Path) -> dict:
    from safetensors.torch import load_file
    return load_file(run / "hf" / "model.safetensors")


def reference(run: Path, tiny_llama: Path, steps: int = 12, warmup: int = 3):
    """(losses, model) of the plain loop on ARGS' schedule (the recipe's min_lr_ratio and weight decay, 0.1)."""
    return reference_losses(tiny_llama, run, steps, 3e-3, warmup, 0.1, weight_decay=0.1)


def assert_weights_are(run: Path, model, atol: float) -> None:
    """The exported weights are the reference model's (the bound allows for another reduction order)."""
    import torch
    ours, want = weights(run), model.state_dict()
    assert ours.keys() <= want.keys() and "model.embed_tokens.weight" in ours
    for key in ours:
        torch.testing.assert_close(ours[key], want[key], rtol=0, atol=atol,
                                   msg=lambda m, key=key: f"{key}: {m}")


def rank_process(launcher_pid: int, local_rank: int) -> psutil.Process:
    found = processes_below(launcher_pid, "train.py", f"--local_rank={local_rank}")
    assert len(found) == 1, found
    return found[0]


def wait_for_steps(run: Path, n: int, proc: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.time() + timeout
    while steps_logged(run) < n:
        assert proc.poll() is None, proc.communicate()
        assert time.time() < deadline, f"run did not reach step {n}"
        time.sleep(0.05)


# ----------------------------------------------------------------------------- kill -9, retried by launch/

CHAOS = ["--train.max_steps=60", "--checkpoint.every=10", "--train.warmup_steps=5"]


# Seeds 1 and 2 both drew rank 0 at steps 16 and 17: one scenario run twice (63 s of the suite); rank 0, whose
# process holds the job's store, is the harder victim. Rank 1 killed by -9: test_preference.py; the survivor's
# exit for either victim: test_survivor_exits_by_itself_naming_the_dead_rank below
@pytest.mark.parametrize("seed", [1])
def test_kill9_of_a_rank_is_retried_by_launch_script_and_matches_uninterrupted(tmp_path, cache, tiny_llama, seed):
    """kill -9 one rank at a random step; launch/single_node.sh restarts, resumes from the newest complete
    checkpoint and the whole run's per-step losses and final weights are the plain loop's."""
    rng = random.Random(seed)
    victim, at_step = rng.randrange(2), rng.randrange(12, 45)  # after the first checkpoint (step 10)
    run = tmp_path / "run"
    script_env = env(cache, MAX_RESTARTS="2", RESTART_DELAY="1", NPROC_PER_NODE="2", MASTER_PORT=str(free_port()),
                     PYTHON=sys.executable, OUTPUT_DIR=str(run))
    proc = subprocess.Popen(["launch/single_node.sh", *ARGS, *CHAOS, f"--model.name_or_path={tiny_llama}"],
                            cwd=ROOT, env=script_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        wait_for_steps(run, at_step, proc)
        rank_process(proc.pid, victim).send_signal(signal.SIGKILL)
        out, err = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            kill_tree(proc.pid)
    assert proc.returncode == 0, err[-5000:]
    assert "restart 1 of 2" in err and "restart 2" not in err
    assert "died" in err, err[-5000:]  # the surviving rank named the dead one before it left
    resumed = [line for line in err.splitlines() if "resumed from" in line]
    assert len(resumed) == 1 and "step_000000" in resumed[0]
    want, model = reference(run, tiny_llama, steps=60, warmup=5)
    got = losses(run)
    # measured against the plain loop after 60 steps: losses within 5.1e-6, weights within 6.7e-6 (another
    # reduction order); with a 1% larger lr in the loop, 7.0e-2 and 3.4e-2
    assert len(got) == 60 and got == pytest.approx(want, rel=5e-5, abs=0)
    assert_weights_are(run, model, atol=5e-5)


# ----------------------------------------------------------------------------- a rank dies, nobody waits

def start_ranks(run: Path, cache: Path, model: Path, extra: list[str]) -> list[subprocess.Popen]:
    """Two ranks started by hand (no launcher that would kill the survivor for us), as on two nodes."""
    port = str(free_port())
    procs = []
    for rank in range(2):
        e = env(cache, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
                MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        procs.append(subprocess.Popen([sys.executable, "train.py", *ARGS, "--train.max_steps=100000",
                                       "--checkpoint.every=0", f"--model.name_or_path={model}", "--output_dir",
                                       str(run), *extra], cwd=ROOT, env=e, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    return procs


@pytest.mark.parametrize("victim,how", [(1, "kill"), (0, "kill"), (1, "freeze")])
def test_survivor_exits_by_itself_naming_the_dead_rank(tmp_path, cache, tiny_llama, victim, how):
    """No launcher to clean up: the survivor must leave within the peer timeout (6 s here), naming the rank
    that died, in one line: no traceback of the collective that failed with it (that goes to the stacks file).
    A frozen process (SIGSTOP, like a lost node) is found by its missing heartbeat."""
    run = tmp_path / "run"
    procs = start_ranks(run, cache, tiny_llama, ["--fault.peer_timeout=6"])
    try:
        wait_for_steps(run, 3, procs[0])
        procs[victim].send_signal(signal.SIGKILL if how == "kill" else signal.SIGSTOP)
        hit = time.time()
        survivor = procs[1 - victim]
        _, err = survivor.communicate(timeout=60)
        took = time.time() - hit
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.communicate()
    assert survivor.returncode == 1, err[-4000:]
    assert took < 6 + 5, f"survivor took {took:.1f} s"
    if how == "freeze":
        assert f"rank {victim} on " in err and "stopped responding: no heartbeat" in err, err[-3000:]
    else:
        assert f"rank {victim} on " in err and "died" in err, err[-3000:]
    assert not tracebacks(err), err[-4000:]
    assert (run / "stacks" / f"rank{1 - victim}.txt").exists()


def test_stalled_rank_is_ended_by_the_watchdog_with_every_rank_stack(tmp_path, cache, tiny_llama):
    run = tmp_path / "run"
    began = time.time()
    proc = launch(ARGS + [f"--model.name_or_path={tiny_llama}", "--output_dir", str(run), "--train.max_steps=50",
                          "--fault.stall_timeout=8", "--checkpoint.every=0"], cache, check=False,
                  timeout=300, DSTRAIN_FAULT="step:stall:rank=1:step=5")
    assert proc.returncode != 0
    assert "no progress for 8 s" in proc.stderr, proc.stderr[-4000:]
    assert steps_logged(run) == 4
    stalled = (run / "stacks" / "rank1.txt").read_text()
    waiting = (run / "stacks" / "rank0.txt").read_text()
    assert "faults.py" in stalled and "train.py" in stalled  # the stack shows where rank 1 sat
    assert "train.py" in waiting
    last_step = (run / "metrics.jsonl").stat().st_mtime
    assert time.time() - began < 300 and (run / "stacks" / "rank0.txt").stat().st_mtime - last_step < 8 + 6


# ----------------------------------------------------------------------------- torn and corrupt checkpoints

@pytest.mark.parametrize("point,resumes_at", [("save:shards", 4), ("save:manifest", 4), ("save:publish", 8),
                                              ("save:prune", 8)])
def test_kill_during_save_resumes_from_last_complete_checkpoint(tmp_path, cache, tiny_llama, point, resumes_at):
    run = tmp_path / "run"
    args = ARGS + [f"--model.name_or_path={tiny_llama}", "--output_dir", str(run), "--checkpoint.every=4",
                   "--checkpoint.keep_last=1"]
    killed = launch(args, cache, launcher="python", check=False, DSTRAIN_FAULT=f"{point}:kill:step=8")
    assert killed.returncode == -signal.SIGKILL
    resumed = launch(args, cache, launcher="warm-python")
    assert f"resumed from {run / 'checkpoints' / f'step_{resumes_at:08d}'} at step {resumes_at}" in resumed.stderr
    got = losses(run)
    assert len(got) == 12 and got == pytest.approx(reference(run, tiny_llama)[0], rel=1e-5, abs=0)
    assert sorted(p.name for p in (run / "checkpoints").iterdir() if p.name.startswith(("step_", ".tmp"))) == \
        ["step_00000012"]


def test_corrupt_file_in_newest_checkpoint_is_skipped_and_named(tmp_path, cache, tiny_llama):
    run = tmp_path / "run"
    args = ARGS + [f"--model.name_or_path={tiny_llama}", "--checkpoint.every=4"]
    launch(args + ["--output_dir", str(run), "--train.exit_at_step=8"], cache)
    newest = run / "checkpoints" / "step_00000008"
    victim = newest / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped bit-pattern, same size: only the checksum can tell
    victim.write_bytes(bytes(data))
    proc = launch(args + ["--output_dir", str(run)], cache)
    assert f"checkpoint {newest} is damaged ({victim.name} fails its CRC-32 check)" in proc.stderr
    assert f"resumed from {run / 'checkpoints' / 'step_00000004'} at step 4" in proc.stderr
    assert (run / "checkpoints" / "step_00000008.corrupt" / victim.name).exists()
    got = losses(run)
    assert len(got) == 12 and got == pytest.approx(reference(run, tiny_llama)[0], rel=1e-5, abs=0)


# ----------------------------------------------------------------------------- a full disk

@pytest.fixture
def small_disk(tmp_path, tiny_llama):
    """A tmpfs with room for one checkpoint of the model (about 4x its fp32 weights) but not two."""
    mount = tmp_path / "small"
    mount.mkdir()
    size = 6 * (tiny_llama / "model.safetensors").stat().st_size + 2 * 2**20
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mount)],
                                           capture_output=True).returncode != 0:
        # no mount rights: the same failures, injected (a background save is tried again once, at the next save)
        yield mount, "save:shards:enospc:step=4;save:shards:enospc:step=6"
        return
    try:
        yield mount, ""
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def test_full_disk_stops_with_clear_error_and_earlier_checkpoint_intact(tmp_path, cache, tiny_llama, small_disk):
    from dstrain.errors import EXIT_SAVE_FAILED
    from dstrain.parallel.dist import DistContext
    from dstrain.run import checkpoint

    mount, fault = small_disk
    run = mount / "run"
    script_env = env(cache, MAX_RESTARTS="2", RESTART_DELAY="1", NPROC_PER_NODE="2", MASTER_PORT=str(free_port()),
                     PYTHON=sys.executable, OUTPUT_DIR=str(run), DSTRAIN_FAULT=fault)
    proc = subprocess.run(["launch/single_node.sh", *ARGS, f"--model.name_or_path={tiny_llama}",
                           "--checkpoint.every=2", "--checkpoint.keep_last=3", "--checkpoint.export_hf=false"],
                          cwd=ROOT, env=script_env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == EXIT_SAVE_FAILED, proc.stderr[-4000:]
    assert "restart" not in proc.stderr  # a full disk stays full: not retried
    line = next(ln for ln in proc.stderr.splitlines() if "could not save checkpoint" in ln)
    assert ("the file system is full" in line or "No space left on device" in line) and "is intact" in line, line
    complete = checkpoint.complete_checkpoints(run / "checkpoints")
    assert complete and not list((run / "checkpoints").glob(".tmp-*"))
    assert checkpoint.verify(complete[-1], DistContext(0, 0, 1)) == []  # every file still matches its checksum


# ----------------------------------------------------------------------------- another world size or ZeRO stage

# (ds_config, ranks) of each launch: a chain stops at step 5, continues to 9, then to 12, each link on another world
# size, ZeRO stage or both. The stage changes are what a person does after an out-of-memory (issue 69: ZeRO-2 -> 3 was
# an empty AssertionError, ZeRO-2 -> 0 on 1 rank an AttributeError in torch's optimizer, both seen failing here).
# ZeRO-1 and 2 are one DeepSpeed optimizer with one checkpoint layout; every target's universal loader is met:
# ZeRO-3 and ZeRO-1/2 (DeepSpeed's) and ZeRO-0 in fp32 (PyTorch's AdamW, dstrain's).
CHAINS = {"zero2-3-2": (("zero2.json", 2), ("zero3.json", 1), ("zero2.json", 2)),
          "zero3-1-0": (("zero3.json", 2), ("zero1.json", 2), ("zero0.json", 1))}


@pytest.mark.parametrize("chain", sorted(CHAINS))
def test_resume_on_another_world_size_or_zero_stage(tmp_path, cache, tiny_llama, chain):
    """Global batch 16 on 2 ranks x accum 2 or 1 rank x accum 4. Each launch's recipe is written for the world
    before it (the user did not edit it); each resume converts through DeepSpeed's universal checkpoint where the
    layout changed, keeps the global batch and the sample position, and continues the losses of the plain
    single-process loop (tests/helpers.py: reference_losses, an independent reference and no launch: an uninterrupted
    2-rank run gave the same losses to the last digit for ZeRO-1/2/3 in both world directions)."""
    run = tmp_path / "run"
    links = CHAINS[chain]
    args = ARGS + [f"--model.name_or_path={tiny_llama}", "--output_dir", str(run), "--checkpoint.every=0"]
    before = None
    for (config, ranks), stop in zip(links, (5, 9, 12)):
        accum = 4 // (before[1] if before else ranks)  # written for the world before it
        extra = ["--ds_config", config, f"--train.grad_accum_steps={accum}"] + (
            [f"--train.exit_at_step={stop}"] if stop < 12 else [])
        proc = launch(args + extra, cache, launcher="warm-python") if ranks == 1 else launch(args + extra, cache)
        if before and before[1] != ranks:
            assert f"world changed from {before[1]} to {ranks} data-parallel ranks" in proc.stderr
            assert f"grad_accum_steps {accum} -> {4 // ranks} keeps the global batch at 16" in proc.stderr
        if before and before[0] != config:
            stages = before[0][4], config[4]
            assert f"ZeRO stage changed from ZeRO-{stages[0]} to ZeRO-{stages[1]}" in proc.stderr, proc.stderr
            assert f"ZeRO stage {stages[0]} -> {stages[1]} since the last start" in proc.stderr
        done = json.loads((run / "checkpoints" / f"step_{stop:08d}" / "complete.json").read_text())
        assert done["samples"] == stop * 16 and done["world_size"] == ranks and done["zero_stage"] == int(config[4])
        before = (config, ranks)
    starts = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]
    assert [r["zero_stage"] for r in starts if r["event"] == "start"] == [int(c[4]) for c, _ in links]
    got = losses(run)
    want, _ = reference(run, tiny_llama)
    # the bound allows for another reduction order on another world size
    assert len(got) == 12 and got == pytest.approx(want, rel=1e-5, abs=0)


LEAVE = """
import sys, time
from datetime import timedelta
from pathlib import Path
import torch.distributed as dist
from dstrain.config import FaultConfig
from dstrain.parallel.dist import env_context
from dstrain.run.watchdog import Watchdog
dist.init_process_group("gloo", timeout=timedelta(seconds=30))
ctx = env_context()
watchdog = Watchdog(Path(sys.argv[1]), FaultConfig(heartbeat_interval=0.2, peer_timeout=20), ctx).start()
time.sleep(0.5 if ctx.rank == 0 else 2.0)  # rank 1 finds the same bad input later: ten heartbeats later
watchdog.close()
sys.exit(2)
"""


def test_a_rank_leaving_on_purpose_is_not_reported_dead(tmp_path, cache):
    """CI failure of 2026-11-25: a bad --ds value on a 2-rank deepspeed launch exited 1 instead of 2 now and then.
    Both ranks raise the same UserError; rank 0 (which hosts the store) left first, rank 1's watchdog saw the
    store vanish with rank 0's process gone, reported `rank 0 ... died` and exited 1, which the launcher passed
    on. A rank leaving on purpose is not a death: rank 0 waits for the others before it takes the store down."""
    script = tmp_path / "leave.py"
    script.write_text(LEAVE)
    port = str(free_port())
    procs = [subprocess.Popen([sys.executable, str(script), str(tmp_path)], cwd=ROOT, stderr=subprocess.PIPE,
                              text=True, env=env(cache, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE="2",
                                                 LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=port))
             for r in range(2)]
    errs = [p.communicate(timeout=120)[1] for p in procs]
    assert [p.returncode for p in procs] == [2, 2], errs
    assert not any("died" in e or "stopping" in e for e in errs), errs
    assert not (tmp_path / "stacks").exists()


def test_a_bad_input_is_said_even_when_another_rank_finds_it_first(tmp_path, cache, tiny_llama):
    """Seen in the suite under load: `deepspeed ... --ds_config pipe2_zero1.json --ds.zero_optimization.stage=2`
    exited 1 without its error line: rank 1 found the bad value first and left, and the launcher killed rank 0
    (the one that speaks) before it said why. Rank 0 made 3 s late here; the line must still come, with exit 2."""
    proc = launch(["--train.max_steps=2", "--log.wandb=false", f"--model.name_or_path={tiny_llama}", "--output_dir",
                   str(tmp_path / "run"), "--ds_config", "pipe2_zero1.json", "--ds.zero_optimization.stage=2"],
                  cache, check=False, DSTRAIN_FAULT="validate:slow:rank=0:step=0:seconds=3")
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert len(errors) == 1 and "work with ZeRO stage 0 or 1, not 2" in errors[0], proc.stderr[-3000:]
