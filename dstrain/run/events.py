"""events.jsonl in the run directory: a row per launch of the run (its nodes, world, the step it starts at) and,
when the membership changed since the previous launch (a node lost or back, an elastic restart, a resume on
another world), who left, who joined, the old and new world, the steps recomputed and the seconds lost. That
change is also said in one line.

A deliberate stop (a signal, a STOP file, train.exit_at_step) writes a `stop` row after its checkpoint; the next
launch then says "resumed after a stop" and counts no time lost: the pause was the user's, not a fault's.

A node is a launcher process on a host (`host/pid`): torchrun's agent, DeepSpeed's launch.py, so two agents on
one machine count as two nodes and a restarted agent as a node that joined.
"""
from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Callable
from pathlib import Path

from .. import env
from ..metrics import read_metrics
from ..parallel.dist import DistContext, all_gather_objects

NAME = "events.jsonl"


def record_start(run_dir: Path, ctx: DistContext, start_step: int, say: Callable[[str], None],
                 zero_stage: int | None = None) -> dict | None:
    """Every rank calls this once the starting step is known, before the metrics log drops the rows a lost
    attempt logged past its checkpoint (those are the steps recomputed). Returns rank 0's row."""
    nodes = sorted(set(all_gather_objects(f"{socket.gethostname()}/{os.getppid()}")))
    if not ctx.is_main:
        return None
    path = run_dir / NAME
    now = time.time()
    row = {"event": "start", "time": now, "step": start_step, "world_size": ctx.world_size, "nodes": nodes,
           "elastic_restart": env.elastic_restart(), "zero_stage": zero_stage}
    events = read_metrics(path)
    previous = [r for r in events if r.get("event") == "start"]
    ends = [r for r in events if r.get("event") in ("start", "stop")]  # elastic's fit/wait rows between them
    stopped = ends[-1] if ends and ends[-1]["event"] == "stop" and ends[-1]["step"] == start_step else None
    if previous:
        before = previous[-1]
        left, joined = sorted(set(before["nodes"]) - set(nodes)), sorted(set(nodes) - set(before["nodes"]))
        row.update(left=left, joined=joined, old_world_size=before["world_size"])
        world = f"world {before['world_size']} -> {ctx.world_size}"
        if before.get("zero_stage") is not None and before["zero_stage"] != zero_stage:  # the user's new config
            row["old_zero_stage"] = before["zero_stage"]
            say(f"ZeRO stage {before['zero_stage']} -> {zero_stage} since the last start (events.jsonl)")
    if previous and stopped:  # a checkpointed stop (a person, a scheduler, an elastic agent re-forming the world)
        row.update(after_stop=stopped["reason"], seconds_lost=0.0, steps_recomputed=0,
                   paused_s=round(now - stopped["time"], 1))
        changed = f"; {world}" if before["world_size"] != ctx.world_size else ""
        say(f"resumed after a stop ({stopped['reason']}) at step {start_step}{changed}; nothing recomputed")
    elif previous:
        done = [r for r in read_metrics(run_dir / "metrics.jsonl") if "loss" in r and "time" in r]
        redone = [r for r in done if r["step"] > start_step]
        last = done[-1] if done else None
        # the wall time since the lost attempt's last step, plus what its steps past the checkpoint had cost
        lost = (now - last["time"] if last else 0.0) + sum(r.get("step_s", 0.0) for r in redone)
        row.update(steps_recomputed=len(redone), seconds_lost=round(lost, 1),
                   last_logged_step=last["step"] if last else None)
        if left or joined or before["world_size"] != ctx.world_size:
            say(f"membership changed: {', '.join(left) or 'none'} left, {', '.join(joined) or 'none'} joined; "
                f"{world}; {len(redone)} step(s) recomputed; {lost:.1f} s lost since step {row['last_logged_step']} "
                f"was logged (events.jsonl)")
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")
    return row


def record_stop(run_dir: Path, ctx: DistContext, step: int, reason: str) -> None:
    """Rank 0 notes a deliberate stop, once its checkpoint at `step` is written (see record_start)."""
    if ctx.is_main:
        with open(run_dir / NAME, "a") as f:
            f.write(json.dumps({"event": "stop", "time": time.time(), "step": step, "reason": reason}) + "\n")
