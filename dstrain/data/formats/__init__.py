"""One module per data format, each behind the same small interface:

    fields(cfg) -> [(column, recipe key)]      the columns it reads (checked before anything is tokenized)
    tokenize(dataset, cfg, tokenizer, seq_len, num_proc) -> (tokenized split, counts for the report)

text (pretraining), prompt_response and chat (SFT, both through sft.py), preference (chosen/rejected pairs). A new
format is one new module and one line in FORMATS, plus its name in config.DataConfig's check.
"""
from __future__ import annotations

import hashlib
import json
from typing import Any

from ...config import DataConfig
from ...errors import UserError
from . import chat, preference, prompt_response, text

FORMATS = {"text": text, "prompt_response": prompt_response, "chat": chat, "preference": preference}


def _require_field(dataset, field_name: str, key: str, path: str) -> None:
    if field_name not in dataset.column_names:
        raise UserError(f"dataset '{path}' has no field '{field_name}' (columns: {', '.join(dataset.column_names)});"
                        f" set {key} to one of them")


def check_fields(dataset, cfg: DataConfig) -> None:
    for name, key in FORMATS[cfg.format].fields(cfg):
        _require_field(dataset, name, key, cfg.path)


def tokenize(dataset, cfg: DataConfig, tokenizer, seq_len: int) -> tuple[Any, dict]:
    """Raw split -> (model-ready split, counts for the report), by the recipe's data.format."""
    check_fields(dataset, cfg)
    return FORMATS[cfg.format].tokenize(dataset, cfg, tokenizer, seq_len, cfg.num_proc if cfg.num_proc > 1 else None)


def report(stats: dict, seq_len: int) -> str:
    """One line on what tokenization made of the data."""
    if "documents" in stats:
        return (f"{stats['documents']:,} documents packed into {stats['sequences']:,} sequences of {seq_len} "
                f"tokens (the last partial block dropped"
                f"{'; attention kept within each document' if stats.get('separated') else ''})")
    if "pairs" in stats:
        text = f"{stats['pairs']:,} preference pairs, each side padded to {seq_len} tokens"
        if "padding" in stats:
            text += f" ({stats['padding']:.1%} padding)"
        if stats["truncated"]:
            text += (f"; {stats['truncated']:,} longer than seq_len were cut (prompt start, then response ends); "
                     f"raise train.seq_len to keep them whole")
        if stats["dropped"]:
            text += f"; {stats['dropped']:,} dropped (a response with no token left)"
        if stats["identical"]:
            text += (f"; warning: {stats['identical']:,} pairs have identical chosen and rejected responses "
                     f"(they teach nothing)")
        return text
    text = f"{stats['examples']:,} examples -> {stats['sequences']:,} sequences of {seq_len} tokens"
    if "packed_examples" in stats:
        text += f" ({stats['packed_examples']:,} examples packed, no attention across them)"
    if "padding" in stats:
        text += f", {stats['padding']:.1%} padding"
    if stats["truncated"] or stats["dropped"]:
        text += (f"; {stats['truncated']:,} longer than seq_len were truncated (their end cut), "
                 f"{stats['dropped']:,} dropped (no reply token within {seq_len}); raise train.seq_len to keep them")
    return text


def tokenizer_fingerprint(tokenizer) -> str:
    """What every tokenized output depends on (vocabulary, template, special tokens): the cache key's and a prepared
    corpus's record of its tokenizer."""
    payload = json.dumps({"vocab": sorted(tokenizer.get_vocab().items()), "template": tokenizer.chat_template,
                          "eos": tokenizer.eos_token, "bos": tokenizer.bos_token, "pad": tokenizer.pad_token,
                          "class": type(tokenizer).__name__}, sort_keys=True)
    return hashlib.sha256(payload.encode()).hexdigest()
