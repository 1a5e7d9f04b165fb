"""Reading a recipe: a YAML file, the command line's dotted overrides merged over it (defaults < YAML < command
line), every key checked against the schema (dstrain/config/__init__.py) with the closest name offered."""
from __future__ import annotations

import dataclasses
import types
import typing
from pathlib import Path
from typing import Any

import yaml

from ..errors import UserError, closest
from ..paths import REPO_ROOT
from . import RECIPES_DIR, Recipe


def find_file(name: str | Path, directory: Path, suffix: str, what: str) -> Path:
    """A path as given, or a name looked up under directory (with or without the suffix)."""
    for candidate in (Path(name), directory / name, directory / f"{name}{suffix}"):
        if candidate.is_file():
            return candidate
    known = sorted(str(p.relative_to(directory)) for p in directory.rglob(f"*{suffix}"))
    shown = directory.relative_to(REPO_ROOT) if directory.is_relative_to(REPO_ROOT) else directory
    # the list stays off the error line (it grows with every shipped file): `ls` shows it
    raise UserError(f"{what} '{name}' not found{closest(str(name), known)}; pass a path, or a name among the "
                    f"{len(known)} in {shown}/ (ls {shown})")


def resolve_recipe_path(name: str | Path) -> Path:
    return find_file(name, RECIPES_DIR, ".yaml", "recipe")


def parse_overrides(items: list[str]) -> dict:
    """['--train.lr=1e-3', '--model.name_or_path', 'x'] -> nested dict; values parsed as YAML scalars."""
    nested: dict = {}
    i = 0
    while i < len(items):
        item = items[i]
        if not item.startswith("--"):
            raise UserError(f"unexpected argument '{item}'; overrides look like --train.max_steps=20")
        key, sep, value = item[2:].partition("=")
        values = []
        if not sep:
            # `--rl.reward_funcs a.py:f b.py:g`, as TRL's and argparse's nargs='+' take it: the words up to the next
            # `--` are the key's values, one of them a scalar and several a list
            while i + 1 < len(items) and not items[i + 1].startswith("--"):
                values.append(items[i + 1])
                i += 1
            if not values:
                raise UserError(f"override --{key} has no value; write --{key}=VALUE")
            value = values[0]
        i += 1
        parsed = [_yaml_value(v) for v in values] if len(values) > 1 else _yaml_value(value)
        node = nested
        parts = key.split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise UserError(f"override --{key} conflicts with another override of '{part}'")
        node[parts[-1]] = parsed
    return nested


def _yaml_value(text: str) -> Any:
    """An override's text as YAML reads it (`1e-3`, `true`, `[a, b]`); text YAML cannot read stays text."""
    try:
        return yaml.safe_load(text) if text != "" else ""
    except yaml.YAMLError:
        return text


# List-valued keys whose elements are mappings: a comma in their value is not a separator
_MAPPING_LISTS = {"data.mix"}


def _as_list(key: str, value: Any) -> Any:
    """One value where a list is expected: `--rl.reward_funcs=a.py:f` is the one-element list TRL would make of it,
    and `a.py:f,b.py:g` two elements (no element of these keys holds a comma: module names, numbers, paths to .py
    files), each read as YAML reads a scalar."""
    if isinstance(value, str) and key not in _MAPPING_LISTS:
        return [_yaml_value(part.strip()) for part in value.split(",")] if "," in value else [_yaml_value(value)]
    if isinstance(value, (int, float)) and key not in _MAPPING_LISTS:
        return [value]
    return value


def merge(base: dict, update: dict) -> dict:
    """Nested update: mappings merge key by key, anything else replaces."""
    out = dict(base)
    for key, value in update.items():
        out[key] = merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def _check_type(key: str, value: Any, hint: Any) -> Any:
    """Coerce/validate a value against a dataclass field's type hint, with a one-line error."""
    origin = typing.get_origin(hint)
    if origin is typing.Union or origin is types.UnionType:  # Optional[X], X | None
        if value is None:
            return None
        kinds = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(kinds) > 1:  # `int | str` (checkpoint.every: a number or `auto`): the section's own check decides
            return value
        hint = kinds[0]
    if hint is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if hint is float and isinstance(value, str):  # YAML 1.1 reads 1e-3 as a string
        try:
            return float(value)
        except ValueError:
            pass
    if hint is str and isinstance(value, (int, float, bool)) and not isinstance(value, bool):
        return str(value)
    if hint is str and isinstance(value, bool):
        return str(value).lower()
    if hint is list:
        value = _as_list(key, value)
    expected = {int: int, float: float, str: str, bool: bool, list: list, dict: dict}.get(hint)
    if expected is not None:
        ok = isinstance(value, expected) and not (expected is int and isinstance(value, bool))
        if not ok:
            form = (f"; write one value, several separated by commas ({key}=a,b), or a YAML list ('{key}=[a, b]')"
                    if expected is list else "")
            raise UserError(f"{key}={value!r} should be of type {expected.__name__}{form}")
    return value


