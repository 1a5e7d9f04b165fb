"""What the benchmarks share: a Llama of a chosen size with the tiny recipe's tokenizer, a free port."""
from __future__ import annotations

import shutil
import socket
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def make_llama(out: Path, **sizes) -> int:
    """The tiny recipe's Llama config with `sizes` applied, random weights (seed 0), saved with the tokenizer;
    returns the parameter count."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(ROOT / "recipes/tiny/model")
    config.update(sizes)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(ROOT / "recipes/tiny/model" / name, out / name)
    return sum(p.numel() for p in model.parameters())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_section(script: str, title: str, body: str) -> None:
    """Replace (or append) the section of docs/benchmarks.md that `script` owns, between its markers."""
    begin, end = f"<!-- {script} begin -->", f"<!-- {script} end -->"
    doc = ROOT / "docs" / "benchmarks.md"
    text = doc.read_text() if doc.exists() else "# Benchmarks\n"
    section = f"{begin}\n## {title} ({script})\n\n{body}{end}"
    if begin in text:
        text = text[:text.index(begin)] + section + text[text.index(end) + len(end):]
    else:
        text = text.rstrip() + "\n\n" + section + "\n"
    doc.parent.mkdir(exist_ok=True)
    doc.write_text(text)
