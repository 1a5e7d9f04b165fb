"""Rollouts: completions sampled from the current weights, each from its own random stream (issue 56).

Completion c of prompt p at step s is sampled with a generator seeded by (seed, s, p, c), so which rank samples
it, and beside which other prompts, does not change it: a run on 1 rank and on 2 ranks draws the same completions
(up to rounding: a row's logits can differ in the last bit with the batch's padding, which flips a draw only
when its uniform falls within that of a token boundary). Written by hand because neither `generate` nor
DeepSpeed's rollout engine (`deepspeed.runtime.rollout.HybridEngineRollout`, which calls `generate`) takes a
generator per row: both draw from the process's global stream, which depends on the batch's composition.

The sampler left-pads the prompts, runs one prefill (once per distinct prompt: a prompt's G copies share it, their
KV cache repeated) and then one token per forward with transformers' KV cache,
and draws each row's token by inverse transform sampling (one uniform per row and token from the row's generator,
over the probabilities after temperature, top-k and top-p). temperature 0 is greedy. A row stops at its first
EOS (kept in the completion); the batch stops when every row has stopped or at `max_new_tokens` (a completion
that reached it without EOS is `truncated`). `keep_going(active)`, when given, decides for the batch, so ranks
that must run the same number of forwards (ZeRO-3 gathers parameters inside each) can agree on it.

Rollout engines. `rl.rollout_engine` names what samples: `sampler` (the above, the default) or a user's engine,
`path/to/file.py:Name` or `package.module:Name`, for vLLM (a server, or colocated) or any other backend on GPUs:
  engine = Name(tokenizer=..., sampling=Sampling(...), eos_token_id=..., pad_token_id=...)   once, at start
  engine(model, prompt_ids, keys) -> list[list[int]]     each rollout: the completion of every prompt (EOS kept
                                                        where one ended it), at most sampling.max_new_tokens each
`model` is the policy being trained (the engine's module: push its weights to the server before generating;
under ZeRO-3 gather them with deepspeed.zero.GatheredParameters on every rank together), `keys` the
(seed, step, prompt place, completion index) of each row, for engines that can seed a row's sampling. An
engine that ignores the keys still trains; only the sampler's rank-count invariance needs them.
"""
from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class Sampling:
    max_new_tokens: int
    temperature: float = 1.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = 0  # 0: off


@dataclass
class Rollouts:
    completion_ids: list[list[int]]  # each completion's tokens, its EOS included when it has one
    truncated: list[bool]  # reached max_new_tokens without EOS


def keep_last(model, count: int) -> dict:
    """`logits_to_keep=count` where the model takes it (every common causal LM in transformers 5 does): the head
    then runs on the last `count` positions only."""
    module = getattr(model, "module", model)
    return {"logits_to_keep": count} if "logits_to_keep" in inspect.signature(module.forward).parameters else {}


def generator_for(key: Sequence[int]) -> torch.Generator:
    """A CPU generator seeded from a key such as (seed, step, prompt index, completion index)."""
    seed = int(np.random.SeedSequence([abs(int(k)) for k in key]).generate_state(1, np.uint64)[0] >> 1)
    return torch.Generator().manual_seed(seed)


