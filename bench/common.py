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


def peer_parser(ints: dict, floats: dict, paths=("model", "data", "ds_config", "output_dir", "result")):
    """A Trainer peer's arguments: the required `paths`, integer and float settings with their defaults, the
    precision, and the deepspeed launcher's --local_rank."""
    import argparse

    parser = argparse.ArgumentParser()
    for name in paths:
        parser.add_argument(f"--{name}", required=True)
    for kind, defaults in ((int, ints), (float, floats)):
        for name, default in defaults.items():
            parser.add_argument(f"--{name}", type=kind, default=default)
    parser.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    parser.add_argument("--local_rank", type=int, default=-1)  # the deepspeed launcher's
    return parser


def write_result(path: str, started: float, record, trainer, **figures) -> None:
    """A Trainer peer's result.json, from rank 0: its step end times and losses (`record`, step_recorder's), the
    peak RSS of this rank, whether a DeepSpeed engine was built, its CUDA peak, and any other per-step `figures`."""
    import json
    import os
    import resource
    from pathlib import Path

    import torch
    if int(os.environ.get("RANK", "0")) != 0:
        return
    Path(path).write_text(json.dumps({
        "started": started, "step_end": record.step_end, "losses": record.losses, **figures,
        "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, **engine_of(trainer),
        "peak_cuda_bytes": torch.cuda.max_memory_allocated() if torch.cuda.is_available() else None}))


def train_and_write(trainer_class, result: str, started: float, **kwargs) -> None:
    """A Trainer peer's run: `trainer_class(**kwargs)` with a step recorder, trained, its result.json written."""
    record = step_recorder()
    trainer = trainer_class(**kwargs, callbacks=[record])
    trainer.train()
    write_result(result, started, record, trainer)


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
