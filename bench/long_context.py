#!/usr/bin/env python3
"""Long context on CPU ranks: how much longer a sequence fits per rank with Ulysses sequence parallelism and with
ring attention (context parallelism), and what packing saves on SFT data, side by side.

Part 1, memory: recipes/tiny/long_context.yaml (the tiny Llama, ZeRO-3, activation checkpointing, the MLP in
512-token slices, micro batch 1) for a few steps at each sequence length under each layout: zero3.json (2 data-
parallel ranks, each holding whole sequences), sp2_zero3.json (Ulysses: each of 2 ranks half of every sequence),
cp2_zero3.json (a ring of 2: each rank 2 of 4 zigzag chunks) and a ring of 4 (4 ranks, each 2 of 8 chunks; 4
processes on this machine's cores, so its step time is not comparable). Peak: rank 0's RSS above its pre-model
baseline (run_dir/memory.json; every rank holds the same). The longest length within a budget is interpolated
between measured lengths (peaks grow monotonically); the preflight's own prediction for the same budget is beside
it.

Part 2, packing: recipes/tiny/sft.yaml (ZeRO-2, 2 ranks) with data.packing false and true, alternating
--repeats times: the padding fraction of the tokenized rows, tokens/s counting real tokens only (medians over
steps after the first), and the losses.

    python bench/long_context.py [--lengths 2048 4096 8192 16384] [--budget_mib 400] [--repeats 2] [--write]
                                 [--layouts zero3.json sp2_zero3.json cp2_zero3.json cp4]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from common import free_port, write_section

ROOT = Path(__file__).resolve().parent.parent
QUIET = ["--log.wandb=false", "--log.progress_bar=false", "--log.plot=false", "--checkpoint.export_hf=false",
         "--checkpoint.every=0", "--eval.every=0", "--eval.max_batches=1"]


# label -> (DeepSpeed JSON, ranks); cp4 is written into the work directory (cp2_zero3.json with a ring of 4)
LAYOUTS = {"zero3.json": ("zero3.json", 2), "sp2_zero3.json": ("sp2_zero3.json", 2),
           "cp2_zero3.json": ("cp2_zero3.json", 2), "cp4": ("cp4_zero3.json", 4)}
TITLES = {"zero3.json": "sp=1", "sp2_zero3.json": "Ulysses 2", "cp2_zero3.json": "ring 2", "cp4": "ring 4"}


def layout_config(label: str, work: Path) -> tuple[str, int]:
    name, ranks = LAYOUTS[label]
    if label == "cp4":
        cfg = json.loads((ROOT / "ds_configs" / "cp2_zero3.json").read_text())
        path = work / name
        path.write_text(json.dumps(dict(cfg, context_parallel_size=4)))
        return str(path), ranks
    return name, ranks


def launch(args: list[str], out: Path, work: Path, ranks: int = 2) -> Path:
    cmd = [str(Path(sys.executable).parent / "deepspeed"), "--num_gpus", str(ranks), "--master_port", str(free_port()),
           "train.py", "--output_dir", str(out), *QUIET, *args]
    # a fixed mmap threshold returns freed large tensors to the OS, so RSS peaks are live memory (bench/memory.py)
    env = dict(os.environ, OMP_NUM_THREADS="1", DSTRAIN_CACHE=str(work / "cache"), MALLOC_MMAP_THRESHOLD_="131072")
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"{' '.join(args)} failed:\n{proc.stderr[-3000:]}")
    shutil.rmtree(out / "checkpoints", ignore_errors=True)
    return out


def steps_of(out: Path) -> list[dict]:
    return [r for r in (json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()) if "loss" in r]


def memory_run(label: str, length: int, work: Path, steps: int) -> dict:
    ds, ranks = layout_config(label, work)
    out = launch(["--recipe", "tiny/long_context.yaml", "--ds_config", ds, f"--train.seq_len={length}",
                  f"--train.max_steps={steps}", "--train.warmup_steps=1", "--train.grad_accum_steps=1",
                  f"--world_size={ranks}"], work / f"{label}-{length}", work, ranks)
    memory = json.loads((out / "memory.json").read_text())
    rows = steps_of(out)
    return {"peak_mib": memory["peak_above_baseline_bytes"] / 2**20,
            "estimate_mib": memory["estimated_device_bytes"] / 2**20,
            "step_s": statistics.median(r["step_s"] for r in rows[1:]), "loss": rows[-1]["loss"]}


def longest_within(points: list[tuple[int, float]], budget: float) -> str:
    """The longest length whose peak stays within budget, linear between measured points (">" past the last)."""
    fitting = [(n, p) for n, p in points if p <= budget]
    if not fitting:
        return f"< {points[0][0]:,}"
    n0, p0 = fitting[-1]
    later = [(n, p) for n, p in points if n > n0]
    if not later:
        return f"> {n0:,}"
    n1, p1 = later[0]
    return f"{int(n0 + (n1 - n0) * (budget - p0) / (p1 - p0)):,}"


def predicted_longest(label: str, budget_bytes: int, work: Path) -> int:
    """What the preflight says for the same run and budget (memory.longest_seq_len)."""
    from dstrain.config import load_recipe, parse_overrides
    from dstrain.model import hidden_size, load_config
    from dstrain.parallel import ds_config
    from dstrain.parallel.layout import Layout
    from dstrain.planner import memory

    ds, ranks = layout_config(label, work)
    recipe = load_recipe("tiny/long_context.yaml", parse_overrides(["--train.grad_accum_steps=1"]))
    config = load_config(recipe.model, recipe.train.seq_len)[1]
    cfg = ds_config.resolve(ds_config.load(ds), recipe, ranks, ds_config.DeviceCaps.detect(), hidden_size(config))
    return memory.longest_seq_len(config, memory.count_parameters(config), recipe, cfg,
                                  Layout.from_ds_config(cfg, ranks), None, 0, budget_bytes)


def packing_run(packing: bool, work: Path, steps: int, tag: str) -> dict:
    out = launch(["--recipe", "tiny/sft.yaml", f"--data.packing={str(packing).lower()}", f"--train.max_steps={steps}"],
                 work / f"packing-{packing}-{tag}", work)
    info = json.loads((out / "run_info.json").read_text())
    padding = re.search(r"([0-9.]+)% padding", info["data"])
    rows = steps_of(out)
    return {"padding": float(padding.group(1)) / 100 if padding else None, "rows": info["train_sequences"],
            "tokens_per_s": statistics.median(r["tokens_per_s"] for r in rows[1:]),
            "step_s": statistics.median(r["step_s"] for r in rows[1:]), "loss": rows[-1]["loss"],
            "label_tokens": statistics.median(r["label_tokens"] for r in rows)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096, 8192, 16384])
    parser.add_argument("--budget_mib", type=float, default=400.0, help="per-rank budget above the baseline")
    parser.add_argument("--memory_steps", type=int, default=3)
    parser.add_argument("--packing_steps", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--skip", choices=["memory", "packing"], help="run one part only")
    parser.add_argument("--layouts", nargs="+", choices=list(LAYOUTS), default=list(LAYOUTS))
    parser.add_argument("--write", action="store_true", help="update docs/benchmarks.md")
    parser.add_argument("--results", type=Path, help="also write every run's figures to this JSON file")
    parser.add_argument("--load", type=Path, help="report the runs of an earlier --results file (e.g. another budget)")
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="dstrain-bench-long-"))
    results: dict = {"memory": {}, "packing": {"false": [], "true": []}}
    if args.load:
        results = json.loads(args.load.read_text())
        results["memory"] = {ds: {int(n): r for n, r in runs.items()} for ds, runs in results["memory"].items()}
        args.lengths = sorted(next(iter(results["memory"].values()), {}))
        args.skip = "both"
    try:
        if args.skip not in ("memory", "both"):
            for length in args.lengths:
                for label in args.layouts:
                    r = memory_run(label, length, work, args.memory_steps)
                    results["memory"].setdefault(label, {})[length] = r
                    print(f"  {label} seq {length}: peak {r['peak_mib']:,.0f} MiB (estimate "
                          f"{r['estimate_mib']:,.0f}), step {r['step_s']:.2f} s", flush=True)
        if args.skip not in ("packing", "both"):
            for repeat in range(args.repeats):  # alternating: drift hits both settings alike
                for packing in (False, True):
                    r = packing_run(packing, work, args.packing_steps, str(repeat))
                    results["packing"][str(packing).lower()].append(r)
                    print(f"  packing={packing}: {r['rows']} rows, padding {r['padding']:.1%}, "
                          f"{r['tokens_per_s']:,.0f} tok/s, loss {r['loss']:.4f}", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    where = f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, 2 CPU ranks (gloo), fp32"
    body = ""
    if results["memory"]:
        budget = args.budget_mib
        mem = results["memory"]
        labels = [label for label in LAYOUTS if label in mem]
        body += (f"### Longest sequence per rank budget: whole sequences, Ulysses and ring attention\n\n"
                 f"recipes/tiny/long_context.yaml (0.8M-parameter Llama, ZeRO-3 over the ranks, activation "
                 f"checkpointing, train.mlp_chunk_tokens=512, micro batch 1), {args.memory_steps} steps per length, "
                 f"{where.replace('2 CPU ranks', 'CPU ranks')}: 2 ranks, the ring of 4 on 4. Peak: rank 0's RSS "
                 f"above its pre-model baseline; estimate: the preflight's per-rank figure for the same run "
                 f"(peak / estimate in brackets).\n\n"
                 "| seq_len | " + " | ".join(f"{TITLES[x]} peak MiB (/est.)" for x in labels) + " | " +
                 " | ".join(f"{TITLES[x]} step s" for x in labels) + " |\n|---|" + "---|" * (2 * len(labels)) + "\n")
        for length in args.lengths:
            runs = [mem[x].get(length) for x in labels]
            body += (f"| {length:,} | " + " | ".join(
                f"{r['peak_mib']:,.0f} ({r['peak_mib'] / r['estimate_mib']:.2f})" if r else "-" for r in runs) +
                " | " + " | ".join(f"{r['step_s']:.2f}" if r else "-" for r in runs) + " |\n")
        longest = {x: longest_within([(n, mem[x][n]["peak_mib"]) for n in args.lengths if n in mem[x]], budget)
                   for x in labels}
        predicted = {x: predicted_longest(x, int(budget * 2**20), Path(tempfile.mkdtemp())) for x in labels}
        figures = []
        for x in labels:
            ratio = ""
            try:
                ratio = (f", {float(longest[x].replace(',', '')) / float(longest[labels[0]].replace(',', '')):.2f}x "
                         f"{TITLES[labels[0]]}'s" if x != labels[0] else "")
            except ValueError:  # a bound (< or >) rather than a figure
                pass
            figures.append(f"{TITLES[x]} up to seq_len {longest[x]}{ratio} (the preflight predicts {predicted[x]:,})")
        body += f"\nWithin {budget:,.0f} MiB per rank: " + "; ".join(figures) + ".\n\n"
        results["longest"], results["predicted_longest"] = longest, predicted
    if results["packing"]["true"]:
        pk = results["packing"]

        def med(key: str, packing: str) -> float:
            return statistics.median(r[key] for r in pk[packing])

        body += (f"### Packing SFT examples\n\nrecipes/tiny/sft.yaml (ZeRO-2, micro batch 8 x 64 tokens), "
                 f"{args.packing_steps} steps, medians of {args.repeats} alternating runs, {where}. tokens/s counts "
                 f"real (not padding) tokens.\n\n| data.packing | rows | padding | tokens/s | vs unpacked | "
                 f"label tokens/step | final loss |\n|---|---|---|---|---|---|---|\n")
        for packing in ("false", "true"):
            body += (f"| {packing} | {pk[packing][0]['rows']:,} | {pk[packing][0]['padding']:.1%} | "
                     f"{med('tokens_per_s', packing):,.0f} | "
                     f"{med('tokens_per_s', packing) / med('tokens_per_s', 'false'):.2f}x | "
                     f"{med('label_tokens', packing):,.0f} | {med('loss', packing):.4f} |\n")
        body += ("\nThe same examples in fewer rows: a step of 8 rows per rank carries more examples when packed, so "
                 "losses over the same number of steps are not comparable; tests/unit/test_packing.py shows the same "
                 "examples give the same losses and gradients packed or padded.\n")
    print(body)
    if args.results:
        args.results.write_text(json.dumps(results, indent=1, default=str))
    if args.write:
        write_section("bench/long_context.py", "Long context: sequence parallelism, ring attention and packing",
                      body)


if __name__ == "__main__":
    main()
