"""The training objective: what a step minimises, as one seam (like torchtitan's build_loss_fn).

`Objective` below names every part, required and optional; `make(recipe)` chooses the objective from
`data.format` through the one table `KINDS`, which also answers what the preflight and the sweeps ask before
anything is built (rows per sample, the evaluation's figures). dstrain/trainer/steps.py runs any objective the
same way: the gradient of a step is that of the loss normalised over the whole global batch, however it is spread
over micro-batches and ranks (objectives/batches.py counts the global batch).

  causal_lm.py   next-token cross-entropy: pretraining and SFT (chunked head, sequence parallel, pipeline)
  preference.py  DPO and its kin on chosen/rejected pairs (`data.format: preference`, the `preference` section)
  rl.py          GRPO and its kin on prompts, learning from rewards (`data.format: prompt`, the `rl` section), with
                 rl_math.py (losses, advantages), rewards.py (reward functions), rollout.py (seeded sampling)
"""
from __future__ import annotations

import importlib
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from ..config import Recipe

if TYPE_CHECKING:  # the preflight and the sweeps' checks ask this package without needing torch
    import torch


@runtime_checkable
class Objective(Protocol):
    """What the loop asks of an objective. Required:"""
    name: str
    primary: str  # the key of counts() the step's summed loss is divided by (label_tokens, pairs, completions)
    perplexity: bool  # whether exp(eval loss) means anything

    def validate(self, setup) -> None:
        """Every check, in the one validation pass before anything is built (the components' Setup)."""

    def counts(self, batch: dict[str, torch.Tensor]) -> dict[str, float]:
        """What the loss is normalised by, counted on the host per micro-batch and summed over the global batch."""

    def real_tokens(self, batch: dict[str, torch.Tensor]) -> int:
        """Input tokens that are not padding: throughput and MFU count work."""

    def host_batch(self, batch: dict[str, torch.Tensor], model) -> dict[str, torch.Tensor]:
        """The micro-batch as the model takes it, made on the host before the copy to the device."""

    def loss_sum(self, model, batch: dict[str, torch.Tensor], totals: dict[str, float]
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(summed loss, summed statistics as a 1-d tensor or None): the step's loss is the sum over the global
        batch divided by totals[primary]."""

    def metrics(self, stats: list[float], totals: dict[str, float]) -> dict[str, float]:
        """The logged figures, from the statistics summed over the global batch."""

    def before_training(self, engine, datasets: list, setup, data_cache: Path | None, weights: str) -> list:
        """Work before the first step, with the engine built (preference: the reference model's log-probs, kept
        under `data_cache` and keyed by `weights`, the base weights' fingerprint); returns the datasets to train
        and evaluate on."""


# Optional parts, found with optional_part() so that their absence has one meaning everywhere:
#   prepare(engine, batches, layout, step) -> batches   makes a step's micro-batches from the stream's before
#                                   anything is counted (RL: the rollout, the rewards, the advantages); evaluation too
#   steps_per_batch: int (1)        optimizer steps that train on one batch of the stream; the trainer reads batch
#                                   (step - 1) // it and saves and stops only at a multiple of it (RL's num_iterations)
#   step_hooks(say) -> list         the objective's own step hooks (trainer/hooks.py), after the components' (next-
#                                   token prediction on an MoE model: moe.RouterWatch over its routing figures)
OPTIONAL = ("prepare", "steps_per_batch", "step_hooks")


def optional_part(objective, name: str, default: Any = None) -> Any:
    assert name in OPTIONAL, name
    return getattr(objective, name, default)


# data.format -> (module, class, the recipe section its constructor takes): the one place an objective is chosen
KINDS: dict[str, tuple[str, str, str | None]] = {
    "preference": ("preference", "Preference", "preference"),
    "prompt": ("rl", "RL", "rl"),
}
DEFAULT_KIND = ("causal_lm", "CausalLM", None)  # text, sft and chat: next-token prediction


def kind_of(recipe: Recipe):
    """The objective class for this recipe's data.format, and the recipe section it is built from."""
    module, cls, section = KINDS.get(recipe.data.format, DEFAULT_KIND)
    return getattr(importlib.import_module(f".{module}", __name__), cls), section


def make(recipe: Recipe) -> Objective:
    cls, section = kind_of(recipe)
    return cls(getattr(recipe, section)) if section else cls()


def sequences_per_sample(recipe: Recipe) -> int:
    """Rows of seq_len tokens one sample puts through the model (a preference pair is two: chosen and rejected;
    a prompt rl.num_generations). The preflight's activations and the planner's step time count them."""
    return kind_of(recipe)[0].sequences_per_sample(recipe)


def evaluation_keys(recipe: Recipe) -> list[str]:
    """The figures an evaluation writes to metrics.jsonl for this recipe (what a sweep may optimise), as fnmatch
    patterns: `eval_loss`, then perplexity, or the objective's own figures with the `eval_` prefix."""
    return kind_of(recipe)[0].evaluation_keys(recipe)
