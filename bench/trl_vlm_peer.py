#!/usr/bin/env python3
"""The peer in bench/vlm.py: TRL's SFTTrainer on a vision-language model, written as TRL's VLM SFT guide writes it
(`SFTConfig(...)`, `SFTTrainer(model=..., args=..., train_dataset=..., processing_class=processor)`,
`trainer.train()`), on TRL's vision layout (an `images` column of PIL images, messages with image parts: datasets'
Image feature over the rows' paths), assistant-only loss (TRL's `assistant_only_loss`, from the processor's template
with transformers' `{% generation %}` tags around the assistant's reply and end of turn, as train.py masks it), plus
`TrainingArguments(deepspeed=...)`. fp32 (`bf16=False`: SFTConfig turns bf16 on by default) or, with --precision
bf16 (GPUs), bf16. SFTConfig's own default, activation checkpointing on, unless --no_checkpointing (the same work
as train.py's run, which does not recompute).

Run under the `deepspeed` launcher. Rank 0 writes --result: the wall-clock time at the end of every optimizer step,
the logged losses, the peak RSS of this rank, and whether a DeepSpeed engine was built.
"""
from __future__ import annotations

import time
from pathlib import Path

import torch
from common import leave, peer_parser, train_and_write


def tagged(template: str) -> str:
    """The processor's template with transformers' assistant-mask tags around what the assistant writes. The tiny
    VLM's template renders each message as `<|role|>`, its content, then eos: the tags go around an assistant
    message's content and eos (train.py's loss covers the same tokens)."""
    head = "{% for message in messages %}{{ '<|' + message['role'] + '|>' }}"
    tail = "{% endfor %}{% if add_generation_prompt %}"
    if not template.startswith(head) or tail not in template:
        raise SystemExit("bench/trl_vlm_peer.py: the processor's template is not the tiny VLM's (role, content, eos)")
    middle, rest = template[len(head):].rsplit(tail, 1)
    if not middle.endswith("{{ eos_token }}"):
        raise SystemExit("bench/trl_vlm_peer.py: the template does not end a message with eos")
    return (head + "{% if message['role'] == 'assistant' %}{% generation %}" + middle + "{% endgeneration %}"
            "{% else %}" + middle + "{% endif %}" + tail + rest)


def main() -> None:
    parser = peer_parser({"micro_batch_size": 8, "grad_accum_steps": 1, "max_steps": 20, "warmup_steps": 2,
                          "seed": 42}, {"lr": 3e-3, "weight_decay": 0.0})
    parser.add_argument("--no_checkpointing", action="store_true", help="activation checkpointing off")
    args = parser.parse_args()
    started = time.time()

    import datasets
    from transformers import AutoModelForImageTextToText, AutoProcessor
    from trl import SFTConfig, SFTTrainer

    processor = AutoProcessor.from_pretrained(args.model)
    processor.chat_template = tagged(processor.chat_template)
    rows = datasets.load_dataset("json", data_files=args.data, split="train")
    base = Path(args.data).resolve().parent
    rows = rows.map(lambda row: {"images": [str(base / path) for path in row["images"]]})
    rows = rows.cast_column("images", datasets.Sequence(datasets.Image()))
    training_args = SFTConfig(
        output_dir=args.output_dir, deepspeed=args.ds_config, use_cpu=not torch.cuda.is_available(),
        per_device_train_batch_size=args.micro_batch_size, gradient_accumulation_steps=args.grad_accum_steps,
        max_steps=args.max_steps, learning_rate=args.lr, lr_scheduler_type="cosine", warmup_steps=args.warmup_steps,
        weight_decay=args.weight_decay, max_length=None, assistant_only_loss=True, logging_steps=1,
        bf16=args.precision == "bf16", gradient_checkpointing=not args.no_checkpointing,
        save_strategy="no", eval_strategy="no", report_to=[], seed=args.seed, disable_tqdm=True)
    dtype = torch.bfloat16 if args.precision == "bf16" else torch.float32
    model = AutoModelForImageTextToText.from_pretrained(args.model, dtype=dtype)

    train_and_write(SFTTrainer, args.result, started,
                    model=model, args=training_args, train_dataset=rows, processing_class=processor)


if __name__ == "__main__":
    main()
    leave()
