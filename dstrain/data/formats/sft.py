"""Supervised fine-tuning examples, shared by the `prompt_response` and `chat` formats: a conversation rendered
with the run's chat template, loss only on the assistant's tokens (labels IGNORE_INDEX elsewhere), truncated at
`seq_len` (the end cut; an example left with no reply token dropped), padded, or packed several to a row."""
from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import numpy as np

from ... import chat_templates
from ...config import DataConfig

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


_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")


def _render(tokenizer, messages: list[dict], tools, generation_prompt: bool = False) -> str:
    return tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                         add_generation_prompt=generation_prompt)


class Conversation(list):
    """Messages whose first `prompt_turns` are a prompt (TRL's conversational prompt-completion): only what the
    assistant writes after them trains."""
    prompt_turns = 0


def _common_prefix(a, b) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


_MARKER = "dstrainturnmarker"


def assistant_spans(messages: list[dict], tokenizer, tools=None) -> tuple[str, list[list[tuple[int, int]]]]:
    """The conversation rendered once by the run's template, and the character spans the assistant writes in it,
    a list for each assistant turn (more than one piece where a tool's reply is rendered inside the turn).

    Each assistant turn's span is found in that one rendering, so templates that render earlier turns differently
    (reasoning kept for the last turn only, a date in the system turn) train on the text the model sees. The same
    conversation rendered with that turn's content replaced by a marker (no reasoning, no tool calls) gives the text
    before and after the turn's own part; between them in the whole rendering lies what the turn's content,
    reasoning and tool calls became. The span then reaches back to where the generation prompt leaves off (what the
    model writes after `<|im_start|>assistant\\n`) and on through the end of turn. Written by hand: transformers gives
    assistant masks only for templates marked with `{% generation %}` (used as they are, in _sft_tokens), and TRL
    only for those or the templates it ships rewritten; this needs no change to the template."""
    text = _render(tokenizer, messages, tools)
    spans, cursor = [], 0
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        marker_turn = [{"role": "assistant", "content": _MARKER}]
        try:
            marked = _render(tokenizer, messages[:i] + marker_turn + messages[i + 1:], tools)
        except Exception:  # noqa: BLE001 - a tool reply after a turn without calls, refused by the template:
            # the marker turn keeps its calls, which then lie after the marker, reached by the end of turn below
            marker_turn = [{k: v for k, v in message.items() if k not in chat_templates.REASONING} |
                           {"content": _MARKER}]
            try:
                marked = _render(tokenizer, messages[:i] + marker_turn + messages[i + 1:], tools)
            except Exception:  # noqa: BLE001
                span = _prefix_span(tokenizer, messages, i, tools, text)
                if span is None:
                    raise
                spans.append(span)
                cursor = span[1]
                continue
        at = marked.find(_MARKER)
        if at < 0 and message.get("tool_calls"):  # a template that drops a calling turn's content (gpt-oss writes
            # only the call): the marker goes where the call's arguments are
            marker_turn = [_marked_call(message)]
            marked = _render(tokenizer, messages[:i] + marker_turn + messages[i + 1:], tools)
            at = marked.find(_MARKER)
        before, after = (marked[:at], marked[at + len(_MARKER):]) if at >= 0 else (marked, "")
        # the text after the turn's part is the same whatever the turn holds; the text before it may not be (a
        # template that opens an empty <think> block for a turn without reasoning): then up to where they differ
        end = len(text) - len(after) if at >= 0 and text.endswith(after) else \
            _past_tag(text, len(text) - _common_prefix(text[::-1], marked[::-1]))
        start = len(before) if text.startswith(before) else _common_prefix(text, marked)
        start = max(cursor, min(start, end))
        start = _after_generation_prompt(tokenizer, messages[:i], tools, text, cursor, start)
        # the end of turn: what follows the reply when the turn is the last one, as far as the conversation goes on
        # the same way (ChatML's `<|im_end|>\\n`, Phi-3's `<|end|>\\n` before the next turn and `<|end|>\\n</s>` at
        # the end, Llama 3's `<|eot_id|>`, an EOS)
        last = _render(tokenizer, messages[:i] + marker_turn, tools)
        closing = last[last.find(_MARKER) + len(_MARKER):] if _MARKER in last else ""
        shared = _whole_tags(closing, _common_prefix(closing, text[end:]))
        if not closing[:shared].strip() and closing.startswith("<"):  # another end tag mid-conversation (gpt-oss:
            # <|end|>, the last turn's <|return|>): the tag the template writes after a reply whatever follows it
            tag = _closing_tag(tokenizer, messages[:i], marker_turn, tools)
            shared = len(tag) if tag and text.startswith(tag, end) else shared
        end += shared
        spans.append((start, end))
        cursor = end
    return text, _without_tool_replies(text, messages, tokenizer, tools, spans)


