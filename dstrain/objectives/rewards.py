"""Reward functions for learning from rewards (issue 56), in TRL's convention so users bring what they have:
`fn(prompts, completions, completion_ids, **columns) -> list[float | None]`, one value per completion, None where
the function does not apply (a completion every function skips is unscorable: advantage 0).

A reward is named in the recipe as
  `path/to/file.py:function`   a file (relative to the working directory, as data.path is)
  `package.module:function`    anything importable, e.g. `trl.rewards:think_format_reward`
  `exact_answer`               built in: the completion's final answer equals the row's `answer` column
  `format_regex`               built in, made with a pattern: the whole completion matches it
  `overlong_penalty`           built in: DAPO's soft length penalty over the last rl.overlong_cache tokens
TRL's own reward functions serve as they are (e.g. `trl.rewards:think_format_reward`).

score() calls each function once on a rollout batch and combines them as TRL does (weights, None -> NaN,
nansum). A function that raises, returns the wrong number of values, or a value that is not a finite number, is
one line naming the function and the completion's index (found by calling it on one completion at a time).
"""
from __future__ import annotations

import importlib
import importlib.util
import math
import numbers
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import UserError


def _text(completion) -> str:
    """A completion as text: a string, or TRL's conversational form (a list of messages)."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, list) and completion and isinstance(completion[-1], dict):
        return str(completion[-1].get("content", ""))
    return str(completion)


_BOXED = re.compile(r"\\boxed\{([^{}]*)\}")
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def final_answer(text: str) -> str:
    """The answer a text ends with: the last \\boxed{...}, else what follows GSM8K's '####', else the last number,
    else the last line; normalised (case, surrounding space and punctuation, thousands separators)."""
    boxed = _BOXED.findall(text)
    if boxed:
        answer = boxed[-1]
    elif "####" in text:
        answer = text.rsplit("####", 1)[1]
    else:
        numbers = _NUMBER.findall(text)
        answer = numbers[-1] if numbers else (text.strip().splitlines() or [""])[-1]
    answer = answer.strip().strip(".").strip().lower()
    return answer.replace(",", "") if _NUMBER.fullmatch(answer) else answer


def exact_answer(prompts, completions, answer=None, **_) -> list[float | None]:
    """1.0 where the completion's final answer equals the `answer` column's (both read by final_answer), 0.0
    where not, None for rows without an answer."""
    if answer is None:
        raise UserError("the built-in reward exact_answer needs an `answer` column in the data")
    return [None if ref is None else float(final_answer(_text(c)) == final_answer(str(ref)))
            for c, ref in zip(completions, answer)]


def format_regex(pattern: str) -> Callable:
    """A reward of 1.0 where the whole completion matches `pattern` (re.DOTALL), else 0.0."""
    try:
        compiled = re.compile(pattern, re.DOTALL)
    except re.error as e:
        raise UserError(f"format_regex: the pattern {pattern!r} is not a regular expression ({e})") from None

    def format_reward(prompts, completions, **_) -> list[float]:
        return [float(compiled.fullmatch(_text(c)) is not None) for c in completions]
    return format_reward


def overlong_penalty(max_completion_length: int, cache: int) -> Callable:
    """DAPO's soft overlong punishment (its Eq. 13; TRL's get_soft_overlong_punishment, a development dependency
    here, so written out): 0 up to max_completion_length - cache tokens, then falling linearly to -1 at
    max_completion_length, -1 beyond."""
    start = max_completion_length - cache

    def overlong_penalty(prompts=None, completions=None, completion_ids=None, **_) -> list[float]:
        return [0.0 if len(ids) <= start else -1.0 if len(ids) > max_completion_length
                else (start - len(ids)) / cache for ids in completion_ids]
    return overlong_penalty


BUILTINS: dict[str, Callable] = {"exact_answer": exact_answer}
FACTORIES: dict[str, Callable] = {"format_regex": format_regex, "overlong_penalty": overlong_penalty}


@dataclass
class Reward:
    name: str
    fn: Callable


def load(spec: str, **params) -> Reward:
    """The reward function `spec` names (see the module docstring); `params` make a built-in factory's."""
    if spec in BUILTINS:
        return Reward(spec, BUILTINS[spec])
    if spec in FACTORIES:
        return Reward(spec, FACTORIES[spec](**params))
    fn = load_named(spec, "reward", f"name a built-in ({', '.join([*BUILTINS, *FACTORIES])}) or ")
    return Reward(spec.rpartition(":")[2], fn)  # TRL's metric names use the function's name: rewards/<name>/mean


