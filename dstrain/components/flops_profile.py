"""log.flops_profile_step: DeepSpeed's flops profiler for one step, on rank 0 (dstrain/flops.py)."""
from __future__ import annotations

from .. import flops
from ..config import Recipe
from ..parallel import ds_internals
from . import Component, Setup


class FlopsProfile(Component):
    name = "flops_profile"

    def __init__(self, step: int):
        self.step = step

    def describe(self) -> dict:
        return {"step": self.step}

    def configure(self, ds_cfg: dict, setup: Setup) -> None:
        ds_cfg["flops_profiler"] = flops.profiler_config(self.step, str(setup.run_dir / "flops_profile.txt"))

    def attach(self, engine, setup: Setup) -> None:
        ds_internals.profile_one_step(engine, bool(setup.ds_cfg.get("wall_clock_breakdown", False)))


def make(recipe: Recipe) -> FlopsProfile | None:
    return FlopsProfile(recipe.log.flops_profile_step) if recipe.log.flops_profile_step else None
