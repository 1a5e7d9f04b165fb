"""train.loss_chunk_tokens: the fused, chunked LM head + cross-entropy of dstrain/loss.py."""
from __future__ import annotations

import torch

from .. import loss
from ..config import Recipe
from ..errors import UserError
from . import Component, Setup


class ChunkedLoss(Component):
    name = "loss_chunk_tokens"

    def __init__(self, tokens: int):
        self.tokens = tokens

    def validate(self, setup: Setup) -> None:
        if setup.layout.splits_model:
            raise UserError("train.loss_chunk_tokens is not supported with pipeline stages or tensor parallelism "
                            "(their heads are split or staged); set train.loss_chunk_tokens=0")
        loss.check_precision(self.tokens, setup.precision)
        from transformers import AutoModelForCausalLM
        with torch.device("meta"):  # the model's shape without its weights: nothing is built or read
            shape = AutoModelForCausalLM.from_config(setup.model_config)
        loss.check_model(shape, self.tokens)

    def describe(self) -> dict:
        return {"tokens": self.tokens}

    def convert(self, model, setup: Setup):
        loss.install(model, self.tokens, setup.precision)
        return model


def make(recipe: Recipe) -> ChunkedLoss | None:
    return ChunkedLoss(recipe.train.loss_chunk_tokens) if recipe.train.loss_chunk_tokens else None