def load_named(spec: str, what: str, hint: str = "") -> Callable:
    """The callable `path/to/file.py:name` (relative to the working directory) or `package.module:name` names;
    a spec that does not resolve is one line saying why (`what` names the recipe key's kind)."""
    where, sep, name = spec.rpartition(":")
    if not sep or not where or not name:
        raise UserError(f"{what} {spec!r}: {hint}'path/to/file.py:name' or 'package.module:name'")
    if where.endswith(".py"):
        path = Path(where)
        if not path.is_file():
            raise UserError(f"{what} {spec!r}: no file {where} (paths are relative to the working directory)")
        module_spec = importlib.util.spec_from_file_location(f"dstrain_{what.replace(' ', '_')}_{path.stem}", path)
        module = importlib.util.module_from_spec(module_spec)
        try:
            module_spec.loader.exec_module(module)
        except Exception as e:  # noqa: BLE001 -- the user's file: one line, not our traceback
            raise UserError(f"{what} {spec!r}: {path} failed to load ({type(e).__name__}: {e})") from None
    else:
        try:
            module = importlib.import_module(where)
        except ImportError as e:
            raise UserError(f"{what} {spec!r}: cannot import {where} ({e})") from None
    fn = getattr(module, name, None)
    if not callable(fn):
        raise UserError(f"{what} {spec!r}: {where} has no function {name}")
    return fn


def score(rewards: list[Reward], weights: list[float] | None, prompts: list, completions: list,
          completion_ids: list[list[int]], columns: dict[str, list]) -> tuple[torch.Tensor, torch.Tensor]:
    """(per-function rewards (N, F) with NaN where a function returned None, their weighted sum (N,) with NaN
    where every function returned None), as TRL's GRPOTrainer combines them (weights default to 1)."""
    weights = [1.0] * len(rewards) if weights is None else list(weights)
    if len(weights) != len(rewards):
        raise UserError(f"{len(weights)} reward weights for {len(rewards)} reward functions; give one per function")
    per_func = torch.zeros(len(completions), len(rewards))
    for f, reward in enumerate(rewards):
        values = _call(reward, prompts, completions, completion_ids, columns)
        per_func[:, f] = torch.tensor([math.nan if v is None else float(v) for v in values])
    total = (per_func * torch.tensor(weights)).nansum(dim=1)
    total[torch.isnan(per_func).all(dim=1)] = math.nan
    return per_func, total


def _call(reward: Reward, prompts, completions, completion_ids, columns) -> list:
    def call(idx: list[int]) -> list:
        return reward.fn(prompts=[prompts[i] for i in idx], completions=[completions[i] for i in idx],
                         completion_ids=[completion_ids[i] for i in idx],
                         **{k: [col[i] for i in idx] for k, col in columns.items()})
    everything = list(range(len(completions)))
    try:
        values = call(everything)
    except UserError:
        raise
    except Exception as error:  # noqa: BLE001 -- the user's function: find the completion it fails on
        for i in everything:
            try:
                call([i])
            except Exception as one:  # noqa: BLE001
                raise UserError(f"reward function {reward.name} raised {type(one).__name__}: {one} on completion "
                                f"{i} (prompt {prompts[i]!r:.80}); fix the function or the data") from None
        raise UserError(f"reward function {reward.name} raised {type(error).__name__}: {error} on the whole batch "
                        f"but not on any completion alone") from None
    if hasattr(values, "tolist") and not isinstance(values, (list, tuple)):  # a numpy array or a tensor, as TRL takes
        values = values.tolist()
    if not isinstance(values, (list, tuple)) or len(values) != len(completions):
        count = len(values) if isinstance(values, (list, tuple)) else type(values).__name__
        raise UserError(f"reward function {reward.name} returned {count} values for {len(completions)} completions; "
                        f"it must return one float (or None) per completion")
    for i, v in enumerate(values):
        if v is not None and (not isinstance(v, numbers.Real) or not math.isfinite(v)):
            raise UserError(f"reward function {reward.name} returned {v!r} for completion {i} (prompt "
                            f"{prompts[i]!r:.80}); a reward is a finite number, or None where it does not apply")
    return list(values)
