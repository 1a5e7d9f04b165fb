"""`python -m dstrain.data.inspect [train.py's arguments] [--rows N] [--json]`: what a run trains on.

The recipe and overrides are train.py's; the first N rows of the training split (default 3) are tokenized exactly as
the run tokenizes them (the same chat template, masks, truncation and seq_len; packing off, so each example stands
alone) and printed: each sequence as text with the trained tokens marked, in colour on a terminal and between `[[`
and `]]` otherwise; with --json one object per example, `{"text": <the sequence, decoded>, "trained": [<each run of
trained tokens, decoded, in order>]}` (preference pairs: one per side, with `"side"`). Nothing is written: no run
directory, no cache entry.
"""
from __future__ import annotations

import json
import sys
from dataclasses import replace

from .. import chat_templates
from ..cli import exit_with, load_inputs
from ..errors import UserError
from . import check_fields, load_raw, split_train_val, tokenize
from .formats import check_rows, layout_of
from .formats.sft import IGNORE_INDEX
from .load import row_location

GREEN, RESET = "\033[32m", "\033[0m"


def _options(argv: list[str]) -> tuple[int, bool, list[str]]:
    rows, as_json, rest, i = 3, False, [], 0
    while i < len(argv):
        word = argv[i]
        if word == "--json":
            as_json = True
        elif word == "--rows" or word.startswith("--rows="):
            value = word.split("=", 1)[1] if "=" in word else (argv[i + 1] if i + 1 < len(argv) else "")
            i += 0 if "=" in word else 1
            if not value.isdigit() or int(value) < 1:
                raise UserError(f"--rows {value!r}: give a positive number of rows")
            rows = int(value)
        else:
            rest.append(word)
        i += 1
    return rows, as_json, rest


def runs(ids: list[int], labels: list[int]) -> list[tuple[int, int]]:
    """(start, end) token positions of each run of trained tokens."""
    out, start = [], None
    for i, label in enumerate([*labels, IGNORE_INDEX]):
        if label != IGNORE_INDEX and start is None:
            start = i
        elif label == IGNORE_INDEX and start is not None:
            out.append((start, i))
            start = None
    return out


def examples(tokenized, fmt: str) -> list[tuple[str | None, list[int], list[int]]]:
    """(side, ids, labels) of each tokenized example, padding left out."""
    out = []
    for row in tokenized:
        if fmt == "preference":
            for side in ("chosen", "rejected"):
                n = sum(row[f"{side}_attention_mask"])
                out.append((side, row[f"{side}_input_ids"][:n], row[f"{side}_labels"][:n]))
        elif "labels" in row:
            n = sum(row["attention_mask"])
            out.append((None, row["input_ids"][:n], row["labels"][:n]))
        elif "prompt_ids" in row:  # learning from rewards: the completions are sampled in training
            out.append((None, row["prompt_ids"], [IGNORE_INDEX] * len(row["prompt_ids"])))
        else:  # pretraining text: every token
            out.append((None, row["input_ids"], row["input_ids"]))
    return out


def show(tokenizer, side, ids: list[int], labels: list[int], as_json: bool, colour: bool) -> str:
    spans = runs(ids, labels)
    if as_json:
        record = {"text": tokenizer.decode(ids), "trained": [tokenizer.decode(ids[a:b]) for a, b in spans]}
        return json.dumps(record | ({"side": side} if side else {}), ensure_ascii=False)
    opened, closed = (GREEN, RESET) if colour else ("[[", "]]")
    pieces, at = [], 0
    for a, b in spans:
        pieces += [tokenizer.decode(ids[at:a]), opened + tokenizer.decode(ids[a:b]) + closed]
        at = b
    pieces.append(tokenizer.decode(ids[at:]))
    trained = sum(b - a for a, b in spans)
    head = f"--- {side + ' ' if side else ''}{len(ids)} tokens, {trained} trained"
    return head + "\n" + "".join(pieces)


def main(argv: list[str] | None = None) -> int:
    import datasets
    datasets.disable_progress_bars()
    rows, as_json, rest = _options(sys.argv[1:] if argv is None else argv)
    _, recipe, _ = load_inputs(rest)
    cfg = replace(recipe.data, packing=False)
    from .. import model as models
    tokenizer = models.load_tokenizer(recipe.model)
    if cfg.format != "text":
        chat_templates.apply(cfg.chat_template, tokenizer, lambda text: print(text, file=sys.stderr), cfg.format)
    raw = load_raw(cfg)
    train_raw, _ = split_train_val(raw, cfg, recipe.train.seed)
    cfg = layout_of(train_raw, cfg, lambda text: print(text, file=sys.stderr))
    check_fields(train_raw, cfg)
    head = train_raw.select(range(min(rows, len(train_raw))))
    check_rows(head, cfg, lambda number: row_location(cfg, cfg.train_split, len(train_raw), number))
    tokenized, _ = tokenize(head, cfg, tokenizer, recipe.train.seq_len)
    colour = not as_json and sys.stdout.isatty()
    for side, ids, labels in examples(tokenized, cfg.format):
        print(show(tokenizer, side, list(ids), list(labels), as_json, colour))
    return 0


if __name__ == "__main__":
    exit_with(main)
