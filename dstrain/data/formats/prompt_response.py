"""`data.format: prompt_response`: SFT on prompt/response pairs (one user turn, one assistant turn)."""
from __future__ import annotations

from typing import Any

from ...config import DataConfig
from . import sft


def fields(cfg: DataConfig) -> list[tuple[str, str]]:
    return [(cfg.prompt_field, "data.prompt_field"), (cfg.response_field, "data.response_field")]


def row_problem(row: dict, cfg: DataConfig) -> str | None:
    for name in (cfg.prompt_field, cfg.response_field):
        value = row.get(name)
        if not isinstance(value, (str, int, float)) or isinstance(value, bool):
            return (f"'{name}' is {'missing (null)' if value is None else 'a ' + type(value).__name__}, not text; "
                    f"give every row a prompt and a response (a list of messages is data.format=chat)")
    return None


def to_messages(row: dict, cfg: DataConfig) -> list[dict]:
    return [{"role": "user", "content": str(row[cfg.prompt_field])},
            {"role": "assistant", "content": str(row[cfg.response_field])}]


def tokenize(dataset, cfg: DataConfig, tokenizer, seq_len: int, num_proc: int | None) -> tuple[Any, dict]:
    return sft.tokenize(dataset, cfg, tokenizer, seq_len, num_proc, to_messages)
