#!/usr/bin/env python3
"""The peer in bench/grpo.py: TRL's GRPOTrainer with a DeepSpeed config, written as TRL's GRPO quick start writes
it (`GRPOConfig(...)`, `GRPOTrainer(model=..., reward_funcs=..., args=..., train_dataset=...)`, `trainer.train()`),
generation through transformers' `generate` (TRL's default without vLLM), fp32 on CPUs (`bf16=False`) or bf16 on
GPUs, plus `TrainingArguments(deepspeed=...)`. TRL counts its batch in completions: per_device_train_batch_size is
prompts per rank x num_generations, so a step takes the same prompts as train.py's.

Run under the `deepspeed` launcher. Rank 0 writes --result: the wall-clock time at the end of every optimizer step,
the logged losses and rewards, whether a DeepSpeed engine was built, the CUDA peak on GPUs.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import time
from pathlib import Path

import torch
from common import engine_of, leave, step_recorder


def main() -> None:
    parser = argparse.ArgumentParser()
    for name in ("model", "data", "ds_config", "output_dir", "result", "rewards"):
        parser.add_argument(f"--{name}", required=True)
    for name, default in (("prompts_per_rank", 4), ("num_generations", 8), ("max_completion_length", 32),
                          ("max_steps", 20), ("warmup_steps", 2), ("seed", 42)):
        parser.add_argument(f"--{name}", type=int, default=default)
    for name, default in (("lr", 1e-4), ("temperature", 1.0)):
        parser.add_argument(f"--{name}", type=float, default=default)
    parser.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    parser.add_argument("--local_rank", type=int, default=-1)  # the deepspeed launcher's
    args = parser.parse_args()
    started = time.time()

    import datasets
    from trl import GRPOConfig, GRPOTrainer

    spec = importlib.util.spec_from_file_location("rewards", args.rewards)
    rewards = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(rewards)
    dataset = datasets.load_dataset("json", data_files=str(Path(args.data) / "train.jsonl"), split="train")
    training_args = GRPOConfig(
        output_dir=args.output_dir, deepspeed=args.ds_config, use_cpu=not torch.cuda.is_available(),
        per_device_train_batch_size=args.prompts_per_rank * args.num_generations, gradient_accumulation_steps=1,
        num_generations=args.num_generations, max_completion_length=args.max_completion_length,
        temperature=args.temperature, max_steps=args.max_steps, learning_rate=args.lr, lr_scheduler_type="cosine",
        warmup_steps=args.warmup_steps, weight_decay=0.0, logging_steps=1, bf16=args.precision == "bf16",
        save_strategy="no", eval_strategy="no", report_to=[], seed=args.seed, disable_tqdm=True)

    record = step_recorder()
    trainer = GRPOTrainer(model=args.model, reward_funcs=[rewards.says_the_count, rewards.one_sentence],
                          args=training_args, train_dataset=dataset, callbacks=[record])
    trainer.train()

    if int(os.environ.get("RANK", "0")) == 0:
        rewards_logged = [r["reward"] for r in trainer.state.log_history if "reward" in r]
        Path(args.result).write_text(json.dumps({
            "started": started, "step_end": record.step_end, "losses": record.losses, "rewards": rewards_logged,
            **engine_of(trainer),
            "peak_cuda_bytes": torch.cuda.max_memory_allocated() if torch.cuda.is_available() else None}))


if __name__ == "__main__":
    main()
    leave()
