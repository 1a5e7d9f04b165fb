"""`data.format: alpaca`: Stanford Alpaca's rows, `{"instruction", "input", "output"}` (and the many datasets in its
layout). Read as LLaMA-Factory reads them: the user turn is the instruction, then a newline and the input when
the input is not empty; the assistant turn is the output. The conversation is rendered with the run's chat
template like any SFT example, the loss taken on the output only. The column names are `data.instruction_field`,
`data.input_field` (optional: a dataset without it trains on the instruction) and `data.output_field`."""
from __future__ import annotations

from typing import Any

from ...config import DataConfig
from . import sft


def fields(cfg: DataConfig) -> list[tuple[str, str]]:
    return [(cfg.instruction_field, "data.instruction_field"), (cfg.output_field, "data.output_field")]


def reads(cfg: DataConfig) -> list[str]:
    return [cfg.instruction_field, cfg.input_field, cfg.output_field]


def row_problem(row: dict, cfg: DataConfig) -> str | None:
    for name in (cfg.instruction_field, cfg.output_field):
        if not isinstance(row.get(name), str):
            return f"'{name}' is {_kind(row.get(name))}, not text; give every row an instruction and an output"
    if row.get(cfg.input_field) is not None and not isinstance(row[cfg.input_field], str):
        return f"'{cfg.input_field}' is {_kind(row[cfg.input_field])}, not text; use \"\" for no input"
    return None


def _kind(value) -> str:
    return "missing (null)" if value is None else f"a {type(value).__name__}"


def prompt_of(row: dict, cfg: DataConfig) -> str:
    """The user turn: the instruction, and the input on the next line when there is one."""
    extra = row.get(cfg.input_field)
    return f"{row[cfg.instruction_field]}\n{extra}" if extra else str(row[cfg.instruction_field])


def to_messages(row: dict, cfg: DataConfig) -> list[dict]:
    return [{"role": "user", "content": prompt_of(row, cfg)},
            {"role": "assistant", "content": str(row[cfg.output_field])}]


def tokenize(dataset, cfg: DataConfig, tokenizer, seq_len: int, num_proc: int | None) -> tuple[Any, dict]:
    return sft.tokenize(dataset, cfg, tokenizer, seq_len, num_proc, to_messages)
