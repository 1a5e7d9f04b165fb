"""tensor_parallel.autotp_size > 1: DeepSpeed's AutoTP splits every attention and MLP layer over the ranks of a
tensor-parallel group (the engine does the splitting from the JSON; this component checks the model first).

AutoTP splits attention by heads, so the sizes must divide the model's head counts. Checked in the one validation
pass, from the model's config alone, before any checkpoint is set aside or anything is built (issue 30: it was
checked while the model was being built, after a damaged newer checkpoint had already been renamed).
"""
from __future__ import annotations

from ..errors import UserError
from ..parallel.layout import parallel_sizes
from . import Component, Setup


def check_heads(config, tp: int) -> None:
    """AutoTP splits attention by heads: the sizes must divide evenly."""
    for key in ("num_attention_heads", "num_key_value_heads", "n_head"):
        heads = getattr(config, key, None)
        if heads is not None and heads % tp:
            raise UserError(f"tensor_parallel.autotp_size={tp} does not divide the model's {key}={heads}; "
                            f"choose a size that divides it")


class TensorParallel(Component):
    name = "tensor_parallel"

    def __init__(self, size: int):
        self.size = size

    def validate(self, setup: Setup) -> None:
        check_heads(setup.model_config, self.size)

    def describe(self) -> dict:
        return {"autotp_size": self.size}


def make(raw_ds: dict) -> TensorParallel | None:
    size = parallel_sizes(raw_ds).tensor
    return TensorParallel(size) if size > 1 else None