def _marked_call(message: dict) -> dict:
    """The turn with its content dropped and its last call's last argument replaced by the marker."""
    calls = [dict(call) for call in message["tool_calls"]]
    last = dict(calls[-1])
    function = dict(last.get("function", last))
    arguments = function.get("arguments")
    if isinstance(arguments, dict) and arguments:
        function["arguments"] = {**arguments, list(arguments)[-1]: _MARKER}
    else:
        function["arguments"] = _MARKER
    calls[-1] = {**last, "function": function} if "function" in last else function
    return {k: v for k, v in message.items() if k not in chat_templates.REASONING} | {"content": "",
                                                                                         "tool_calls": calls}


def _without_tool_replies(text: str, messages: list[dict], tokenizer, tools,
                          spans: list[tuple[int, int]]) -> list[list[tuple[int, int]]]:
    """The spans less the tool replies a template renders inside the assistant's turn (Gemma 4's
    `<|tool_response>...<tool_response|>` follows the call within the model's turn): where a reply's content lies in a
    span, the text its run of tool messages adds (found by rendering the conversation without them) is the caller's
    to give, never the model's to learn. A reply outside every span (ChatML's tool turn) changes nothing."""
    frames, i = [], 0
    while i < len(messages):
        j = i
        while j < len(messages) and messages[j]["role"] == "tool":
            j += 1
        if j == i:
            i += 1
            continue
        try:
            marked = _render(tokenizer, messages[:i] + [{**messages[i], "content": _MARKER}] + messages[i + 1:], tools)
            at = marked.find(_MARKER)
            inside = at >= 0 and text.startswith(marked[:at]) and any(s <= at < e for s, e in spans)
            without = _render(tokenizer, messages[:i] + messages[j:], tools) if inside else ""
        except Exception:  # noqa: BLE001 - a template that needs the replies: nothing to take out
            inside = False
        if inside:
            head = _whole_tags(text, _common_prefix(text, without))
            frames.append((head, len(text) - _common_prefix(text[head:][::-1], without[head:][::-1])))
        i = j
    out = []
    for start, end in spans:
        pieces = [(start, end)]
        for a, b in frames:
            pieces = [piece for s, e in pieces for piece in ((s, min(e, a)), (max(s, b), e)) if piece[0] < piece[1]]
        out.append(pieces)
    return out


