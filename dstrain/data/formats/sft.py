"""Supervised fine-tuning examples, shared by the `prompt_response` and `chat` formats: a conversation rendered
with the run's chat template, loss only on the assistant's tokens (labels IGNORE_INDEX elsewhere), truncated at
`seq_len` (the end cut; an example left with no reply token dropped), padded, or packed several to a row."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from ...config import DataConfig
from ...errors import UserError

IGNORE_INDEX = -100
SFT_COLUMNS = ("input_ids", "labels", "attention_mask")


PACKED_COLUMNS = ("input_ids", "labels", "attention_mask", "position_ids")


def pack_examples(examples: list[tuple[list[int], list[int]]], seq_len: int, pad: int) -> dict[str, list]:
    """SFT examples (ids, labels, each at most seq_len long) into rows of seq_len, first fit in order: each example
    keeps its tokens and labels, its positions restart at 0 and its first label is ignored (it would be predicted
    from the previous example's last token). The tail of a row is padding: its own positions, no labels.
    Deterministic: the same examples in the same order give the same rows."""
    rows: list[list[tuple[list[int], list[int]]]] = []
    room: list[int] = []
    for ids, labels in examples:
        for r, free in enumerate(room):
            if len(ids) <= free:
                rows[r].append((ids, labels))
                room[r] -= len(ids)
                break
        else:
            rows.append([(ids, labels)])
            room.append(seq_len - len(ids))
    out = {k: [] for k in PACKED_COLUMNS}
    for row, free in zip(rows, room):
        ids, labels, positions = [], [], []
        for piece_ids, piece_labels in row:
            ids += piece_ids
            labels += [IGNORE_INDEX] + piece_labels[1:]
            positions += list(range(len(piece_ids)))
        out["input_ids"].append(ids + [pad] * free)
        out["labels"].append(labels + [IGNORE_INDEX] * free)
        out["attention_mask"].append([1] * len(ids) + [0] * free)
        out["position_ids"].append(positions + list(range(free)))
    return out


def _segments_with_template(messages: list[dict], tokenizer) -> list[tuple[str, bool]]:
    """Split a templated conversation into (text, trainable) pieces: only assistant replies train."""
    def render(msgs, gen):
        return tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)

    pieces, previous = [], ""
    for i, message in enumerate(messages):
        if message.get("role") == "assistant":
            prompt = render(messages[:i], True) if i else render([], True)
            full = render(messages[:i + 1], False)
            if not (prompt.startswith(previous) and full.startswith(prompt)):
                raise UserError("the tokenizer's chat template does not render conversations prefix by prefix; "
                                "set data.format=prompt_response or fix the template")
            pieces += [(prompt[len(previous):], False), (full[len(prompt):], True)]
        else:
            full = render(messages[:i + 1], False)
            pieces.append((full[len(previous):], False))
        previous = full
    return pieces


def _sft_tokens(messages: list[dict], tokenizer) -> tuple[list[int], list[int]]:
    """A whole conversation's ids and labels (IGNORE_INDEX except on assistant replies), untruncated. The
    tokenizer carries the run's template (dstrain/chat_templates.py)."""
    if not tokenizer.chat_template:
        raise ValueError("the tokenizer has no chat template: chat_templates.apply sets one first")
    pieces = _segments_with_template(messages, tokenizer)
    ids, labels = [], []
    for text, trainable in pieces:
        piece = tokenizer(text, add_special_tokens=False)["input_ids"]
        ids += piece
        labels += piece if trainable else [IGNORE_INDEX] * len(piece)
    return ids, labels


def _pad_id(tokenizer) -> int:
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id


def _fit(ids: list[int], labels: list[int], seq_len: int, tokenizer, pad_to: bool = True) -> dict | None:
    """Truncated (the end of the conversation is cut) and padded to seq_len (unless not `pad_to`: packing fills
    the rest); None when no reply token is left."""
    ids, labels = ids[:seq_len], labels[:seq_len]
    if all(label == IGNORE_INDEX for label in labels[1:]):
        return None
    if not pad_to:
        return {"input_ids": ids, "labels": labels, "attention_mask": [1] * len(ids)}
    pad = _pad_id(tokenizer)
    n_pad = seq_len - len(ids)
    return {"input_ids": ids + [pad] * n_pad, "labels": labels + [IGNORE_INDEX] * n_pad,
            "attention_mask": [1] * len(ids) + [0] * n_pad}


def sft_example(messages: list[dict], tokenizer, seq_len: int) -> dict | None:
    """input_ids / labels / attention_mask of one conversation, padded to seq_len; labels only on replies.

    None when truncation leaves no reply token to learn from."""
    return _fit(*_sft_tokens(messages, tokenizer), seq_len, tokenizer)


def tokenize(dataset, cfg: DataConfig, tokenizer, seq_len: int, num_proc: int | None,
             to_messages: Callable[[dict, DataConfig], list[dict]]) -> tuple[Any, dict]:
    """Raw split -> (input_ids, labels, attention_mask [+ position_ids when packed], counts for the report).

    SFT examples longer than seq_len are truncated at seq_len (their end is cut); those left without a reply
    token are dropped. Both are counted: a user should know what a seq_len costs."""
    def fn(batch):
        rows = [dict(zip(batch, values)) for values in zip(*batch.values())]
        out = {k: [] for k in (*SFT_COLUMNS, "full_length", "has_reply")}
        for row in rows:
            ids, labels = _sft_tokens(to_messages(row, cfg), tokenizer)
            example = _fit(ids, labels, seq_len, tokenizer, pad_to=not cfg.packing)
            for key in SFT_COLUMNS:  # a dropped example stays as an empty row until it is counted
                out[key].append(example[key] if example else [])
            out["full_length"].append(len(ids) if example else -len(ids))
            out["has_reply"].append(any(label != IGNORE_INDEX for label in labels))  # at any length
        return out
    marked = dataset.map(fn, batched=True, batch_size=1000, remove_columns=dataset.column_names,
                         num_proc=num_proc, desc="tokenizing")
    lengths = np.asarray(marked["full_length"], dtype=np.int64)
    kept = np.flatnonzero(lengths >= 0)
    out = marked.select(kept).remove_columns(["full_length", "has_reply"])
    stats = {"examples": len(dataset), "sequences": len(out), "truncated": int((lengths > seq_len).sum()),
             "dropped": int((lengths < 0).sum()), "no_reply": int(len(dataset) - sum(marked["has_reply"]))}
    if cfg.packing and len(out):
        pad = _pad_id(tokenizer)

        def pack(batch):  # 1000 examples at a time: rows never mix examples far apart in the data's order
            return pack_examples(list(zip(batch["input_ids"], batch["labels"])), seq_len, pad)
        out = out.map(pack, batched=True, batch_size=1000, remove_columns=out.column_names, desc="packing")
        stats |= {"packed_examples": stats["sequences"], "sequences": len(out)}
    if len(out):
        stats["padding"] = 1 - int(np.minimum(lengths[kept], seq_len).sum()) / (len(out) * seq_len)
    return out, stats
