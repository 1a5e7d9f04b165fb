"""Optional features, all the same shape, so train() needs no feature-specific branch.

A component is built from the recipe and the raw DeepSpeed JSON when it is turned on, and offers hooks that
train() calls in order for every component:
  validate(setup)            every check, in one pass before anything is built, converted or written:
                             raises UserError naming the conflict and the fix. What DeepSpeed itself cannot
                             combine (pipeline with ZeRO-2/3, sequence with pipeline or tensor parallelism) is
                             checked in ds_config.resolve, which the preflight and the cluster check share
  configure(ds_cfg, setup)   edits to the resolved DeepSpeed config before the engine exists
  load_kwargs(setup)         extra keyword arguments for from_pretrained (QLoRA's quantization_config)
  convert(model, setup)      the model before deepspeed.initialize (returns the model to train)
  attach(engine, setup)      after the engine exists
  after_step(step, say)      at each step boundary
  evaluated()                a context the evaluations run in (DiLoCo streaming: the shared weights swapped in)
  describe()                 what run_info.json records about it
A component with per-rank state for checkpoints sets `stateful = True` and offers
state_dict() / load_state_dict(state, same_world); the checkpointer takes a dict of them by name.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..config import Recipe
from ..parallel.dist import DistContext
from ..parallel.layout import Layout


@dataclass
class Setup:
    """What the components see: everything resolved, nothing built."""
    recipe: Recipe
    layout: Layout
    ds_cfg: dict  # the resolved DeepSpeed config (components may edit it in configure)
    precision: str  # fp32, bf16 or fp16
    model_config: Any  # the Hugging Face config of the model to train
    run_dir: Path
    ctx: DistContext
    log: Callable[[str], None]
    init_from: Path | None = None  # the weights the run starts from instead of model.name_or_path's (--init_from)
    saved_world: int | None = None  # resuming a checkpoint from another data-parallel size: the ranks it was saved on


class Component:
    name = "component"
    stateful = False

    def validate(self, setup: Setup) -> None:
        pass

    def configure(self, ds_cfg: dict, setup: Setup) -> None:
        pass

    def load_kwargs(self, setup: Setup) -> dict:
        return {}

    def convert(self, model, setup: Setup):
        return model

    def attach(self, engine, setup: Setup) -> None:
        pass

    def after_step(self, step: int, say: Callable[[str], None]) -> None:
        pass

    def evaluated(self) -> contextlib.AbstractContextManager:
        """The weights an evaluation measures, when they are not the ones training (entered on every rank)."""
        return contextlib.nullcontext()

    def describe(self) -> dict:
        """What run_info.json records about this component."""
        return {}

    def trained_parameters(self) -> int | None:
        """How many parameters train, when not all of them (LoRA): FLOPs, memory and the log count these."""
        return None

    def state_dict(self) -> dict:
        raise NotImplementedError

    def load_state_dict(self, state: dict, same_world: bool) -> None:
        raise NotImplementedError

    def source_rank(self, rank: int) -> int:
        """On another world, the rank whose saved state `rank` loads: rank 0's (the component keeps what is shared)."""
        return 0


def build(recipe: Recipe, raw_ds: dict) -> list[Component]:
    """The components this recipe and DeepSpeed JSON turn on, in the order their hooks run."""
    from . import (
        chunked_loss,
        compile,
        compression,
        diloco,
        expert_parallel,
        flops_profile,
        lora,
        muon,
        pipeline,
        sequence_parallel,
        tensor_parallel,
        tiled_mlp,
        trace,
    )

    # the chunked loss patches the HF model before lora wraps it (peft passes its keyword arguments through)
    # Ulysses wraps the attention of the model lora returns (peft passes its keyword arguments through)
    found = [pipeline.make(raw_ds), tensor_parallel.make(raw_ds), expert_parallel.make(raw_ds),
             chunked_loss.make(recipe), lora.make(recipe), tiled_mlp.make(recipe), sequence_parallel.make(raw_ds),
             compression.make(recipe), diloco.make(recipe), muon.make(recipe, raw_ds), flops_profile.make(recipe),
             compile.make(recipe), trace.make(recipe)]
    return [c for c in found if c is not None]


def validate_all(components: list[Component], setup: Setup) -> None:
    for component in components:
        component.validate(setup)


def load_kwargs(components: list[Component], setup: Setup) -> dict:
    out: dict = {}
    for component in components:
        out.update(component.load_kwargs(setup))
    return out


def trained_parameters(components: list[Component]) -> int | None:
    found = [c.trained_parameters() for c in components if c.trained_parameters() is not None]
    return found[0] if found else None


@contextlib.contextmanager
def evaluated(components: list[Component]):
    with contextlib.ExitStack() as stack:
        for component in components:
            stack.enter_context(component.evaluated())
        yield


def stateful(components: list[Component]) -> dict[str, Component]:
    """The components whose state goes into checkpoints, by the name their files carry."""
    return {c.name: c for c in components if c.stateful}
