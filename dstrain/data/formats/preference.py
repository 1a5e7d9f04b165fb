"""`data.format: preference`: chosen/rejected pairs for DPO and its kin (dstrain/objectives/preference.py).

TRL's two forms: strings (`prompt`, `chosen`, `rejected`; the responses get the tokenizer's EOS when they lack it)
and conversations (lists of messages, rendered with the run's chat template; a missing prompt is the messages that
chosen and rejected share, as TRL's `extract_prompt` finds it). A text prompt beside conversational responses is
TRL's `maybe_extract_prompt` case: the responses repeat the user turn (UltraFeedback's layout), so the prompt is
extracted from them and the text column is not read; where the responses hold no user turn at all, the text
prompt becomes the user turn (TRL would drop it). The response starts where the tokenized prompt and
the tokenized prompt + response part (TRL's rule too: templates and merges can change the prompt's last tokens).
A pair longer than seq_len loses the start of its prompt down to data.max_prompt_length, then the ends of its
responses; counted and reported. Each side is padded to seq_len; labels are the response tokens only.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from ... import chat_templates
from ...chat_templates import normalize, tools_of
from ...config import DataConfig
from ...errors import UserError
from .sft import IGNORE_INDEX, _common_prefix, _pad_id

SIDES = ("chosen", "rejected")
COLUMNS = tuple(f"{side}_{k}" for side in SIDES for k in ("input_ids", "labels", "attention_mask"))


def fields(cfg: DataConfig) -> list[tuple[str, str]]:
    return [(cfg.chosen_field, "data.chosen_field"), (cfg.rejected_field, "data.rejected_field")]


def reads(cfg: DataConfig) -> list[str]:
    return [cfg.prompt_field, cfg.chosen_field, cfg.rejected_field, cfg.tools_field]


def _conversational(value) -> bool:
    return isinstance(value, list) and all(isinstance(m, dict) for m in value)


def _kind(value) -> str:
    if value is None:
        return "missing (null)"
    return "a list of messages" if _conversational(value) else f"a {type(value).__name__}"


def row_problem(row: dict, cfg: DataConfig) -> str | None:
    """What is wrong with one pair, with the fix; None when it can be trained."""
    chosen, rejected, prompt = row.get(cfg.chosen_field), row.get(cfg.rejected_field), row.get(cfg.prompt_field)
    forms = {"messages" if _conversational(v) else "text" if isinstance(v, str) else None for v in (chosen, rejected)}
    if None in forms or len(forms) > 1:
        return (f"'{cfg.chosen_field}' is {_kind(chosen)} and '{cfg.rejected_field}' {_kind(rejected)}; both should "
                f"be text, or both lists of {{role, content}} messages")
    if prompt is not None and not (isinstance(prompt, str) or _conversational(prompt)):
        return f"'{cfg.prompt_field}' is {_kind(prompt)}; it should be text or a list of {{role, content}} messages"
    if _conversational(prompt) and not _conversational(chosen):
        return (f"'{cfg.prompt_field}' is a list of messages but the responses are text; make the responses "
                f"assistant messages, or the prompt text")
    for value in (prompt, chosen, rejected):
        if _conversational(value):
            try:
                normalize(value, cfg.role_map)
            except UserError as error:
                return str(error)
    return None


def _messages(value, cfg: DataConfig) -> list[dict]:
    return normalize(value, cfg.role_map)  # role/content from either role/content or ShareGPT's from/value


def extract_prompt(chosen, rejected) -> tuple[Any, Any, Any]:
    """(prompt, chosen, rejected) of a pair whose prompt is implicit: TRL's extract_prompt rule, item by item
    (messages, or characters of strings): the prompt ends where the two first differ, a space before that
    goes to the responses."""
    idx = 0
    for idx in range(min(len(chosen), len(rejected))):
        if chosen[idx] != rejected[idx]:
            if chosen[idx - 1] == " ":
                idx -= 1
            break
    return chosen[:idx], chosen[idx:], rejected[idx:]


def _ids(tokenizer, content, generation_prompt: bool = False, tools=None) -> list[int]:
    mistral = chat_templates.mistral_of(tokenizer) if isinstance(content, list) else None
    if mistral is not None:  # Mistral's own format (a prompt: up to `[/INST]`, where the model writes)
        return chat_templates.mistral_ids(mistral, content, tools)
    if isinstance(content, list):
        return list(tokenizer.apply_chat_template(content, tools=tools, tokenize=True, return_dict=True,
                                                  add_generation_prompt=generation_prompt)["input_ids"])
    return list(tokenizer(text=content)["input_ids"])


def pair_tokens(row: dict, cfg: DataConfig, tokenizer) -> tuple[list[int], list[int], list[int]]:
    """(prompt ids, chosen ids, rejected ids) of one pair, untruncated, as TRL tokenizes it."""
    chosen, rejected = row[cfg.chosen_field], row[cfg.rejected_field]
    prompt = row.get(cfg.prompt_field)
    if _conversational(chosen):
        chosen, rejected = _messages(chosen, cfg), _messages(rejected, cfg)
        if isinstance(prompt, str) and not any(m["role"] == "user" for m in chosen):
            prompt = [{"role": "user", "content": prompt}]  # the responses alone: the text is their user turn
        elif prompt is not None:
            prompt = _messages(prompt, cfg) if _conversational(prompt) else None  # text: TRL extracts it
    if prompt is None:
        prompt, chosen, rejected = extract_prompt(chosen, rejected)
    if _conversational(chosen):  # the row's function schemas reach the template (TRL's `tools` column)
        messages, tools = list(prompt), tools_of(row, cfg.tools_field)
        prompt_ids = _ids(tokenizer, messages, generation_prompt=True, tools=tools)
        full = [_ids(tokenizer, messages + list(side), tools=tools) for side in (chosen, rejected)]
    else:
        eos = tokenizer.eos_token or ""
        prompt_ids = _ids(tokenizer, str(prompt))
        full = [_ids(tokenizer, str(prompt) + (s if s.endswith(eos) else s + eos))
                for s in map(str, (chosen, rejected))]
    start = min(_common_prefix(prompt_ids, f) for f in full)
    return prompt_ids[:start], full[0][start:], full[1][start:]


def _conversations(dataset, cfg: DataConfig):
    """(messages, tools) of every conversational prompt, chosen and rejected side: what the template must render."""
    for row in dataset:
        tools = tools_of(row, cfg.tools_field)
        yield [], tools
        for name in (cfg.prompt_field, cfg.chosen_field, cfg.rejected_field):
            if _conversational(row.get(name)):
                yield _messages(row[name], cfg), None


def fit(prompt: list[int], chosen: list[int], rejected: list[int], seq_len: int, max_prompt: int
        ) -> tuple[list[int], list[int], list[int], bool]:
    """The pair cut to seq_len: the prompt's start first (down to max_prompt tokens), then the responses' ends."""
    if len(prompt) + max(len(chosen), len(rejected)) <= seq_len:
        return prompt, chosen, rejected, False
    if len(prompt) > max_prompt:
        prompt = prompt[len(prompt) - max_prompt:]
    room = seq_len - len(prompt)
    return prompt, chosen[:room], rejected[:room], True


def _side(prompt: list[int], response: list[int], seq_len: int, pad: int) -> tuple[list[int], list[int], list[int]]:
    ids = prompt + response
    n_pad = seq_len - len(ids)
    return (ids + [pad] * n_pad, [IGNORE_INDEX] * len(prompt) + response + [IGNORE_INDEX] * n_pad,
            [1] * len(ids) + [0] * n_pad)


def tokenize(dataset, cfg: DataConfig, tokenizer, seq_len: int, num_proc: int | None) -> tuple[Any, dict]:
    """Raw split -> chosen_/rejected_ input_ids, labels, attention_mask (each padded to seq_len) and pair_index
    (the row's place in the split: the stored reference log-probs are looked up by it)."""
    max_prompt = cfg.max_prompt_length or seq_len // 2
    pad = _pad_id(tokenizer)
    chat_templates.check_rendered(_conversations(dataset, cfg), tokenizer, cfg.chat_template)

    def fn(batch):
        rows = [dict(zip(batch, values)) for values in zip(*batch.values())]
        out = {k: [] for k in (*COLUMNS, "truncated", "identical", "empty")}
        for row in rows:
            prompt, chosen, rejected = pair_tokens(row, cfg, tokenizer)
            prompt, chosen, rejected, cut = fit(prompt, chosen, rejected, seq_len, max_prompt)
            for side, response in zip(SIDES, (chosen, rejected)):
                ids, labels, mask = _side(prompt, response, seq_len, pad)
                out[f"{side}_input_ids"].append(ids)
                out[f"{side}_labels"].append(labels)
                out[f"{side}_attention_mask"].append(mask)
            out["truncated"].append(cut)
            out["identical"].append(chosen == rejected)
            out["empty"].append(not chosen or not rejected)
        return out
    marked = dataset.map(fn, batched=True, batch_size=1000, remove_columns=dataset.column_names,
                         num_proc=num_proc, desc="tokenizing pairs")
    empty = np.asarray(marked["empty"], dtype=bool)
    out = marked.select(np.flatnonzero(~empty)).remove_columns(["truncated", "identical", "empty"])
    out = out.add_column("pair_index", list(range(len(out))))  # the row's place in this split
    real = sum(int(np.asarray(out[f"{side}_attention_mask"]).sum()) for side in SIDES) if len(out) else 0
    stats = {"examples": len(dataset), "sequences": len(out), "pairs": len(out),
             "truncated": int(np.asarray(marked["truncated"]).sum()), "dropped": int(empty.sum()),
             "identical": int(np.asarray(marked["identical"])[~empty].sum()), "no_reply": int(empty.sum())}
    if len(out):
        stats["padding"] = 1 - real / (2 * len(out) * seq_len)
    return out, stats
