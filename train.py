#!/usr/bin/env python3
"""Train a Hugging Face causal LM with DeepSpeed.

    deepspeed train.py --ds_config zero3.json                      # default tiny recipe, every local device
    deepspeed train.py --recipe recipes/llama-3.2-1b/sft.yaml --train.max_steps=500
    python train.py ...  |  torchrun --nproc_per_node 2 train.py ...  |  accelerate launch ... train.py ...

parse -> resolve and validate every input -> build -> loop -> finish. See README.md for every recipe key;
optional features are components (dstrain/components/), so nothing here is feature-specific.
"""
from __future__ import annotations

import sys
import time
from dataclasses import replace
from pathlib import Path

from dstrain import cli, env
from dstrain.config import Recipe
from dstrain.errors import EXIT_FAILED, EXIT_OK, UserError
from dstrain.run import preempt, run_lock  # preempt notes the launchers while they live


def main(argv: list[str] | None = None) -> int:
    """Exit code of the run; the process group is still up when it returns (see dist.leave)."""
    args, recipe, ds_overrides = cli.load_inputs(argv)
    if args.preflight:
        return run_preflight(args, recipe, ds_overrides)
    if args.plan or args.simulate:
        from dstrain.planner import plan
        return plan.run(args, recipe, ds_overrides, sys.argv[1:] if argv is None else argv)
    run_dir = cli.run_dir_of(args)
    created = cli.prepare_run_dir(run_dir)
    try:
        return run(args, recipe, ds_overrides, run_dir, created)
    except UserError:  # bad input leaves no empty run directory behind: the rank that made it removes it
        run_lock.remove_if_unused(run_dir, created)
        raise


def run(args, recipe: Recipe, ds_overrides: dict, run_dir: Path, created: bool) -> int:
    from dstrain.parallel import dist, ds_config
    from dstrain.run import checkpoint, resume
    from dstrain.run.watchdog import Watchdog

    resume.resolve_resume(args.resume, run_dir / "checkpoints")  # a bad --resume fails before anything starts
    init_from = resume.resolve_init_from(args.init_from)
    raw_ds = ds_config.load(recipe.ds_config, ds_overrides)
    if env.elastic():  # the world the elastic agents formed may be more than the run can use
        from dstrain.run import elastic
        found = elastic.fit(env.world_size(), raw_ds, recipe, args.world_size, args.resume, run_dir)
        if not elastic.apply(found, run_dir):
            return elastic.stand_by(run_dir)
    ctx = dist.init()
    run_lock.lock_run_dir(run_dir, ctx.is_main)  # one run per directory: a second launch is refused here
    watchdog = Watchdog(run_dir, recipe.fault, ctx).start()  # a dead or stuck rank ends the job, no hang
    try:
        code = train(args, recipe, raw_ds, run_dir, ctx, watchdog, init_from)
    except (UserError, SystemExit, KeyboardInterrupt) as error:  # the same bad input (or Ctrl-C) on every rank
        if isinstance(error, UserError):  # said before anyone leaves: the launcher kills the rest when one exits
            cli.say(error)
            error.waited = True
            # likewise the empty run directory's removal, by the rank that made it (main() for earlier errors)
            run_lock.remove_if_unused(run_dir, created)
        watchdog.close()  # the ranks leave together (Watchdog.close)
        raise
    except checkpoint.SaveError as error:  # this rank could not write; the others may wait in a collective
        watchdog.abort(str(error), error.code)
    except BaseException as error:  # a crash here, or a collective that failed because a peer died
        watchdog.fail(error)
    watchdog.close()
    return code


