"""`--plan --trial K`: the top K candidates run as real train.py jobs on the same ranks, a few steps each.

Each rank of the plan starts one child train.py with its own rank variables and a fresh rendezvous port (rank 0
picks it and broadcasts it), so the trial runs on exactly the ranks, nodes and network of the real run under any
launcher (deepspeed, torchrun, srun). The parents wait in no collective while a trial runs. A trial writes into
<run dir>/plan/trial-<i>/ (no checkpoints kept, no export) and is timed from its metrics.jsonl: the median step
time after the first TRIAL_SKIP steps (warm-up). Gradient compression's warm-up of uncompressed steps is cut to
1 step in a trial, so the measured steps are the compressed ones the prediction describes. A DiLoCo trial syncs
at its last step: measured is the inner steps' median plus 1/H of what the sync step took beyond it (the mean
step over H steps, which the prediction describes).
"""
from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

import torch
import torch.distributed as tdist

from ..metrics import read_metrics
from ..parallel.dist import free_port

TRIAL_STEPS = 6
TRIAL_SKIP = 2
DROPPED = {"--plan": 0, "--trial": 1, "--output_dir": 1, "--ds_config": 1, "--resume": 1, "--plan_max_mb": 1}


def child_arguments(argv: list[str]) -> list[str]:
    """The plan's own command line without the planner's options (and the launcher's --local_rank)."""
    out, skip = [], 0
    for item in argv:
        if skip:
            skip -= 1
            continue
        key = item.split("=", 1)[0]
        if key.startswith("--local_rank"):
            continue
        if key in DROPPED:
            skip = DROPPED[key] if "=" not in item else 0
            continue
        out.append(item)
    return out


def pick(preds: list, k: int) -> list:
    """The K fastest predicted candidates that fit, at most two per strategy (micro-batch variants of one
    strategy rarely change the order between strategies)."""
    chosen, per_name = [], {}
    for p in preds:
        if not p.fits or per_name.get(p.candidate.name, 0) >= 2:
            continue
        per_name[p.candidate.name] = per_name.get(p.candidate.name, 0) + 1
        chosen.append(p)
        if len(chosen) == k:
            break
    return chosen


def trial_overrides(candidate, steps: int = TRIAL_STEPS) -> list[str]:
    """The candidate's recipe overrides, with gradient compression's uncompressed warm-up cut to one step (a
    trial of a few steps would otherwise time the plain all-reduce). DiLoCo syncs at the trial's last step only
    (diloco.every may not exceed the run): the median step times the inner steps, and the prediction's 1/H share
    of a sync is measured from the last step (measured_step_s). With diloco.warmup_steps the trial averages up to
    its first timed step (TRIAL_SKIP + 1), whose sync is the averaged steps' (measured_step_s weighs it by their
    share of the run). Streaming DiLoCo's trial syncs the whole model at once (diloco.fragments=1, overlap=0): a
    trial of a few steps would send its fragments far more often than the run does, and the whole sync's share is
    the same work (on GPUs an upper bound: the prediction hides the crossing behind the overlapped steps; on CPUs
    nothing hid, bench/streaming.py)."""
    out = candidate.overrides() + (["--compression.warmup_steps=1"] if candidate.compression != "none" else [])
    if candidate.diloco_every and tuple(candidate.diloco_stream) != (1, 0):
        out += ["--diloco.fragments=1", "--diloco.overlap=0"]
    if candidate.diloco_warmup:
        out.append(f"--diloco.warmup_steps={TRIAL_SKIP + 1 if candidate.diloco_every >= steps else 0}")
    return out + ([f"--diloco.every={steps}"] if candidate.diloco_every > steps else [])


def measured_step_s(rows: list[dict], diloco_every: int, steps: int, averaged: float = 0.0) -> float | None:
    """The trial's step time from its metrics rows: the median after TRIAL_SKIP steps. With DiLoCo the last step
    holds the trial's one sync: the inner steps' median plus 1/H of the sync step's excess over it. averaged: the
    share of the run's steps that diloco.warmup_steps syncs (Prediction.detail's averaged_share); the trial's
    first timed step is one of them (trial_overrides), and its excess over the median counts in that share."""
    timed = {r["step"]: r["step_s"] for r in rows if r["step"] > TRIAL_SKIP}
    if not diloco_every:
        return statistics.median(timed.values()) if timed else None
    if diloco_every < steps:  # syncs inside the trial: the mean holds them in their share
        return statistics.mean(timed.values()) if timed else None
    first = TRIAL_SKIP + 1 if averaged else 0
    inner = [s for step, s in timed.items() if first < step < steps]
    if not inner or steps not in timed or (averaged and first not in timed):
        return None
    median = statistics.median(inner)
    out = median + (1 - averaged) * max(timed[steps] - median, 0.0) / diloco_every
    return out + (averaged * max(timed[first] - median, 0.0) if averaged else 0.0)


