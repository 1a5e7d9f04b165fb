"""The `--plan` entry point (see the package docstring): measure, predict, rank, trial, write plan/."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from ..errors import EXIT_OK, UserError
from ..parallel.layout import parallel_sizes


def run(args, recipe, ds_overrides: dict, argv: list[str]) -> int:
    from .. import cli
    from ..model import hidden_size, load_config
    from ..parallel import ds_config

    if args.simulate:
        from . import simulate
        return simulate.run(args, recipe, ds_overrides)
    if args.trial is not None and args.trial < 1:
        raise UserError(f"--trial {args.trial}: give the number of top candidates to run (1 or more)")
    raw_ds = ds_config.load(recipe.ds_config, ds_overrides)
    sizes = parallel_sizes(raw_ds)
    if sizes.sequence > 1 or sizes.context > 1:  # no candidate, probe or cost term for them yet
        key = "sequence_parallel_size" if sizes.sequence > 1 else "context_parallel_size"
        raise UserError(f"--plan does not model sequence parallelism yet ({key}="
                        f"{max(sizes.sequence, sizes.context) if key[0] == 'c' else sizes.sequence}); plan with a "
                        f"ZeRO config, or use --preflight for memory")
    if sizes.expert:  # no candidate, probe or cost term for the all-to-alls or the experts' own groups yet
        raise UserError(f"--plan does not model expert parallelism yet (expert_parallel.autoep_size={sizes.expert});"
                        f" bench/moe.py measures it against ZeRO-2 and ZeRO-3, and --preflight estimates its memory")
    if ds_config.optimizer_of(raw_ds, recipe.train) == "muon":  # no cost term for Newton-Schulz or its gathers
        raise UserError("--plan does not model Muon yet (its Newton-Schulz time and gathers); plan with "
                        "train.optimizer=adamw, or use --preflight for memory")
    model_config = load_config(recipe.model, recipe.train.seq_len)[1]
    run_dir = cli.run_dir_of(args)
    cli.prepare_run_dir(run_dir)

    from ..parallel import dist
    from . import cost, probe
    ctx = dist.init()
    log = (lambda text: print(text, file=sys.stderr, flush=True)) if ctx.is_main else (lambda text: None)
    caps = ds_config.DeviceCaps.detect()
    from .. import env
    ranks_per_node = env.ranks_per_node()
    hidden = hidden_size(model_config)
    work = cost.workload(recipe, raw_ds, ctx.world_size, model_config)
    found = cost.candidates(recipe, raw_ds, ctx.world_size, model_config, ranks_per_node=ranks_per_node)
    if not found:
        raise UserError(f"no strategy keeps the recipe's global batch of {work.global_batch} on {ctx.world_size} "
                        f"ranks; change train.micro_batch_size x train.grad_accum_steps")
    # memory first (no measurement needed): only the micro-batch sizes of candidates that fit are timed
    capacity = probe._memory(ranks_per_node)
    unmeasured = probe.Measurements("cpu" if caps.name == "cpu" else caps.name, "", ctx.world_size, ranks_per_node,
                                    probe.Compute(), {}, *capacity)
    fitting = [c for c in found if cost.predict(c, work, unmeasured, recipe, caps, hidden).fits]
    micro_sizes = sorted({c.micro for c in fitting})[:6] or [1]
    precision = ds_config.precision(ds_config.resolve(raw_ds, recipe, ctx.world_size, caps, hidden))
    meas = probe.measure(model_config, precision, recipe.train.seq_len, micro_sizes, ctx, ranks_per_node,
                         max_bytes=int(args.plan_max_mb * probe.MB), log=log,
                         compressed_shapes=cost.compression_sample(work), embedding_shapes=work.embedding_shapes,
                         parameters=work.parameters,
                         stages=tuple(sorted({int((c.ds.get("zero_optimization") or {}).get("stage", 0))
                                              for c in fitting} - {0})))
    preds = cost.rank([cost.predict(c, work, meas, recipe, caps, hidden) for c in found])
    out = run_dir / "plan"
    if ctx.is_main:
        out.mkdir(exist_ok=True)
        log(report_measurements(meas))
        log(report_predictions(preds, meas))
    best = preds[0]
    if args.trial:
        from . import trial
        best = trial.run(preds, args.trial, argv, out, ctx, log)
    if ctx.is_main:
        launch = command(out, best, args, argv, meas.nodes, meas.ranks_per_node)
        write(out, meas, preds, best, recipe, args, launch)
        log(f"plan: best {best.candidate.name} micro {best.candidate.micro} x accumulation {best.candidate.accum}; "
            f"train with:\n  {launch}")
    dist.barrier()
    return EXIT_OK


def command(out: Path, best, args, argv: list[str], nodes: int, ranks_per_node: int) -> str:
    """The launch that trains the best layout on the ranks it was measured on: the launcher's rank counts (a CPU
    machine's `deepspeed` alone starts one rank), the plan's own recipe overrides and output_dir, then the
    candidate's (later overrides win)."""
    launcher = ["deepspeed", *(["--num_nodes", str(nodes), "--hostfile", "HOSTFILE"] if nodes > 1 else []),
                "--num_gpus", str(ranks_per_node)]
    own = [a for a in argv if a.startswith("--") and "=" in a and "." in a.split("=")[0] and not a.startswith("--ds.")]
    where = ["--output_dir", args.output_dir] if args.output_dir else []
    return " ".join([*launcher, "train.py", "--recipe", args.recipe, "--ds_config", str(out / "best.json"), *where,
                     *own, *best.candidate.overrides()])


