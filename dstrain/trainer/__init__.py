"""The training loop's package: a run in phases (docs/architecture.md).

  resolve.py   every input read and checked, nothing built: one frozen `Resolved`
  trainer.py   Trainer: build (engine, data stream, checkpointer, hooks), fit (the loop), finish; its state_dict
               is what a checkpoint's manifest keeps besides DeepSpeed's state
  hooks.py     the step-hook protocol and its ordered list (checks and per-step features)
  steps.py     one optimizer step and one evaluation pass, for any objective
  schedule.py  the recipe's learning-rate schedule
"""
from .resolve import Resolved, resolve
from .trainer import Trainer, log_on_main

__all__ = ["Resolved", "Trainer", "log_on_main", "resolve"]
