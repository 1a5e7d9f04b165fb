"""One optimizer step and one evaluation pass over a DeepSpeed engine.

Loss normalisation: the gradient of every step is that of the mean loss over all label tokens of the
global batch, however they are spread over micro-batches and ranks (so SFT batches with uneven
response lengths weigh every token equally, unlike a mean of per-micro-batch means). Each micro-batch
contributes sum_loss * (accum * dp) / global_tokens: DeepSpeed divides by accum and averages over dp.
Under sequence parallelism each rank's sum covers its slice of the sequences, and the sp ranks' gradients add
up (Layout.gradients_averaged_over: what DeepSpeed divides by, dp x sp under ZeRO-3).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .data import IGNORE_INDEX
from .dist import all_reduce_sum
from .layout import Layout


def label_count(batch: dict[str, torch.Tensor]) -> int:
    if "shift_labels" in batch:  # a sequence-parallel slice: its targets are already aligned (data.shard_sequence)
        return int((batch["shift_labels"] != IGNORE_INDEX).sum())
    return int((batch["labels"][:, 1:] != IGNORE_INDEX).sum())


def real_count(batch: dict[str, torch.Tensor]) -> int:
    """Input tokens that are not padding (packed pretraining rows have none)."""
    mask = batch.get("attention_mask")
    return int(mask.sum()) if mask is not None else batch["input_ids"].numel()


def model_inputs(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What the model is called with. Rows with position_ids (packed, or a sequence-parallel slice) go without
    the attention mask: transformers then derives a causal mask per document from position_ids (and padding
    sits at the end of a row, behind every real token, so a causal mask never lets a real token see it)."""
    if "position_ids" in batch:
        return {k: batch[k] for k in ("input_ids", "position_ids")}
    return {k: v for k, v in batch.items() if k in ("input_ids", "attention_mask")}


def loss_sum(model, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Summed next-token cross-entropy over the batch's label tokens (fp32 logits)."""
    inputs = model_inputs(batch)
    shifted = "shift_labels" in batch  # a sequence-parallel slice: position t's target is shift_labels[t]
    labels = batch["shift_labels"] if shifted else batch["labels"]
    if chunked_loss(model):  # components/chunked_loss.py: no full logits
        return model(**inputs, use_cache=False, sum_loss_labels=labels, labels_shifted=shifted,
                     label_positions=batch.get("label_positions")).loss
    logits = model(**inputs, use_cache=False).logits
    if not shifted:
        logits, labels = logits[:, :-1], labels[:, 1:]
    return F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), labels.reshape(-1), ignore_index=IGNORE_INDEX,
                           reduction="sum")


def chunked_loss(model) -> bool:
    return bool(getattr(getattr(model, "module", model), "dstrain_loss_chunk_tokens", 0))


def to_device(engine, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Copy a host batch to the engine's device (pinned on GPUs: asynchronous). The chunked loss's label positions
    are found here, on the host, so the device never has to report how many there are (no sync in the step)."""
    if chunked_loss(engine):
        from .components.chunked_loss import label_positions_of
        shifted = "shift_labels" in batch
        batch = dict(batch, label_positions=label_positions_of(batch["shift_labels" if shifted else "labels"],
                                                               shifted))
    return {k: v.to(engine.device, non_blocking=True) for k, v in batch.items()}


def _pipe_items(batches: list[dict[str, torch.Tensor]]):
    return iter([(b["input_ids"], b["labels"]) for b in batches])


def _pipe_step(engine, batches: list[dict[str, torch.Tensor]], layout: Layout, train: bool
               ) -> tuple[float, int, int]:
    """The pipeline engine runs the whole schedule itself; the loss function carries the token scaling.
    Stages of one replica see the same batches, so counts are summed over the world and divided by stages."""
    counted, real = all_reduce_sum([sum(label_count(b) for b in batches), sum(real_count(b) for b in batches)],
                                   engine.device)
    global_tokens = max(counted / layout.token_replicas, 1.0)
    engine.module.loss_fn.scale = len(batches) * layout.data_parallel / global_tokens
    if train:
        loss = engine.train_batch(data_iter=_pipe_items(batches))
    else:
        loss = engine.eval_batch(data_iter=_pipe_items(batches), num_micro_batches=len(batches))
    return float(loss), int(global_tokens), int(real / layout.token_replicas)


def train_step(engine, micro_batches: list[dict[str, torch.Tensor]], layout: Layout) -> tuple[float, int, int]:
    """Forward/backward every micro-batch and take one optimizer step; returns (mean loss, label tokens of the
    global batch, its input tokens that are not padding): throughput and MFU count work, not padding."""
    if layout.is_pipeline:
        return _pipe_step(engine, micro_batches, layout, train=True)
    device = engine.device
    replicas = layout.token_replicas  # tensor-parallel peers see the same tokens; count them once
    counted, real = all_reduce_sum([sum(label_count(b) for b in micro_batches),  # CPU counts: no GPU wait
                                    sum(real_count(b) for b in micro_batches)], device)
    global_tokens = max(counted / replicas, 1.0)
    scale = len(micro_batches) * layout.gradients_averaged_over / global_tokens
    local_sum = torch.zeros((), dtype=torch.float64, device=device)  # summed on the device: no sync per micro-batch
    for batch in micro_batches:
        batch = to_device(engine, batch)  # pinned on GPUs (TrainStream)
        summed = loss_sum(engine, batch)
        engine.backward(summed * scale)
        engine.step()  # DeepSpeed only steps the optimizer at the accumulation boundary
        local_sum += summed.detach()
    if torch.distributed.is_initialized():
        torch.distributed.all_reduce(local_sum)
    # the step's one sync, for the log
    return local_sum.item() / replicas / global_tokens, int(global_tokens), int(real / replicas)


@torch.no_grad()
def evaluate(engine, batches: list[dict[str, torch.Tensor]], layout: Layout) -> float:
    """Mean next-token loss over all ranks' validation batches."""
    if layout.is_pipeline:
        size = batches[0]["input_ids"].shape[0] if batches else 0
        full = [b for b in batches if b["input_ids"].shape[0] == size]  # the pipe schedule needs fixed shapes
        return _pipe_step(engine, full, layout, train=False)[0]
    was_training = engine.module.training
    engine.eval()
    local_sum, local_count = 0.0, 0
    for batch in batches:
        batch = to_device(engine, batch)
        local_sum += loss_sum(engine, batch).item()
        local_count += label_count(batch)
    total, count = all_reduce_sum([local_sum, local_count], engine.device)
    if was_training:
        engine.train()
    return total / max(count, 1)
