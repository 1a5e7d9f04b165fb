"""Batches: each data-parallel rank's distinct share of every global batch, in a seeded order that is a pure
function of the step (so a checkpoint's data position is its step), sequence-parallel slices, evaluation batches."""
from __future__ import annotations

import torch

from ..errors import UserError
from ..parallel.layout import Layout, zigzag_order
from .formats import images
from .formats.sft import IGNORE_INDEX
from .order import EpochOrder


def _stack(rows: dict) -> dict[str, torch.Tensor]:
    # floats: reference log-probs; not tensors: what data.format=prompt keeps for the reward functions (text,
    # messages, ragged prompt_ids), which the objective turns into tensors (objectives/rl.py)
    batch = {k: v if not isinstance(v, torch.Tensor) or v.is_floating_point() else v.long() for k, v in rows.items()}
    if "pixel_values" in batch:  # a vision-language model's rows: their images as one tensor (dstrain/vision.py)
        batch = images.batch(batch)
    if "labels" not in batch and "input_ids" in batch:  # pretraining rows; preference pairs carry their own
        batch["labels"] = batch["input_ids"].clone()
    return batch


def shard_sequence(batch: dict[str, torch.Tensor], rank: int, size: int, ring: int = 1) -> dict[str, torch.Tensor]:
    """Rank `rank`'s 1/size slice of every sequence, for sequence parallelism: position_ids (0.. unless the row
    is packed) and labels shifted to the token they are predicted from (shift_labels[t] is the target of
    position t) before cutting, so a slice's last token keeps its target in the next slice. The slices of all
    ranks together hold each label once. With ring attention (`ring` > 1 rings of size / ring Ulysses ranks)
    the sequence is first put in zigzag order (ring_attention.zigzag_order: ring rank k's two chunks, k and
    2*ring-1-k, together), so slice rank = ring rank x Ulysses size + Ulysses rank."""
    input_ids = batch["input_ids"]
    length = input_ids.shape[1]
    unit = size * 2 if ring > 1 else size  # a ring rank holds two chunks
    if length % unit:
        what = (f"sequence_parallel_size x context_parallel_size x 2 = {unit}" if ring > 1
                else f"sequence_parallel_size={size}")
        raise UserError(f"a batch of {length} tokens per sequence does not split over {what}; choose "
                        f"train.seq_len divisible by {unit}")
    out = dict(batch)
    if "position_ids" not in out:
        out["position_ids"] = torch.arange(length).expand_as(input_ids)
    labels = out.pop("labels")
    out["shift_labels"] = torch.nn.functional.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)
    if ring > 1:
        order = zigzag_order(length, ring)
        out = {k: v[:, order] for k, v in out.items()}
    chunk = length // size
    return {k: v[:, rank * chunk:(rank + 1) * chunk].contiguous() for k, v in out.items()}


def _for_layout(batch: dict[str, torch.Tensor], layout: Layout) -> dict[str, torch.Tensor]:
    if layout.sequence_shards > 1 and "input_ids" in batch:  # preference pairs are cut by their objective
        return shard_sequence(batch, layout.sequence_shard, layout.sequence_shards, layout.context_parallel)
    return batch


class TrainStream:
    """Global batch `step` holds stream samples [step*G, (step+1)*G); sample k is the dataset's own order when it
    has one (a mix of prepared sources), else element k % n of epoch k // n's permutation keyed by the seed
    (data/order.py), so each epoch is reshuffled and any step can be re-created."""

    def __init__(self, dataset, micro_batch_size: int, grad_accum_steps: int, layout: Layout, seed: int,
                 pin_memory: bool = False):
        self.dataset, self.seed, self.pin_memory = dataset, seed, pin_memory  # pinned: asynchronous copies to GPU
        # ranks of one model replica (pipeline stages, tensor-parallel peers) read the same samples
        self.micro, self.accum = micro_batch_size, grad_accum_steps
        self.dp_rank, self.dp_size = layout.data_parallel_rank, layout.data_parallel
        self.layout = layout
        self.global_batch = layout.global_batch(micro_batch_size, grad_accum_steps)
        self.offset = 0  # samples ahead of step * global_batch (a run resumed with another global batch)
        self.sample_index = dataset.order(seed) if hasattr(dataset, "order") else EpochOrder(len(dataset), [seed])

    def resume(self, step: int, samples: int) -> None:
        """Continue after `samples` stream samples were consumed by `step` steps: none skipped or repeated."""
        self.offset = samples - step * self.global_batch

    def global_batch_indices(self, step: int) -> list[int]:
        start = step * self.global_batch + self.offset
        return [self.sample_index(k) for k in range(start, start + self.global_batch)]

    def micro_batches(self, step: int) -> list[dict[str, torch.Tensor]]:
        """This rank's grad_accum_steps micro-batches of global batch `step`."""
        out = []
        if hasattr(self.dataset, "note_samples"):  # a mix says when a source starts another epoch
            first = step * self.global_batch + self.offset
            self.dataset.note_samples(first, first + self.global_batch)
        for m in range(self.accum):
            start = step * self.global_batch + self.offset + (m * self.dp_size + self.dp_rank) * self.micro
            idx = [self.sample_index(k) for k in range(start, start + self.micro)]
            batch = _for_layout(_stack(self.dataset[idx]), self.layout)
            out.append({k: v.pin_memory() if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
                       if self.pin_memory else batch)
        return out


def eval_batches(dataset, micro_batch_size: int, layout: Layout,
                 max_batches: int | None = None) -> list[dict[str, torch.Tensor]]:
    """This rank's strided share of the validation split; every rank gets the same number of batches."""
    dp_rank, dp_size = layout.data_parallel_rank, layout.data_parallel
    per_rank = len(dataset) // dp_size
    idx = list(range(dp_rank, per_rank * dp_size, dp_size))
    batches = [idx[i:i + micro_batch_size] for i in range(0, len(idx), micro_batch_size)]
    if max_batches is not None:
        batches = batches[:max_batches]
    out = [_stack(dataset[b]) for b in batches]
    if layout.sequence_parallel > 1:  # Ulysses' attention is built for micro_batch_size rows: fill the last batch
        out = [_fill_rows(b, micro_batch_size) for b in out]
    return [_for_layout(b, layout) for b in out]


def _fill_rows(batch: dict[str, torch.Tensor], rows: int) -> dict[str, torch.Tensor]:
    """The batch with rows added (copies of its first, every label ignored): they add no loss and no count."""
    missing = rows - batch["input_ids"].shape[0]
    if missing <= 0:
        return batch
    out = {k: torch.cat([v, v[:1].expand(missing, -1)]) for k, v in batch.items()}
    out["labels"][-missing:] = IGNORE_INDEX
    if "attention_mask" in out:
        out["attention_mask"][-missing:] = 0
    return out
