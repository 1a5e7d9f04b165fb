"""A frozen second model beside the one being trained: RL's reference (rl.beta > 0), a distillation teacher.

Built as TRL builds its reference (trl.models.utils.prepare_deepspeed): the same model loader as the policy, then
`deepspeed.initialize` without an optimizer under the run's DeepSpeed config stripped of its training blocks.
Under ZeRO-3 it is partitioned over the ranks like the policy (built inside zero.Init, so no rank ever holds it
whole) and each forward gathers its parameters, so every rank must run as many of its forwards; under ZeRO-0/1/2
every rank holds it whole (stage 0), in the run's precision. Nothing in it trains or is checkpointed: a resumed
run builds it again from the same weights.
"""
from __future__ import annotations

import copy
from dataclasses import replace

from ..config import ModelConfig, TrainConfig


def inference_config(ds_cfg: dict) -> dict:
    """The run's DeepSpeed config for a model that only runs forwards: no optimizer, scheduler or optimizer
    offload; ZeRO-3 kept (partitioned), any other stage made 0 (whole on every rank)."""
    cfg = copy.deepcopy(ds_cfg)
    cfg.pop("optimizer", None)
    cfg.pop("scheduler", None)
    zero = cfg.setdefault("zero_optimization", {})
    zero.pop("offload_optimizer", None)
    if int(zero.get("stage", 0)) != 3:
        cfg["zero_optimization"] = {"stage": 0}
    return cfg


def build(model_cfg: ModelConfig, train: TrainConfig, ds_cfg: dict, tokenizer):
    """(the frozen model's DeepSpeed engine in eval mode, the HfDeepSpeedConfig that must live as long as it)."""
    import deepspeed

    from .. import model as models
    cfg = inference_config(ds_cfg)
    module, hf_ds_config = models.build(model_cfg, replace(train, activation_checkpointing=False), cfg, tokenizer)
    module.requires_grad_(False)
    engine, *_ = deepspeed.initialize(model=module, config=cfg)
    engine.eval()
    return engine, hf_ds_config