# Names users bring from the HF Trainer, axolotl and LLaMA-Factory: pointed at ours instead of at the nearest
# spelling (`learning_rate` is not near `lr`). A bare name is in the same section.
ALIASES = {"learning_rate": "lr", "per_device_train_batch_size": "micro_batch_size",
           "micro_batch": "micro_batch_size", "batch_size": "micro_batch_size",
           "gradient_accumulation_steps": "grad_accum_steps", "gradient_accumulation": "grad_accum_steps",
           "max_seq_length": "seq_len", "max_length": "seq_len", "sequence_len": "seq_len", "cutoff_len": "seq_len",
           "num_train_epochs": "max_steps", "epochs": "max_steps", "num_epochs": "max_steps",
           "warmup_ratio": "warmup_steps", "lr_scheduler_type": "lr_schedule", "lr_scheduler": "lr_schedule",
           "gradient_checkpointing": "activation_checkpointing", "bf16": "precision", "fp16": "precision",
           "model_name_or_path": "name_or_path", "base_model": "name_or_path", "dataset": "path",
           "datasets": "path", "dataset_path": "path", "save_steps": "checkpoint.every",
           "eval_steps": "eval.every", "save_total_limit": "checkpoint.keep_last", "report_to": "log.wandb",
           "lora_r": "r", "lora_rank": "r", "rank": "lora.r", "lora_alpha": "alpha", "lora_dropout": "dropout",
           "lora_target": "target_modules", "lora_target_modules": "target_modules",
           "async": "background", "async_save": "background",
           "adapter": "lora.r", "finetuning_type": "lora.r", "peft": "lora", "load_in_4bit": "lora.quantize"}
# Keys of features this repository does not have, with what to do instead of a misleading spelling hint.
UNSUPPORTED = {"data.streaming": "streaming datasets are not supported: data is tokenized once into a cache; "
                                 "point data.path at a local copy, or at a subset of its files"}
# the launchers' own flags given after train.py (`deepspeed train.py --num_gpus 2`) reach train.py as recipe keys
_LAUNCHER_FLAG = "a launcher's flag, which goes before train.py (deepspeed --num_gpus 2 train.py ..., torchrun " \
                 "--nproc_per_node 2 train.py ...)"
UNSUPPORTED.update({flag: _LAUNCHER_FLAG for flag in (
    "num_gpus", "num_nodes", "hostfile", "include", "exclude", "master_addr", "master_port", "nproc_per_node",
    "nnodes", "node_rank", "rdzv_endpoint", "rdzv_backend", "standalone", "launcher", "num_processes",
    "num_machines")})


def unknown_keys(cls: type, data: Any, prefix: str) -> list[str]:
    """Every unknown key in the tree, each with its hint: a recipe with two typos hears about both."""
    if not isinstance(data, dict):
        return []
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    found = []
    for key, value in data.items():
        if key in names:
            if dataclasses.is_dataclass(hints[key]):
                found += unknown_keys(hints[key], value, f"{prefix}{key}.")
        elif not prefix and _section_of(key):  # a dedented key: `max_steps:` at the top of the YAML
            found.append(f"'{key}' at the top level (it belongs in the {_section_of(key)} section: "
                         f"{_section_of(key)}.{key}; indent it under `{_section_of(key)}:`)")
        elif f"{prefix}{key}" in UNSUPPORTED:
            found.append(f"'{prefix}{key}': {UNSUPPORTED[prefix + key]}")
        elif key in ALIASES:
            target = ALIASES[key] if "." in ALIASES[key] else f"{prefix}{ALIASES[key]}"
            found.append(f"'{prefix}{key}' (here it is '{target}')")
        else:
            found.append(f"'{prefix}{key}'{closest(key, names)}")
    return found


def _section_of(key: str) -> str | None:
    """The recipe section that has a field named `key`, if exactly one has."""
    hints = typing.get_type_hints(Recipe)
    sections = [name for name, hint in hints.items()
                if dataclasses.is_dataclass(hint) and key in {f.name for f in dataclasses.fields(hint)}]
    return sections[0] if len(sections) == 1 else None


def _build(cls: type, data: dict, prefix: str) -> Any:
    if not isinstance(data, dict):
        raise UserError(f"'{prefix.rstrip('.')}' should be a mapping of keys, got {data!r}")
    unknown = unknown_keys(cls, data, prefix) if not prefix else []  # checked once, at the top
    if unknown:
        raise UserError(f"unknown recipe key{'s' if len(unknown) > 1 else ''} {'; '.join(unknown)}")
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for key, value in data.items():
        hint = hints[key]
        if dataclasses.is_dataclass(hint):
            kwargs[key] = _build(hint, value or {}, f"{prefix}{key}.")
        else:
            kwargs[key] = _check_type(f"{prefix}{key}", value, hint)
    return cls(**kwargs)


def load_recipe(path: str | Path | None, overrides: dict | None = None) -> Recipe:
    """Defaults < YAML file < overrides, validated."""
    raw: dict = {}
    if path is not None:
        recipe_path = resolve_recipe_path(path)
        try:
            raw = yaml.safe_load(recipe_path.read_text()) or {}
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
            problem = getattr(e, "problem", None) or str(e).splitlines()[0]
            raise UserError(f"recipe {recipe_path} is not valid YAML{where}: {problem}; fix that line") from None
        if not isinstance(raw, dict):
            raise UserError(f"recipe {recipe_path} should be a mapping with model/data/train sections")
    return _build(Recipe, merge(raw, overrides or {}), "")


def dump_recipe(recipe: Recipe, path: Path) -> None:
    path.write_text(yaml.safe_dump(recipe.to_dict(), sort_keys=False))