def run(preds: list, k: int, argv: list[str], out: Path, ctx, log, steps: int = TRIAL_STEPS):
    """Run the top K; print measured against predicted; return the measured fastest (a Prediction)."""
    chosen = pick(preds, k)
    base = child_arguments(argv)
    results = []
    for i, pred in enumerate(chosen, 1):
        folder = out / f"trial-{i}"
        if ctx.is_main:
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir(parents=True)
            (folder / "ds.json").write_text(json.dumps(pred.candidate.ds, indent=1))
        port = _shared_port(ctx)
        tdist.barrier()  # the folder exists before any child starts
        args = [sys.executable, str(Path(__file__).resolve().parents[2] / "train.py"), *base,
                "--ds_config", str(folder / "ds.json"), "--output_dir", str(folder / "run"), "--resume", "never",
                *trial_overrides(pred.candidate, steps), f"--train.max_steps={steps}", "--train.exit_at_step=null",
                "--checkpoint.every=0", "--checkpoint.export_hf=false", "--checkpoint.keep_last=1",
                "--eval.every=0", "--eval.max_batches=1", "--log.progress_bar=false", "--log.wandb=false",
                "--log.plot=false"]
        # under torchrun the ranks' store is the agent's (TORCHELASTIC_USE_AGENT_STORE=True): no child would host one
        # on the new port, and every trial hung at its rendezvous; the children's rank 0 hosts it, as elsewhere
        env = dict(os.environ, MASTER_PORT=str(port), TORCHELASTIC_USE_AGENT_STORE="False")
        log(f"plan: trial {i}/{len(chosen)}: {pred.candidate.name} micro {pred.candidate.micro} x "
            f"{pred.candidate.accum}{' AC' if pred.candidate.checkpointing else ''}, {steps} steps")
        with open(folder / f"rank{ctx.rank}.log", "w") as stream:
            code = subprocess.run(args, env=env, stdout=stream, stderr=subprocess.STDOUT).returncode
        codes = torch.tensor([code], dtype=torch.int64)
        tdist.all_reduce(codes, op=tdist.ReduceOp.MAX)
        measured = None
        if ctx.is_main:
            rows = [r for r in read_metrics(folder / "run" / "metrics.jsonl") if "step_s" in r]
            measured = measured_step_s(rows, pred.candidate.diloco_every, steps,
                                       pred.detail.get("averaged_share", 0.0)) if codes.item() == 0 else None
            # the inner steps' and the last sync's waits: the averaged step's (diloco.warmup_steps) is left out
            first = TRIAL_SKIP + (1 if pred.detail.get("averaged_share") else 0)
            comm = [r.get("comm_s") for r in rows if r["step"] > first and r.get("comm_s") is not None]
            results.append((pred, measured, statistics.median(comm) if comm else None))
            if measured is None:
                log(f"plan: trial {i} failed (exit {codes.item()}); see {folder}/rank0.log")
            shutil.rmtree(folder / "run" / "checkpoints", ignore_errors=True)
    if not ctx.is_main:
        return chosen[0]
    log(report(results))
    done = [(p, m) for p, m, _ in results if m is not None]
    if not done:
        return chosen[0]
    best = min(done, key=lambda pm: pm[1])[0]
    (out / "trials.json").write_text(json.dumps([
        {"name": p.candidate.name, "micro_batch_size": p.candidate.micro, "grad_accum_steps": p.candidate.accum,
         "activation_checkpointing": p.candidate.checkpointing, "diloco_warmup_steps": p.candidate.diloco_warmup,
         "predicted_step_s": p.step_s,
         "predicted_comm_s": p.exposed_comm_s, "measured_step_s": m, "measured_comm_s": c}
        for p, m, c in results], indent=1))
    return best


def report(results: list) -> str:
    lines = ["plan: trials, measured against predicted (median step after the first "
             f"{TRIAL_SKIP}; comm: time waited in collectives, rank 0)",
             f"  {'strategy':<18}{'micro x acc':>12}{'AC':>4}{'predicted':>11}{'measured':>10}{'error':>8}"
             f"{'comm pred':>11}{'comm meas':>11}"]
    for p, m, c in results:
        c_ = p.candidate
        error = f"{(p.step_s - m) / m:+.0%}" if m else "-"
        lines.append(f"  {c_.name:<18}{f'{c_.micro} x {c_.accum}':>12}{'on' if c_.checkpointing else '':>4}"
                     f"{p.step_s:>10.3f}s{(f'{m:.3f}s' if m else 'failed'):>10}{error:>8}"
                     f"{p.exposed_comm_s:>10.3f}s{(f'{c:.3f}s' if c is not None else '-'):>11}")
    done = [(p, m) for p, m, _ in results if m]
    if done:
        best = min(done, key=lambda pm: pm[1])[0]
        first = results[0][0].candidate
        lines.append(f"  measured fastest: {best.candidate.name} micro {best.candidate.micro} x {best.candidate.accum}"
                     + (" (the model's first choice too)" if best is results[0][0] else
                        f" (the model ranked {first.name} micro {first.micro} x {first.accum} first)"))
    return "\n".join(lines)


def _shared_port(ctx) -> int:
    """A free port on rank 0's host (where the trial's rendezvous store listens), the same on every rank."""
    port = 0
    if ctx.is_main:
        port = free_port()
    value = torch.tensor([port], dtype=torch.int64)
    tdist.broadcast(value, src=0)
    return int(value.item())
