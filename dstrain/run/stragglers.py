"""Slow ranks: a rank whose compute time per step stays above the others' by `fault.straggler_factor` is named.

Compute time is a rank's step time less the time it waited in collectives (comm_counter: the host's time inside a
gloo collective, CUDA events around an NCCL one), so the ranks that wait for a slow one do not look slow
themselves. Every `fault.straggler_every` steps the ranks' mean compute times are all-gathered (one collective of
a float per rank) and each is compared with the median of the others (with two ranks, the other one);
`fault.straggler_checks` windows in a row above the factor name the rank (its host, its time against the
median) in the log, events.jsonl and summary.json. A named rank that recovers is said again.
"""
from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from ..config import FaultConfig


class Stragglers:
    """A step hook (dstrain/trainer/hooks.py's protocol): after each step, its time less its time in collectives."""
    name = "stragglers"
    stopping = False  # it names a rank; the run goes on at that rank's pace

    def __init__(self, cfg: FaultConfig, rank: int, world: int, hosts: list[str], run_dir: Path,
                 say: Callable[[str], None], device: torch.device):
        self.cfg, self.rank, self.world, self.hosts, self.run_dir, self.say, self.device = \
            cfg, rank, world, hosts, run_dir, say, device
        self.on = cfg.straggler_every > 0 and world > 1
        self.compute, self.steps, self.first = 0.0, 0, None
        self.strikes = [0] * world
        self.named: dict[int, dict] = {}  # rank -> what was said when it was named (summary.json)
        self.check_s = 0.0

    def step(self, step: int, seconds: float, comm_s: float) -> dict:
        """A finished step's time and its time in collectives; every straggler_every steps, the comparison
        (the metrics row gets the slowest rank and its ratio)."""
        if not self.on:
            return {}
        began = time.perf_counter()
        self.compute += max(seconds - comm_s, 0.0)
        self.steps += 1
        self.first = self.first or step
        if step % self.cfg.straggler_every:
            self.check_s += time.perf_counter() - began
            return {}
        mine = torch.tensor([self.compute / self.steps], dtype=torch.float64, device=self.device)
        everyone = [torch.zeros_like(mine) for _ in range(self.world)]
        torch.distributed.all_gather(everyone, mine)
        times = [t.item() for t in everyone]
        window = (self.first, step)
        self.compute, self.steps, self.first = 0.0, 0, None
        ratios = [t / max(statistics.median(times[:r] + times[r + 1:]), 1e-9) for r, t in enumerate(times)]
        for r, ratio in enumerate(ratios):
            self.strikes[r] = self.strikes[r] + 1 if ratio > self.cfg.straggler_factor else 0
            if self.strikes[r] == self.cfg.straggler_checks and r not in self.named:
                self._name(r, times, ratios[r], window)
            elif self.strikes[r] == 0 and r in self.named and not self.named[r].get("recovered_at"):
                self.named[r]["recovered_at"] = step
                self.say(f"rank {r} ({self.hosts[r]}) is no longer slow at step {step} ({ratio:.2f}x the median)")
        slowest = max(range(self.world), key=lambda r: ratios[r])
        self.check_s += time.perf_counter() - began
        return {"slowest_rank": slowest, "slowest_ratio": round(ratios[slowest], 3)}

    def _name(self, r: int, times: list[float], ratio: float, window: tuple[int, int]) -> None:
        others = statistics.median(times[:r] + times[r + 1:])
        checked = self.cfg.straggler_checks * self.cfg.straggler_every
        row = {"event": "slow_rank", "time": time.time(), "step": window[1], "rank": r, "host": self.hosts[r],
               "compute_s": round(times[r], 4), "median_s": round(others, 4), "ratio": round(ratio, 2),
               "steps": checked}
        self.named[r] = row
        self.say(f"slow rank: rank {r} on {self.hosts[r]} computed {times[r]:.3f} s per step against the others' "
                 f"median {others:.3f} s ({ratio:.2f}x) in each of the last {self.cfg.straggler_checks} windows of "
                 f"{self.cfg.straggler_every} steps (to step {window[1]}); the whole job runs at its pace: check "
                 f"that host (thermals, clocks, a noisy neighbour) or leave it out (events.jsonl)")
        if self.rank == 0:
            with open(self.run_dir / "events.jsonl", "a") as f:
                f.write(json.dumps(row) + "\n")

    # ---- the step-hook protocol
    def before_step(self, step: int) -> None:
        pass

    def after_update(self, step: int, say: Callable[[str], None]) -> None:
        pass

    def after_step(self, result) -> None:
        result.columns |= self.step(result.step, result.seconds, result.comm_s)

    def before_save(self, step: int) -> bool:
        return True

    def state_dict(self) -> None:  # a resumed run starts its windows afresh
        return None

    def load_state_dict(self, state) -> None:
        pass

    def close(self) -> None:
        pass

    def summary(self) -> dict:
        return {"slow_ranks": self.slow_ranks(), "check_s": self.check_s}

    def slow_ranks(self) -> list[dict]:
        return [{k: v for k, v in row.items() if k not in ("event", "time")} for row in self.named.values()]
