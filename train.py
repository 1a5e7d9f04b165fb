#!/usr/bin/env python3
"""Train a Hugging Face causal LM with DeepSpeed.

    deepspeed train.py --ds_config zero3.json                      # default tiny recipe, every local device
    deepspeed train.py --recipe recipes/llama-3.2-1b/sft.yaml --train.max_steps=500
    python train.py ...  |  torchrun --nproc_per_node 2 train.py ...  |  accelerate launch ... train.py ...

parse -> resolve config -> init distributed -> build -> loop. See README.md for every recipe key.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from pathlib import Path

from dstrain.config import DEFAULT_RECIPE, RECIPES_DIR, Recipe, load_recipe, parse_overrides, resolve_recipe_path
from dstrain.errors import UserError


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False,
                                     epilog="Any recipe key can be overridden: --train.max_steps=20 "
                                            "--model.name_or_path=/path/to/model; any DeepSpeed key with "
                                            "--ds.: --ds.zero_optimization.stage=3")
    parser.add_argument("--recipe", default=str(DEFAULT_RECIPE), help="YAML in recipes/ or a path")
    parser.add_argument("--ds_config", default=None, help="JSON in ds_configs/ or a path (default: the recipe's)")
    parser.add_argument("--output_dir", default=None, help="run directory (default: runs/<recipe name>)")
    parser.add_argument("--resume", default="auto", help="auto (newest complete checkpoint), never, or a path")
    parser.add_argument("--preflight", action="store_true",
                        help="estimate per-rank memory for this recipe, config and --world_size, then exit")
    parser.add_argument("--world_size", type=int, default=None,
                        help="with --preflight: ranks of the real run (default: WORLD_SIZE, the recipe's, or 1)")
    parser.add_argument("--ranks_per_node", type=int, default=None,
                        help="with --preflight: ranks sharing one node's GPUs or RAM (default: all on one node)")
    parser.add_argument("--local_rank", type=int, default=None, help=argparse.SUPPRESS)  # the deepspeed launcher's
    args, rest = parser.parse_known_args(argv)
    return args, parse_overrides(rest)


def default_run_dir(recipe_arg: str) -> Path:
    path = resolve_recipe_path(recipe_arg).resolve()
    name = path.relative_to(RECIPES_DIR).with_suffix("") if path.is_relative_to(RECIPES_DIR) else Path(path.stem)
    return Path("runs") / str(name).replace(os.sep, "-")


def prepare_run_dir(path: Path) -> Path:
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".write-test-{os.getpid()}"
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        raise UserError(f"cannot write to output_dir {path}: {e.strerror}; choose a writable --output_dir") from None
    return path


def load_inputs(argv: list[str] | None) -> tuple[argparse.Namespace, Recipe, dict]:
    """(arguments, recipe with its DeepSpeed config chosen, --ds.* overrides); also used by dstrain.cluster."""
    args, overrides = parse_args(argv)
    ds_overrides = overrides.pop("ds", {})  # --ds.zero_optimization.stage=3 edits the DeepSpeed JSON
    recipe: Recipe = load_recipe(args.recipe, overrides)
    recipe.ds_config = args.ds_config or os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE") or recipe.ds_config
    return args, recipe, ds_overrides


def main(argv: list[str] | None = None) -> int:
    """Exit code of the run; the process group is still up when it returns (see dist.leave)."""
    args, recipe, ds_overrides = load_inputs(argv)
    if args.preflight:
        run_preflight(args, recipe, ds_overrides)
        return 0
    run_dir = prepare_run_dir(Path(args.output_dir) if args.output_dir else default_run_dir(args.recipe))

    from dstrain import checkpoint, dist, ds_config
    from dstrain.watchdog import Watchdog

    checkpoint.resolve_resume(args.resume, run_dir / "checkpoints")  # a bad --resume fails before anything starts
    raw_ds = ds_config.load(recipe.ds_config, ds_overrides)
    ctx = dist.init()
    watchdog = Watchdog(run_dir, recipe.fault, ctx).start()  # a dead or stuck rank ends the job, no hang
    try:
        code = train(args, recipe, raw_ds, run_dir, ctx, watchdog)
    except (UserError, SystemExit):  # the same bad input on every rank: each says so and leaves
        watchdog.close()
        raise
    except checkpoint.SaveError as error:  # this rank could not write; the others may wait in a collective
        watchdog.abort(str(error), error.code)
    except BaseException as error:  # a crash here, or a collective that failed because a peer died
        watchdog.fail(error)
    watchdog.close()
    return code


def train(args, recipe: Recipe, raw_ds: dict, run_dir: Path, ctx, watchdog) -> int:
    import deepspeed
    from dstrain import (checkpoint, compiler, compression, data, dist, ds_config, faults, flops, loss, memory,
                         model as models, pipeline, preempt, schedule)
    from dstrain.metrics import Metrics
    from dstrain.steps import evaluate, train_step

    train = recipe.train
    log = (lambda text: print(text, file=sys.stderr, flush=True)) if ctx.is_main else (lambda text: None)
    resume = checkpoint.choose(args.resume, run_dir / "checkpoints", ctx, recipe.checkpoint.verify, log)
    layout = ds_config.layout_of(raw_ds, ctx.world_size)
    if train.compile and layout.pipeline_stages > 1:
        raise UserError("train.compile is not supported with pipeline stages; set train.compile=false")
    if train.loss_chunk_tokens and (layout.pipeline_stages > 1 or layout.tensor_parallel > 1):
        raise UserError("train.loss_chunk_tokens is not supported with pipeline stages or tensor parallelism "
                        "(their heads are split or staged); set train.loss_chunk_tokens=0")
    if resume:  # same global batch on a new world size (grad_accum_steps re-derived), universal conversion
        checkpoint.adapt_to_world(resume, train, layout.data_parallel,
                                  layout.pipeline_stages > 1 or layout.tensor_parallel > 1, log)
        if resume.universal:
            checkpoint.to_universal(resume, ctx, log)
            raw_ds.setdefault("checkpoint", {})["load_universal"] = True
    model_config = models.load_config(recipe.model, train.seq_len)[1]
    compress = compression.parse(raw_ds)  # the repository's key; resolve() takes it out of what DeepSpeed sees
    ds_cfg = ds_config.resolve(raw_ds, recipe, ctx.world_size, ds_config.DeviceCaps.detect(),
                               models.hidden_size(model_config), dist.ranks_per_node())

    tokenizer = models.load_tokenizer(recipe.model)
    prepared = data.prepare(recipe.data, tokenizer, train.seq_len, train.seed, ctx.is_local_main, dist.barrier)
    baseline_memory = memory.current_bytes()  # everything after this is the model and its training
    model, _hf_ds_config = models.build(recipe.model, train, ds_cfg, tokenizer)
    if train.loss_chunk_tokens:
        loss.install(model, train.loss_chunk_tokens, ds_config.precision(ds_cfg))
    params_total, params_local = models.parameter_counts(model)  # before the engine: what construction held
    flops_per_token = flops.flops_per_token(model_config, params_total, train.seq_len)
    if recipe.log.flops_profile_step:  # DeepSpeed's profiler, for one step, on rank 0
        ds_cfg["flops_profiler"] = flops.profiler_config(recipe.log.flops_profile_step, str(run_dir / "flops_profile.txt"))
    checkpoint.write_run_files(run_dir, recipe, ds_cfg, model.config, tokenizer, ctx, {
        "parameters": params_total, "parameters_on_rank0_at_build": params_local,
        "activation_checkpointing": bool(getattr(model, "is_gradient_checkpointing", False)),
        "world_size": ctx.world_size, "data_parallel": layout.data_parallel, "data_cache": prepared.cache_path,
        "train_sequences": len(prepared.train), "val_sequences": len(prepared.val or []),
        "gradient_compression": dataclasses.asdict(compress),
        "flops_per_token": flops_per_token})
    if layout.pipeline_stages > 1:  # the same HF modules, regrouped into stages
        piped = pipeline.convert(model, layout.pipeline_stages, ds_cfg["pipeline"].get("partition_method", "parameters"),
                                 train.activation_checkpointing)
        checkpoint.write_pipeline_names(run_dir, piped.hf_names, ctx)
        model = piped.module
    scheduler = (lambda opt: schedule.make(opt, train)) if ds_config.uses_recipe_schedule(ds_cfg) else None
    engine, *_ = deepspeed.initialize(model=model, model_parameters=models.param_groups(model, train.weight_decay),
                                      lr_scheduler=scheduler, config=ds_cfg, mpu=dist.tensor_parallel_groups(layout))
    reducer = compression.install(engine, compress)  # None unless the JSON asks for it
    compiled = compiler.install(engine, ds_config.zero_stage(ds_cfg), layout.tensor_parallel, train.activation_checkpointing,
                                train.compile_wait, ctx.local_rank, log) if train.compile else None
    peak = flops.device_peak(engine.device, ds_config.precision(ds_cfg))  # all ranks at once: shared cores
    if recipe.log.flops_profile_step:
        flops.profile_one_step(engine, bool(ds_cfg.get("wall_clock_breakdown", False)))
    dp_rank = dist.data_parallel_rank(engine)
    stream = data.TrainStream(prepared.train, train.micro_batch_size, train.grad_accum_steps, dp_rank,
                              layout.data_parallel, train.seed, pin_memory=engine.device.type == "cuda")
    val = data.eval_batches(prepared.val, train.micro_batch_size, dp_rank, layout.data_parallel,
                            recipe.eval.max_batches) if prepared.val is not None else []
    ckpt = checkpoint.Checkpointer(run_dir, recipe.checkpoint, ctx, layout.tensor_parallel, reducer)
    stop = preempt.StopRequest(run_dir, ctx)  # SIGUSR1 / SIGTERM / a STOP file: checkpoint, exit 75
    start = ckpt.load(engine, resume)["step"] if resume else 0
    if resume:
        stream.resume(start, resume.manifest.get("samples", start * stream.global_batch))
    setup_peak = memory.peak_bytes()  # building, loading and partitioning, before any step
    metrics = Metrics(run_dir, recipe.log, ctx, start, train.max_steps, {"recipe": recipe.to_dict(), "ds": ds_cfg},
                      flops_per_token, peak.flops * ctx.world_size)
    metrics.message(f"{'resumed from ' + str(resume.path) if resume else 'starting'} at step {start}; "
                    f"{'reused' if prepared.cache_hit else 'wrote'} tokenized data {prepared.cache_path}; "
                    f"MFU = tokens/s x {flops_per_token / 1e6:,.1f} MFLOP/token / ({ctx.world_size} x "
                    f"{peak.flops / 1e12:,.3g} TFLOP/s, {peak.source})")
    tokens_per_step = stream.global_batch * train.seq_len

    def saved(step: int) -> dict:  # what a checkpoint records besides DeepSpeed's state
        return {"global_batch": stream.global_batch, "samples": step * stream.global_batch + stream.offset,
                "data_parallel": layout.data_parallel}

    if start == 0 and val:
        metrics.evaluation(0, evaluate(engine, val, layout.data_parallel))
    counter = compression.CommCounter().start() if recipe.log.comm_bytes else None
    watchdog.arm()
    last = train.exit_at_step or train.max_steps
    for step in range(start + 1, last + 1):
        faults.point("step", ctx.rank, step)
        began, lr, sent = time.perf_counter(), engine.get_lr()[0], counter.wire_bytes if counter else 0
        loss, _ = train_step(engine, stream.micro_batches(step - 1), layout.data_parallel)
        metrics.step(step, loss, lr, _as_float(engine.get_global_grad_norm()), tokens_per_step,
                     time.perf_counter() - began, counter.wire_bytes - sent if counter else None)
        watchdog.progress()
        if compiled:
            compiled.poll(step, metrics.message)  # starts the background compile; switches all ranks when done
        if val and (step == train.max_steps or (recipe.eval.every and step % recipe.eval.every == 0)):
            metrics.evaluation(step, evaluate(engine, val, layout.data_parallel))
            watchdog.progress()
        if ckpt.due(step, last):
            ckpt.save(engine, step, saved(step))
            watchdog.progress()
        if stop.agreed(step, engine.device):
            last = step
            break

    if counter:
        counter.stop()
    final = ckpt.save(engine, max(start, last), saved(max(start, last)))
    watchdog.close()  # past the last collective: ranks may now leave at different times
    if stop.stopped_at:
        metrics.message(f"stopped at step {last} ({stop.reason}); checkpoint {final.name} saved; "
                        f"run again with --resume auto to continue")
    elif last < train.max_steps:
        metrics.message(f"stopped at step {last} (train.exit_at_step); run again with --resume auto to continue")
    elif recipe.checkpoint.export_hf and ctx.is_main and not (start == last and (run_dir / "hf").exists()):
        checkpoint.export_hf(final, run_dir / "hf", checkpoint.export_dtype(ds_cfg))
        metrics.message(f"exported {run_dir / 'hf'}")
    if ctx.is_main:
        estimate = memory.estimate(model_config, params_total, recipe, ds_cfg, layout)
        memory.write_measurement(run_dir / "memory.json", baseline_memory,
                                 {"estimated_device_bytes": estimate.device_total, "estimate": estimate.device,
                                  "setup_peak_above_baseline_bytes": setup_peak - baseline_memory})
    metrics.close()
    return preempt.EXIT_CODE if stop.stopped_at else 0


def run_preflight(args: argparse.Namespace, recipe: Recipe, ds_overrides: dict) -> None:
    from dstrain import ds_config, memory

    world = args.world_size or int(os.environ.get("WORLD_SIZE", 0)) or recipe.world_size or 1
    fits, text = memory.preflight(recipe, ds_config.load(recipe.ds_config, ds_overrides), str(recipe.ds_config),
                                  world, args.ranks_per_node or world, ds_config.DeviceCaps.detect())
    print(text)
    if not fits:
        sys.exit(1)


def _as_float(value) -> float | None:
    return None if value is None else float(value)


if __name__ == "__main__":
    try:
        exit_code = main()
    except UserError as error:
        if os.environ.get("RANK", "0") == "0":  # every rank hits the same input error; say it once
            print(f"error: {error}", file=sys.stderr)
        exit_code = 2
    except SystemExit as stop:  # preflight's verdict, argparse, or a stop decided inside the run
        if not isinstance(stop.code, (int, type(None))):
            print(stop.code, file=sys.stderr)
        exit_code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
    if "torch.distributed" in sys.modules and sys.modules["torch.distributed"].is_initialized():
        from dstrain import dist
        dist.leave(exit_code)
    sys.exit(exit_code)
