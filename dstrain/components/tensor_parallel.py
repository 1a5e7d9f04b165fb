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


def check_plan(config, tp_section: dict) -> None:
    """AutoTP shards by transformers' tensor-parallel plan where the model has one; a plan with a style DeepSpeed
    cannot apply (OLMo 2, Phi-3, GLM-4, DeepSeek-V3) is one line here instead of a traceback from every rank once
    the model is built. The families it takes were held to fp32 rounding against the unsharded forward on 2 gloo
    ranks (docs/models.md)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    from ..parallel import ds_internals
    try:
        model_class = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    except KeyError:  # remote code: the config's own plan alone
        model_class = None
    why = ds_internals.autotp_plan_problem(config, model_class, tp_section)
    if why:
        family = getattr(config, "model_type", type(config).__name__)
        raise UserError(f"tensor_parallel with {family}: DeepSpeed's AutoTP cannot apply the model's tensor-parallel "
                        f"plan ({why}); use a ds_config without tensor_parallel (ZeRO-3 shards the weights instead)")


class TensorParallel(Component):
    name = "tensor_parallel"

    def __init__(self, size: int):
        self.size = size

    def validate(self, setup: Setup) -> None:
        check_heads(setup.model_config, self.size)
        check_plan(setup.model_config, setup.ds_cfg.get("tensor_parallel") or {})

    def attach(self, engine, setup: Setup) -> None:
        """What AutoTP split, said; nothing split is refused. AutoTP leaves a layer it does not recognise whole on
        every rank: LFM2's convolution layers and Falcon-H1's or GraniteMoeHybrid's Mamba layers, with nothing or one
        head split (on 2 gloo ranks, issue 85), trained exactly but as a replicated model, with autotp_size taken
        and no word."""
        from ..parallel import ds_internals
        module = engine.module
        ends = [getattr(module, f"get_{end}_embeddings", lambda: None)() for end in ("input", "output")]
        split, whole = ds_internals.autotp_split_weights(module, excluding=tuple(ends))
        family = getattr(setup.model_config, "model_type", "the model")
        if not split:
            raise UserError(f"tensor_parallel.autotp_size={self.size} with {family}: AutoTP found no layer to split "
                            f"between the embedding and the head, so every rank would hold and compute the whole "
                            f"model; use a ds_config without tensor_parallel (ZeRO-3 shards the weights instead)")
        share = split * self.size / (split * self.size + whole)
        setup.log(f"tensor parallelism: AutoTP split {share:.0%} of {family}'s weights between the embedding and the "
                  f"head over {self.size} ranks ({whole:,} weights stay whole on every rank)")

    def describe(self) -> dict:
        return {"autotp_size": self.size}


def make(raw_ds: dict) -> TensorParallel | None:
    size = parallel_sizes(raw_ds).tensor
    return TensorParallel(size) if size > 1 else None
