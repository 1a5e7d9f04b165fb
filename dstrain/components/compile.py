"""train.compile: regional torch.compile in the background, or DeepSpeed's engine.compile (dstrain/compiler.py)."""
from __future__ import annotations

from collections.abc import Callable

from .. import compiler
from ..config import Recipe
from ..ds_config import zero_stage
from ..errors import UserError
from . import Component, Setup


class Compile(Component):
    name = "compile"

    def __init__(self, wait: bool):
        self.wait = wait
        self.regional: compiler.RegionalCompile | None = None

    def validate(self, setup: Setup) -> None:
        if setup.layout.is_pipeline:
            raise UserError("train.compile is not supported with pipeline stages; set train.compile=false")

    def attach(self, engine, setup: Setup) -> None:
        self.regional = compiler.install(engine, zero_stage(setup.ds_cfg), setup.layout,
                                         setup.recipe.train.activation_checkpointing, self.wait,
                                         setup.ctx.local_rank, setup.log)

    def describe(self) -> dict:
        return {"wait": self.wait}

    def after_step(self, step: int, say: Callable[[str], None]) -> None:
        if self.regional is not None:  # starts the background compile; switches all ranks when it is done
            self.regional.poll(step, say)


def make(recipe: Recipe) -> Compile | None:
    return Compile(recipe.train.compile_wait) if recipe.train.compile else None
