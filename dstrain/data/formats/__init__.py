"""One module per data format, each behind the same small interface:

    fields(cfg) -> [(column, recipe key)]      the columns it needs (checked before anything is tokenized)
    reads(cfg) -> [column]                     optional: every column it reads, optional ones too (default: fields)
    row_problem(row, cfg) -> str | None        what is wrong with one row, and the fix (checked before tokenizing)
    tokenize(dataset, cfg, tokenizer, seq_len, num_proc) -> (tokenized split, counts for the report)

text (pretraining), prompt_response, alpaca and chat (SFT, through sft.py), preference (chosen/rejected pairs),
prompt (prompts to learn from rewards). A
new format is one new module and one line in FORMATS, plus its name in config.DataConfig's check.
"""
from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from typing import Any

from ...config import DataConfig
from ...errors import UserError
from . import alpaca, chat, preference, prompt, prompt_response, text

FORMATS = {"text": text, "prompt_response": prompt_response, "alpaca": alpaca, "chat": chat,
           "preference": preference, "prompt": prompt}


def reads(cfg: DataConfig) -> list[str]:
    """Every column data.format reads."""
    module = FORMATS[cfg.format]
    return module.reads(cfg) if hasattr(module, "reads") else [name for name, _ in module.fields(cfg)]


def looks_like(dataset) -> tuple[str, str] | None:
    """(the data.format the columns look like, with the field overrides it needs) or None: what an error about a
    missing column names, so that following it trains instead of meeting the next missing column."""
    columns = set(dataset.column_names)
    first = dataset[0] if len(dataset) else {}
    if {"chosen", "rejected"} <= columns:
        return "preference", ""
    if {"instruction", "output"} <= columns:
        return "alpaca", ""
    for name in ("messages", "conversations", "conversation"):
        if name in columns and isinstance(first.get(name), list):
            return "chat", "" if name == "messages" else f" --data.messages_field={name}"
    for asked, response in (("prompt", "response"), ("prompt", "completion"), ("question", "answer"),
                            ("query", "response"), ("input", "output")):
        if {asked, response} <= columns and isinstance(first.get(asked), (str, list)):
            fields = (f" --data.prompt_field={asked}" if asked != "prompt" else "") + \
                     (f" --data.response_field={response}" if response != "response" else "")
            return "prompt_response", fields
    if "text" in columns:
        return "text", ""
    return None


SFT_FORMATS = ("chat", "prompt_response", "alpaca")  # one objective (next-token loss on the replies), three layouts


def layout_of(dataset, cfg: DataConfig, log=lambda text: None) -> DataConfig:
    """An SFT recipe's data.format, or the SFT layout its columns are when they are not that (found as TRL finds
    them: `messages` are conversational, `prompt` and `completion` prompt-completion), said in the log. Only between
    SFT formats, which train one objective: preference pairs, prompts for rewards and pretraining text stay the
    recipe's choice (check_fields then names the format the columns look like)."""
    import dataclasses

    def has_fields(c: DataConfig) -> bool:
        return all(name in dataset.column_names for name, _ in FORMATS[c.format].fields(c))

    if cfg.format not in SFT_FORMATS or has_fields(cfg):
        return cfg
    guess = looks_like(dataset)
    if not guess or guess[0] not in SFT_FORMATS:
        return cfg
    fields = dict(item.removeprefix("--data.").split("=", 1) for item in guess[1].split())
    found = dataclasses.replace(cfg, format=guess[0], **fields)
    if not has_fields(found):
        return cfg
    first = dataset[0] if len(dataset) else {}
    columns = [name for name, _ in FORMATS[found.format].fields(found)]
    kind = {"chat": "conversational", "alpaca": "Alpaca's"}.get(found.format, "conversational prompt-completion" if all(
        isinstance(first.get(c), list) for c in columns) else "prompt-completion")
    log(f"data: columns {', '.join(columns)} are the {kind} layout: read as data.format={found.format}{guess[1]} "
        f"(the recipe said data.format={cfg.format}; set data.format to choose)")
    return found


def check_fields(dataset, cfg: DataConfig) -> None:
    columns = dataset.column_names
    for name, key in FORMATS[cfg.format].fields(cfg):
        if name in columns:
            continue
        guess = looks_like(dataset)
        if guess and guess[0] != cfg.format:  # another format's data: the field is not the knob to turn
            fix = f"it looks like {guess[0]} data: set --data.format={guess[0]}{guess[1]} (docs/data.md)"
        elif guess and guess[1]:
            fix = f"set{guess[1]}"
        else:
            fix = f"set {key} to one of them"
        raise UserError(f"dataset '{cfg.path}' has no field '{name}' (columns: {', '.join(columns)}); {fix}")


def check_rows(dataset, cfg: DataConfig, locate: Callable[[int], str]) -> None:
    """Every row of a raw split checked by its format before tokenizing: a malformed one is one line naming where
    it is (`locate(row number)`: the file and line of a jsonl file) and the fix, instead of a traceback from inside
    map."""
    module = FORMATS[cfg.format]
    columns = [c for c in reads(cfg) if c in dataset.column_names]
    number = 0
    for batch in dataset.select_columns(columns).iter(batch_size=1000):
        for values in zip(*batch.values()):
            number += 1
            problem = module.row_problem(dict(zip(batch, values)), cfg)
            if problem:
                raise UserError(f"{locate(number)}: {problem}")


