"""`data.chat_template`: which conversation format SFT trains on, and so which one the exported model expects.

null (default) uses the tokenizer's own template; a tokenizer without one gets `plain` with a line saying so.
Named formats: chatml (Qwen, many fine-tunes), llama3 (Llama 3.x instruct), plain (role: text lines). Or a
path to a .jinja file. The chosen template is set on the tokenizer, so model_config/ and the exported hf/
carry it and `apply_chat_template` on the trained model renders exactly what it was trained on.

Written here, not taken from a library: transformers ships no named templates (each model repo carries its
own), and these three are the public formats, small enough to read.
"""
from __future__ import annotations

from pathlib import Path

from .errors import UserError, closest
from .paths import local_or_hub

TEMPLATES = {
    # ChatML as Qwen2.5 renders it: tool schemas in the system turn, calls in <tool_call> tags, tool results in
    # <tool_response> tags of a user turn, reasoning before the reply in <think> tags (on every turn: prefix by
    # prefix); a conversation with none of them renders as plain ChatML
    "chatml": ("{% if tools %}{{ '<|im_start|>system\\n' }}{% if messages[0]['role'] == 'system' %}"
               "{{ messages[0]['content'] + '\\n\\n' }}{% endif %}{{ '# Tools\\n\\n<tools>' }}"
               "{% for tool in tools %}{{ '\\n' + (tool | tojson) }}{% endfor %}{{ '\\n</tools><|im_end|>\\n' }}"
               "{% endif %}{% for message in messages %}{% if not (tools and loop.first and message['role'] == "
               "'system') %}{% if message['role'] == 'tool' %}{{ '<|im_start|>user\\n<tool_response>\\n' + "
               "message['content'] + '\\n</tool_response><|im_end|>\\n' }}{% else %}"
               "{{ '<|im_start|>' + message['role'] + '\\n' }}{% if message.get('reasoning_content') %}"
               "{{ '<think>\\n' + message['reasoning_content'] + '\\n</think>\\n\\n' }}{% endif %}"
               "{{ message['content'] }}{% for call in message.get('tool_calls') or [] %}"
               "{% set call = call['function'] if call.get('function') else call %}"
               "{{ ('\\n' if message['content'] or not loop.first else '') + "
               "'<tool_call>\\n{\"name\": \"' + call['name'] + '\", \"arguments\": ' + "
               "(call['arguments'] if call['arguments'] is string else call['arguments'] | tojson) + "
               "'}\\n</tool_call>' }}{% endfor %}{{ '<|im_end|>\\n' }}{% endif %}{% endif %}{% endfor %}"
               "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"),
    "llama3": ("{% if bos_token %}{{ bos_token }}{% endif %}{% for message in messages %}"
               "{{ '<|start_header_id|>' + message['role'] + "
               "'<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}{% endfor %}"
               "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"),
    # dstrain's format for tokenizers without a template (what it trained on before templates were a choice)
    "plain": ("{% if bos_token %}{{ bos_token }}{% endif %}{% for message in messages %}"
              "{% if message['role'] == 'assistant' %}{{ 'assistant: ' + message['content'] }}"
              "{% if eos_token %}{{ eos_token }}{% endif %}{% else %}"
              "{{ message['role'] + ': ' + message['content'] + '\\n' }}{% endif %}{% endfor %}"
              "{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}"),
}

ROLES = ("system", "user", "assistant", "tool")
# ShareGPT-style data ({"from": "human"|"gpt"|..., "value": ...}), the most common chat format on the hub
SHAREGPT_ROLES = {"human": "user", "gpt": "assistant", "system": "system", "user": "user",
                  "assistant": "assistant", "tool": "tool", "function_call": "assistant", "observation": "tool"}


def check(choice: str | None) -> None:
    """Validate data.chat_template before anything is loaded."""
    if choice is None or choice in TEMPLATES:
        return
    if not Path(local_or_hub(choice)).is_file():
        raise UserError(f"data.chat_template={choice!r} is neither a named template ({', '.join(TEMPLATES)}) nor a "
                        f"file{closest(choice, TEMPLATES)}; pass one of those or a path to a .jinja file")


# Mistral's own tokenizer files (mistral-common's): a model folder with one of these and no Jinja template (Magistral,
# Devstral, Mistral Small 3.x as Mistral ships them) is rendered by mistral-common, as Mistral's inference does
MISTRAL_FILES = ("tekken.json", "tokenizer.model.v*")


