"""Next-token cross-entropy (pretraining and SFT): the mean over every label token of the global batch.

Each micro-batch contributes sum_loss * (accum * dp) / global_tokens: DeepSpeed divides by accum and averages over
dp, so SFT batches with uneven response lengths weigh every token equally (unlike a mean of per-micro-batch means).
Under sequence parallelism each rank's sum covers its slice of the sequences, and the sp ranks' gradients add up
(Layout.gradients_averaged_over: what DeepSpeed divides by, dp x sp under ZeRO-3).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..data import IGNORE_INDEX


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


class CausalLM:
    name = "causal_lm"
    primary = "label_tokens"
    perplexity = True

    def validate(self, setup) -> None:
        pass

    def counts(self, batch: dict[str, torch.Tensor]) -> dict[str, int]:
        return {"label_tokens": label_count(batch)}

    def real_tokens(self, batch: dict[str, torch.Tensor]) -> int:
        return real_count(batch)

    def host_batch(self, batch: dict[str, torch.Tensor], model) -> dict[str, torch.Tensor]:
        """The chunked loss's label positions are found on the host, so the device never has to report how many
        there are (no sync in the step)."""
        if chunked_loss(model):
            from ..components.chunked_loss import label_positions_of
            shifted = "shift_labels" in batch
            batch = dict(batch, label_positions=label_positions_of(batch["shift_labels" if shifted else "labels"],
                                                                   shifted))
        return batch

    def loss_sum(self, model, batch: dict[str, torch.Tensor], totals: dict[str, float]):
        return loss_sum(model, batch), None

    def metrics(self, stats, totals: dict[str, float]) -> dict[str, float]:
        return {}

    def before_training(self, engine, datasets: list, setup, data_cache, weights: str) -> list:
        return datasets

    @staticmethod
    def sequences_per_sample(recipe) -> int:
        return 1

    @staticmethod
    def evaluation_keys(recipe) -> list[str]:
        return ["eval_loss", "perplexity"]