def write(out: Path, meas, preds, best, recipe, args, said: str) -> None:
    from .cost import dumps
    tmp = out / ".plan.json.tmp"
    tmp.write_text(dumps({"measurements": meas.to_dict(), "predictions": [p.to_dict() for p in preds],
                          "best": best.to_dict(), "recipe": recipe.to_dict()}))
    os.replace(tmp, out / "plan.json")
    (out / "best.json").write_text(json.dumps(best.candidate.ds, indent=2) + "\n")
    (out / "best.txt").write_text(said + "\n")


def _rate(nbytes_per_s: float) -> str:
    return f"{nbytes_per_s / 1e9:7.2f} GB/s" if nbytes_per_s >= 1e8 else f"{nbytes_per_s / 1e6:7.1f} MB/s"


def report_measurements(meas) -> str:
    c = meas.compute
    lines = [f"plan: measured in {meas.seconds:.1f} s on {meas.world_size} ranks ({meas.nodes} node(s) x "
             f"{meas.ranks_per_node}), {meas.device}, {meas.precision}",
             f"  compute: matmul {c.matmul_flops / 1e12:.3g} TFLOP/s at the model's shapes; one layer forward+backward "
             + ", ".join(f"{1e3 * t:.2f} ms (micro {m})" for m, t in sorted(c.layer.items(), key=lambda x: int(x[0])))
             + f"; AdamW {c.adam_elements_per_s / 1e6:,.0f}M elements/s"
             + (f", CPU Adam {c.cpu_adam_elements_per_s / 1e6:,.0f}M/s" if c.cpu_adam_elements_per_s else "")
             + (f", host copies {_rate(c.host_copy_bytes_per_s)}" if c.host_copy_bytes_per_s else ""),
             *(f"  warning: {note}" for note in c.notes),
             f"  memory: {meas.device_memory / 2**30:.1f} GiB per rank, {meas.host_memory / 2**30:.1f} GiB host RAM "
             f"per node",
             "  collectives (nccl-tests convention: size = full tensor, busbw = algbw x 2(n-1)/n all-reduce, "
             "x (n-1)/n gather/scatter):",
             f"  {'level':<13}{'op':<15}{'ranks':>5}  " + "  ".join(f"{_size(b):>17}" for b in _sizes(meas))]
    for level, ops in meas.links.items():
        for op, curve in ops.items():
            cells = {b: f"{t * 1e3:7.2f} ms {_rate(bw).strip():>9}" for (b, t), bw in
                     zip(curve.points, curve.busbw(op))}
            lines.append(f"  {level:<13}{op:<15}{curve.ranks:>5}  " +
                         "  ".join(f"{cells.get(b, '-'):>17}" for b in _sizes(meas)))
    return "\n".join(lines)


def _sizes(meas) -> list[int]:
    return sorted({b for ops in meas.links.values() for curve in ops.values() for b, _ in curve.points})


def _size(nbytes: int) -> str:
    return f"{nbytes >> 20} MB"


def _price(price: float | None) -> str:
    return "?" if price is None else "exact" if price == 0 else f"{price:+.1%}"


def report_predictions(preds, meas, top: int = 15) -> str:
    fitting = [p for p in preds if p.fits]
    lines = [f"plan: {len(preds)} candidates, {len(fitting)} fit; best first (step = compute + exposed comm + "
             f"update: optimizer, offload copies, compression)",
             f"  {'#':>3} {'strategy':<28}{'micro x acc':>12}{'AC':>4}{'memory':>10}{'compute':>10}{'comm':>10}"
             f"{'update':>10}{'step':>10}{'tokens/s':>11}{'comm %':>8}{'MB sent':>9}{'eval loss':>10}"]
    for i, p in enumerate(fitting[:top], 1):
        c = p.candidate
        lines.append(f"  {i:>3} {c.name:<28}{f'{c.micro} x {c.accum}':>12}{'on' if c.checkpointing else '':>4}"
                     f"{p.memory_bytes / 2**30:>8.2f}Gi{p.compute_s:>9.3f}s{p.exposed_comm_s:>9.3f}s"
                     f"{p.optimizer_s:>9.3f}s{p.step_s:>9.3f}s{p.tokens_per_s:>11,.0f}{p.comm_fraction:>8.0%}"
                     f"{p.comm_bytes / 1e6:>9.1f}{_price(p.price):>10}")
    lines.append("  eval loss: against exact training, measured at 300 steps (bench/compression.py, the tiny recipe, "
                 "mean over its data orders; ? not measured), or at 1,000 steps on a corpus seen once where that ran "
                 "the setting (bench/slow_links.py --corpus once: DiLoCo, TopK); DiLoCo: one replica per node; _wN: N "
                 "averaged steps first (diloco.warmup_steps)")
    if len(fitting) > top:
        lines.append(f"  ... {len(fitting) - top} more fitting candidates in plan.json")
    refused = {}
    for p in preds:
        if not p.fits:
            refused.setdefault(p.candidate.name, p.reason)
    for name, reason in list(refused.items())[:8]:
        lines.append(f"  does not fit / cannot run: {name}: {reason}")
    return "\n".join(lines)
