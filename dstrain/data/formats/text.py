"""`data.format: text`: pretraining. Documents joined with EOS and cut into `seq_len` blocks (no padding); with
`data.packing` each document attends only within itself (position_ids restart after every EOS)."""
from __future__ import annotations

from typing import Any

from ...config import DataConfig
from ...errors import UserError


def fields(cfg: DataConfig) -> list[tuple[str, str]]:
    """(column, the recipe key naming it) for each column this format reads."""
    return [(cfg.text_field, "data.text_field")]


def row_problem(row: dict, cfg: DataConfig) -> str | None:
    value = row.get(cfg.text_field)
    if not isinstance(value, str):
        return (f"'{cfg.text_field}' is {'missing (null)' if value is None else 'a ' + type(value).__name__}, not "
                f"text; remove the row or give it a document")
    return None


def pack_texts(texts: list[str], tokenizer, seq_len: int, separate: bool = False) -> dict[str, list[list[int]]]:
    """Concatenate documents, each followed by EOS, and cut into full seq_len blocks (no padding): input_ids, and
    with `separate` (data.packing) position_ids that restart after each EOS and at each block, so attention never
    crosses a document (the EOS still predicts the next document's first token, as in plain concatenation)."""
    eos = tokenizer.eos_token_id
    if eos is None:
        raise UserError("the tokenizer has no eos_token; packing needs one to separate documents")
    flat: list[int] = []
    positions: list[int] = []
    for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]:
        flat.extend(ids)
        flat.append(eos)
        positions.extend(range(len(ids) + 1))
    usable = len(flat) // seq_len * seq_len
    out = {"input_ids": [flat[i:i + seq_len] for i in range(0, usable, seq_len)]}
    if separate:  # a document cut by a block boundary starts again at position 0 in the next block
        out["position_ids"] = [_restart_at_zero(positions[i:i + seq_len]) for i in range(0, usable, seq_len)]
    return out


def _restart_at_zero(positions: list[int]) -> list[int]:
    offset = positions[0]
    out = []
    for p in positions:
        if p == 0:
            offset = 0
        out.append(p - offset)
    return out


def tokenize(dataset, cfg: DataConfig, tokenizer, seq_len: int, num_proc: int | None) -> tuple[Any, dict]:
    """Raw split -> (input_ids blocks [+ position_ids], counts for the report)."""
    def fn(batch):
        return pack_texts(batch[cfg.text_field], tokenizer, seq_len, separate=cfg.packing)
    out = dataset.map(fn, batched=True, batch_size=1000, remove_columns=dataset.column_names,
                      num_proc=num_proc, desc="tokenizing")
    return out, {"documents": len(dataset), "sequences": len(out), "separated": cfg.packing}
