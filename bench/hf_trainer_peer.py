#!/usr/bin/env python3
"""The peer in bench/speed.py: the Hugging Face Trainer with a DeepSpeed config, written the way its users
write it (examples/pytorch/language-modeling/run_clm.py): tokenize with `datasets`, concatenate the
documents (each followed by EOS, as dstrain packs them) into seq_len blocks, labels = input_ids,
`TrainingArguments(deepspeed=...)`, `Trainer.train()`.

Run under the `deepspeed` launcher. Rank 0 writes --result: the wall-clock time at the end of every optimizer
step, the logged losses, and whether the Trainer really built a DeepSpeed engine (and which ZeRO stage).

`--align` takes the Trainer, one setting at a time, to what train.py (and bench/plain_loop.py) does, for
bench/loss_gap.py to measure what each difference costs in loss:
  blocks    documents concatenated per 1,000 (dstrain's datasets.map batch) instead of in one group
  order     dstrain's documented sample order (epoch e: numpy's permutation seeded by (seed, e)) instead of the
            Trainer's seeded RandomSampler; accelerate deals the batches to ranks in turn, as dstrain does
  schedule  the learning rate of step s (1-based) on step s; the Trainer's schedule counts from 0, so its first
            update has lr 0 and every later one the lr dstrain gives the step before
  decay     weight decay on matrices only: the Trainer hands DeepSpeed's optimizer every parameter in one group
            (norms decayed too); without the JSON's optimizer it builds its own AdamW with its own grouping
"""
from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
from common import engine_of, leave, step_recorder

ALIGN = ("blocks", "order", "schedule", "decay")


def aligned(trainer_class, args, n: int):
    """The Trainer class with --align's order and schedule (see the module docstring)."""
    import math

    import numpy as np
    from torch.utils.data import Sampler

    class DstrainOrder(Sampler):
        """Each pass over the data is the next epoch of dstrain's stream."""
        def __init__(self):
            self.epoch = 0

        def __len__(self):
            return n

        def __iter__(self):
            order = np.random.default_rng([args.seed, self.epoch]).permutation(n)
            self.epoch += 1
            return iter(order.tolist())

    def factor(s: int) -> float:  # dstrain's, at the 1-based step s
        if s <= args.warmup_steps:
            return s / args.warmup_steps
        progress = (s - args.warmup_steps) / (args.max_steps - args.warmup_steps)
        return args.min_lr_ratio + (1 - args.min_lr_ratio) * (1 + math.cos(math.pi * progress)) / 2

    class Aligned(trainer_class):
        def _get_train_sampler(self, *a, **k):
            return DstrainOrder() if "order" in args.align else super()._get_train_sampler(*a, **k)

        def create_scheduler(self, num_training_steps, optimizer=None):
            if "schedule" not in args.align or self.lr_scheduler is not None:
                return super().create_scheduler(num_training_steps, optimizer)
            self.lr_scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer or self.optimizer,
                                                                  lambda i: factor(i + 1))
            return self.lr_scheduler
    return Aligned


def main() -> None:
    parser = argparse.ArgumentParser()
    for name in ("model", "data", "ds_config", "output_dir", "result"):
        parser.add_argument(f"--{name}", required=True)
    for name, default in (("seq_len", 128), ("micro_batch_size", 8), ("grad_accum_steps", 1), ("max_steps", 30),
                          ("warmup_steps", 10), ("seed", 42)):
        parser.add_argument(f"--{name}", type=int, default=default)
    for name, default in (("lr", 3e-3), ("weight_decay", 0.1), ("min_lr_ratio", 0.1), ("max_grad_norm", 1.0)):
        parser.add_argument(f"--{name}", type=float, default=default)
    parser.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    parser.add_argument("--torch_compile", action="store_true", help="TrainingArguments(torch_compile=True)")
    parser.add_argument("--align", nargs="*", default=[], choices=ALIGN, help="settings taken to dstrain's")
    parser.add_argument("--local_rank", type=int, default=-1)  # the deepspeed launcher's
    args = parser.parse_args()
    # DeepSpeed's JIT-built ops from the directories `make setup` built them into, as train.py finds them: neither
    # side pays a compile inside the comparison (built into torch's default directory instead, the shared-memory op
    # cost the peer ~30 s on a fresh machine)
    from dstrain.parallel.ds_internals import announce_jit_builds
    announce_jit_builds(lambda text: print(text, flush=True))

    import datasets
    from transformers import (
        AutoModelForCausalLM,
        AutoTokenizer,
        Trainer,
        TrainingArguments,
        default_data_collator,
    )

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    raw = datasets.load_dataset("json", data_files={"train": str(Path(args.data) / "train.jsonl")})["train"]

    def tokenize(batch):
        return {"input_ids": [ids + [tokenizer.eos_token_id]
                              for ids in tokenizer(batch["text"], add_special_tokens=False)["input_ids"]]}

    def group_texts(batch):  # with --align blocks, called per 1,000 documents
        flat = [token for ids in batch["input_ids"] for token in ids]
        usable = len(flat) // args.seq_len * args.seq_len
        blocks = [flat[i:i + args.seq_len] for i in range(0, usable, args.seq_len)]
        return {"input_ids": blocks, "labels": [list(b) for b in blocks]}

    tokenized = raw.map(tokenize, batched=True, remove_columns=raw.column_names)
    # run_clm groups 1000 documents at a time; the bench's users would not notice: one group unless aligned
    train = tokenized.map(group_texts, batched=True, batch_size=1000 if "blocks" in args.align else len(tokenized))

    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    if "decay" in args.align:
        ds = json.loads(Path(args.ds_config).read_text())
        ds.pop("optimizer", None)
        args.ds_config = str(Path(args.output_dir) / "ds_config_own_optimizer.json")
        Path(args.ds_config).write_text(json.dumps(ds))
    training_args = TrainingArguments(
        output_dir=args.output_dir, deepspeed=args.ds_config, use_cpu=not torch.cuda.is_available(),
        bf16=args.precision == "bf16", per_device_train_batch_size=args.micro_batch_size,
        gradient_accumulation_steps=args.grad_accum_steps, max_steps=args.max_steps, learning_rate=args.lr,
        lr_scheduler_type="cosine_with_min_lr", lr_scheduler_kwargs={"min_lr_rate": args.min_lr_ratio},
        warmup_steps=args.warmup_steps, weight_decay=args.weight_decay, adam_beta1=0.9, adam_beta2=0.95,
        adam_epsilon=1e-8, max_grad_norm=args.max_grad_norm, logging_steps=1, save_strategy="no",
        eval_strategy="no", report_to=[], seed=args.seed, dataloader_drop_last=True, disable_tqdm=True,
        torch_compile=args.torch_compile)

    record = step_recorder()
    trainer = aligned(Trainer, args, len(train))(model=model, args=training_args, train_dataset=train,
                                                data_collator=default_data_collator, callbacks=[record])
    trainer.train()

    if int(os.environ.get("RANK", "0")) == 0:
        Path(args.result).write_text(json.dumps({
            "step_end": record.step_end, "losses": record.losses, **engine_of(trainer),
            "world_size": int(os.environ.get("WORLD_SIZE", "1")),
            "peak_cuda_bytes": torch.cuda.max_memory_allocated() if torch.cuda.is_available() else None}))


if __name__ == "__main__":
    main()
    leave()