def mistral_file(folder) -> Path | None:
    """The Mistral tokenizer file in a model folder (tekken.json first), or None."""
    folder = Path(folder)
    for pattern in MISTRAL_FILES:
        found = sorted(folder.glob(pattern)) if folder.is_dir() else []
        if found:
            return found[-1]
    return None


def mistral_of(tokenizer):
    """mistral-common's tokenizer for a tokenizer that renders conversations through it (apply() decides), or None."""
    path = getattr(tokenizer, "mistral_common_file", None)
    if not path or tokenizer.chat_template:
        return None
    cached = getattr(tokenizer, "_dstrain_mistral", None)
    if cached is None:
        from mistral_common.protocol.instruct.validator import ValidationMode
        from mistral_common.tokens.tokenizers.mistral import MistralTokenizer
        cached = MistralTokenizer.from_file(path, mode=ValidationMode.finetuning)
        tokenizer._dstrain_mistral = cached
    return cached


def apply(choice: str | None, tokenizer, say, fmt: str = "chat") -> str:
    """Set the chosen template on the tokenizer; returns a short description for the log and run_info."""
    check(choice)
    if choice is None:
        if tokenizer.chat_template:
            return "the tokenizer's"
        if getattr(tokenizer, "mistral_common_file", None):
            return _mistral(tokenizer, fmt)
        tokenizer.chat_template = TEMPLATES["plain"]
        say("note: the tokenizer has no chat template; training on dstrain's plain format ('user: ...\\n"
            "assistant: ...'), which the exported model carries; set data.chat_template (chatml, llama3, plain or "
            "a .jinja file) to choose")
        return "plain (the tokenizer has none)"
    tokenizer.chat_template = TEMPLATES[choice] if choice in TEMPLATES else Path(local_or_hub(choice)).read_text()
    return choice


def _mistral(tokenizer, fmt: str) -> str:
    name = Path(tokenizer.mistral_common_file).name
    try:
        import mistral_common  # noqa: F401
    except ImportError:
        raise UserError(f"the model's tokenizer is Mistral's ({name}) with no chat template: pip install "
                        f"mistral-common to train on its own format, or set data.chat_template") from None
    return f"mistral-common's ({name})"


# what a message may carry besides its role and content, as transformers' chat templates read it: the assistant's
# calls (OpenAI's {type, function: {name, arguments}}), a tool reply's function name and call id, the reasoning
# (reasoning_content for most templates, thinking for gpt-oss's)
KEPT = ("tool_calls", "name", "tool_call_id", "reasoning_content", "thinking")
REASONING = ("reasoning_content", "thinking")
# per-turn training switches other tools read (axolotl's `weight`, `train`, `loss`): not read here, and every
# assistant turn trains, so a turn the data marks untrained would be trained silently: refused instead
SWITCHES = ("weight", "train", "loss", "trainable", "mask")


