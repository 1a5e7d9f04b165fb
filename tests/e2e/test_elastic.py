"""Elastic training on torch's elastic agent (launch/elastic.sh): two torchrun agents on loopback act as two
nodes; one is lost mid-run (agent and rank killed with SIGKILL), the survivor's agent meets alone in a new
rendezvous round and its rank resumes on the new world from the newest checkpoint, keeping the global batch,
to the end: every step's loss is what an uninterrupted run computes, the plain single-process loop's
(tests/helpers.py: reference_losses)."""
from __future__ import annotations

import json
import socket
import subprocess
import sys
import time

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

ARGS = ["--train.max_steps=70", "--train.lr=3e-3", "--train.warmup_steps=3", "--train.micro_batch_size=4",
        "--train.grad_accum_steps=1", "--train.seq_len=64", "--train.precision=fp32", "--eval.every=0",
        "--log.wandb=false", "--log.progress_bar=false", "--ds_config", "zero2.json", "--checkpoint.every=4",
        "--fault.heartbeat_interval=0.5", "--checkpoint.export_hf=false"]


HELD = 40  # the step the lone world of the lost-and-back test holds until b2 joins


def uninterrupted(run, tiny_llama, steps: int) -> list[float]:
    """ARGS' schedule in the plain loop (the recipe's min_lr_ratio and weight decay, 0.1)."""
    return reference_losses(tiny_llama, run, steps, 3e-3, 3, 0.1, weight_decay=0.1)[0]


def logged(run) -> int:
    try:
        return len(metrics(run)[0])
    except (FileNotFoundError, json.JSONDecodeError):
        return 0


def listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def published_steps(run) -> list[int]:
    return [int(p.name[5:]) for p in (run / "checkpoints").glob("step_*")
            if p.name[5:].isdigit() and (p / "complete.json").exists()]


def wait_for(what, agent, log, timeout=300) -> None:
    deadline = time.time() + timeout
    while not what():
        assert time.time() < deadline and agent.poll() is None, log.read_text()[-6000:]
        time.sleep(0.1)


