"""train.mlp_chunk_tokens: every decoder MLP computed a slice of the sequence at a time, with DeepSpeed's TiledMLP
(deepspeed.runtime.sequence_parallel.ulysses_sp, Arctic Long Sequence Training).

At long sequences the MLP's intermediate activations (tokens x intermediate_size, three of them for SwiGLU) are the
largest tensors of a layer. TiledMLP runs the MLP without keeping them, one slice of tokens at a time, and
recomputes each slice in backward: the MLP's activation memory becomes that of one slice, for one more MLP
forward per step. It tells ZeRO not to reduce a weight's gradient until the last slice has added to it
(ds_grad_is_ready). Applied by replacing each MLP instance's forward (the class and its weights are untouched,
so checkpoints and export do not change); works under every ZeRO stage, LoRA (peft's layers inside the MLP)
and sequence parallelism (a rank's slice of the sequence is cut further).
"""
from __future__ import annotations

import math
import types

import torch

from ..errors import UserError
from . import Component, Setup

GATED = ("gate_proj", "up_proj", "down_proj")  # the Llama family's SwiGLU MLP (Llama, Mistral, Qwen2/3, ...)


def mlps(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The decoder layers' MLP modules: a `mlp` child of each decoder layer."""
    return [m.mlp for m in model.modules() if isinstance(getattr(m, "mlp", None), torch.nn.Module)]


class TiledMlp(Component):
    name = "mlp_chunk_tokens"

    def __init__(self, tokens: int):
        self.tokens = tokens

    def validate(self, setup: Setup) -> None:
        if setup.layout.splits_model or setup.recipe.train.compile:
            raise UserError("train.mlp_chunk_tokens is not supported with pipeline stages, tensor parallelism or "
                            "train.compile; set train.mlp_chunk_tokens=0")
        from ..vision import model_class
        with torch.device("meta"):  # the model's shape without its weights
            shape = model_class(setup.model_config).from_config(setup.model_config)
        found = mlps(shape)
        if not found or not all(hasattr(m, name) for m in found for name in GATED):
            raise UserError(f"train.mlp_chunk_tokens needs decoder layers with a gated MLP (gate_proj, up_proj, "
                            f"down_proj: Llama, Mistral, Qwen); {type(shape).__name__} has none; set "
                            f"train.mlp_chunk_tokens=0")

    def convert(self, model, setup: Setup):
        for mlp in mlps(model):
            install(mlp, self.tokens)
        return model

    def describe(self) -> dict:
        return {"tokens": self.tokens}


def install(mlp: torch.nn.Module, tokens: int) -> None:
    """Route mlp(x) through TiledMLP in slices of at most `tokens` tokens (one slice: the plain forward)."""
    from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledMLP

    plain = type(mlp).forward  # the class's own forward, called on each slice

    def forward(self, x):
        slices = math.ceil(x.shape[:-1].numel() / tokens)  # every rank has the same shape: no agreement needed
        if slices <= 1:
            return plain(self, x)
        return TiledMLP.apply(plain, self, x, slices, list(self.parameters()))

    mlp.forward = types.MethodType(forward, mlp)


def make(recipe) -> TiledMlp | None:
    return TiledMlp(recipe.train.mlp_chunk_tokens) if recipe.train.mlp_chunk_tokens else None