def train(args, recipe: Recipe, raw_ds: dict, run_dir: Path, ctx, watchdog, init_from: Path | None) -> int:
    # imported here, not at the top: deepspeed and transformers take seconds, and bad input or --preflight
    # should answer without them
    import deepspeed

    from dstrain import chat_templates, components, data, env, flops, memory, objectives, schedule
    from dstrain import model as models
    from dstrain.components.diloco import replicas_for
    from dstrain.metrics import Metrics
    from dstrain.parallel import comm_counter, ds_config, ds_internals
    from dstrain.parallel.layout import Layout, recipe_accumulation
    from dstrain.paths import weights_fingerprint
    from dstrain.run import checkpoint, events, export, faults, health, resume
    from dstrain.steps import evaluate, train_step

    log = (lambda text: print(text, file=sys.stderr, flush=True)) if ctx.is_main else (lambda text: None)

    # ---- every input resolved and checked; nothing is built, converted or written before this block ends
    faults.point("validate", ctx.rank, 0)
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
    lone = cli.one_cpu_rank_note(ctx.world_size, device.name, env.launched())  # `deepspeed` counts GPUs
    if lone:
        log(lone)
    ds_cfg = ds_config.resolve(raw_ds, recipe, ctx.world_size, device,
                               models.hidden_size(model_config), env.ranks_per_node(), layout.replicas)
    if start_from:  # saved under another ZeRO stage: converted like a world change, or refused in one line
        start_from = resume.adapt_to_stage(start_from, ds_cfg, ds_config.optimizer_of(raw_ds, train), layout, log)
    setup = components.Setup(recipe, layout, ds_cfg, ds_config.precision(ds_cfg), model_config, run_dir, ctx, log,
                             init_from or started_from,
                             start_from.manifest.get("world_size") if start_from and start_from.universal else None)
    features = components.build(recipe, raw_ds)
    objective = objectives.make(recipe)  # what a step minimises: next-token loss, or DPO and its kin
    components.validate_all(features + [objective], setup)
    checkpoint.check_background(recipe.checkpoint, ds_cfg)
    health.check(recipe.fault, ds_config.precision(ds_cfg), layout)
    tokenizer = models.load_tokenizer(recipe.model)
    chat_template = chat_templates.apply(recipe.data.chat_template, tokenizer, log) \
        if recipe.data.format != "text" else None  # set on the tokenizer: model_config/ and hf/ carry it
    prepared = data.prepare(recipe.data, tokenizer, train.seq_len, train.seed, log)
    global_batch = layout.global_batch(train.micro_batch_size, train.grad_accum_steps)
    data.amount.check(len(prepared.train), global_batch, f"train.micro_batch_size {train.micro_batch_size} x "
                      f"grad_accum_steps {train.grad_accum_steps} x {layout.data_parallel} data-parallel ranks")
    identity = resume.run_identity(recipe.to_dict(), ds_config.optimizer_of(raw_ds, train))
    if start_from:  # a run directory holds one run; checked last, so a plain input mistake is named first
        resume.check_same_run(start_from, identity, run_dir)

    # ---- build
    resume.set_aside(start_from, ctx, log)  # damaged checkpoints newer than the chosen one
    if start_from and start_from.universal:
        resume.to_universal(start_from, ctx, log)
        if not start_from.into_plain:  # DeepSpeed's own universal loader (ZeRO-1/2/3, BF16 optimizer)
            ds_cfg.setdefault("checkpoint", {})["load_universal"] = True
    for feature in features:
        feature.configure(ds_cfg, setup)
    baseline_memory = memory.current_bytes()  # everything after this is the model and its training
    base = resume.materialize_init_from(init_from, run_dir, ctx, log) if init_from else started_from
    model_source = recipe.model if not base else replace(  # the other run's weights, as transformers loads
        recipe.model, name_or_path=str(base), from_scratch="false")
    model, _hf_ds_config = models.build(model_source, train, ds_cfg, tokenizer,
                                        components.load_kwargs(features, setup), layout.replicas == 1)
    params_total, params_local = models.parameter_counts(model)  # before the engine: what construction held
    trained = components.trained_parameters(features)  # None: every parameter trains
    flops_per_token = flops.flops_per_token(model_config, params_total, train.seq_len, trained)
    checkpoint.write_run_files(run_dir, recipe, ds_cfg, model.config, tokenizer, ctx, {
        "parameters": params_total, "parameters_on_rank0_at_build": params_local,
        "trainable_parameters": trained or params_total,
        "activation_checkpointing": bool(getattr(model, "is_activation_checkpointing" if hasattr(  # transformers 5
            type(model), "is_activation_checkpointing") else "is_gradient_checkpointing", False)),
        "world_size": ctx.world_size, "data_parallel": layout.data_parallel, "data_cache": prepared.cache_path,
        # samples per optimizer step (DeepSpeed's train_batch_size counts a ring's ranks as data-parallel ones)
        "global_batch": layout.global_batch(train.micro_batch_size, train.grad_accum_steps),
        "train_sequences": len(prepared.train), "val_sequences": len(prepared.val or []), "data": prepared.summary,
        "chat_template": chat_template,
        "components": {f.name: f.describe() for f in features}, "flops_per_token": flops_per_token,
        "init_from": str(init_from) if init_from else None})
    for feature in features:
        model = feature.convert(model, setup)
    scheduler = (lambda opt: schedule.make(opt, train)) if ds_config.uses_recipe_schedule(ds_cfg) else None
    ds_internals.defer_muon_compile()  # 1.7 s of a rank's start-up otherwise
    with ds_internals.keep_muon_tags():  # Muon's tags (components/muon.py) survive DeepSpeed's by-name ones
        engine, *_ = deepspeed.initialize(model=model, lr_scheduler=scheduler, config=ds_cfg,
                                          model_parameters=models.param_groups(model, train.weight_decay),
                                          mpu=ds_internals.model_parallel_unit(layout))
    layout = ds_internals.bind_groups(engine, layout)  # checks our rank arithmetic against DeepSpeed's groups
    ds_internals.record_fp32_grad_norm(engine)  # ZeRO-0 in fp32 logs its grad_norm too
    engine.train()  # from_pretrained returns the model in eval mode: dropout was off for the whole run
    setup.layout = layout
    for feature in features:
        feature.attach(engine, setup)
    peak = flops.device_peak(engine.device, ds_config.precision(ds_cfg))  # all ranks at once: shared cores
    prepared.train, prepared.val = objective.before_training(  # preference: the reference model's log-probs
        engine, [prepared.train, prepared.val], layout, ctx, run_dir, prepared.cache_path,
        weights_fingerprint(model_source.name_or_path), train.micro_batch_size, log)
    per = getattr(objective, "steps_per_batch", 1)  # steps that train on one batch of the stream (RL: the rollout's)
    stream = data.TrainStream(prepared.train, train.micro_batch_size, train.grad_accum_steps, layout, train.seed,
                              pin_memory=engine.device.type == "cuda")
    val = data.eval_batches(prepared.val, train.micro_batch_size, layout, recipe.eval.max_batches) \
        if prepared.val is not None else []
    eval_note = data.amount.eval_note(prepared.val_rows, len(prepared.val or []), len(val), layout.data_parallel,
                                      train.seq_len)
    if eval_note:
        log(eval_note)
    background, said = checkpoint.background_decision(recipe.checkpoint, ds_cfg, layout, params_total, trained,
                                                       env.ranks_per_node())
    log(said)
    ckpt = checkpoint.Checkpointer(run_dir, recipe.checkpoint, ctx, layout, components.stateful(features), background)
    stop = preempt.StopRequest(run_dir, ctx)  # SIGUSR1 / SIGTERM / a STOP file: checkpoint, exit 75
    start = ckpt.load(engine, start_from)["step"] if start_from else 0
    if start_from:
        stream.resume(start // per, start_from.manifest.get("samples", start // per * stream.global_batch))
    # who takes part; what a change of members (or of the ZeRO stage) cost (events.jsonl)
    events.record_start(run_dir, ctx, start, log, ds_config.zero_stage(ds_cfg))
    setup_peak = memory.peak_bytes()  # building, loading and partitioning, before any step
    memory.reset_peak()  # from here on, the training phase's peak (what the preflight models)
    metrics = Metrics(run_dir, recipe.log, ctx, start, train.max_steps, {"recipe": recipe.to_dict(), "ds": ds_cfg},
                      flops_per_token, peak.flops * ctx.world_size,
                      lambda achieved: flops.record_achieved(engine.device, ds_config.precision(ds_cfg),
                                                             achieved / ctx.world_size))
    checks = health.StepHealth.for_run(recipe.fault, ds_config.precision(ds_cfg), ds_config.zero_stage(ds_cfg),
                                       layout, run_dir, engine, metrics.message)  # NaNs, spikes, slow ranks, SDC
    checks.restore(start_from.manifest.get("health") if start_from else None)
    metrics.message(f"data: {prepared.summary}; "
                    f"{data.amount.describe(train.max_steps // per, global_batch, len(prepared.train))}")
    metrics.message(f"{'resumed from ' + str(start_from.path) if start_from else 'starting'} at step {start}; "
                    f"{'reused' if prepared.cache_hit else 'wrote'} tokenized data {prepared.cache_path}; "
                    f"MFU = tokens/s x {flops_per_token / 1e6:,.1f} MFLOP/token / ({ctx.world_size} x "
                    f"{peak.flops / 1e12:,.3g} TFLOP/s, {peak.source})")

    def saved(step: int) -> dict:  # what a checkpoint records besides DeepSpeed's state
        return {"global_batch": stream.global_batch, "samples": step // per * stream.global_batch + stream.offset,
                "data_parallel": layout.data_parallel, "sequence_parallel": layout.sequence_parallel,
                "context_parallel": layout.context_parallel, "replicas": layout.replicas, "run": identity,
                "zero_stage": ds_config.zero_stage(ds_cfg),
                "health": checks.state()}

    # ---- the loop
    def evaluation(step: int) -> None:
        with components.evaluated(features):  # DiLoCo streaming: the shared weights
            metrics.evaluation(step, *evaluate(engine, val, layout, objective))

    def search(step: int) -> str | None:  # the first non-finite step, re-run with hooks: the module it began in
        return health.locate(engine, stream.micro_batches((step - 1) // per), objective, layout, step)

    if start == 0 and val:
        evaluation(0)
    counter = comm_counter.CommCounter().start()  # bytes sent and time waited in collectives, every step
    watchdog.arm()
    last = train.exit_at_step or train.max_steps
    for step in range(start + 1, last + 1):
        faults.point("step", ctx.rank, step)
        began, lr, comm = time.perf_counter(), engine.get_lr()[0], counter.snapshot()
        checks.begin(step)
        try:
            loss, counts, tokens, extra = train_step(engine, stream.micro_batches((step - 1) // per), layout, objective,
                                                     ckpt.before_update, step, checks)
        except UserError as error:  # bad data every rank met in this step (a reward function's): the save in
            if getattr(error, "every_rank", False):  # flight, the last good state, is finished before leaving
                ckpt.finish(step - 1, metrics.message)
            raise
        for feature in features:  # a step's work (DiLoCo's outer step) counts in its time and bytes
            feature.after_step(step, metrics.message)
        seconds, spent = time.perf_counter() - began, counter.since(comm)
        extra |= checks.after(step, loss, _as_float(engine.get_global_grad_norm()), search, seconds, spent["comm_s"])
        metrics.step(step, loss, lr, extra.pop("grad_norm"), tokens, int(counts["label_tokens"]), seconds, spent,
                     extra)
        watchdog.progress()
        if val and (step == train.max_steps or (recipe.eval.every and step % recipe.eval.every == 0)):
            evaluation(step)
            watchdog.progress()
        if step % per:  # inside a rollout batch (RL's rl.num_iterations): saves and stops wait for its last step
            continue
        ckpt.poll(step, engine.device, metrics.message)  # a background save whose files are all written is published
        ckpt.choose_interval(ctx.world_size // env.ranks_per_node(), recipe.fault.mtbf_hours, engine.device,
                             metrics.message)  # checkpoint.every=auto, once the first save's stall is known
        if not checks.stopping and ckpt.due(step, last) and checks.safe_to_save(engine, step):
            ckpt.save(engine, step, saved(step), wait=step == last, say=metrics.message)  # the last: no copy
            watchdog.progress()
        if checks.stopping or stop.agreed(step, engine.device):  # checks: the same on every rank
            last = step
            break

    # ---- finish
    counter.stop()
    checks.close()
    if checks.weights_bad or not checks.safe_to_save(engine, last):  # a non-finite update applied, or SDC
        ckpt.finish(last, metrics.message, last=True)  # an earlier save in flight held a state checked good
        final = None
    else:
        final = ckpt.save(engine, max(start, last), saved(max(start, last)), say=metrics.message)  # waits: written
    watchdog.close()  # past the last collective: ranks may now leave at different times
    resume_hint = f"run the same command again (--resume auto) to continue from {final and final.name}"
    outcome = {"status": "finished", "max_steps": train.max_steps, "checkpoint": final and str(final), "export": None,
               "next": None, "train_sequences": len(prepared.train),
               "epochs": round(data.amount.epochs(max(start, last), global_batch, len(prepared.train)), 3),
               "saves": {"background": background, "every": ckpt.every or recipe.checkpoint.every,
                         "stall_s": ckpt.stalls, "write_s": ckpt.writes}, "health": checks.summary()}
    if checks.stopping:
        outcome.update(status=f"stopped ({checks.why})", next=checks.advice(last))
        events.record_stop(run_dir, ctx, last, checks.why)
    elif stop.stopped_at:
        metrics.message(f"stopped at step {last} ({stop.reason}); checkpoint {final.name} saved; "
                        f"run again with --resume auto to continue")
        outcome.update(status=f"stopped ({stop.reason})", next=resume_hint)
        events.record_stop(run_dir, ctx, last, stop.reason)
    elif last < train.max_steps:
        metrics.message(f"stopped at step {last} (train.exit_at_step); run again with --resume auto to continue")
        outcome.update(status="stopped (train.exit_at_step)", next=resume_hint)
        events.record_stop(run_dir, ctx, last, "train.exit_at_step")
    elif recipe.checkpoint.export_hf and not (start == last and (run_dir / "hf").exists()):
        export.at_end(final, run_dir / "hf", ds_cfg, ctx, metrics.message)
    if last >= train.max_steps and (run_dir / "hf").exists():
        outcome.update(export=str(run_dir / "hf"), next=f"AutoModelForCausalLM.from_pretrained('{run_dir / 'hf'}'), "
                       f"or train on from it: --model.name_or_path={run_dir / 'hf'}")
    memory.record(run_dir / "memory.json", ctx, baseline_memory, setup_peak,
                  memory.estimate(model_config, params_total, recipe, ds_cfg, layout, trained))
    metrics.close(outcome)
    return checks.exit_code if checks.stopping else preempt.EXIT_CODE if stop.stopped_at else EXIT_OK


def run_preflight(args, recipe: Recipe, ds_overrides: dict) -> int:
    from dstrain import env, memory
    from dstrain.parallel import ds_config

    world = args.world_size or env.world_size(default=0) or recipe.world_size or 1
    target = memory.target_device(args.device, args.device_memory)  # planning for GPUs this machine lacks
    caps = ds_config.DeviceCaps("cuda", bf16=True, fp16=True) if target else ds_config.DeviceCaps.detect()
    fits, text = memory.preflight(recipe, ds_config.load(recipe.ds_config, ds_overrides), str(recipe.ds_config),
                                  world, args.ranks_per_node or world, caps, target)
    print(text)
    return EXIT_OK if fits else EXIT_FAILED


def _as_float(value) -> float | None:
    return None if value is None else float(value)


if __name__ == "__main__":
    cli.exit_with(main)