def test_a_node_lost_and_back_the_job_goes_on_with_the_uninterrupted_losses(tmp_path, cache, tiny_llama):
    """Agents a and b start together (world 2). At step 10 b's node is lost: agent and rank killed with SIGKILL.
    a's rank names the dead rank and exits, a's agent meets alone in a new round, and its rank resumes from the
    newest checkpoint on 1 rank with twice the accumulation. Then a new agent (b2) starts: a's agent stops its
    rank (SIGTERM: a checkpoint at once), both meet, and the job goes on on 2 ranks to the end."""
    run = tmp_path / "run"
    args = ARGS + [f"--model.name_or_path={tiny_llama}"]
    port = free_port()
    # the lone world holds step HELD until its agent stops it for b2 (SIGTERM): without it, a lone world faster than
    # b2's start trained on to step 70 and the world of 2 had nothing left (CI, stop 46)
    agent_env = env(cache, RDZV_ENDPOINT=f"127.0.0.1:{port}", NNODES="1:2", NPROC_PER_NODE="1",
                    MAX_RESTARTS="3", PYTHON=sys.executable, OUTPUT_DIR=str(run),
                    DSTRAIN_EXIT_BARRIER_TIMEOUT="5", DSTRAIN_FAULT=f"step:slow:seconds=300:until=signalled:step={HELD}")
    logs = {name: tmp_path / f"agent_{name}.txt" for name in ("a", "b", "b2")}

    def start(name):
        with open(logs[name], "w") as log:
            return subprocess.Popen(["launch/elastic.sh", *args], cwd=ROOT, env=agent_env, stdout=log,
                                    stderr=subprocess.STDOUT, start_new_session=True)

    a = start("a")  # first: it hosts the rendezvous store (the c10d backend's), and it is the one that stays
    wait_for(lambda: listening(port), a, logs["a"])
    agents = [a, start("b")]
    try:
        wait_for(lambda: logged(run) >= 10, a, logs["a"])
        published = published_steps(run)  # a save may still be in flight (asynchronous): not one to count on
        lost_at = time.time()
        kill_tree(agents[1].pid)  # the node is gone: its agent and its rank at once (SIGKILL)
        wait_for(lambda: "world changed from 2 to 1" in logs["a"].read_text(), a, logs["a"])
        back_at = time.time()
        wait_for(lambda: logged(run) >= HELD - 1, a, logs["a"])  # trained alone (from step 8 or so) to the hold
        agents.append(start("b2"))
        wait_for(lambda: "world changed from 1 to 2" in logs["a"].read_text(), a, logs["a"])
        # b2's node freezes (its agent stopped, its rank goes on to the end): at the end a's agent waits for it
        # only DSTRAIN_EXIT_BARRIER_TIMEOUT seconds (torchrun's own barrier: 300 s), then exits
        frozen = processes_below(agents[2].pid, "dstrain.run.elastic_run")
        assert len(frozen) == 1
        frozen[0].suspend()
        assert a.wait(timeout=600) == 0, logs["a"].read_text()[-6000:]
        waited = time.time() - (run / "summary.json").stat().st_mtime
        frozen[0].resume()
        assert agents[2].wait(timeout=120) == 0, logs["b2"].read_text()[-6000:]
    finally:
        for agent in agents:
            kill_tree(agent.pid)
    said = logs["a"].read_text()
    assert "grad_accum_steps 1 -> 2 keeps the global batch at 8" in said, said[-6000:]
    assert "world changed from 1 to 2 data-parallel ranks" in said + logs["b2"].read_text(), said[-6000:]
    ours = [t for t in tracebacks(said) if "dstrain/" in t or "train.py" in t]
    assert not ours, ours[0]
    assert back_at - lost_at < 90, f"{back_at - lost_at:.0f} s from the loss to training again"
    assert 4 < waited < 60, f"a's agent left {waited:.0f} s after the run ended (exit barrier: 5 s)"
    starts = [r for r in map(json.loads, (run / "events.jsonl").read_text().splitlines()) if r["event"] == "start"]
    assert [r["world_size"] for r in starts] == [2, 1, 2], starts
    assert starts[1]["left"] and not starts[1]["joined"] and starts[2]["joined"], starts
    # resumed from the newest checkpoint published before the loss (or one whose last record was already in);
    # with one asynchronous save in flight at most, that is at most 2 x every - 1 steps back; SIGTERM saves at once
    assert starts[1]["step"] >= max(published), (published, starts)
    assert starts[1]["steps_recomputed"] == starts[1]["last_logged_step"] - starts[1]["step"] <= 7, starts
    assert starts[2]["steps_recomputed"] == 0, starts
    assert starts[1]["step"] < starts[2]["step"] == HELD, starts  # each world trained some of the steps

    # the ranks of the last world (one on an agent that restarted twice, one on a new agent) leave together: their
    # watchdogs share keys (they did not, and each waited fault.peer_timeout, 60 s, for the other's exit)
    last = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if '"loss"' in line][-1]
    ended = (run / "summary.json").stat().st_mtime - last["time"]
    assert ended < 20, f"{ended:.0f} s from the last step to the summary"

    got = metrics(run)[0]
    # the lone world accumulates 2 micro-batches where the loop takes the batch in one pass: a rounding difference
    # from step 12 that 70 AdamW steps amplify, to 1.0e-4 on an AMD EPYC without AVX-512 (2026-12-06, real torchrun
    # agents as ever; within 5e-5 on the machines before); one step skipped in the loop moves it by 3.4e-2
    assert len(got) == 70 and got == pytest.approx(uninterrupted(run, tiny_llama, 70), rel=2e-4, abs=0)


