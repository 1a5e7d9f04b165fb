"""Completions fed to both sides of the comparison with TRL (tests/e2e/test_rl_vs_trl.py), so that nothing is
sampled twice: completion c of a prompt at step s is a pure function of (the prompt's tokens, c, s). A run takes
them through `--rl.rollout_engine=tests/fed_rollouts.py:Fed` (the engine interface users plug vLLM into), TRL's
GRPOTrainer through its `rollout_func`, its RLOOTrainer through `_generate_single_turn` (it has no hook).

The completions have random lengths 1..MAX_LEN, random ordinary tokens, and end with EOS or not (cut: truncated),
so padding, masks and truncation all show; the rewards give NaNs (a function that does not apply) and unscorable
completions (none applies) as well as ordinary values."""
from __future__ import annotations

import hashlib
import random

MAX_LEN = 6
FIRST_ORDINARY = 5  # the tiny tokenizer's special ids are 0..3


def completion(prompt_ids, c: int, step: int, vocab: int, eos: int) -> list[int]:
    seed = int(hashlib.sha256(repr(([int(t) for t in prompt_ids], int(c), int(step))).encode()).hexdigest()[:16], 16)
    rng = random.Random(seed)
    tokens = [rng.randrange(FIRST_ORDINARY, vocab) for _ in range(rng.randint(1, MAX_LEN))]
    if rng.random() < 0.6:
        tokens[-1] = eos
    return tokens


class Fed:
    """A rollout engine (dstrain/objectives/rollout.py's interface) that samples nothing."""

    def __init__(self, tokenizer, sampling, eos_token_id, pad_token_id):
        assert sampling.max_new_tokens >= MAX_LEN
        self.vocab, self.eos = len(tokenizer), eos_token_id

    def __call__(self, model, prompt_ids, keys):
        return [completion(p, key[3], key[1], self.vocab, self.eos) for p, key in zip(prompt_ids, keys)]


def for_trl(prompt_ids: list[list[int]], step: int, vocab: int, eos: int) -> list[list[int]]:
    """TRL's generation batch repeats each prompt G times in a row: occurrence k of a prompt is completion k."""
    seen: dict[tuple, int] = {}
    out = []
    for p in prompt_ids:
        c = seen.get(tuple(p), 0)
        seen[tuple(p)] = c + 1
        out.append(completion(p, c, step, vocab, eos))
    return out


def vowels(prompts, completions, **_):
    """Vowels in the completion's text; None (does not apply) when the text is empty."""
    return [float(sum(ch in "aeiou" for ch in c)) if c.strip() else None for c in completions]


def brevity(prompts, completions, completion_ids, **_):
    """1 / the completion's length in tokens; None for completions of 1 or 2 tokens."""
    return [None if len(ids) <= 2 else 1.0 / len(ids) for ids in completion_ids]
