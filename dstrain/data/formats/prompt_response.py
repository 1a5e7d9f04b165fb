"""`data.format: prompt_response`: SFT on prompt/response pairs: text (one user turn, one assistant turn), or TRL's
conversational prompt-completion (`prompt` and `completion` lists of messages, with `--data.response_field=
completion`): the whole conversation rendered once, the loss on what the assistant writes in the completion only
(TRL's completion_only_loss)."""
from __future__ import annotations

from typing import Any

from ...chat_templates import conversational, normalize, tools_of
from ...config import DataConfig
from ...errors import UserError
from . import sft


def fields(cfg: DataConfig) -> list[tuple[str, str]]:
    return [(cfg.prompt_field, "data.prompt_field"), (cfg.response_field, "data.response_field")]


def reads(cfg: DataConfig) -> list[str]:
    return [cfg.prompt_field, cfg.response_field, cfg.tools_field]


def row_problem(row: dict, cfg: DataConfig) -> str | None:
    prompt, response = row.get(cfg.prompt_field), row.get(cfg.response_field)
    if conversational(prompt) and conversational(response):
        try:
            for value in (prompt, response):
                normalize(value, cfg.role_map)
            tools_of(row, cfg.tools_field)
        except UserError as error:
            return str(error)
        return None
    for name, value in ((cfg.prompt_field, prompt), (cfg.response_field, response)):
        if conversational(value):
            other = cfg.response_field if name == cfg.prompt_field else cfg.prompt_field
            return (f"'{name}' is a list of messages but '{other}' is not; give both as text, or both as lists of "
                    f"messages (TRL's conversational prompt-completion)")
        if not isinstance(value, (str, int, float)) or isinstance(value, bool):
            return (f"'{name}' is {'missing (null)' if value is None else 'a ' + type(value).__name__}, not text; "
                    f"give every row a prompt and a response (a list of messages is data.format=chat)")
    return None


def to_messages(row: dict, cfg: DataConfig) -> list[dict]:
    prompt, response = row[cfg.prompt_field], row[cfg.response_field]
    if conversational(prompt):
        messages = sft.Conversation(normalize(prompt, cfg.role_map) + normalize(response, cfg.role_map))
        messages.prompt_turns = len(prompt)
        return messages
    messages = sft.Conversation([{"role": "user", "content": str(prompt)},
                                 {"role": "assistant", "content": str(response)}])
    messages.prompt_turns = 1  # the user turn is the prompt
    return messages


def to_tools(row: dict, cfg: DataConfig) -> list | None:
    return tools_of(row, cfg.tools_field)


def tokenize(dataset, cfg: DataConfig, tokenizer, seq_len: int, num_proc: int | None) -> tuple[Any, dict]:
    return sft.tokenize(dataset, cfg, tokenizer, seq_len, num_proc, to_messages, to_tools)
