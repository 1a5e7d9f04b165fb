"""The first phase of a run: every input read and checked, nothing built, converted or written.

What it returns, `Resolved`, is all the build phase (trainer.py) starts from. The order of the checks is the
order a user meets their mistakes in: the parallel layout and the batch arithmetic, the checkpoint to resume (and
what it needs on another world size or ZeRO stage), the model's config, DeepSpeed's config resolved for this
device, the components' and the objective's own checks, the data, and last whether the checkpoint belongs to this
run at all, so that a plain input mistake is named before "this directory holds another run". The one thing
written here is the tokenized-data cache (data.prepare), which is keyed by its inputs and shared between runs.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from .. import chat_templates, cli, components, data, env, families, objectives, vision
from .. import model as models
from ..config import Recipe
from ..parallel import ds_config
from ..parallel.layout import Layout, recipe_accumulation
from ..run import checkpoint, faults, health, resume


@dataclass(frozen=True)
class Resolved:
    recipe: Recipe  # as the run trains it: grad_accum_steps re-derived for this world or the checkpoint's batch
    raw_ds: dict  # the DeepSpeed JSON as the user gave it (with --ds.* overrides)
    ds_cfg: dict  # resolved for this world and device; the components' configure() edit it during the build
    run_dir: Path
    layout: Layout  # this rank's place in the parallel layout (its process groups are bound after the engine)
    start_from: checkpoint.Resume | None  # the checkpoint this run resumes, None for a new run
    init_from: Path | None  # --init_from's checkpoint, when this run starts from another run's weights
    started_from: Path | None  # a resumed run begun with --init_from: the base it started on
    model_config: Any  # the Hugging Face config of the model to train
    setup: components.Setup  # what the components and the objective see
    features: list  # the components this recipe and JSON turn on, in their hooks' order
    objective: objectives.Objective
    tokenizer: Any
    chat_template: str | None
    prepared: data.Prepared  # tokenized train and validation data (before the objective's before_training)
    global_batch: int  # samples per optimizer step
    identity: dict  # what makes a checkpoint this run's (resume.run_identity)


def resolve(args, recipe: Recipe, raw_ds: dict, run_dir: Path, ctx, init_from: Path | None,
            log: Callable[[str], None]) -> Resolved:
    faults.point("validate", ctx.rank, 0)
    from ..components.diloco import replicas_for
    layout = Layout.from_ds_config(raw_ds, ctx.world_size, ctx.rank,
                                   replicas_for(recipe, ctx.world_size, env.ranks_per_node()))
    accum, note = recipe_accumulation(layout, raw_ds, recipe.train.micro_batch_size, recipe.train.grad_accum_steps,
                                      recipe.world_size, args.world_size)  # the global batch is a hyper-parameter
    if note:
        log(note)
        recipe = replace(recipe, train=replace(recipe.train, grad_accum_steps=accum))
    start_from = resume.choose(args.resume, run_dir / "checkpoints", ctx, recipe.checkpoint.verify)
    if start_from and init_from:
        log(f"note: {run_dir} already holds this run's checkpoints; resuming it (--init_from only starts a run)")
        init_from = None
    # a run begun with --init_from resumes on the same base (a LoRA checkpoint holds only the adapters)
    started_from = resume.started_from(run_dir) if start_from else None
    if start_from:  # same global batch on a new world size: grad_accum_steps re-derived, universal conversion
        train_cfg, start_from = resume.adapt_to_world(start_from, recipe.train, layout, log)
        recipe = replace(recipe, train=train_cfg)
    train = recipe.train
    model_config = models.load_config(recipe.model, train.seq_len)[1]
    if init_from:
        resume.check_init_from(init_from, model_config)
    device = ds_config.DeviceCaps.detect()
    cpu_note = cli.one_cpu_rank_note(ctx.world_size, device.name, env.launched())  # `deepspeed` counts GPUs
    if cpu_note:
        log(cpu_note)
    ds_cfg = ds_config.resolve(raw_ds, recipe, ctx.world_size, device,
                               models.hidden_size(model_config), env.ranks_per_node(), layout.replicas)
    if start_from:  # saved under another ZeRO stage: converted like a world change, or refused in one line
        start_from = resume.adapt_to_stage(start_from, ds_cfg, ds_config.optimizer_of(raw_ds, train), layout, log)
    precision = ds_config.precision(ds_cfg)
    setup = components.Setup(recipe, layout, ds_cfg, precision, model_config, run_dir, ctx, log,
                             init_from or started_from,
                             start_from.manifest.get("world_size") if start_from and start_from.universal else None)
    features = components.build(recipe, raw_ds)
    objective = objectives.make(recipe)  # what a step minimises: next-token loss, DPO and its kin, or rewards
    if vision.is_vision(model_config):  # a vision-language model's layouts and data format, before the components'
        vision.check(setup)
    components.validate_all(features + [objective], setup)
    families.check(setup)  # packing and sequence splits exact for this family, or refused in one line
    checkpoint.check_background(recipe.checkpoint, ds_cfg)
    health.check(recipe.fault, precision, layout)
    tokenizer = models.load_tokenizer(recipe.model)
    chat_template = chat_templates.apply(recipe.data.chat_template, tokenizer, log, recipe.data.format) \
        if recipe.data.format != "text" else None  # set on the tokenizer: model_config/ and hf/ carry it
    prepared = data.prepare(recipe.data, tokenizer, train.seq_len, train.seed, log)
    global_batch = layout.global_batch(train.micro_batch_size, train.grad_accum_steps)
    data.amount.check(len(prepared.train), global_batch, f"train.micro_batch_size {train.micro_batch_size} x "
                      f"grad_accum_steps {train.grad_accum_steps} x {layout.data_parallel} data-parallel ranks")
    identity = resume.run_identity(recipe.to_dict(), ds_config.optimizer_of(raw_ds, train))
    if start_from:  # a run directory holds one run; checked last, so a plain input mistake is named first
        resume.check_same_run(start_from, identity, run_dir)
        resume.check_not_finished(run_dir, start_from, recipe)  # nothing is converted or written before this
    return Resolved(recipe, raw_ds, ds_cfg, run_dir, layout, start_from, init_from, started_from, model_config,
                    setup, features, objective, tokenizer, chat_template, prepared, global_batch, identity)