def _content(content, images: bool = False):
    """A message's text: a string, or OpenAI's content parts with their text parts joined. With `images` (a chat
    row, which a vision-language model may train on: dstrain/vision.py) parts holding an image stay parts,
    `{"type": "image"}` and `{"type": "text", "text": ...}`; elsewhere an image part is refused."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(part, dict) for part in content):
        kinds = {part.get("type", "text" if "text" in part else None) for part in content}
        if images and kinds == {"text", "image"} or images and kinds == {"image"}:
            return [{"type": "image"} if part.get("type") == "image" else
                    {"type": "text", "text": str(part.get("text", ""))} for part in content]
        if kinds - {"text"}:
            other = sorted(str(k) for k in kinds - {"text"})
            where = "text and image parts are" if images else "only text parts are"
            raise UserError(f"a chat message holds content parts of type {', '.join(other)}; {where} trained "
                            f"(images with data.format=chat and a vision-language model): remove those parts")
        return "".join(str(part.get("text", "")) for part in content)
    if content is None:
        return ""
    return str(content)


def normalize(messages, role_map: dict, images: bool = False) -> list[dict]:
    """role/content messages from role/content or ShareGPT's from/value, roles mapped (data.role_map first), the
    content as text (content parts joined), and everything a template renders kept (KEPT: tool calls, a tool reply's
    name and call id, the reasoning). An assistant turn may have no content when it holds tool calls."""
    if not isinstance(messages, list):
        raise UserError(f"a chat example is {type(messages).__name__}, not a list of messages; check "
                        f"data.messages_field")
    out = []
    for message in messages:
        if not isinstance(message, dict):
            raise UserError(f"a chat message is {type(message).__name__}, not a mapping with role and content")
        role = message.get("role", message.get("from"))
        content = message.get("content", message.get("value"))
        if content is None and not message.get("tool_calls"):
            raise UserError(f"a chat message has no 'content' (or ShareGPT 'value'); keys: {', '.join(message)}")
        mapped = role_map.get(role, SHAREGPT_ROLES.get(role, role))
        if mapped not in ROLES:
            raise UserError(f"chat role {role!r} is not one of {', '.join(ROLES)}; map it, e.g. "
                            f"--data.role_map.{role}=user")
        switch = next((key for key in SWITCHES if key in message), None)
        if switch is not None:
            raise UserError(f"a chat message has '{switch}' (a per-turn training switch), which dstrain does not read: "
                            f"every assistant turn trains; remove the field, or the turns it marks untrained")
        kept = {"role": mapped, "content": _content(content, images)}
        kept.update({key: message[key] for key in KEPT if message.get(key) is not None})
        out.append(kept)
    return out


def tools_of(row: dict, field: str):
    """A row's function schemas (TRL's `tools` column: a list, or its JSON text), or None."""
    import json
    tools = row.get(field)
    if isinstance(tools, str):
        try:
            tools = json.loads(tools) if tools.strip() else None
        except ValueError as error:
            raise UserError(f"'{field}' is text that is not JSON ({error}); give the function schemas as a list or "
                            f"its JSON") from None
    if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
        raise UserError(f"'{field}' is a {type(tools).__name__}, not a list of function schemas")
    return [_without_nulls(t) for t in tools] if tools else None


def _without_nulls(value):
    """A schema without null values: a table format (Arrow, parquet) gives every schema of a column every key any
    of them has, the missing ones null (TRL's remove_none_values, which it leaves to its users)."""
    if isinstance(value, dict):
        return {k: _without_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_without_nulls(v) for v in value]
    return value


# what a row holds that a template must render, each with a probe: a conversation carrying a marker in that field
_PROBES = {
    "tool_calls": ([{"role": "user", "content": "u"}, {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "dstrain_probe_call", "arguments": {"x": 1}}}]}], None,
        "dstrain_probe_call"),
    "tools": ([{"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}],
              [{"type": "function", "function": {"name": "dstrain_probe_tool", "description": "d",
                                                 "parameters": {"type": "object", "properties": {}}}}],
              "dstrain_probe_tool"),
    "reasoning_content": ([{"role": "user", "content": "u"}, {"role": "assistant", "content": "a",
                                                              "reasoning_content": "dstrain_probe_reasoning"}],
                          None, "dstrain_probe_reasoning"),
    "thinking": ([{"role": "user", "content": "u"}, {"role": "assistant", "content": "a",
                                                     "thinking": "dstrain_probe_thinking"}],
                 None, "dstrain_probe_thinking"),
}
PROBED = set(_PROBES)
WHAT = {"tool_calls": "assistant tool calls", "tools": "function schemas (tools)",
        "reasoning_content": "reasoning (reasoning_content)", "thinking": "reasoning (thinking)"}


def conversational(value) -> bool:
    """A non-empty list of message mappings (a prompt or completion given as messages, not text)."""
    return isinstance(value, list) and bool(value) and all(isinstance(m, dict) for m in value)


def _present(messages: list[dict], tools) -> set[str]:
    """The fields of one normalized conversation that a template must render (the keys of _PROBES)."""
    found = {key for m in messages for key in REASONING + ("tool_calls",) if m.get(key)}
    return found | ({"tools"} if tools else set())


def check_rendered(conversations, tokenizer, choice: str | None) -> None:
    """Nothing a user gave is dropped silently: each field the conversations hold ((messages, tools) pairs, normalized;
    read until every probed field has been seen) must appear when the run's template (data.chat_template `choice`)
    renders a conversation carrying it, or the run stops here, before anything is tokenized."""
    fields: set[str] = set()
    for messages, tools in conversations:
        fields |= _present(messages, tools)
        if fields >= PROBED:
            break
    missing = []
    for key in sorted(fields):
        messages, tools, marker = _PROBES[key]
        try:
            text = render(tokenizer, messages, tools)
        except Exception as error:  # noqa: BLE001 - a template that raises on the field renders nothing of it
            text = f"{type(error).__name__}"
        if marker not in text:
            missing.append(WHAT[key])
    if missing:
        described = ("mistral-common's" if mistral_of(tokenizer) else "the tokenizer's own") if choice is None \
            else f"data.chat_template={choice}"
        them = "those fields" if len(missing) > 1 else "that field"
        raise UserError(f"the rows hold {' and '.join(missing)}, which the chat template ({described}) never renders: "
                        f"the model would be trained without them; set data.chat_template to one that renders them "
                        f"(chatml does; or a .jinja file, docs/data.md) or remove {them} from the data")


def render(tokenizer, messages: list[dict], tools=None) -> str:
    """The conversation as the run renders it: the tokenizer's template, or mistral-common's encoding decoded."""
    mistral = mistral_of(tokenizer)
    if mistral is None:
        return tokenizer.apply_chat_template(messages, tools=tools, tokenize=False)
    return tokenizer.decode(mistral_ids(mistral, messages, tools))


def mistral_ids(mistral, messages: list[dict], tools=None) -> list[int]:
    """A conversation's ids in mistral-common's own format; a prompt (ending with a user turn or tool results) up to
    where the model writes (`[/INST]`), as a DPO pair's prompt, a GRPO prompt or a completion-only mask needs it.
    mistral-common's finetuning mode encodes only conversations that end with the assistant (a prompt raised
    InvalidMessageStructureException), so a prompt is encoded with a one-character reply whose own tokens, as
    mistral-common encodes that message, are cut off the end: the system prompt lands where it does for the real
    reply (Mistral's v3 puts it in the last user turn)."""
    if messages and messages[-1]["role"] == "assistant":
        return list(mistral_request(mistral, messages, tools)[1])
    request, ids = mistral_request(mistral, [*messages, {"role": "assistant", "content": "."}], tools)
    reply = mistral.instruct_tokenizer.encode_assistant_message(request.messages[-1],
                                                                is_before_last_user_message=False)
    if list(ids[-len(reply):]) != list(reply):
        raise ValueError("mistral-common's encoding of the prompt does not end with its placeholder reply")
    return list(ids[:-len(reply)])


def mistral_request(mistral, messages: list[dict], tools=None):
    """(the validated request, its token ids) of a conversation in mistral-common's own format (finetuning mode: a
    conversation may end with the assistant)."""
    from mistral_common.protocol.instruct.request import ChatCompletionRequest

    request = ChatCompletionRequest.from_openai(_openai(messages), tools=tools or None)
    return request, mistral.encode_chat_completion(request).tokens


def _openai(messages: list[dict]) -> list[dict]:
    """Normalized messages as mistral-common's from_openai reads them: call arguments as JSON text, reasoning left out
    (check_rendered refuses it first), and call ids as Mistral's format has them (9 letters or digits; another id, or
    none, becomes the conversation's n-th such id, the same in its calls and their replies)."""
    import json
    import re

    ids: dict = {}
    pending: list[str] = []  # the calls of the last calling turn not answered yet, in order

    def valid(call_id) -> str:
        if isinstance(call_id, str) and re.fullmatch(r"[A-Za-z0-9]{9}", call_id):
            return call_id
        return ids.setdefault(call_id if call_id is not None else f"missing{len(ids)}", f"call{len(ids):05d}")

    out = []
    for message in messages:
        message = {k: v for k, v in message.items() if k not in REASONING}
        if message.get("tool_calls"):
            calls = []
            for call in message["tool_calls"]:
                function = dict(call.get("function", call))
                if not isinstance(function.get("arguments"), str):
                    function["arguments"] = json.dumps(function.get("arguments") or {})
                calls.append({"id": valid(call.get("id")), "type": "function", "function": function})
            message["tool_calls"] = calls
            pending = [call["id"] for call in calls]
        if message["role"] == "tool":
            given = message.get("tool_call_id")
            known = given if given in pending else ids.get(given)
            if known is None and pending:  # a reply whose id no call has: the next call not answered yet
                known = pending[0]
                if given is not None:
                    ids[given] = known
            message["tool_call_id"] = known or valid(given)
            pending = [p for p in pending if p != message["tool_call_id"]]
        out.append(message)
    return out