def _closing_tag(tokenizer, history: list[dict], marker_turn: list[dict], tools) -> str:
    """The tag right after a reply that is followed by another turn, when it is the same whether a user or an
    assistant turn follows (so it closes the reply rather than opening the next turn); "" otherwise."""
    tags = []
    for following in ({"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}):
        try:
            rendered = _render(tokenizer, history + marker_turn + [following], tools)
        except Exception:  # noqa: BLE001 - a template that refuses the probe: no tag
            return ""
        rest = rendered[rendered.find(_MARKER) + len(_MARKER):]
        tags.append(rest[:rest.find(">") + 1] if rest.startswith("<") and ">" in rest else "")
    return tags[0] if tags[0] == tags[1] else ""


def _prefix_span(tokenizer, messages: list[dict], i: int, tools, text: str) -> tuple[int, int] | None:
    """Turn i's span where the template renders the conversation prefix by prefix up to it: from its generation
    prompt's end to the end of the conversation rendered through it; None where it does not."""
    prompt = _render(tokenizer, messages[:i], tools, generation_prompt=True)
    full = _render(tokenizer, messages[:i + 1], tools)
    return (len(prompt), len(full)) if full.startswith(prompt) and text.startswith(full) else None


def _after_generation_prompt(tokenizer, history: list[dict], tools, text: str, cursor: int, start: int) -> int:
    """Where the model starts writing a turn: after the generation prompt (`<|im_start|>assistant\\n`, a `<think>`
    the template opens there too), found as far as the turn's text has it before `start`."""
    try:
        prompt_less = _render(tokenizer, history, tools)
        prompt = _render(tokenizer, history, tools, generation_prompt=True)
    except Exception:  # noqa: BLE001 - a template that cannot render an empty conversation
        return start
    header = prompt[len(prompt_less):] if prompt.startswith(prompt_less) else ""
    if not header:
        return start
    found = text.rfind(header, cursor, start + len(header))
    if found >= 0 and found + len(header) <= start:
        return found + len(header)
    first = header.split("\n", 1)[0]  # the role's opening line; then as far as the turn agrees with the prompt
    found = text.rfind(first, cursor, start) if first else -1
    if found < 0:
        return start
    return min(start, found + _whole_tags(header, _common_prefix(header, text[found:])))


def _past_tag(text: str, n: int) -> int:
    """n, or more so that text[n:] does not start inside a tag: the common end of two renderings that differ in the
    turn's own closing tag (gpt-oss's last turn: `<|call|>` where the marker's reply has `<|return|>`, both ending in
    `|>`) ends after that tag, which is the turn's. A tag here: `<` to `>`, no space inside, at most 32 characters."""
    opened, closed = text.rfind("<", 0, n), text.find(">", n)
    if opened < 0 or closed < 0 or text.rfind(">", 0, n) > opened or closed - opened > 32:
        return n
    return n if any(c.isspace() for c in text[opened:closed]) else closed + 1


def _whole_tags(text: str, n: int) -> int:
    """n, or less so that text[:n] does not end inside a tag (`<|end|>\\n<` of `<|end|>\\n</s>` against
    `<|end|>\\n<|user|>`: the `<` belongs to the next one)."""
    opened = text.rfind("<", 0, n)
    return opened if opened > text.rfind(">", 0, n) else n


def _sft_tokens(messages: list[dict], tokenizer, tools=None, prompt_turns: int = 0) -> tuple[list[int], list[int]]:
    """A whole conversation's ids and labels (IGNORE_INDEX except on what the assistant writes), untruncated, from
    the conversation rendered once (assistant_spans). The tokenizer carries the run's template
    (dstrain/chat_templates.py); one marked with `{% generation %}` gives transformers' own assistant mask. The
    first `prompt_turns` messages are a prompt (TRL's prompt-completion layout): its assistant turns do not train."""
    mistral = chat_templates.mistral_of(tokenizer)
    if mistral is not None:
        return _mistral_tokens(mistral, messages, tools, prompt_turns)
    if not tokenizer.chat_template:
        raise ValueError("the tokenizer has no chat template: chat_templates.apply sets one first")
    if _GENERATION_TAG.search(tokenizer.chat_template):
        out = tokenizer.apply_chat_template(messages, tools=tools, tokenize=True, return_dict=True,
                                            return_assistant_tokens_mask=True)
        ids, mask = list(out["input_ids"]), list(out["assistant_masks"])
        if prompt_turns:  # the completion starts where the prompt's own tokens end (TRL's completion mask)
            prompt = tokenizer.apply_chat_template(messages[:prompt_turns], tools=tools, tokenize=True,
                                                   return_dict=True, add_generation_prompt=True)["input_ids"]
            cut = _common_prefix(list(prompt), ids)
            mask = [0] * cut + mask[cut:]
        return ids, [i if m else IGNORE_INDEX for i, m in zip(ids, mask)]
    text, spans = assistant_spans(messages, tokenizer, tools)
    turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    spans = [piece for turn, pieces in zip(turns, spans) if turn >= prompt_turns for piece in pieces]
    # tokenized piece by piece at the spans' edges: no token straddles a trained and an untrained character, and the
    # text before a reply becomes the tokens a prompt rendered up to there becomes at inference
    ids, labels, at = [], [], 0
    for start, end in [*spans, (len(text), len(text))]:
        for piece, train in ((text[at:start], False), (text[start:end], True)):
            piece_ids = tokenizer(piece, add_special_tokens=False)["input_ids"] if piece else []
            ids += piece_ids
            labels += piece_ids if train else [IGNORE_INDEX] * len(piece_ids)
        at = end
    return ids, labels


def _mistral_tokens(mistral, messages: list[dict], tools, prompt_turns: int) -> tuple[list[int], list[int]]:
    """ids and labels in Mistral's own format: the conversation encoded once by mistral-common (the system prompt
    where its version puts it, e.g. in the last user turn), each assistant turn's tokens as mistral-common encodes
    that message alone (its reply or calls and the EOS), found in order in the whole: what the model writes after
    `[/INST]` or a tool's results. Mistral's own fine-tuning code (mistral-finetune) masks the same way, message by
    message; mistral-common gives no mask itself, hence this."""
    from mistral_common.protocol.instruct.messages import AssistantMessage, UserMessage

    request, ids = chat_templates.mistral_request(mistral, messages, tools)
    turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    asked = [(at, m) for at, m in enumerate(request.messages) if isinstance(m, AssistantMessage)]
    labels, cursor = [IGNORE_INDEX] * len(ids), 0
    for n, (at, message) in enumerate(asked):
        later_user = any(isinstance(m, UserMessage) for m in request.messages[at + 1:])
        part = mistral.instruct_tokenizer.encode_assistant_message(message, is_before_last_user_message=later_user)
        found = next((k for k in range(cursor, len(ids) - len(part) + 1) if ids[k:k + len(part)] == part), None)
        if found is None:
            raise ValueError(f"assistant turn {n + 1} not found in mistral-common's encoding of the conversation")
        if n < len(turns) and turns[n] >= prompt_turns:
            labels[found:found + len(part)] = part
        cursor = found + len(part)
    return list(ids), labels


def _with_options(messages: list[dict], tokenizer, tools, cfg: DataConfig) -> tuple[list[int], list[int]]:
    """ids and labels under TRL's two switches: data.assistant_only_loss (what the assistant writes; false: every
    token) and data.completion_only_loss (prompt-completion rows: the completion only; false: the prompt's own
    assistant turns too, or with assistant_only_loss false the whole sequence). TRL's masks combine the same way.
    data.last_turn_only reads every turn before the last assistant turn as the prompt."""
    prompt_turns = getattr(messages, "prompt_turns", 0)
    if cfg.last_turn_only:  # every turn before the last assistant turn is its prompt
        prompt_turns = max([prompt_turns] + [i for i, m in enumerate(messages) if m["role"] == "assistant"])
    if cfg.assistant_only_loss:
        return _sft_tokens(messages, tokenizer, tools, prompt_turns if cfg.completion_only_loss else 0)
    ids, _ = _sft_tokens(messages, tokenizer, tools)
    if not (prompt_turns and cfg.completion_only_loss):
        return ids, list(ids)
    mistral = chat_templates.mistral_of(tokenizer)
    if mistral is not None:  # the prompt's ids in Mistral's format (it ends with the user's turn)
        prompt_ids = chat_templates.mistral_ids(mistral, messages[:prompt_turns], tools)
    else:
        prompt = _render(tokenizer, messages[:prompt_turns], tools, generation_prompt=True)  # the completion: after
        prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    cut = _common_prefix(prompt_ids, ids)  # TRL's completion mask
    return ids, [IGNORE_INDEX] * cut + ids[cut:]


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
             to_messages: Callable[[dict, DataConfig], list[dict]],
             to_tools: Callable[[dict, DataConfig], list | None] = lambda row, cfg: None) -> tuple[Any, dict]:
    """Raw split -> (input_ids, labels, attention_mask [+ position_ids when packed], counts for the report).

    SFT examples longer than seq_len are truncated at seq_len (their end is cut); those left without a reply
    token are dropped. Both are counted: a user should know what a seq_len costs."""
    rows = (dict(zip(batch, values)) for batch in dataset.iter(batch_size=1000) for values in zip(*batch.values()))
    chat_templates.check_rendered(((to_messages(row, cfg), to_tools(row, cfg)) for row in rows), tokenizer,
                                  cfg.chat_template)

    def fn(batch):
        rows = [dict(zip(batch, values)) for values in zip(*batch.values())]
        out = {k: [] for k in (*SFT_COLUMNS, "full_length", "has_reply")}
        for row in rows:
            messages = to_messages(row, cfg)
            ids, labels = _with_options(messages, tokenizer, to_tools(row, cfg), cfg)
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
    if len(out):  # what the loss is taken on, said in the run's data line
        stats["tokens"] = int(sum(sum(mask) for mask in out["attention_mask"]))
        stats["trained_tokens"] = int(sum(sum(label != IGNORE_INDEX for label in labels) for labels in out["labels"]))
    if cfg.packing and len(out):
        pad = _pad_id(tokenizer)

        def pack(batch):  # 1000 examples at a time: rows never mix examples far apart in the data's order
            return pack_examples(list(zip(batch["input_ids"], batch["labels"])), seq_len, pad)
        out = out.map(pack, batched=True, batch_size=1000, remove_columns=out.column_names, desc="packing")
        stats |= {"packed_examples": stats["sequences"], "sequences": len(out)}
    if len(out):
        stats["padding"] = 1 - int(np.minimum(lengths[kept], seq_len).sum()) / (len(out) * seq_len)
    return out, stats
