"""`data.format: prompt`: prompts to learn from rewards (dstrain/objectives/rl.py), in TRL's GRPO layout: a `prompt`
column, text (tokenized as TRL does: with the tokenizer's special tokens, a BOS where it adds one) or a list of
messages (rendered with the run's chat template and its generation prompt, as TRL does). Every other column stays
in the row: the reward functions receive them (e.g. `answer`). The completion is sampled during training; what
tokenization makes here is `prompt_ids` and the row's index."""
from __future__ import annotations

from typing import Any

from ... import chat_templates
from ...chat_templates import normalize, tools_of
from ...config import DataConfig
from ...errors import UserError

KEEPS_COLUMNS = True  # every column reaches the reward functions: none is "not read"


def fields(cfg: DataConfig) -> list[tuple[str, str]]:
    return [(cfg.prompt_field, "data.prompt_field")]


def row_problem(row: dict, cfg: DataConfig) -> str | None:
    value = row.get(cfg.prompt_field)
    if isinstance(value, str) and value:
        return None
    if chat_templates.conversational(value):
        try:
            normalize(value, cfg.role_map)
            tools_of(row, cfg.tools_field)
        except UserError as error:
            return str(error)
        return None
    kind = "missing (null)" if value is None else "empty" if value in ("", []) else f"a {type(value).__name__}"
    return (f"'{cfg.prompt_field}' is {kind}; a prompt is text or a list of {{role, content}} messages: give every "
            f"row one or remove the row")


def prompt_ids(prompt, tokenizer, tools=None, role_map: dict | None = None) -> list[int]:
    """A prompt's tokens: text as TRL tokenizes it, messages (tool calls, tool replies, reasoning and content parts
    kept: chat_templates.normalize) rendered with the row's function schemas and the generation prompt."""
    if isinstance(prompt, str):
        return tokenizer(prompt)["input_ids"]
    mistral = chat_templates.mistral_of(tokenizer)
    if mistral is not None:  # Mistral's own format, up to `[/INST]`
        return chat_templates.mistral_ids(mistral, normalize(prompt, role_map or {}), tools)
    if not tokenizer.chat_template:
        raise UserError("the prompts are messages but the tokenizer has no chat template; set data.chat_template "
                        "(docs/data.md) or give text prompts")
    return tokenizer.apply_chat_template(normalize(prompt, role_map or {}), tools=tools, tokenize=True,
                                         add_generation_prompt=True, return_dict=True)["input_ids"]


def tokenize(dataset, cfg: DataConfig, tokenizer, seq_len: int, num_proc: int | None) -> tuple[Any, dict]:
    """Raw split -> the same rows with `prompt_ids` and `prompt_index` added (nothing dropped: a prompt longer than
    the room train.seq_len leaves beside rl.max_completion_length keeps its end, cut when it is sampled)."""
    conversations = ((normalize(row[cfg.prompt_field], cfg.role_map), tools_of(row, cfg.tools_field))
                     for row in dataset if chat_templates.conversational(row[cfg.prompt_field]))
    chat_templates.check_rendered(conversations, tokenizer, cfg.chat_template)  # before anything is tokenized

    def fn(batch):
        rows = [dict(zip(batch, values)) for values in zip(*batch.values())]
        return {"prompt_ids": [prompt_ids(row[cfg.prompt_field], tokenizer, tools_of(row, cfg.tools_field),
                                          cfg.role_map) for row in rows]}
    out = dataset.map(fn, batched=True, batch_size=1000, num_proc=num_proc, desc="tokenizing prompts")
    out = out.add_column("prompt_index", list(range(len(out))))
    lengths = [len(ids) for ids in out["prompt_ids"]]
    return out, {"examples": len(dataset), "sequences": len(out), "prompts": len(out),
                 "longest_prompt": max(lengths, default=0)}
