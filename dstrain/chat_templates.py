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
    "chatml": ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
               "'<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
               "{% endif %}"),
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


def apply(choice: str | None, tokenizer, say) -> str:
    """Set the chosen template on the tokenizer; returns a short description for the log and run_info."""
    check(choice)
    if choice is None:
        if tokenizer.chat_template:
            return "the tokenizer's"
        tokenizer.chat_template = TEMPLATES["plain"]
        say("note: the tokenizer has no chat template; training on dstrain's plain format ('user: ...\\n"
            "assistant: ...'), which the exported model carries; set data.chat_template (chatml, llama3, plain or "
            "a .jinja file) to choose")
        return "plain (the tokenizer has none)"
    tokenizer.chat_template = TEMPLATES[choice] if choice in TEMPLATES else Path(local_or_hub(choice)).read_text()
    return choice


def normalize(messages, role_map: dict) -> list[dict]:
    """role/content messages from role/content or ShareGPT's from/value, roles mapped (data.role_map first)."""
    if not isinstance(messages, list):
        raise UserError(f"a chat example is {type(messages).__name__}, not a list of messages; check "
                        f"data.messages_field")
    out = []
    for message in messages:
        if not isinstance(message, dict):
            raise UserError(f"a chat message is {type(message).__name__}, not a mapping with role and content")
        role = message.get("role", message.get("from"))
        content = message.get("content", message.get("value"))
        if content is None:
            raise UserError(f"a chat message has no 'content' (or ShareGPT 'value'); keys: {', '.join(message)}")
        mapped = role_map.get(role, SHAREGPT_ROLES.get(role, role))
        if mapped not in ROLES:
            raise UserError(f"chat role {role!r} is not one of {', '.join(ROLES)}; map it, e.g. "
                            f"--data.role_map.{role}=user")
        out.append({"role": mapped, "content": str(content)})
    return out
