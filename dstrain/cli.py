"""Command-line arguments and recipe loading, shared by train.py and the cluster check; the process's exit."""
from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

from . import env
from .config import DEFAULT_RECIPE, RECIPES_DIR, Recipe, load_recipe, parse_overrides, resolve_recipe_path
from .errors import EXIT_FAILED, EXIT_INTERRUPTED, EXIT_OK, EXIT_USER_ERROR, UserError

DESCRIPTION = "Train a Hugging Face causal LM with DeepSpeed."


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, dict]:
    parser = argparse.ArgumentParser(description=DESCRIPTION, allow_abbrev=False,
                                     epilog="Any recipe key can be overridden: --train.max_steps=20 "
                                            "--model.name_or_path=/path/to/model; any DeepSpeed key with "
                                            "--ds.: --ds.zero_optimization.stage=3")
    parser.add_argument("--recipe", default=str(DEFAULT_RECIPE), help="YAML in recipes/ or a path")
    parser.add_argument("--ds_config", default=None, help="JSON in ds_configs/ or a path (default: the recipe's)")
    parser.add_argument("--output_dir", default=None, help="run directory (default: runs/<recipe name>)")
    parser.add_argument("--resume", default="auto", help="auto (newest complete checkpoint), never, or a path")
    parser.add_argument("--init_from", default=None,
                        help="start a new run from the weights of another run's checkpoint (a run directory or "
                             "checkpoints/step_*): fresh optimizer, step 0; e.g. SFT after pretraining")
    parser.add_argument("--preflight", action="store_true",
                        help="estimate per-rank memory for this recipe, config and --world_size, then exit")
    parser.add_argument("--world_size", type=int, default=None,
                        help="with --preflight: ranks of the real run (default: WORLD_SIZE, the recipe's, or 1); "
                             "when training: accept this world for a recipe written for another world_size "
                             "and train with its batch as written (by default grad_accum_steps is re-derived "
                             "to keep the recipe's global batch)")
    parser.add_argument("--ranks_per_node", type=int, default=None,
                        help="with --preflight: ranks sharing one node's GPUs or RAM (default: all on one node)")
    parser.add_argument("--device", default=None,
                        help="with --preflight: plan for this GPU instead of this machine (h100-80gb, a100-80gb, "
                             "h200-141gb, ...: the table in dstrain/planner/memory.py); the precision is the config's")
    parser.add_argument("--device_memory", default=None,
                        help="with --preflight: memory per GPU of the planned run, e.g. 80GiB (overrides --device's)")
    plan = parser.add_argument_group("strategy planner (dstrain/planner)")
    plan.add_argument("--plan", action="store_true",
                      help="measure compute, links and memory on these ranks, rank every strategy by predicted step "
                           "time, write <run dir>/plan/best.json; launch it like the real run")
    plan.add_argument("--trial", type=int, default=None, metavar="K",
                      help="with --plan: run the top K candidates for a few steps each and keep the measured fastest")
    plan.add_argument("--plan_max_mb", type=float, default=256,
                      help="with --plan: largest collective message measured, MB (default 256)")
    plan.add_argument("--simulate", action="store_true",
                      help="with --plan: predict tokens/s and scaling from 1 to --max_gpus GPUs of --device over "
                           "--interconnect from tables (and --measurements), without launching anything")
    plan.add_argument("--interconnect", default=None,
                      help="with --simulate: the network between nodes (ib-ndr, ib-hdr, ib-edr, 400gbe, 100gbe, ...)")
    plan.add_argument("--gpus_per_node", type=int, default=8, help="with --simulate (default 8)")
    plan.add_argument("--max_gpus", type=int, default=1024, help="with --simulate (default 1024)")
    plan.add_argument("--measurements", default=None,
                      help="with --simulate: a plan.json written by --plan: its measured compute and links")
    parser.add_argument("--local_rank", type=int, default=None, help=argparse.SUPPRESS)  # the deepspeed launcher's
    args, rest = parser.parse_known_args(argv)
    return args, parse_overrides(rest)


