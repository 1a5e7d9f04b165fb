"""A micro-batch run again beside training, without touching it: what run/health.py's search for the first
non-finite module and run/sdc.py's replay share."""
from __future__ import annotations

import warnings
from contextlib import contextmanager

import torch

from ..objectives.batches import to_device


@contextmanager
def without_parameter_gradients(model):
    """Parameters frozen and the embeddings' output asking for a gradient instead: a forward and backward through
    the module (rerun_loss) then makes activation gradients only, so DeepSpeed's gradient buffers and hooks see
    nothing. torch's warnings that module hooks on ModelOutput-returning modules never fire are silenced."""
    def wants_gradient(_module, _args, output):
        return output.requires_grad_() if isinstance(output, torch.Tensor) and output.is_floating_point() else None

    frozen = [p for p in model.parameters() if p.requires_grad]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        handle = model.get_input_embeddings().register_forward_hook(wants_gradient)
        try:
            for p in frozen:
                p.requires_grad_(False)
            yield
        finally:
            handle.remove()
            for p in frozen:
                p.requires_grad_(True)


def rerun_loss(engine, batch: dict, objective, totals: dict, backward: bool, scale: float = 1.0,
               accumulation: int = 1) -> torch.Tensor:
    """The objective's summed loss of one micro-batch through the module, not the engine (the engine's forward
    hooks its outputs so that any backward through them runs DeepSpeed's gradient reduction,
    DeepSpeedEngine._backward_prologue); inside without_parameter_gradients. The backward starts from
    summed x scale / accumulation, the very operations train_step and engine.backward apply, so a replay's
    gradients round as the step's did in any precision."""
    summed, _ = objective.loss_sum(engine.module, to_device(engine, batch, objective), totals)
    if backward and summed.requires_grad:
        ((summed * scale) / accumulation).backward()
    return summed.detach()
