"""One optimizer step and one evaluation pass over a DeepSpeed engine, for any training objective
(dstrain/objectives: what is summed, what it is normalised by, what else is logged).

Normalisation: the gradient of every step is that of the objective's loss averaged over the whole global batch
(every label token for next-token prediction, every pair for preference training), however it is spread over
micro-batches and ranks. Each micro-batch contributes summed_loss * (accum * dp) / global_count: DeepSpeed divides
by accum and averages over dp (Layout.gradients_averaged_over: dp x sp under ZeRO-3 with sequence parallelism).
"""
from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import nullcontext

import torch

from ..objectives import optional_part
from ..objectives.batches import global_counts, to_device
from ..objectives.causal_lm import label_count, real_count
from ..parallel.dist import all_reduce_sum
from ..parallel.layout import Layout
from ..run import faults


def _pipe_items(batches: list[dict[str, torch.Tensor]]):
    return iter([(b["input_ids"], b["labels"]) for b in batches])


def _pipe_step(engine, batches: list[dict[str, torch.Tensor]], layout: Layout, train: bool
               ) -> tuple[float, int, int]:
    """The pipeline engine runs the whole schedule itself; the loss function carries the token scaling.
    Stages of one replica see the same batches, so counts are summed over the world and divided by stages.
    Next-token prediction only (objectives.preference refuses pipelines). DiLoCo: the engine averages over its
    replica's data-parallel ranks, so a replica's loss is normalised by its own label tokens (counted over its
    stage's data-parallel group: each of its samples once), and the logged loss is the replicas' token-weighted
    mean."""
    labels = sum(label_count(b) for b in batches)
    counted, real = all_reduce_sum([labels, sum(real_count(b) for b in batches)], engine.device)
    global_tokens = max(counted / layout.token_replicas, 1.0)
    own = max(all_reduce_sum([labels], engine.device, layout.data_parallel_group)[0], 1.0) \
        if layout.replicas > 1 else global_tokens
    engine.module.loss_fn.scale = len(batches) * layout.replica_data_parallel / own
    if train:
        loss = float(engine.train_batch(data_iter=_pipe_items(batches)))
    else:
        loss = float(engine.eval_batch(data_iter=_pipe_items(batches), num_micro_batches=len(batches)))
    if layout.replicas > 1:  # every rank of a replica holds its replica's loss
        loss = all_reduce_sum([loss * own], engine.device)[0] / layout.replica_size / global_tokens
    return loss, int(global_tokens), int(real / layout.token_replicas)


def _add(acc: torch.Tensor | None, summed: torch.Tensor, stats: torch.Tensor | None) -> torch.Tensor:
    row = summed.detach().reshape(1).to(torch.float64)
    if stats is not None:
        row = torch.cat([row, stats.detach().reshape(-1).to(torch.float64)])
    return row if acc is None else acc + row


def train_step(engine, micro_batches: list[dict[str, torch.Tensor]], layout: Layout, objective,
               before_update: Callable[[], None] = lambda: None, step: int = 0, checks=None
               ) -> tuple[float, dict, int, dict]:
    """Forward/backward every micro-batch and take one optimizer step; returns (mean loss, the objective's counts
    over the global batch, its input tokens that are not padding, the objective's metrics): throughput and MFU
    count work, not padding. before_update() runs just before the optimizer changes the weights (a background
    save's copy of them is finished there). An objective with `prepare` makes its micro-batches first (RL: the
    rollout of step `step`). `checks` (run/health.py's StepHealth) may want the step's loss before the update (a
    loss spike is skipped: the loss is then all-reduced before the optimizer step, not after) and, at its check
    steps, the first micro-batch replayed before the update (run/sdc.py)."""
    disarm = faults.arm(engine.module, layout.rank, step)  # tests' injected NaNs and spikes; nothing otherwise
    try:
        return _train_step(engine, micro_batches, layout, objective, before_update, step, checks)
    finally:
        disarm()


