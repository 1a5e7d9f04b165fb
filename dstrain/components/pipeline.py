"""Pipeline stages (the DeepSpeed JSON's pipeline.stages): the same HF modules regrouped into stages."""
from __future__ import annotations

from .. import pipeline
from ..checkpoint import write_pipeline_names
from ..errors import UserError
from ..layout import parallel_sizes
from . import Component, Setup


class Pipeline(Component):
    name = "pipeline"

    def __init__(self, stages: int):
        self.stages = stages

    def validate(self, setup: Setup) -> None:
        if setup.recipe.data.packing:  # stages pass hidden states only: no position_ids reach the attention
            raise UserError(f"data.packing with pipeline stages ({self.stages}) is not supported; set "
                            f"data.packing=false or use a ZeRO config")

    def describe(self) -> dict:
        return {"stages": self.stages}

    def convert(self, model, setup: Setup):
        piped = pipeline.convert(model, self.stages, setup.ds_cfg["pipeline"].get("partition_method", "parameters"),
                                 setup.recipe.train.activation_checkpointing)
        write_pipeline_names(setup.run_dir, piped.hf_names, setup.ctx)
        return piped.module


def make(raw_ds: dict) -> Pipeline | None:
    stages = parallel_sizes(raw_ds).pipeline
    return Pipeline(stages) if stages > 1 else None
