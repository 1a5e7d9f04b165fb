"""launch/slurm.sbatch on a real two-node SLURM cluster (see conftest.py): it trains and exports what a
single-node run computes, and a job signalled mid-run (as SLURM does before a time limit) checkpoints, requeues
itself, resumes, and ends with the per-step losses of an uninterrupted run. launch/slurm_elastic.sbatch: one
node's agent and rank killed mid-run, the job finishes on the other with the same losses. What a run computes is the plain
single-process loop's (tests/helpers.py: reference_losses): an independent reference that costs no launch."""
from __future__ import annotations

import json
import re
import subprocess
import time
from pathlib import Path

import pytest
import torch

from tests.helpers import ROOT, env, metrics, reference_losses, tracebacks

ARGS = ["--train.warmup_steps=2", "--train.micro_batch_size=4", "--train.grad_accum_steps=2",
        "--train.seq_len=64", "--eval.max_batches=2", "--eval.every=0", "--log.wandb=false",
        "--log.progress_bar=false", "--ds_config", "zero2.json"]


def submit(slurm, cache: Path, tmp_path: Path, run_dir: Path, args: list[str], script: str = "launch/slurm.sbatch",
           **extra_env) -> str:
    job_env = slurm.env(env(cache, OUTPUT_DIR=str(run_dir), NPROC_PER_NODE="1", GLOO_SOCKET_IFNAME="lo", **extra_env))
    out = subprocess.run(["sbatch", "--parsable", "--nodes=2", f"--output={tmp_path}/slurm-%j.out",
                          str(ROOT / script)] + args, cwd=ROOT, env=job_env, capture_output=True,
                         text=True, check=True)
    return out.stdout.strip().split(";")[0]


def wait_done(slurm, job_id: str, tmp_path: Path, timeout: float = 900) -> dict:
    deadline = time.time() + timeout
    while time.time() < deadline:
        job = slurm.job(job_id)
        if job.get("JobState") in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"):
            return job
        time.sleep(1)
    subprocess.run(["scancel", job_id], env=slurm.env({}))
    raise AssertionError(f"job {job_id} still {slurm.job(job_id).get('JobState')} after {timeout}s\n"
                         f"{job_log(tmp_path, job_id)}\n{slurm.logs()}")


def job_log(tmp_path: Path, job_id: str) -> str:
    path = tmp_path / f"slurm-{job_id}.out"
    return path.read_text() if path.exists() else "(no job output)"


def reference(model: Path, run_dir: Path, steps: int):
    """(losses, model) of the plain loop: the default recipe's lr 3e-3 and min_lr_ratio 0.1, weight decay 0.1 (the
    default), ARGS' warmup; CPU ranks train in fp32 (precision auto)."""
    return reference_losses(model, run_dir, steps, 3e-3, 2, 0.1, weight_decay=0.1)


def test_sbatch_trains_on_two_nodes_and_exports(tmp_path, cache, tiny_llama, slurm):
    run_dir = tmp_path / "run"
    job_id = submit(slurm, cache, tmp_path, run_dir, ARGS + ["--train.max_steps=8",
                                                             f"--model.name_or_path={tiny_llama}"])
    job = wait_done(slurm, job_id, tmp_path)
    log = job_log(tmp_path, job_id)
    assert job["JobState"] == "COMPLETED", f"{job}\n{log}\n{slurm.logs()}"
    assert "2 nodes x 1 ranks" in log and "cluster check: world 2" in log, log
    assert job["NodeList"] in ("n[1-2]", "n1,n2"), job  # the launcher ran on both nodes
    want, model = reference(tiny_llama, run_dir, 8)
    got, _ = metrics(run_dir)
    assert len(got) == 8 and got == pytest.approx(want, rel=1e-5, abs=0)
    from transformers import AutoModelForCausalLM
    exported = AutoModelForCausalLM.from_pretrained(run_dir / "hf").state_dict()
    single = model.state_dict()
    assert exported.keys() == single.keys()
    for name, tensor in single.items():
        torch.testing.assert_close(exported[name], tensor, rtol=0, atol=1e-5, msg=name)


