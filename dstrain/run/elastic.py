"""A world the run cannot use, under an elastic launch (DSTRAIN_ELASTIC=1: launch/elastic.sh).

torch's elastic agent forms a world from whichever nodes are there. Outside elastic launches a world the DeepSpeed
config or the checkpoint cannot use is bad input (one line, exit 2); here it is the normal weather of a job whose
nodes come and go, and refusing it would end the job after its restarts. So before the process group exists,
the ranks find the largest world the run can use: a multiple of pipeline x tensor x sequence parallel sizes on
which the global batch splits (a checkpoint's, or the recipe's), and which the newest checkpoint resumes on (a
pipeline or tensor-parallel checkpoint only on its own layout). The first `used` ranks train on it; the others
stand by, doing nothing, until their agent stops them for the next rendezvous round (a node joined or left) or
the run finishes (summary.json written after they began: the run directory is on a shared filesystem in a
multi-node run, where every rank reads the checkpoint). When no world fits (2 pipeline stages, 1 rank left) every
rank stands by: the job waits for more nodes. Either way rank 0 says which in one line and a row of events.jsonl.

The questions asked are the ones train.py asks afterwards (Layout, recipe_accumulation, resume.adapt_to_world), so
the world chosen here is one train.py accepts. torch's agent has no notion of a usable world size (its
--nnodes MIN:MAX counts nodes, not ranks a config can use): this is the part written by hand.
"""
from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

from .. import env
from ..config import Recipe
from ..errors import UserError


@dataclass(frozen=True)
class Fit:
    formed: int  # ranks the agents started
    used: int  # ranks that train: the largest usable world, 0 when none is
    reason: str  # why `formed` is not usable ('' when it is)


def fit(formed: int, raw_ds: dict, recipe: Recipe, accepted_world: int | None, resume_mode: str,
        run_dir: Path) -> Fit:
    """The largest world <= formed that the DeepSpeed config, the global batch and the newest checkpoint allow."""
    from ..parallel.layout import Layout, parallel_sizes, recipe_accumulation
    from . import resume
    from .checkpoint import COMPLETE, Resume

    try:
        newest = resume.resolve_resume(resume_mode, run_dir / "checkpoints")
    except UserError:
        newest = None  # train.py says it, on the world as formed
    start = Resume(newest, json.loads((newest / COMPLETE).read_text())) if newest else None

    def problem(world: int) -> str | None:
        """Why this run cannot train on `world` ranks (train.py's own questions), None when it can."""
        try:
            layout = Layout.from_ds_config(raw_ds, world)
            accum, _ = recipe_accumulation(layout, raw_ds, recipe.train.micro_batch_size,
                                           recipe.train.grad_accum_steps, recipe.world_size, accepted_world)
            if start is not None:
                resume.adapt_to_world(start, replace(recipe.train, grad_accum_steps=accum), layout, log=lambda _: None)
        except UserError as error:
            return str(error)
        return None

    reason = problem(formed)
    if reason is None:
        return Fit(formed, formed, "")
    for world in range(formed - 1, 0, -1):
        if problem(world) is None:
            return Fit(formed, world, reason)
    # none fits: wait for more nodes if a larger world would train; otherwise no world can (bad input): say it
    bound = 4 * max(formed, parallel_sizes(raw_ds).model, (start.manifest.get("world_size") or 0) if start else 0)
    if any(problem(world) is None for world in range(formed + 1, bound + 1)):
        return Fit(formed, 0, reason)
    raise UserError(reason)


def apply(found: Fit, run_dir: Path) -> bool:
    """Say the fit (rank 0) and narrow this rank's launcher variables to the used world; False: stand by."""
    rank, local_rank = env.rank(), env.local_rank()
    if found.used == found.formed:
        return True
    if rank == 0:
        if found.used:
            spare = f"rank {found.used} stands" if found.formed - found.used == 1 else \
                f"ranks {found.used}-{found.formed - 1} stand"
            text = (f"elastic: {found.formed} ranks joined and {found.used} of them train; {spare} by until the "
                    f"nodes change or the run ends ({found.formed} ranks: {found.reason})")
        else:
            text = (f"elastic: waiting for more nodes: no world of at most {found.formed} rank(s) can train this run "
                    f"({found.reason}); every rank stands by until the nodes change")
        print(text, file=sys.stderr, flush=True)
        run_dir.mkdir(parents=True, exist_ok=True)
        with open(run_dir / "events.jsonl", "a") as f:
            f.write(json.dumps({"event": "fit" if found.used else "wait", "time": time.time(),
                                "world_formed": found.formed, "world_used": found.used, "reason": found.reason}) + "\n")
    if rank >= found.used:
        return False
    node_first = rank - local_rank  # torchrun numbers each node's ranks consecutively
    here = min(env.ranks_per_node(), found.used - node_first)
    env.export("WORLD_SIZE", str(found.used))
    for name in ("LOCAL_WORLD_SIZE", "LOCAL_SIZE"):
        if name in os.environ:
            env.export(name, str(here))
    return True


def stand_by(run_dir: Path, poll_s: float = 1.0) -> int:
    """A rank the fitted world leaves out: wait for the agent's SIGTERM (the next round) or the run's end."""
    began = time.time() - 1.0  # file times come from a coarser clock; an older attempt's summary is minutes old
    summary = run_dir / "summary.json"
    while True:
        try:
            if summary.stat().st_mtime >= began:
                return 0
        except FileNotFoundError:
            pass
        time.sleep(poll_s)
