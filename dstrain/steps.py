"""One optimizer step and one evaluation pass over a DeepSpeed engine.

Loss normalisation: the gradient of every step is that of the mean loss over all label tokens of the
global batch, however they are spread over micro-batches and ranks (so SFT batches with uneven
response lengths weigh every token equally, unlike a mean of per-micro-batch means). Each micro-batch
contributes sum_loss * (accum * dp) / global_tokens: DeepSpeed divides by accum and averages over dp.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .data import IGNORE_INDEX
from .dist import all_reduce_sum


def label_count(batch: dict[str, torch.Tensor]) -> int:
    return int((batch["labels"][:, 1:] != IGNORE_INDEX).sum())


def loss_sum(model, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Summed next-token cross-entropy over the batch's label tokens (fp32 logits)."""
    inputs = {k: v for k, v in batch.items() if k in ("input_ids", "attention_mask")}
    logits = model(**inputs, use_cache=False).logits
    shift_logits = logits[:, :-1].float().reshape(-1, logits.size(-1))
    shift_labels = batch["labels"][:, 1:].reshape(-1)
    return F.cross_entropy(shift_logits, shift_labels, ignore_index=IGNORE_INDEX, reduction="sum")


def train_step(engine, micro_batches: list[dict[str, torch.Tensor]], dp_size: int) -> tuple[float, int]:
    """Forward/backward every micro-batch and take one optimizer step; returns (mean loss, label tokens)."""
    device = engine.device
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    replicas = world // dp_size  # tensor-parallel peers see the same samples; count them once
    (counted,) = all_reduce_sum([sum(label_count(b) for b in micro_batches)], device)
    global_tokens = max(counted / replicas, 1.0)
    scale = len(micro_batches) * dp_size / global_tokens
    local_sum = 0.0
    for batch in micro_batches:
        batch = {k: v.to(device) for k, v in batch.items()}
        summed = loss_sum(engine, batch)
        engine.backward(summed * scale)
        engine.step()  # DeepSpeed only steps the optimizer at the accumulation boundary
        local_sum += summed.item()
    (total,) = all_reduce_sum([local_sum], device)
    return total / replicas / global_tokens, int(global_tokens)


@torch.no_grad()
def evaluate(engine, batches: list[dict[str, torch.Tensor]]) -> float:
    """Mean next-token loss over all ranks' validation batches."""
    was_training = engine.module.training
    engine.eval()
    local_sum, local_count = 0.0, 0
    for batch in batches:
        batch = {k: v.to(engine.device) for k, v in batch.items()}
        local_sum += loss_sum(engine, batch).item()
        local_count += label_count(batch)
    total, count = all_reduce_sum([local_sum, local_count], engine.device)
    if was_training:
        engine.train()
    return total / max(count, 1)