def test_signalled_job_checkpoints_requeues_and_resumes_exactly(tmp_path, cache, tiny_llama, slurm):
    steps = 40  # the stop lands a step or two after the test's signal (measured: asked at step 2, stopped at 3)
    run_dir = tmp_path / "run"
    job_id = submit(slurm, cache, tmp_path, run_dir, ARGS + [f"--train.max_steps={steps}", "--checkpoint.every=0",
                                                             f"--model.name_or_path={tiny_llama}"])
    deadline = time.time() + 600
    while not (run_dir / "metrics.jsonl").exists() or sum(
            '"loss"' in line for line in (run_dir / "metrics.jsonl").read_text().splitlines()) < 2:
        assert time.time() < deadline and slurm.job(job_id).get("JobState") in ("PENDING", "RUNNING"), \
            f"{slurm.job(job_id)}\n{job_log(tmp_path, job_id)}"
        time.sleep(0.2)
    # what --signal=B:USR1@300 does five minutes before the time limit
    subprocess.run(["scancel", "--signal=USR1", "--batch", job_id], env=slurm.env({}), check=True)
    job = wait_done(slurm, job_id, tmp_path)
    log = job_log(tmp_path, job_id)
    assert job["JobState"] == "COMPLETED", f"{job}\n{log}\n{slurm.logs()}"
    assert int(job["Restarts"]) == 1, f"{job}\n{log}"
    stopped = re.search(r"stopped at step (\d+) \(STOP file\); checkpoint (step_\d+) saved", log)
    assert stopped and int(stopped.group(1)) < steps, log
    assert "requeueing to resume" in log and f"resumed from {run_dir / 'checkpoints' / stopped.group(2)}" in log, log
    assert "restart 1:" in log
    want, _ = reference(tiny_llama, run_dir, steps)
    got, _ = metrics(run_dir)
    gap = max(abs(g - w) / w for g, w in zip(got, want))
    print(f"requeued SLURM job vs the plain loop over {steps} steps: max relative gap {gap:.1e}")
    # measured: 7.9e-6 (100 steps: 1.3e-4); the loop with a 0.1% larger lr departs by 3.9e-3, 1% by 3.2e-2
    assert len(got) == steps and got == pytest.approx(want, rel=1e-4, abs=0)
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == f"step_{steps:08d}"
    assert (run_dir / "hf" / "config.json").exists()


def logged(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    return sum('"loss"' in line for line in path.read_text().splitlines()) if path.exists() else 0


def test_elastic_job_loses_a_node_and_finishes_on_the_other_with_the_uninterrupted_losses(tmp_path, cache,
                                                                                           tiny_llama, slurm):
    """launch/slurm_elastic.sbatch: a torchrun agent per node under srun. At step 8 one node's agent and rank are
    killed with SIGKILL (the node that does not host the rendezvous store: on a real cluster the first node hosts
    it; here both nodes are this machine, so whichever agent bound the port first). The survivor's agent meets
    alone, its rank resumes on 1 rank with twice the accumulation, and the job ends COMPLETED with every step's
    loss the plain loop's."""
    import psutil
    steps = 40
    run_dir = tmp_path / "run"
    job_id = submit(slurm, cache, tmp_path, run_dir, ARGS + [
        f"--train.max_steps={steps}", "--checkpoint.every=4", "--fault.heartbeat_interval=0.5",
        "--checkpoint.export_hf=false", f"--model.name_or_path={tiny_llama}"], script="launch/slurm_elastic.sbatch",
        DSTRAIN_EXIT_BARRIER_TIMEOUT="5")
    deadline = time.time() + 600
    while logged(run_dir) < 8:
        assert time.time() < deadline and slurm.job(job_id).get("JobState") in ("PENDING", "RUNNING"), \
            f"{slurm.job(job_id)}\n{job_log(tmp_path, job_id)}"
        time.sleep(0.1)
    port = int(re.search(r"rendezvous [^ ]+:(\d+),", job_log(tmp_path, job_id)).group(1))
    agents = {}
    for proc in psutil.process_iter(["cmdline"]):
        try:
            if "dstrain.run.elastic_run" in " ".join(proc.info["cmdline"] or []):
                agents[proc.environ()["SLURMD_NODENAME"]] = proc
        except (psutil.Error, KeyError):
            continue
    assert sorted(agents) == ["n1", "n2"], agents
    host = [n for n, p in agents.items() if any(c.laddr.port == port and c.status == psutil.CONN_LISTEN
                                                for c in p.net_connections())]
    assert len(host) == 1, host
    victim = agents["n2" if host == ["n1"] else "n1"]
    doomed = victim.children(recursive=True) + [victim] + [victim.parent()]  # its rank, the agent, elastic.sh
    for proc in doomed:
        proc.kill()
    job = wait_done(slurm, job_id, tmp_path)
    log = job_log(tmp_path, job_id)
    assert job["JobState"] == "COMPLETED" and job["ExitCode"] == "0:0", f"{job}\n{log}\n{slurm.logs()}"
    assert "world changed from 2 to 1" in log and "grad_accum_steps 2 -> 4 keeps the global batch at 16" in log, log
    assert "restart 1 of" not in log, log  # the agents carried it: the script did not start the step again
    ours = [t for t in tracebacks(log) if "dstrain/" in t or "train.py" in t]  # the lost peer is one line
    assert not ours, ours[0]
    starts = [r for r in map(json.loads, (run_dir / "events.jsonl").read_text().splitlines()) if r["event"] == "start"]
    assert [r["world_size"] for r in starts] == [2, 1], starts
    want, _ = reference(tiny_llama, run_dir, steps)
    got, _ = metrics(run_dir)
    assert len(got) == steps and got == pytest.approx(want, rel=1e-5, abs=0)
