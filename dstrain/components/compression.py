"""Gradient compression (PowerSGD, block-sign) chosen by the DeepSpeed JSON's gradient_compression key."""
from __future__ import annotations

import dataclasses
import sys

from .. import compression
from . import Component, Setup


class GradientCompression(Component):
    name = "compression"  # checkpoint files: compression_rank<R>.pt

    def __init__(self, config: compression.CompressionConfig):
        self.config = config
        self.reducer: compression.Reducer | None = None
        self.is_main = False

    @property
    def stateful(self) -> bool:  # no reducer on a data-parallel world of one: nothing to save
        return self.reducer is not None

    def attach(self, engine, setup: Setup) -> None:
        self.reducer = compression.install(engine, self.config, setup.layout)
        self.is_main = setup.ctx.is_main

    def describe(self) -> dict:
        return dataclasses.asdict(self.config)

    def state_dict(self) -> dict:
        return self.reducer.state_dict()

    def load_state_dict(self, state: dict, same_world: bool) -> None:
        """Another data-parallel world: the per-rank residuals have no owner, so only the factors carry over."""
        self.reducer.load_state_dict(state, errors=same_world)
        if not same_world and self.is_main:
            print("warning: the data-parallel world changed, so the gradient-compression residuals were dropped "
                  "(the low-rank factors carry over)", file=sys.stderr)


def make(raw_ds: dict) -> GradientCompression | None:
    config = compression.parse(raw_ds)
    return GradientCompression(config) if config.enabled else None