def failing_row(dataset, cfg: DataConfig, tokenizer, seq_len: int, locate: Callable[[int], str]) -> UserError | None:
    """After tokenizing raised: the first row that fails alone (bisected: about twice the split's work), as the one
    line of a data error; None when no single row fails (then it is a bug, and its traceback stands)."""
    def error(lo: int, hi: int) -> Exception | None:
        try:
            FORMATS[cfg.format].tokenize(dataset.select(range(lo, hi)), cfg, tokenizer, seq_len, None)
        except Exception as e:  # noqa: BLE001 - whatever the row makes the tokenizer or template raise
            return e
        return None

    lo, hi = 0, len(dataset)
    if not hi or error(lo, hi) is None:
        return None
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if error(lo, mid) else (mid, hi)
    found = error(lo, hi)
    if found is None:
        return None
    text = str(found).splitlines()[0][:200] if str(found) else ""
    return UserError(f"{locate(lo + 1)} cannot be tokenized ({type(found).__name__}: {text}); fix or remove that row")


def tokenize(dataset, cfg: DataConfig, tokenizer, seq_len: int) -> tuple[Any, dict]:
    """Raw split -> (model-ready split, counts for the report), by the recipe's data.format."""
    check_fields(dataset, cfg)
    out, stats = FORMATS[cfg.format].tokenize(dataset, cfg, tokenizer, seq_len,
                                              cfg.num_proc if cfg.num_proc > 1 else None)
    used = reads(cfg)
    stats["unused"] = [] if getattr(FORMATS[cfg.format], "KEEPS_COLUMNS", False) else [  # said in the data line
        c for c in dataset.column_names if c not in used]
    stats["format"] = cfg.format
    stats["unread_keys"] = message_keys_not_read(dataset, [c for c in used if c in dataset.column_names])
    return out, stats


MESSAGE_KEYS = ("role", "content", "from", "value")  # with chat_templates.KEPT: what a message gives the template
SCANNED = 1000  # rows looked at for message keys


def message_keys_not_read(dataset, columns: list[str]) -> list[str]:
    """Keys of the chat messages in the columns read (the first SCANNED rows) that no template is given (an `id`,
    a `timestamp`): said in the data line, as unread columns are, instead of dropped without a word."""
    from ...chat_templates import KEPT, SWITCHES
    known = set(MESSAGE_KEYS) | set(KEPT) | set(SWITCHES)
    found: dict[str, None] = {}
    rows = dataset.select(range(min(SCANNED, len(dataset)))) if hasattr(dataset, "select") else dataset
    for row in rows:
        for column in columns:
            value = row.get(column)
            for message in value if isinstance(value, list) else ():
                if isinstance(message, dict):
                    found.update({k: None for k, v in message.items() if k not in known and v is not None})
    return list(found)


def report(stats: dict, seq_len: int) -> str:
    """One line on what tokenization made of the data, and the columns it did not read."""
    unused, keys = stats.get("unused"), stats.get("unread_keys")
    line = _counts(stats, seq_len)
    if unused:
        line += (f"; column{'s' if len(unused) > 1 else ''} {', '.join(unused)} not read by "
                 f"data.format={stats['format']} (docs/data.md)")
    if keys:
        line += (f"; message key{'s' if len(keys) > 1 else ''} {', '.join(keys)} not given to the chat template (it "
                 f"gets role, content, tool calls, names and reasoning: docs/data.md)")
    return line


def _counts(stats: dict, seq_len: int) -> str:
    if "documents" in stats:
        return (f"{stats['documents']:,} documents packed into {stats['sequences']:,} sequences of {seq_len} "
                f"tokens (the last partial block dropped"
                f"{'; attention kept within each document' if stats.get('separated') else ''})")
    if "prompts" in stats:
        return (f"{stats['prompts']:,} prompts (the longest {stats['longest_prompt']:,} tokens), their completions "
                f"sampled in training")
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
    if stats.get("tokens"):
        text += (f"; {stats['trained_tokens']:,} of {stats['tokens']:,} tokens trained "
                 f"({stats['trained_tokens'] / stats['tokens']:.0%}: `python -m dstrain.data.inspect` shows which)")
    if stats["truncated"] or stats["dropped"]:
        text += (f"; {stats['truncated']:,} longer than seq_len were truncated (their end cut), "
                 f"{stats['dropped']:,} dropped (no reply token within {seq_len}); raise train.seq_len to keep them")
    return text


def tokenizer_fingerprint(tokenizer) -> str:
    """What every tokenized output depends on (vocabulary, template, special tokens): the cache key's and a prepared
    corpus's record of its tokenizer."""
    payload = json.dumps({"vocab": sorted(tokenizer.get_vocab().items()), "template": tokenizer.chat_template,
                          "eos": tokenizer.eos_token, "bos": tokenizer.bos_token, "pad": tokenizer.pad_token,
                          "class": type(tokenizer).__name__,
                          **({"mistral": _file_hash(tokenizer.mistral_common_file)}
                             if getattr(tokenizer, "mistral_common_file", None) else {}),
                          # a vision-language model's image processing (sizes, normalisation, tokens per image)
                          **({"processor": tokenizer._dstrain_processor.to_json_string()}
                             if getattr(tokenizer, "_dstrain_processor", None) is not None else {})},
                         sort_keys=True)
    return hashlib.sha256(payload.encode()).hexdigest()


def _file_hash(path: str) -> str:
    return hashlib.sha256(open(path, "rb").read()).hexdigest()
