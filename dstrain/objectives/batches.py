"""A micro-batch's way to the model, and the counts a step is normalised by, for any objective: shared by the loop
(dstrain/trainer/steps.py) and by what re-runs a step beside it (dstrain/run/rerun.py, run/health.py's search),
so neither of those imports the loop."""
from __future__ import annotations

import torch

from ..parallel.dist import all_reduce_sum
from ..parallel.layout import Layout


def to_device(engine, batch: dict[str, torch.Tensor], objective) -> dict[str, torch.Tensor]:
    """The objective's host-side preparation, then a copy to the engine's device (pinned on GPUs: asynchronous)."""
    batch = objective.host_batch(batch, engine)
    return {k: v.to(engine.device, non_blocking=True) for k, v in batch.items()}


def global_counts(objective, batches: list[dict[str, torch.Tensor]], layout: Layout, device, group=None
                  ) -> tuple[dict, int]:
    """The objective's counts and the real tokens, summed over the global batch (host counts: no device wait), or
    over one DiLoCo replica's share of it (group: the replica's ranks)."""
    counts = [objective.counts(b) for b in batches]
    keys = list(counts[0]) if counts else [objective.primary]
    local = [sum(c[k] for c in counts) for k in keys] if counts else [0.0]
    *summed, real = all_reduce_sum(local + [sum(objective.real_tokens(b) for b in batches)], device, group)
    replicas = layout.token_replicas  # tensor-parallel peers see the same samples; count them once
    totals = {k: v / replicas for k, v in zip(keys, summed)}
    totals[objective.primary] = max(totals[objective.primary], 1.0)
    return totals, int(real / replicas)
