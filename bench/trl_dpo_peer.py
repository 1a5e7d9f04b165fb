#!/usr/bin/env python3
"""The peer in bench/dpo.py: TRL's DPOTrainer with a DeepSpeed config, written as TRL's DPO quick start writes it
(`DPOConfig(...)`, `DPOTrainer(model=..., args=..., train_dataset=..., processing_class=...)`, `trainer.train()`),
in fp32 (`bf16=False`: DPOConfig turns bf16 on by default) or, with --precision bf16 (GPUs), bf16,
plus `TrainingArguments(deepspeed=...)`. `--fast` adds TRL's own speed settings: `precompute_ref_log_probs` (the
reference's log-probs computed in one pass before training, its model then dropped) with a larger
`precompute_ref_batch_size`; `padding_free` is not offered by TRL 1.16's DPOTrainer (it warns and pads).

Run under the `deepspeed` launcher. Rank 0 writes --result: the wall-clock time at the end of every optimizer step,
the logged losses, the peak RSS of this rank, and whether a DeepSpeed engine was built.
"""
from __future__ import annotations

import time
from pathlib import Path

import torch
from common import leave, peer_parser, train_and_write


def main() -> None:
    parser = peer_parser({"max_length": 48, "micro_batch_size": 8, "grad_accum_steps": 1, "max_steps": 20,
                          "warmup_steps": 2, "seed": 42}, {"lr": 5e-4, "beta": 0.1, "weight_decay": 0.0})
    parser.add_argument("--fast", action="store_true", help="TRL's own speed settings")
    args = parser.parse_args()
    started = time.time()

    import datasets
    from transformers import AutoTokenizer
    from trl import DPOConfig, DPOTrainer

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    dataset = datasets.load_dataset("json", data_files=str(Path(args.data) / "train.jsonl"), split="train")
    extra = {"precompute_ref_log_probs": True, "precompute_ref_batch_size": 4 * args.micro_batch_size} \
        if args.fast else {}
    training_args = DPOConfig(
        output_dir=args.output_dir, deepspeed=args.ds_config, use_cpu=not torch.cuda.is_available(),
        per_device_train_batch_size=args.micro_batch_size, gradient_accumulation_steps=args.grad_accum_steps,
        max_steps=args.max_steps, learning_rate=args.lr, lr_scheduler_type="cosine", warmup_steps=args.warmup_steps,
        weight_decay=args.weight_decay, beta=args.beta, max_length=args.max_length, logging_steps=1,
        bf16=args.precision == "bf16",
        save_strategy="no", eval_strategy="no", report_to=[], seed=args.seed, disable_tqdm=True, **extra)

    train_and_write(DPOTrainer, args.result, started,
                    model=args.model, args=training_args, train_dataset=dataset, processing_class=tokenizer)


if __name__ == "__main__":
    main()
    leave()