def test_a_world_the_checkpoint_cannot_use_trains_on_its_largest_usable_part(tmp_path, cache, tiny_llama):
    """The checkpoint's global batch of 8 (micro-batches of 4) cannot be split over 3 data-parallel ranks. Under
    the elastic launcher 3 ranks form (as they would when a third node joins): 2 of them resume and train to the
    end, the third stands by and leaves when the run is done, and the agent ends by itself. The losses are the
    plain single-process loop's. (Outside elastic launches the same world is bad input: test_faults.)"""
    run = tmp_path / "run"
    args = ARGS + [f"--model.name_or_path={tiny_llama}", "--train.max_steps=12"]
    launch(args + ["--output_dir", str(run), "--train.exit_at_step=5"], cache)
    agent_env = env(cache, RDZV_ENDPOINT=f"127.0.0.1:{free_port()}", NNODES="1", NPROC_PER_NODE="3",
                    MAX_RESTARTS="0", PYTHON=sys.executable, OUTPUT_DIR=str(run), DSTRAIN_EXIT_BARRIER_TIMEOUT="5")
    proc = subprocess.run(["launch/elastic.sh", *args], cwd=ROOT, env=agent_env, capture_output=True, text=True,
                          timeout=600, start_new_session=True)
    said = proc.stdout + proc.stderr
    assert proc.returncode == 0, said[-6000:]
    assert "elastic: 3 ranks joined and 2 of them train; rank 2 stands by until the nodes change or the run ends " \
           "(3 ranks: checkpoint" in said, said[-6000:]
    assert f"resumed from {run / 'checkpoints' / 'step_00000005'} at step 5" in said, said[-6000:]
    rows = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]
    assert [(r["event"], r.get("world_used"), r.get("world_size")) for r in rows] == \
        [("start", None, 2), ("stop", None, None), ("fit", 2, None), ("start", None, 2)], rows
    assert rows[3]["after_stop"] == "train.exit_at_step" and rows[3]["seconds_lost"] == 0.0
    got = metrics(run)[0]
    assert len(got) == 12 and got == pytest.approx(uninterrupted(run, tiny_llama, 12), rel=1e-5, abs=0)


def test_too_few_ranks_for_the_config_wait_for_a_node_then_train(tmp_path, cache, tiny_llama):
    """Tensor-parallel size 2 and one node of one rank: the rank says it waits for more nodes and stands by; a
    second agent joins, the agents meet again, and the 2-rank job trains to the end with the plain loop's
    losses."""
    run = tmp_path / "run"
    args = ARGS + [f"--model.name_or_path={tiny_llama}", "--train.max_steps=6", "--ds_config", "tp2_zero1.json"]
    agent_env = env(cache, RDZV_ENDPOINT=f"127.0.0.1:{free_port()}", NNODES="1:2", NPROC_PER_NODE="1",
                    MAX_RESTARTS="3", PYTHON=sys.executable, OUTPUT_DIR=str(run), DSTRAIN_EXIT_BARRIER_TIMEOUT="5")
    logs = {name: tmp_path / f"agent_{name}.txt" for name in ("a", "b")}

    def start(name):
        with open(logs[name], "w") as log:
            return subprocess.Popen(["launch/elastic.sh", *args], cwd=ROOT, env=agent_env, stdout=log,
                                    stderr=subprocess.STDOUT, start_new_session=True)

    agents = [start("a")]
    try:
        wait_for(lambda: "elastic: waiting for more nodes" in logs["a"].read_text(), agents[0], logs["a"])
        agents.append(start("b"))
        for name, agent in zip("ab", agents):
            assert agent.wait(timeout=600) == 0, logs[name].read_text()[-6000:]
    finally:
        for agent in agents:
            kill_tree(agent.pid)
    said = logs["a"].read_text()
    assert "no world of at most 1 rank(s) can train this run (world size 1 is not divisible by pipeline stages (1) " \
           "x tensor-parallel size (2)" in said, said[-6000:]
    rows = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]
    assert [(r["event"], r.get("world_used"), r.get("world_size")) for r in rows] == [("wait", 0, None),
                                                                                    ("start", None, 2)], rows
    got = metrics(run)[0]
    assert len(got) == 6 and got == pytest.approx(uninterrupted(run, tiny_llama, 6), rel=1e-5, abs=0)
