"""What the benchmarks share: a Llama of a chosen size with the tiny recipe's tokenizer, a free port."""
from __future__ import annotations

import shutil
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
    from dstrain.parallel.dist import free_port as pick  # below the ephemeral range: no connection takes it meanwhile
    return pick()


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


def step_recorder():
    """A transformers TrainerCallback that keeps the wall-clock time at the end of every optimizer step and the
    logged losses (the peers' side of a bench: what dstrain's metrics.jsonl holds)."""
    import time

    from transformers import TrainerCallback

    class Record(TrainerCallback):
        def __init__(self):
            self.step_end, self.losses = [], []

        def on_step_end(self, _args, state, control, **kwargs):
            self.step_end.append(time.time())

        def on_log(self, _args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                self.losses.append(float(logs["loss"]))
    return Record()


def engine_of(trainer) -> dict:
    """Whether a Trainer really built a DeepSpeed engine, and its ZeRO stage."""
    import deepspeed
    engine = trainer.model_wrapped
    is_engine = isinstance(engine, deepspeed.DeepSpeedEngine)
    return {"deepspeed_engine": type(engine).__name__ if is_engine else None,
            "zero_stage": engine.zero_optimization_stage() if is_engine else None}


def leave() -> None:
    """End a peer rank skipping interpreter teardown, as train.py does (dstrain.parallel.dist.leave): destroying gloo's
    threads there aborted a finished Trainer rank ("terminate called without an active exception", SIGABRT)."""
    import os
    import sys

    import torch.distributed as torch_dist
    if torch_dist.is_initialized():
        torch_dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
