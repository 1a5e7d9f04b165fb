#!/usr/bin/env python3
"""The floor in bench/speed.py: what the chip does with no framework. A plain PyTorch training loop, written the
way a person writes one for speed (nanoGPT's shape), sharing no code with dstrain:

  the model      AutoModelForCausalLM from the bench's saved checkpoint, fp32 weights, SDPA attention
  precision      fp32, or bf16 as torch.autocast over the fp32 weights (what a plain loop does on a GPU)
  compile        `--compile`: torch.compile(model), the whole model (torch's default mode)
  optimizer      torch.optim.AdamW (fused on CUDA, foreach on CPU), weight decay on the matrices only,
                 betas (0.9, 0.95), eps 1e-8; gradient clipping to --max_grad_norm
  schedule       linear warm-up then cosine to min_lr_ratio, set by hand before each step (1-based steps)
  data           data/tiny/train.jsonl, each document followed by EOS, concatenated per group of 1,000 documents
                 and cut into full seq_len blocks (dstrain's documented packing of `data.format: text`); sample k of
                 the stream is element k % n of numpy's permutation seeded by (seed, k // n), global batch s holds
                 samples [s*G, (s+1)*G), micro-batch m of rank r its positions (m*world + r)*micro ... (dstrain's
                 documented order): so the loop trains on what train.py trains on, step by step
  ranks          one process per device; several under a launcher (RANK/WORLD_SIZE set) average gradients with
                 torch's DistributedDataParallel (gloo on CPU ranks, nccl on GPUs)
  the loss       logits -> cross entropy over the shifted labels, mean over the global batch's tokens; .item()
                 once per step, as any loop that logs its loss

Run under the `deepspeed` launcher (or alone: one process). Rank 0 writes --result: the wall-clock time at the end
of every optimizer step, the losses, the world size and torch.cuda.max_memory_allocated() on CUDA.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

GROUP = 1000  # documents concatenated together before cutting blocks (dstrain's datasets.map batch size)


def blocks(path: Path, tokenizer, seq_len: int) -> torch.Tensor:
    texts = [json.loads(line)["text"] for line in path.read_text().splitlines() if line.strip()]
    out = []
    for g in range(0, len(texts), GROUP):
        flat = [t for ids in tokenizer(texts[g:g + GROUP], add_special_tokens=False)["input_ids"]
                for t in ids + [tokenizer.eos_token_id]]
        out += [flat[i:i + seq_len] for i in range(0, len(flat) // seq_len * seq_len, seq_len)]
    return torch.tensor(out, dtype=torch.long)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name in ("model", "data", "result"):
        parser.add_argument(f"--{name}", required=True)
    for name, default in (("seq_len", 256), ("micro_batch_size", 8), ("grad_accum_steps", 1), ("max_steps", 30),
                          ("warmup_steps", 10), ("seed", 42)):
        parser.add_argument(f"--{name}", type=int, default=default)
    for name, default in (("lr", 3e-3), ("weight_decay", 0.1), ("min_lr_ratio", 0.1), ("max_grad_norm", 1.0)):
        parser.add_argument(f"--{name}", type=float, default=default)
    parser.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    parser.add_argument("--compile", action="store_true", help="torch.compile(model)")
    parser.add_argument("--trace_steps", default=None, help="A-B: a torch.profiler trace of steps A-B (1-based) "
                                                             "written beside --result as plain_rank<R>.json")
    parser.add_argument("--local_rank", type=int, default=-1)  # the deepspeed launcher's
    args = parser.parse_args()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    if world > 1:
        dist.init_process_group("nccl" if cuda else "gloo")

    data = blocks(Path(args.data) / "train.jsonl", AutoTokenizer.from_pretrained(args.model), args.seq_len)
    n, micro, accum = len(data), args.micro_batch_size, args.grad_accum_steps
    global_batch = micro * accum * world

    epochs: dict[int, np.ndarray] = {}

    def micro_batch(step: int, m: int) -> torch.Tensor:
        start = step * global_batch + (m * world + rank) * micro
        idx = []
        for k in range(start, start + micro):
            if k // n not in epochs:
                epochs[k // n] = np.random.default_rng([args.seed, k // n]).permutation(n)
            idx.append(int(epochs[k // n][k % n]))
        return data[idx].to(device, non_blocking=True)

    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32, attn_implementation="sdpa").to(device)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW([{"params": [p for p in params if p.ndim >= 2], "weight_decay": args.weight_decay},
                             {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), eps=1e-8, **({"fused": True} if cuda else {"foreach": True}))
    forward = torch.compile(model) if args.compile else model
    if world > 1:
        forward = torch.nn.parallel.DistributedDataParallel(forward, device_ids=[device.index] if cuda else None)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16) if args.precision == "bf16" else nullcontext()

    def factor(s: int) -> float:  # s: the 1-based step
        if s <= args.warmup_steps:
            return s / args.warmup_steps
        progress = (s - args.warmup_steps) / (args.max_steps - args.warmup_steps)
        return args.min_lr_ratio + (1 - args.min_lr_ratio) * (1 + math.cos(math.pi * progress)) / 2

    first, last = (int(x) for x in args.trace_steps.split("-")) if args.trace_steps else (0, 0)
    profiler = None
    step_end, losses = [], []
    for step in range(args.max_steps):
        if step + 1 == first:  # from the end of the step before, as train.py's log.trace_steps
            profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU] + (
                [torch.profiler.ProfilerActivity.CUDA] if cuda else []))
            profiler.__enter__()
        for group in opt.param_groups:
            group["lr"] = args.lr * factor(step + 1)
        total = torch.zeros((), device=device)
        for m in range(accum):
            ids = micro_batch(step, m)
            # DDP's all-reduce only on the last micro-batch of the step
            sync = forward.no_sync() if world > 1 and m < accum - 1 else nullcontext()
            with sync, autocast:
                logits = forward(input_ids=ids).logits
                loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten()) / accum
            loss.backward()
            total += loss.detach()
        torch.nn.utils.clip_grad_norm_(params, args.max_grad_norm)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if world > 1:
            dist.all_reduce(total)
        losses.append(total.item() / world)  # the one host sync of a step
        step_end.append(time.time())
        if profiler is not None and step + 1 == last:
            if cuda:
                torch.cuda.synchronize()
            profiler.__exit__(None, None, None)
            profiler.export_chrome_trace(str(Path(args.result).parent / f"plain_rank{rank}.json"))
            profiler = None

    if rank == 0:
        Path(args.result).write_text(json.dumps({
            "step_end": step_end, "losses": losses, "world_size": world, "compiled": args.compile,
            "peak_cuda_bytes": torch.cuda.max_memory_allocated(device) if cuda else None}))
    if world > 1:
        dist.destroy_process_group()
    if args.trace_steps:
        # a traced run ends without the interpreter's finalization: once in a fresh-clone suite (2026-12-07) rank 1
        # aborted there after its trace was written ("terminate called without an active exception", exit -6), the
        # teardown race of torch's profiler threads at process exit (pytorch/kineto#1051); not reproduced in 12 runs
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


if __name__ == "__main__":
    main()
