"""The training objective: what a step minimises, as one seam (like torchtitan's build_loss_fn).

An objective owns, for its data format:
  counts(batch) -> dict               what the loss is normalised by, counted on the host per micro-batch and
                                      summed over the global batch before the step (`primary` is the divisor)
  real_tokens(batch) -> int           input tokens that are not padding (throughput and MFU count work)
  loss_sum(model, batch, totals)      (summed loss: the step's loss is its sum over the global batch divided by
                                      totals[primary], summed statistics: a 1-d tensor or None)
  metrics(stats, totals) -> dict      the logged figures from the statistics summed over the global batch
  perplexity                          whether exp(eval loss) means anything
  validate(setup), before_training(...) the one validation pass; work before the first step (reference log-probs)
  prepare(engine, batches, layout, step)  optional: makes a step's micro-batches from the stream's before anything
                                      is counted (RL: the rollout, the rewards and the advantages); evaluation too
  steps_per_batch                     optional (1): optimizer steps that train on one batch of the stream; train.py
                                      reads batch (step - 1) // it and saves and stops only at a multiple of it
                                      (RL's num_iterations: a rollout batch's later updates)
steps.py runs any objective the same way: the gradient of a step is that of the loss normalised over the whole
global batch, however it is spread over micro-batches and ranks.

  causal_lm.py   next-token cross-entropy: pretraining and SFT (chunked head, sequence parallel, pipeline)
  preference.py  DPO and its kin on chosen/rejected pairs (`data.format: preference`, the `preference` section)
  rl.py          GRPO and its kin on prompts, learning from rewards (`data.format: prompt`, the `rl` section), with
                 rl_math.py (losses, advantages), rewards.py (reward functions), rollout.py (seeded sampling)
"""
from __future__ import annotations

from ..config import Recipe


def sequences_per_sample(recipe: Recipe) -> int:
    """Rows of seq_len tokens one sample puts through the model: a preference pair is two (chosen and rejected,
    one forward of 2B rows). The preflight's activations and the planner's step time count them."""
    if recipe.data.format == "prompt":  # each prompt becomes rl.num_generations prompt + completion rows
        return recipe.rl.num_generations
    return 2 if recipe.data.format == "preference" else 1


def evaluation_keys(recipe: Recipe) -> list[str]:
    """The figures an evaluation writes to metrics.jsonl for this recipe (what a sweep may optimise), as fnmatch
    patterns: `eval_loss`, then perplexity, or the objective's own figures with the `eval_` prefix."""
    if recipe.data.format == "preference":
        from .preference import ORPO_STATS, STATS
        return ["eval_loss"] + [f"eval_{name}" for name in STATS + (ORPO_STATS if recipe.preference.loss == "orpo"
                                                                    else ())]
    if recipe.data.format == "prompt":
        from .rl import EVAL_KEYS
        keys = [key for key, wanted in EVAL_KEYS.items() if wanted(recipe.rl)]
        return ["eval_loss"] + [f"eval_{key}" for key in keys]
    return ["eval_loss", "perplexity"]


def make(recipe: Recipe):
    if recipe.data.format == "preference":
        from .preference import Preference
        return Preference(recipe.preference)
    if recipe.data.format == "prompt":
        from .rl import RL
        return RL(recipe.rl)
    from .causal_lm import CausalLM
    return CausalLM()
