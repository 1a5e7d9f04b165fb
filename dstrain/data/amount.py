"""How much data a run has against what it asks for: the epochs its steps make, a global batch the training split
cannot fill, and a validation split that gives nothing to evaluate. Said in the data line and the summary."""
from __future__ import annotations

from ..errors import UserError


def epochs(steps: int, global_batch: int, sequences: int) -> float:
    """Passes over the training split that `steps` global batches make."""
    return steps * global_batch / sequences if sequences else 0.0


def check(train_sequences: int, global_batch: int, batch_text: str) -> None:
    """A global batch larger than the training split repeats samples inside one batch (each step would see several
    epochs): refused, with the sizes that fit."""
    if global_batch > train_sequences:
        raise UserError(f"the global batch of {global_batch:,} sequences ({batch_text}) is larger than the training "
                        f"split's {train_sequences:,}: every step would repeat samples; lower "
                        f"train.micro_batch_size or train.grad_accum_steps, or add data")


def describe(steps: int, global_batch: int, train_sequences: int) -> str:
    """'40 steps x 16 sequences = 3.2 epochs of 200': what the data line adds."""
    return (f"{steps:,} steps x {global_batch:,} sequences = {epochs(steps, global_batch, train_sequences):,.2f} "
            f"epochs of {train_sequences:,}")


def eval_note(val_rows: int | None, val_sequences: int, batches_per_rank: int, data_parallel: int,
              seq_len: int) -> str | None:
    """Why evaluation has nothing to evaluate, and what to change; None when it has batches or was never asked."""
    if val_rows is None:  # no validation split and data.val_fraction=0: asked for none
        return None
    if val_sequences == 0:
        return (f"note: the validation split's {val_rows:,} rows give no sequences of {seq_len} tokens, so nothing "
                f"is evaluated; raise data.val_fraction, add validation data or lower train.seq_len")
    if batches_per_rank == 0:
        return (f"note: the validation split's {val_sequences:,} sequences are fewer than the {data_parallel} "
                f"data-parallel ranks, so nothing is evaluated; raise data.val_fraction or add validation data")
    return None