def filtered_probs(logits: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """Probabilities (rows x vocabulary, fp32) after temperature, top-k and top-p (the smallest set of the most
    likely tokens whose probability reaches top_p; the most likely token always stays)."""
    logits = logits.float() / sampling.temperature
    if sampling.top_k and sampling.top_k < logits.shape[-1]:
        kth = torch.topk(logits, sampling.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if sampling.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
        before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs  # probability of the more likely tokens
        sorted_probs = sorted_probs.masked_fill(before >= sampling.top_p, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def draw(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Inverse transform sampling: per row, the first token whose cumulative probability exceeds its uniform."""
    cumulative = torch.cumsum(probs, dim=-1)
    picked = torch.searchsorted(cumulative, uniforms.to(cumulative.dtype).unsqueeze(-1) * cumulative[..., -1:])
    return picked.squeeze(-1).clamp(max=probs.shape[-1] - 1)


class Sampler:
    """The built-in engine (`rl.rollout_engine: sampler`): `sample` below on the policy's own forward."""

    def __init__(self, sampling: Sampling, eos_token_id: int, pad_token_id: int, keep_going=None, **_):
        self.sampling, self.eos, self.pad, self.keep_going = sampling, eos_token_id, pad_token_id, keep_going

    def __call__(self, model, prompt_ids: list[list[int]], keys: list[Sequence[int]]) -> list[list[int]]:
        return sample(model, prompt_ids, keys, self.sampling, self.eos, self.pad, self.keep_going).completion_ids


@torch.no_grad()
def sample(model, prompts: list[list[int]], keys: list[Sequence[int]], sampling: Sampling, eos_token_id: int,
           pad_token_id: int, keep_going: Callable[[bool], bool] | None = None) -> Rollouts:
    """Sample one completion per prompt (repeat a prompt with different keys for several); see the module
    docstring. `model`: a Hugging Face causal LM (the engine's module), run in eval mode and put back."""
    if len(prompts) != len(keys):
        raise ValueError(f"{len(prompts)} prompts and {len(keys)} keys")
    device = next(model.parameters()).device
    rows = len(prompts)
    # a prompt's num_generations copies share their prefill: each distinct prompt runs once, then its KV cache,
    # mask and first logits are repeated to its rows (G x fewer prompt tokens through the model)
    distinct: dict[tuple, int] = {}
    where = torch.tensor([distinct.setdefault(tuple(p), len(distinct)) for p in prompts])
    unique = list(distinct)
    width = max(len(p) for p in unique)
    ids = torch.full((len(unique), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros(len(unique), width, dtype=torch.long)
    for i, prompt in enumerate(unique):  # left padding: every prompt ends at the last column
        ids[i, width - len(prompt):] = torch.tensor(prompt, dtype=torch.long)
        mask[i, width - len(prompt):] = 1
    ids, mask, where = ids.to(device), mask.to(device), where.to(device)
    generators = [generator_for(k) for k in keys]
    # transformers 5.24 renamed past_key_values to cache (the old name warns); requirements.txt allows 5.23
    cache_arg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    last = keep_last(model, 1)
    out: list[list[int]] = [[] for _ in range(rows)]
    done = [False] * rows
    was_training = model.training
    model.eval()
    try:
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        step_ids, cache = ids, None
        for n in range(sampling.max_new_tokens):
            result = model(input_ids=step_ids, attention_mask=mask, position_ids=positions, use_cache=True,
                           **last, **{cache_arg: cache})
            cache, logits = getattr(result, cache_arg), result.logits[:, -1]
            if n == 0:  # the prefill ran once per distinct prompt: its rows from here on
                cache.reorder_cache(where)
                logits, mask, positions = logits[where], mask[where], positions[where]
            if sampling.temperature <= 0:
                tokens = logits.argmax(dim=-1).cpu()
            else:
                uniforms = torch.stack([torch.rand((), generator=g) for g in generators])
                tokens = draw(filtered_probs(logits, sampling).cpu(), uniforms)
            for i in range(rows):
                if not done[i]:
                    out[i].append(int(tokens[i]))
                    done[i] = int(tokens[i]) == eos_token_id
            active = not all(done)
            if not (keep_going(active) if keep_going is not None else active):
                break
            step_ids = torch.where(torch.tensor(done), pad_token_id, tokens).unsqueeze(-1).to(device)
            mask = torch.cat([mask, torch.tensor([[0 if d else 1] for d in done], device=device)], dim=-1)
            positions = positions[:, -1:] + 1
    finally:
        model.train(was_training)
    return Rollouts(out, [not d and len(o) == sampling.max_new_tokens for d, o in zip(done, out)])
