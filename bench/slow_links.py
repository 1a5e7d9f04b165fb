#!/usr/bin/env python3
"""Time to a target loss across a slow link: DiLoCo and gradient compression against synchronous training.

Two network namespaces joined by a veth pair (bench/compression.py's SlowLink), one rank in each (two "nodes"),
the ~3M-parameter Llama of bench/compression.py on data/tiny, ZeRO-0, fp32. Each run is one train.py job with the
link either shaped with tc (--rate, netem delay where the kernel has sch_netem) or unshaped:

- the reference: the fully synchronous fp32 all-reduce on the unshaped link, --steps steps. Its eval loss at
  --target-step is the target;
- DiLoCo (two replicas of one rank, H = 50, int8 pseudo-gradients, outer lr 1 and no momentum: the setting
  bench/compression.py found for runs of hundreds of steps) on the shaped link, --steps steps;
- PowerSGD rank 4 and the synchronous fp32 all-reduce on the shaped link, for contrast: the same --steps schedule,
  stopped at the reference's target step (PowerSGD half as many steps again: its loss lags a little).

Reported per run: bytes each rank sends per step (counted at the collectives, mean over the steps), eval loss at
the target step and at the last step and its gap to the reference's at the same step, and the wall-clock time
from the start of step 1 to the target loss (the first eval at or below it, interpolated linearly in time between
that eval and the one before). Every run evaluates at the same steps (DiLoCo evaluates at its syncs), so the
evaluations cost every run the same. Plot: eval loss against wall time (docs/slow_links.png).

--corpus once trains on a corpus seen once instead of data/tiny (which 1,000 steps of 16 sequences repeat about 7
times): ONCE_STORIES stories from data/tiny's own generator (scripts/make_tiny_assets.py) with another seed, written
to the work folder, evaluated on data/tiny/val.jsonl; its results, section and plot are separate (*_once).

--side-by-side STOP times the time target on one machine in one sitting, beside the saved results: the reference
on the unshaped link to --target-step, --diloco on the shaped link for STOP steps, and the synchronous run on the
shaped link for --contrast-steps steps (its time to the target projected from its median step).

--loss-seeds 1,2 adds the reference and DiLoCo with other data orders (train.seed), for their eval loss only (the
time is not measured there: those runs may share the machine); with --seeds-only, to the saved results. --add
diloco200 runs DiLoCo with H = 200 (evaluated at its syncs, every 200 steps) on the shaped link and adds it; --add
also takes bench/compression.py's short names (diloco50int8, diloco10, topk01, ...).

    python bench/slow_links.py [--corpus tiny|once] [--steps 1000] [--target-step 300] [--rate 100mbit] [--delay 10ms]
                               [--loss-seeds 1,2 [--seeds-only]] [--add diloco200] [--write]
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

from common import make_llama, write_section
from compression import METHODS, SHORT, make_model, train_args, two_nodes

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "docs" / "slow_links_bench.json"
PLOT = ROOT / "docs" / "slow_links.png"
EVERY = 50  # eval.every: DiLoCo's H, so every run evaluates at the same steps
REFERENCE = "fp32 all-reduce"
DILOCO = "DiLoCo H=50 int8, outer lr 1, no momentum"
POWERSGD = "PowerSGD rank 4"
DILOCO200 = "DiLoCo H=200 int8, outer lr 1, no momentum"
OWN = {DILOCO200: ["--diloco.every=200", "--diloco.replicas=2", "--diloco.dtype=int8", "--diloco.outer_lr=1",
                   "--diloco.outer_momentum=0"]}  # evaluates every 200 steps (at its syncs)
CONTRAST = {**SHORT, "powersgd": POWERSGD, "fp32": REFERENCE, "diloco200": DILOCO200}  # --add also takes
# bench/compression.py's short names (diloco50int8: the paper's outer Nesterov step, topk01, ...)

WARMUP = 20  # compression.warmup_steps: gradient compression's uncompressed first steps
ONCE_STORIES = 60_000  # ~2.8M tokens: 1,000 steps of 16 x 128 tokens read 0.74 of it


# --model: bench/compression.py's ~3M Llama, or one of ~30M (the second size) of the same family
MODELS = {"3m": None, "30m": {"hidden_size": 512, "intermediate_size": 1536, "num_hidden_layers": 10,
                              "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 64}}


def outputs(corpus: str, model: str = "3m", steps: int = 1000) -> tuple[Path, Path, str, str]:
    """A corpus's (and model's, and horizon's) saved results, plot, and docs/benchmarks.md section (its marker and
    its title). A horizon other than 1,000 steps keeps its own files: a 300-step look is not overwritten by the
    1,000-step measurement."""
    if corpus == "tiny" and model == "3m" and steps == 1000:
        return RESULTS, PLOT, "bench/slow_links.py", "Training across a slow link"
    key = corpus + (f"_{model}" if model != "3m" else "") + (f"_{steps}" if steps != 1000 else "")
    flags = (f" --corpus {corpus}" if corpus != "tiny" else "") + (f" --model {model}" if model != "3m" else "") + \
        (f" --steps {steps}" if steps != 1000 else "")
    title = "Training across a slow link" + (", a corpus seen once" if corpus == "once" else "") + \
        (f", a ~{model.upper()} model" if model != "3m" else "") + (f", {steps} steps" if steps != 1000 else "")
    return (RESULTS.with_name(f"slow_links_{key}_bench.json"), PLOT.with_name(f"slow_links_{key}.png"),
            f"bench/slow_links.py{flags}", title)


def make_corpus(folder: Path) -> Path:
    """data/tiny's distribution, never repeated in a run: its generator's stories with another seed."""
    spec = importlib.util.spec_from_file_location("make_tiny_assets", ROOT / "scripts" / "make_tiny_assets.py")
    assets = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(assets)
    rng = random.Random(2026)
    assets._write_jsonl(folder / "train.jsonl", [{"text": assets._story(rng)} for _ in range(ONCE_STORIES)])
    shutil.copy(ROOT / "data/tiny/val.jsonl", folder / "val.jsonl")
    return folder


def run_on_link(name: str, shaped: bool, stop: int, seed: int, model: Path, work: Path, args) -> dict:
    """One train.py job of --steps steps (the learning-rate schedule's length) stopped after `stop`, a rank in each
    namespace; its evaluations with their wall time, losses, bytes and step time."""
    out = work / f"run-{len(list(work.glob('run-*')))}"
    every = 200 if name == DILOCO200 else EVERY
    cmd = train_args(model, out, args.steps, WARMUP, (OWN.get(name) or METHODS[name]) + [f"--train.seed={seed}",
                                                                                     f"--eval.every={every}"] +
                     ([f"--train.exit_at_step={stop}"] if stop < args.steps else []) +
                     ([f"--data.path={args.data}"] if args.data else []))
    shaping, _ = two_nodes(cmd, args.rate if shaped else None, args.delay, work,
                           f"{name} ({'shaped' if shaped else 'unshaped'})")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps_rows = {r["step"]: r for r in rows if "loss" in r}
    start = steps_rows[1]["time"] - steps_rows[1]["step_s"]  # the start of step 1: start-up is not counted
    from dstrain.flops import cpu_name
    return {"name": name, "shaped": shaped, "seed": seed, "shaping": shaping, "cpu": cpu_name(),
            "evals": [(r["step"], r["eval_loss"], steps_rows[r["step"]]["time"] - start if r["step"] else 0.0)
                      for r in rows if "eval_loss" in r],
            "losses": [steps_rows[s]["loss"] for s in sorted(steps_rows)],
            "bytes_per_step": sum(r["comm_bytes"] for r in steps_rows.values()) / len(steps_rows),
            "step_s": sorted(r["step_s"] for r in steps_rows.values())[len(steps_rows) // 2]}


def time_to(evals: list, target: float) -> float | None:
    """Seconds until the eval loss first reaches target, linear in time between that eval and the one before."""
    before = (0.0, None)
    for _step, loss, seconds in evals:
        if loss <= target:
            if before[1] is None:
                return seconds
            return before[0] + (before[1] - target) / (before[1] - loss) * (seconds - before[0])
        before = (seconds, loss)
    return None


def loss_at(run: dict, step: int) -> float | None:
    return next((loss for s, loss, _ in run["evals"] if s == step), None)


def plot(runs: list[dict], targets: tuple, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for r in runs:
        steps, losses, seconds = zip(*r["evals"])
        ax.plot(seconds, losses, marker="o", markersize=3, label=label(r))
    for target, style in zip(targets, (":", "--")):
        ax.axhline(target, color="grey", linestyle=style, linewidth=1)
    low = min(loss for r in runs for _, loss, _ in r["evals"])
    ax.set(xlabel="wall-clock seconds from step 1", ylabel="eval loss", ylim=(min(0.8, low - 0.05), 1.6),
           title="eval loss against time, 2 nodes (grey: the reference's losses at the two target steps)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def label(r: dict) -> str:
    return f"{r['name']}, {'shaped' if r['shaped'] else 'unshaped'} link"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1000, help="the reference's and DiLoCo's steps (the horizon)")
    parser.add_argument("--target-step", type=int, default=300, help="the reference's eval loss here is the target")
    parser.add_argument("--rate", default="100mbit")
    parser.add_argument("--delay", default="10ms", help="each way (netem only; 20 ms round trip by default)")
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--corpus", choices=("tiny", "once"), default="tiny",
                        help="data/tiny (repeated ~7 times in 1,000 steps) or a corpus of its kind seen once")
    parser.add_argument("--model", choices=tuple(MODELS), default="3m",
                        help="bench/compression.py's ~3M Llama or a ~30M one (hidden 512, 10 layers)")
    parser.add_argument("--diloco", default="",
                        help="the timed DiLoCo run's setting (a short name, as --add), the one the orders table shows "
                             "(diloco50int8avg for a new measurement; adding to saved results: theirs)")
    parser.add_argument("--loss-seeds", default="", help="more data orders, eval loss only (comma-separated)")
    parser.add_argument("--contrast", default="powersgd,fp32",
                        help="shaped-link contrast runs: powersgd, fp32, diloco200, none")
    parser.add_argument("--add", default="", help="run only these on the shaped link (comma-separated: as --contrast, "
                                                  "or bench/compression.py's short names) and add them to the saved "
                                                  "results")
    parser.add_argument("--write", action="store_true", help="update docs/benchmarks.md, the JSON and the PNG")
    parser.add_argument("--report", action="store_true", help="only print (and with --write, write) the saved results")
    parser.add_argument("--methods", default="", help="with --loss-seeds: run these instead of the reference and "
                                                      "DiLoCo H=50 (short names, as --add; a seed's reference is run "
                                                      "when missing)")
    parser.add_argument("--seeds-only", action="store_true",
                        help="run only --loss-seeds, adding them to the saved results (the timed runs are kept)")
    parser.add_argument("--side-by-side", type=int, default=0, metavar="STOP",
                        help="time the reference (unshaped, to --target-step), --diloco (shaped, stopped after STOP "
                             "steps) and the synchronous run on the shaped link (--contrast-steps) one after the "
                             "other on this machine, kept beside the saved results (which stay)")
    parser.add_argument("--contrast-steps", type=int, default=30,
                        help="with --side-by-side: the shaped synchronous run's steps (its time to the target is "
                             "projected from its median step)")
    args = parser.parse_args()
    if args.target_step % EVERY or args.steps % EVERY or args.target_step > args.steps:
        parser.error(f"--steps and --target-step must be multiples of {EVERY}, the target step at most --steps")
    results, plot_path, *section = outputs(args.corpus, args.model, args.steps)
    saved = results if args.write else Path(tempfile.gettempdir()) / f"dstrain-{results.stem}.json"
    state = json.loads(saved.read_text()) if saved.exists() else {}
    if args.report:
        a = state["args"]
        if args.write:
            plot(state["runs"], (loss_at(state["runs"][0], a["target_step"]), loss_at(state["runs"][0], a["steps"])),
                 plot_path)
        return _print(report(state), args.write, *section)
    adding = args.seeds_only or bool(args.add) or bool(args.side_by_side)
    unknown = [c for c in (args.add + "," + args.methods + "," + args.diloco).split(",") if c and c not in CONTRAST]
    if unknown:
        parser.error(f"--add/--methods {','.join(unknown)}: not one of {', '.join(CONTRAST)}")
    if adding and state.get("args", {}).get("steps") != args.steps:
        parser.error(f"--seeds-only and --add add to saved results of {args.steps} steps; {saved} has none")
    work = Path(tempfile.mkdtemp(prefix="dstrain-slow-links-"))
    try:
        state["params"] = make_llama(work / "model", **MODELS[args.model]) if MODELS[args.model] else \
            make_model(work / "model")
        args.data = make_corpus(work / "corpus") if args.corpus == "once" else None
        if not adding:
            state["args"] = {"steps": args.steps, "target_step": args.target_step, "rate": args.rate,
                             "delay": args.delay, "seed": args.seed, "corpus": args.corpus, "model": args.model,
                             "diloco": CONTRAST[args.diloco or "diloco50int8avg"]}
        diloco = state["args"].get("diloco", DILOCO)
        if args.side_by_side:
            state["side_by_side"] = side_by_side(args, CONTRAST[args.diloco] if args.diloco else diloco, work,
                                                 saved, state)
            _print(report(state), args.write, *section)
            return
        added = [c for c in args.add.split(",") if c]
        if added:
            plan = [(CONTRAST[c], True, args.target_step if c == "fp32" else args.steps) for c in added]
        elif args.seeds_only:
            plan = []
        else:
            plan = [(REFERENCE, False, args.steps), (diloco, True, args.steps)]
            contrast = [c for c in args.contrast.split(",") if c and c != "none"]
            if "powersgd" in contrast:
                plan.append((POWERSGD, True, min(args.steps, args.target_step * 3 // 2 // EVERY * EVERY)))
            if "fp32" in contrast:
                plan.append((REFERENCE, True, args.target_step))
            if "diloco200" in contrast:
                plan.append((DILOCO200, True, args.steps))
        # adding: the saved runs stay, but for those run again
        runs = [r for r in state["runs"] if not (r["shaped"] and any(r["name"] == n for n, _, _ in plan))] \
            if adding else []
        for name, shaped, steps in plan:
            began = time.time()
            runs.append(run_on_link(name, shaped, steps, args.seed, work / "model", work, args))
            state.get("loss_seeds", {}).get(str(args.seed), {}).pop(name, None)  # this run is the order's figure
            print(f"  {label(runs[-1])}: {time.time() - began:.0f} s, {runs[-1]['step_s']:.3f} s/step, "
                  f"eval loss {runs[-1]['evals'][-1][1]:.4f}", file=sys.stderr)
            state["runs"] = runs
            saved.write_text(json.dumps(state, indent=1))  # a failure later keeps what ran
        seeds = state.setdefault("loss_seeds", {})
        methods = [CONTRAST[m] for m in args.methods.split(",") if m]
        for seed in [int(s) for s in args.loss_seeds.split(",") if s]:
            have = set(seeds.get(str(seed), {})) | ({REFERENCE} if seed == state["args"]["seed"] else set())
            # the reference once: when missing, and again only where --methods names it (fp32: a rerun here)
            wanted = [REFERENCE] * (REFERENCE not in have) + methods if methods else [REFERENCE, diloco]
            for name in dict.fromkeys(wanted):
                r = run_on_link(name, False, args.steps, seed, work / "model", work, args)
                seeds.setdefault(str(seed), {})[name] = {str(s): loss for s, loss, _ in r["evals"]}
                print(f"  seed {seed}, {name}: eval loss {r['evals'][-1][1]:.4f}", file=sys.stderr)
                saved.write_text(json.dumps(state, indent=1))
        plot(runs, (loss_at(runs[0], args.target_step), loss_at(runs[0], args.steps)),
             plot_path if args.write else work / plot_path.name)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    _print(report(state), args.write, *section)


def side_by_side(args, diloco: str, work: Path, saved: Path, state: dict) -> dict:
    """The time target measured on one machine in one sitting: the reference on the unshaped link to the target
    step (its own eval loss there is the target), `diloco` on the shaped link stopped after --side-by-side steps,
    and the synchronous run on the shaped link for --contrast-steps steps (its arithmetic is the reference's, so
    its time to the target is its median step times the target step: projected). One after the other, never two
    at once; saved after each run."""
    import subprocess
    from datetime import datetime, timezone

    from dstrain.flops import cpu_name
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    result = {"cpu": cpu_name(), "date": datetime.now(timezone.utc).strftime("%Y-%m-%d"),
              "commit": commit.stdout.strip(), "seed": args.seed, "runs": []}
    for name, shaped, stop in ((REFERENCE, False, args.target_step), (diloco, True, args.side_by_side),
                               (REFERENCE, True, args.contrast_steps)):
        began = time.time()
        result["runs"].append(run_on_link(name, shaped, stop, args.seed, work / "model", work, args))
        result["runs"][-1]["stopped"] = stop
        print(f"  side by side: {label(result['runs'][-1])}: {time.time() - began:.0f} s", file=sys.stderr)
        state["side_by_side"] = result
        saved.write_text(json.dumps(state, indent=1))
    return result


def side_by_side_report(sbs: dict, target_step: int) -> str:
    """--side-by-side's table: each run's time to the reference's step-`target_step` loss, against the
    reference's, all timed on one machine in one sitting."""
    ref, runs = sbs["runs"][0], sbs["runs"]
    target = loss_at(ref, target_step)
    base = time_to(ref["evals"], target)
    text = (f"\nTimed side by side ({sbs['date']}, {sbs['commit']}, {sbs['cpu']}, data order {sbs['seed']}): the "
            f"runs one after the other on one machine. The target: this reference's eval loss "
            f"at step {target_step} ({target:.4f}).\n\n"
            "| method | link | steps run | bytes/step | s/step (median) | time to the target | against the reference |\n"
            "|---|---|---|---|---|---|---|\n")
    for r in runs:
        seconds, how = time_to(r["evals"], target), "measured"
        if r is not ref and r["name"] == ref["name"]:  # the reference's arithmetic on a slower link
            seconds, how = target_step * r["step_s"], f"projected: {target_step} x its median step"
        cell = (f"{seconds:.0f} s ({how})" if seconds is not None else f"not reached by step {r['stopped']}")
        ratio = f"**{seconds / base:.2f}x**" if seconds is not None else f"> {r['stopped'] * r['step_s'] / base:.2f}x"
        text += (f"| {r['name']} | {'shaped' if r['shaped'] else 'unshaped'} | {r['stopped']} | "
                 f"{r['bytes_per_step'] / 1e6:.3f} MB | {r['step_s']:.3f} | {cell} | {ratio} |\n")
    return text


def _print(text: str, write: bool, marker: str, title: str) -> None:
    print(text)
    if write:
        write_section(marker, title, text)


def report(state: dict) -> str:
    a = argparse.Namespace(**state["args"])
    figure = outputs(state["args"].get("corpus", "tiny"), state["args"].get("model", "3m"), state["args"]["steps"])[1]
    timed = state["args"].get("diloco", DILOCO)  # the timed DiLoCo setting, the orders table's
    runs = state["runs"]
    ref = runs[0]
    horizons = sorted({a.target_step, a.steps})  # one target where the run is only as long as the first
    targets = tuple(loss_at(ref, step) for step in horizons)
    shaping = next((r["shaping"] for r in runs if r["shaped"]), "")
    corpus = ("data/tiny" if state["args"].get("corpus", "tiny") == "tiny" else
              f"a corpus seen once ({ONCE_STORIES:,} stories from data/tiny's generator with another seed, "
              f"{0.74 * a.steps / 1000:.2f} of it read in {a.steps:,} steps; evaluated on data/tiny/val.jsonl)")
    shape = ("bench/compression.py's" if state["args"].get("model", "3m") == "3m" else
             ", ".join(f"{k.removesuffix('_size').replace('num_', '').replace('_', ' ')} {v}"
                       for k, v in MODELS[state["args"]["model"]].items()))
    text = (f"{state['params'] / 1e6:.2f}M-parameter Llama ({shape}), {corpus}, ZeRO-0, fp32, "
            f"micro batch 8 x 128 tokens, {a.steps} steps of the cosine schedule (a run stopped sooner is marked), "
            f"one CPU rank in each of two network namespaces joined by a veth pair (two \"nodes\"); shaped: "
            f"{shaping}; unshaped: the veth's own speed. {platform.machine()}, {os.cpu_count()} cores. Data order seed "
            f"{a.seed}. The reference is the synchronous fp32 run on the unshaped link; "
            + ("two targets: its eval loss " if len(horizons) > 1 else "the target: its eval loss ")
            + " and ".join(f"at step {step} ({t:.4f})" for step, t in zip(horizons, targets)) + ". Time to a "
            f"target: from the start of step 1 to the first evaluation at or below it (every {EVERY} steps), "
            f"interpolated in time from the one before; in brackets, against the reference's own time to it. "
            f"Bytes: what each rank sends, counted at the collectives, mean over all steps.\n\n"
            "| method | link | bytes/step | less than fp32 | s/step (median) | "
            + "".join(f"eval loss at {step} | " for step in horizons)
            + "".join(f"time to the step-{step} loss | " for step in horizons).rstrip()
            + "\n" + "|---" * (5 + 2 * len(horizons)) + "|\n")
    for r in runs:
        last = r["evals"][-1][0]
        cells = []
        for target in targets:
            seconds, base = time_to(r["evals"], target), time_to(ref["evals"], target)
            cells.append(f"{seconds:.0f} s ({seconds / base:.2f}x)" if seconds is not None else
                         f"not reached by step {last}" + (" (stopped)" if last < a.steps else ""))
        text += (f"| {r['name']} | {'shaped' if r['shaped'] else 'unshaped'} | {r['bytes_per_step'] / 1e6:.3f} MB | "
                 f"{ref['bytes_per_step'] / r['bytes_per_step']:.1f}x | {r['step_s']:.3f} | "
                 + "".join(f"{_gap(loss_at(r, step), t)} | " for step, t in zip(horizons, targets))
                 + " | ".join(cells) + " |\n")
    cpus = {r.get("cpu", "not recorded") for r in runs}
    if len(cpus) > 1:  # a later --add ran on another machine: its times are not side by side with the reference's
        text += ("\nTimed on different machines, so the time ratios are not side by side: "
                 + "; ".join(f"{r['name']} ({'shaped' if r['shaped'] else 'unshaped'}) on "
                             f"{r.get('cpu', 'a CPU not recorded')}" for r in runs) + ".\n")
    same = [r for r in runs[1:] if r["name"] == ref["name"]]
    for r in same:  # the link changes the time, not the arithmetic
        n = len(r["losses"])
        worst = max(abs(a / b - 1) for a, b in zip(r["losses"], ref["losses"][:n]))
        text += (f"\nThe synchronous run on the shaped link against the reference, its {n} steps: losses "
                 f"{'identical' if worst == 0 else f'within {worst:.1e} (relative)'}.\n")
    text += f"\nEval loss against wall time: [{figure.name}]({figure.name})\n"
    if state.get("side_by_side"):
        text += side_by_side_report(state["side_by_side"], a.target_step)
    seeds = state.get("loss_seeds", {})
    if seeds:
        diloco = next((r for r in runs if r["name"] == timed), None)
        # the timed order: every run above that went the whole way (the reference unshaped) beside --methods' runs
        # of it (a setting run by --add is dropped from those: one figure per order and setting)
        full = {r["name"]: {str(s): loss for s, loss, _ in r["evals"]} for r in runs
                if r["evals"][-1][0] == a.steps and (r is ref or r["name"] != REFERENCE)}
        orders = {str(a.seed): {timed: {}, **full}}
        for seed, by_name in seeds.items():  # --methods' runs of the timed order join its reference
            orders[seed] = {**orders.get(seed, {}), **by_name}
        others = list(dict.fromkeys(n for by_name in seeds.values() for n in by_name if n not in (REFERENCE, timed)))
        orders_all = orders
        orders = {seed: by_name for seed, by_name in orders.items() if timed in by_name}
        text += (f"\nEvery data order (train.seed; {a.seed} is the timed runs above, the others ran on the unshaped "
                 f"link for their eval loss only). Time to the synchronous run's step-{a.target_step} loss for the "
                 f"other orders is projected: the step at which each run reaches it (interpolated between "
                 f"evaluations) times the median step of the timed runs (DiLoCo on the shaped link "
                 f"{diloco['step_s'] if diloco else float('nan'):.3f} s, the reference {ref['step_s']:.3f} s).\n\n"
                 f"| seed | synchronous fp32 at {a.target_step} | DiLoCo at {a.target_step} | gap | "
                 f"at {a.steps} | DiLoCo at {a.steps} | gap | DiLoCo's time to the step-{a.target_step} loss |\n"
                 "|---|---|---|---|---|---|---|---|\n")
        gaps: dict[int, list[float]] = {}
        ratios = []
        for seed, by_name in sorted(orders.items(), key=lambda kv: int(kv[0])):
            cells = []
            for step in (a.target_step, a.steps):
                ref_loss, loss = by_name[REFERENCE].get(str(step)), by_name[timed].get(str(step))
                gaps.setdefault(step, []).append(loss / ref_loss - 1)
                cells.append(f"{ref_loss:.4f} | {loss:.4f} | {loss / ref_loss - 1:+.2%}")
            if seed == str(a.seed) and diloco:
                ratio = time_to(diloco["evals"], targets[0]) / time_to(ref["evals"], targets[0])
                when = f"{ratio:.2f}x (measured)"
            else:
                target = by_name[REFERENCE][str(a.target_step)]
                took = time_to([(int(k), v, int(k)) for k, v in  # in steps: the step stands in for the time
                                sorted(by_name[timed].items(), key=lambda kv: int(kv[0]))], target)
                ratio = took * diloco["step_s"] / (a.target_step * ref["step_s"]) if took and diloco else None
                when = f"{ratio:.2f}x (step {took:.0f}, projected)" if ratio else "not reached"
            ratios.append(ratio)
            text += f"| {seed} | {cells[0]} | {cells[1]} | {when} |\n"
        mean = {step: sum(v) / len(v) for step, v in gaps.items()}
        text += (f"| mean of {len(orders)} | | | **{mean[a.target_step]:+.2%}** | | | **{mean[a.steps]:+.2%}** | "
                 f"{sum(r <= 1.3 for r in ratios if r)} of {len(ratios)} within 1.3x |\n")
        if others:
            text += ("\nOther settings over the same orders (`--methods`, eval loss only, on the unshaped link): the gap "
                     "to each order's synchronous run, and the bytes each sends less than fp32 (from its settings).\n\n"
                     "| method | less than fp32 | " + " | ".join(f"seed {seed}: at {a.target_step}, at {a.steps}"
                                                           for seed in sorted(orders_all, key=int)) +
                     f" | mean at {a.target_step} | mean at {a.steps} |\n|---|---|" + "---|" * (len(orders_all) + 2)
                     + "\n")
            for name in [timed] + others:
                row, per = [], {a.target_step: [], a.steps: []}
                for seed in sorted(orders_all, key=int):
                    by_name = orders_all[seed]
                    if name not in by_name:
                        row.append("")
                        continue
                    cell = []
                    for step in (a.target_step, a.steps):
                        gap = by_name[name][str(step)] / by_name[REFERENCE][str(step)] - 1
                        per[step].append(gap)
                        cell.append(f"{gap:+.1%}")
                    row.append(", ".join(cell))
                text += (f"| {name} | {_fewer_cell(name, a)} | " + " | ".join(row) + " | " +
                         " | ".join(_mean_cell(v) for v in per.values()) + " |\n")
            text += ("\nA mean's ± is its standard error over the orders (the orders' spread / sqrt(n)): a gap is "
                     "within the issue's 2% where the mean plus twice that is.\n")
    return text


def _mean_cell(gaps: list[float]) -> str:
    """The mean gap over the orders, its standard error (sample deviation / sqrt(n)) and n."""
    if not gaps:
        return ""
    n, mean = len(gaps), sum(gaps) / len(gaps)
    if n < 2:
        return f"**{mean:+.2%}** (1)"
    error = (sum((g - mean) ** 2 for g in gaps) / (n - 1) / n) ** 0.5
    return f"**{mean:+.2%}** ± {error:.1%} ({n})"


def fewer_bytes(name: str, steps: int, ends: bool = True) -> float:
    """How many times fewer bytes than fp32 a DiLoCo setting sends over its first `steps` steps, from its H, its
    averaged first steps (diloco.warmup_steps) and its wire type; ends: the run ends at `steps` (a last sync).
    Gradient compression (TopK, ...): its bytes a step as bench/compression.py counted them on the same 3M model,
    uncompressed for its first WARMUP steps."""
    from dstrain.components.diloco import WIRE_BYTES, warmup_wire
    flags = dict(f.removeprefix("--").split("=", 1) for f in (OWN.get(name) or METHODS[name]))
    if "diloco.every" not in flags:
        counted = json.loads((ROOT / "docs" / "compression_bench.json").read_text())["part1"]
        plain, ours = counted[REFERENCE]["bytes"], counted[name]
        return steps * plain / (min(WARMUP, steps) * ours["warmup_bytes"] + max(steps - WARMUP, 0) * ours["bytes"])
    every, first = int(flags["diloco.every"]), int(flags.get("diloco.warmup_steps", 0))
    dtype = flags.get("diloco.dtype", "fp32")
    sent = sum(WIRE_BYTES[warmup_wire(dtype)] if s <= first else WIRE_BYTES[dtype]
               for s in range(1, steps + 1) if s <= first or s % every == 0 or (ends and s == steps))
    return steps * 4 / sent


def _fewer_cell(name: str, a) -> str:
    """The bytes column: over the run, and over the first target_step steps where that differs."""
    whole, early = fewer_bytes(name, a.steps), fewer_bytes(name, a.target_step, ends=False)
    return f"{whole:.0f}x" + (f" ({early:.0f}x to step {a.target_step})" if abs(early - whole) / whole > 0.05 else "")


def _gap(loss: float | None, ref: float | None) -> str:
    if loss is None:
        return ""
    return f"{loss:.4f}" + (f" ({loss / ref - 1:+.2%})" if ref is not None else "")


if __name__ == "__main__":
    main()
