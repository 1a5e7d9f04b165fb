"""`data.format: chat`: SFT on conversations, `{role, content}` messages or ShareGPT's `{from, value}` (roles
mapped by chat_templates.normalize and `data.role_map`), with what a template renders kept: content parts, tool
calls, tool replies' name and call id, reasoning, and the row's function schemas (`data.tools_field`, TRL's `tools`
column) passed to the template; the loss is taken on everything the assistant writes. With a vision-language model,
the row's images (`data.images_field`, TRL's `images`) go with its `{"type": "image"}` parts (images.py)."""
from __future__ import annotations

from typing import Any

from ...chat_templates import normalize, tools_of
from ...config import DataConfig
from ...errors import UserError
from ...vision import processor_of
from . import images, sft


def fields(cfg: DataConfig) -> list[tuple[str, str]]:
    return [(cfg.messages_field, "data.messages_field")]


def reads(cfg: DataConfig) -> list[str]:
    return [cfg.messages_field, cfg.tools_field, cfg.images_field]


def row_problem(row: dict, cfg: DataConfig) -> str | None:
    try:
        normalize(row.get(cfg.messages_field), cfg.role_map, images=True)
        tools_of(row, cfg.tools_field)
    except UserError as error:
        return str(error)
    return None


def to_messages(row: dict, cfg: DataConfig) -> list[dict]:
    return normalize(row[cfg.messages_field], cfg.role_map, images=True)


def to_tools(row: dict, cfg: DataConfig) -> list | None:
    return tools_of(row, cfg.tools_field)


def tokenize(dataset, cfg: DataConfig, tokenizer, seq_len: int, num_proc: int | None) -> tuple[Any, dict]:
    if processor_of(tokenizer) is not None:  # a vision-language model: images through its processor
        return images.tokenize(dataset, cfg, tokenizer, seq_len, num_proc, to_messages, to_tools)
    return sft.tokenize(dataset, cfg, tokenizer, seq_len, num_proc, _text_messages, to_tools)


def _text_messages(row: dict, cfg: DataConfig) -> list[dict]:
    """A text model's messages: an image part is refused in one line (chat_templates.normalize)."""
    return normalize(row[cfg.messages_field], cfg.role_map)