def default_run_dir(recipe_arg: str) -> Path:
    path = resolve_recipe_path(recipe_arg).resolve()
    name = path.relative_to(RECIPES_DIR).with_suffix("") if path.is_relative_to(RECIPES_DIR) else Path(path.stem)
    return Path("runs") / str(name).replace(os.sep, "-")


def run_dir_of(args: argparse.Namespace) -> Path:
    return Path(args.output_dir) if args.output_dir else default_run_dir(args.recipe)


def prepare_run_dir(path: Path) -> bool:
    """Make the run directory (checked writable); True when this process made it (mkdir is atomic: one rank of
    a launch does), so that rank removes it again if the run is refused before writing anything."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            path.mkdir()
            made = True
        except FileExistsError:
            made = False
        probe = path / f".write-test-{os.getpid()}"
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        raise UserError(f"cannot write to output_dir {path}: {e.strerror}; choose a writable --output_dir") from None
    return made


def load_inputs(argv: list[str] | None) -> tuple[argparse.Namespace, Recipe, dict]:
    """(arguments, recipe with its DeepSpeed config chosen, --ds.* overrides)."""
    args, overrides = parse_args(argv)
    ds_overrides = overrides.pop("ds", {})  # --ds.zero_optimization.stage=3 edits the DeepSpeed JSON
    recipe: Recipe = load_recipe(args.recipe, overrides)
    recipe.ds_config = args.ds_config or env.accelerate_ds_config() or recipe.ds_config
    return args, recipe, ds_overrides


def one_cpu_rank_note(world_size: int, device: str, launched: bool) -> str | None:
    """A launcher that started one rank on a machine without GPUs was most likely not told how many: `deepspeed`
    counts GPUs (issue 54: the docs' commands gave 1 rank where `make train` gives 2)."""
    if world_size == 1 and device == "cpu" and launched:
        return ("note: 1 rank: on a machine without GPUs the launcher starts one CPU rank unless told; "
                "`deepspeed --num_gpus 2 train.py ...` (or `torchrun --nproc_per_node 2`) starts two, as `make train` "
                "does")
    return None


def say(error: UserError) -> None:
    """The one line of a bad input, on rank 0, once (run() says it before the ranks leave together)."""
    if env.rank() == 0 and not getattr(error, "said", False):
        shown = sys.modules.get("dstrain.metrics")  # imported once training began: a progress bar may be up
        if shown is not None:
            shown.end_bar_line()
        print(f"error: {error}", file=sys.stderr, flush=True)
        error.said = True


def exit_with(main: Callable[[], int]) -> NoReturn:
    """Run main and end the process with its exit code: a UserError is one line (said once, by rank 0) and
    EXIT_USER_ERROR; a rank with a process group leaves through dist.leave (see there for why)."""
    try:
        code = main()
    except UserError as error:
        say(error)  # every rank hits the same input error; rank 0 says it once
        if env.rank() != 0 and not getattr(error, "waited", False):
            # found before the ranks could coordinate (no store yet): under the deepspeed launcher the first rank
            # to exit gets the others killed, so give rank 0 a moment to say the line (the same work: ms apart)
            time.sleep(1.0)
        code = EXIT_USER_ERROR
    except KeyboardInterrupt:  # Ctrl-C before the first step (once training runs, it is a graceful stop)
        if env.rank() == 0:
            print("interrupted before training started; nothing was saved", file=sys.stderr)
        code = EXIT_INTERRUPTED
    except SystemExit as stop:  # preflight's verdict, argparse, or a stop decided inside the run
        if not isinstance(stop.code, (int, type(None))):
            print(stop.code, file=sys.stderr)
        code = stop.code if isinstance(stop.code, int) else (EXIT_OK if stop.code is None else EXIT_FAILED)
    if "torch.distributed" in sys.modules and sys.modules["torch.distributed"].is_initialized():
        from .parallel import dist
        dist.leave(code)
    sys.exit(code)