def _train_step(engine, micro_batches, layout, objective, before_update, step, checks):
    prepare = optional_part(objective, "prepare")
    if prepare is not None:
        micro_batches = prepare(engine, micro_batches, layout, step)
    if layout.is_pipeline:
        before_update()  # the pipeline engine's train_batch runs the whole step
        loss, label_tokens, real = _pipe_step(engine, micro_batches, layout, train=True)
        return loss, {"label_tokens": label_tokens}, real, {}
    totals, real = global_counts(objective, micro_batches, layout, engine.device)
    # a DiLoCo replica's gradient is its own share's mean: normalised by the replica's counts, averaged over its ranks
    own = global_counts(objective, micro_batches, layout, engine.device, layout.data_parallel_group)[0] \
        if layout.replicas > 1 else totals
    scale = len(micro_batches) * layout.gradients_averaged_over / own[objective.primary]
    loss_hook = checks.loss_hook if checks is not None else None
    replay = checks is not None and checks.replay_due(step, layout)
    acc = None  # summed on the device: no sync per micro-batch
    for i, batch in enumerate(micro_batches):
        began = time.perf_counter()
        rng = checks.sdc.rng_state() if replay and i == 0 else None  # the replay draws the same dropout masks
        batch = to_device(engine, batch, objective)  # pinned on GPUs (TrainStream)
        with checks.sdc.capture(engine.module, replay and i == 0) if replay else nullcontext([]) as grads:
            summed, stats = objective.loss_sum(engine, batch, own)
            engine.backward(summed * scale)
        if replay and i == 0:  # the step's own numbers, to compare with its replay (fp16's carry the loss scale)
            grad = grads[0] if grads and not engine.fp16_enabled() else None
            first = (micro_batches[0], float(summed.detach()), grad, rng)
        faults.stretch(layout.rank, step, time.perf_counter() - began)  # tests: a rank made slower
        acc = _add(acc, summed, stats)
        if i == len(micro_batches) - 1:
            before_update()
            if loss_hook is not None:
                _all_reduce(acc)
                loss_hook(acc[0].item() / layout.token_replicas / totals[objective.primary])
            if replay:
                checks.sdc.replay(engine, first[0], objective, own, first[1], first[2], scale, step, first[3])
        engine.step()  # DeepSpeed only steps the optimizer at the accumulation boundary
    if loss_hook is None:
        _all_reduce(acc)
    values = (acc / layout.token_replicas).tolist()  # the step's one sync, for the log
    return values[0] / totals[objective.primary], totals, real, objective.metrics(values[1:], totals)


def _all_reduce(acc: torch.Tensor) -> None:
    if torch.distributed.is_initialized():
        torch.distributed.all_reduce(acc)


@torch.no_grad()
def evaluate(engine, batches: list[dict[str, torch.Tensor]], layout: Layout, objective) -> tuple[float, dict]:
    """(mean loss, the objective's metrics) over all ranks' validation batches."""
    if layout.is_pipeline:
        size = batches[0]["input_ids"].shape[0] if batches else 0
        full = [b for b in batches if b["input_ids"].shape[0] == size]  # the pipe schedule needs fixed shapes
        return _pipe_step(engine, full, layout, train=False)[0], {}
    prepare = optional_part(objective, "prepare")
    if prepare is not None:  # RL: the validation prompts' completions (step 0's keys)
        batches = prepare(engine, batches, layout, 0)
    was_training = engine.module.training
    engine.eval()
    totals, _ = global_counts(objective, batches, layout, engine.device)
    acc = None
    for batch in batches:
        summed, stats = objective.loss_sum(engine, to_device(engine, batch, objective), totals)
        acc = _add(acc, summed, stats)
    if was_training:
        engine.train()
    if acc is None:  # no rank had a batch (every rank has the same number)
        return 0.0, {}
    values = all_reduce_sum((acc / layout.token_replicas).tolist(), engine.device)
    return values[0] / totals[objective.primary], objective.metrics(values[1:], totals)
