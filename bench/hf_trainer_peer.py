#!/usr/bin/env python3
"""The peer in bench/speed.py: the Hugging Face Trainer with a DeepSpeed config, written the way its users
write it (examples/pytorch/language-modeling/run_clm.py): tokenize with `datasets`, concatenate the
documents (each followed by EOS, as dstrain packs them) into seq_len blocks, labels = input_ids,
`TrainingArguments(deepspeed=...)`, `Trainer.train()`.

Run under the `deepspeed` launcher. Rank 0 writes --result: the wall-clock time at the end of every optimizer
step, the logged losses, and whether the Trainer really built a DeepSpeed engine (and which ZeRO stage).
"""
from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
from common import engine_of, leave, step_recorder


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
    parser.add_argument("--local_rank", type=int, default=-1)  # the deepspeed launcher's
    args = parser.parse_args()
    # DeepSpeed's JIT-built ops from the directories `make setup` built them into, as train.py finds them: neither
    # side pays a compile inside the comparison (built into torch's default directory instead, the shared-memory op
    # cost the peer ~30 s on a fresh machine)
    from dstrain.ds_internals import announce_jit_builds
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

    def group_texts(batch):
        flat = [token for ids in batch["input_ids"] for token in ids]
        usable = len(flat) // args.seq_len * args.seq_len
        blocks = [flat[i:i + args.seq_len] for i in range(0, usable, args.seq_len)]
        return {"input_ids": blocks, "labels": [list(b) for b in blocks]}

    tokenized = raw.map(tokenize, batched=True, remove_columns=raw.column_names)
    # run_clm groups 1000 documents at a time; one group here, so the blocks are exactly dstrain's
    train = tokenized.map(group_texts, batched=True, batch_size=len(tokenized))

    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
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
    trainer = Trainer(model=model, args=training_args, train_dataset=train, data_collator=default_data_collator,
                      callbacks=[record])
    trainer.train()

    if int(os.environ.get("RANK", "0")) == 0:
        Path(args.result).write_text(json.dumps({
            "step_end": record.step_end, "losses": record.losses, **engine_of(trainer),
            "world_size": int(os.environ.get("WORLD_SIZE", "1"))}))


if __name__ == "__main__":
    main()
    leave()
