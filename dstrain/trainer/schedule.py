"""Learning-rate schedule owned by the recipe: linear warmup, then cosine or linear decay to a floor.

Optimizer step s (1-based) uses lr * factor(s):
  s <= warmup:  s / warmup                       (the first step already learns; none is wasted at 0)
  after:        min + (1 - min) * shape(p),  p = (s - warmup) / (total - warmup) in (0, 1]
                shape = (1 + cos(pi p)) / 2 for cosine, 1 - p for linear, 1 for constant
DeepSpeed's own schedulers spend their first two steps at lr 0, so "auto" in a DeepSpeed JSON selects
this one; an explicit DeepSpeed scheduler type in the JSON is used as written.
"""
from __future__ import annotations

import functools
import math

import torch


def lr_factor(step_index: int, warmup: int, total: int, kind: str, min_ratio: float) -> float:
    """Multiplier of the base lr for 0-based optimizer step `step_index` (LambdaLR's convention)."""
    s = step_index + 1
    if s <= warmup:
        return s / warmup
    if kind == "constant":
        return 1.0
    progress = min(1.0, (s - warmup) / max(1, total - warmup))
    shape = (1 + math.cos(math.pi * progress)) / 2 if kind == "cosine" else 1 - progress
    return min_ratio + (1 - min_ratio) * shape


def make(optimizer, train) -> torch.optim.lr_scheduler.LambdaLR:
    factor = functools.partial(lr_factor, warmup=min(train.warmup_steps, train.max_steps), total=train.max_steps,
                               kind=train.lr_schedule, min_ratio=train.min_lr_ratio)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
