#!/usr/bin/env python3
"""Train a Hugging Face causal LM with DeepSpeed.

    deepspeed train.py --ds_config zero3.json                      # default tiny recipe, every local device
    deepspeed train.py --recipe recipes/llama-3.2-1b/sft.yaml --train.max_steps=500
    python train.py ...  |  torchrun --nproc_per_node 2 train.py ...  |  accelerate launch ... train.py ...

parse -> resolve and validate every input -> build -> fit -> finish (dstrain/trainer/). See README.md for every
recipe key; optional features are components (dstrain/components/), checks and per-step features step hooks
(dstrain/trainer/hooks.py), objectives one protocol (dstrain/objectives/), so nothing here is feature-specific.
"""
from __future__ import annotations

import sys
from pathlib import Path

from dstrain import cli, env
from dstrain.config import Recipe
from dstrain.errors import EXIT_FAILED, EXIT_OK, AlreadyFinished, UserError
from dstrain.run import preempt, run_lock


def main(argv: list[str] | None = None) -> int:
    """Exit code of the run; the process group is still up when it returns (see dist.leave)."""
    preempt.note_launchers()  # first: the launchers above this rank, while they surely live
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
    except AlreadyFinished as done:  # every rank alike: said once, nothing written, exit 0
        if ctx.is_main:
            print(done, file=sys.stderr, flush=True)
        run_lock.put_back()
        watchdog.close()
        return EXIT_OK
    except (UserError, SystemExit, KeyboardInterrupt) as error:  # the same bad input (or Ctrl-C) on every rank
        if isinstance(error, UserError):  # said before anyone leaves: the launcher kills the rest when one exits
            cli.say(error)
            error.waited = True
            run_lock.put_back()
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
    """The run's phases: resolve (every input checked, nothing built), then the Trainer's build, fit and finish."""
    # imported here, not at the top: deepspeed and transformers take seconds, and bad input or --preflight
    # should answer without them
    import deepspeed  # noqa: F401 - imported before the resolution as it always was (its accelerator's notes)

    from dstrain.trainer import Trainer, log_on_main, resolve

    resolved = resolve(args, recipe, raw_ds, run_dir, ctx, init_from, log_on_main(ctx))
    return Trainer(resolved, ctx, watchdog).run()


def run_preflight(args, recipe: Recipe, ds_overrides: dict) -> int:
    from dstrain import env
    from dstrain.parallel import ds_config
    from dstrain.planner import memory

    world = args.world_size or env.world_size(default=0) or recipe.world_size or 1
    target = memory.target_device(args.device, args.device_memory)  # planning for GPUs this machine lacks
    caps = ds_config.DeviceCaps("cuda", bf16=True, fp16=True) if target else ds_config.DeviceCaps.detect()
    fits, text = memory.preflight(recipe, ds_config.load(recipe.ds_config, ds_overrides), str(recipe.ds_config),
                                  world, args.ranks_per_node or world, caps, target)
    print(text)
    return EXIT_OK if fits else EXIT_FAILED


if __name__ == "__main__":
    cli.exit_with(main)
