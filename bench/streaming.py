#!/usr/bin/env python3
"""Streaming DiLoCo across a slow link: the peak bytes of a sync and the time syncs hold the run up.

Two one-rank "nodes" (bench/compression.py's SlowLink: two network namespaces joined by a veth pair, shaped with tc
to --rate, netem --delay each way where the kernel has it), a Llama of bench/slow_links.py's sizes (--model, the
~30M one by default) on the corpus seen once (bench/slow_links.py's), ZeRO-0, fp32, --steps steps of DiLoCo H=25
with int4 pseudo-gradients and plain averaging (bench/slow_links.py's setting, without its averaged first steps:
they sync every step, whatever the streaming), three ways, one after another, --repeats times:

- whole: the whole model syncs every 25 steps, the run waiting for it;
- fragments: 5 fragments (diloco.fragments=5), each every 25 steps at its own step, the run waiting for each;
- overlapped: the same fragments, each landing one step after it was sent while training goes on
  (diloco.overlap=1, diloco.mix=0.5).

Per run, the last step left out (every run ends with a whole-model sync): bytes each rank sends per step (the
mean, and the largest step's: the peak the link must carry in a step), the median step, and the syncs' hold-up:
the steps' time above the median, summed over the run, per 25 steps. The run's losses are not compared here
(bench/slow_links.py measures the eval loss).

    python bench/streaming.py [--model 30m|3m] [--steps 100] [--rate 100mbit] [--delay 10ms] [--repeats 1] [--write]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from common import make_llama, write_section
from compression import make_model, train_args, two_nodes
from slow_links import MODELS, make_corpus

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "docs" / "streaming_bench.json"
EVERY = 25
BASE = [f"--diloco.every={EVERY}", "--diloco.replicas=2", "--diloco.dtype=int4", "--diloco.outer_lr=1",
        "--diloco.outer_momentum=0"]
WAYS = {"whole": BASE, "fragments": BASE + ["--diloco.fragments=5"],
        "overlapped": BASE + ["--diloco.fragments=5", "--diloco.overlap=1", "--diloco.mix=0.5"]}


def run(name: str, model: Path, data: Path, work: Path, args) -> dict:
    out = work / f"run-{len(list(work.glob('run-*')))}"
    cmd = train_args(model, out, args.steps, 0, WAYS[name] + [f"--data.path={data}", "--eval.every=0",
                                                              "--eval.max_batches=1"])
    shaping, _ = two_nodes(cmd, args.rate, args.delay, work, name)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "loss" in r and r["step"] < args.steps]  # the last step: a whole-model sync
    times = [r["step_s"] for r in steps]
    median = statistics.median(times)
    return {"name": name, "shaping": shaping, "median_s": median, "mean_s": statistics.mean(times),
            "holdup_s": sum(max(0.0, t - median) for t in times) * EVERY / len(times),
            "bytes_mean": statistics.mean(r["comm_bytes"] for r in steps),
            "bytes_peak": max(r["comm_bytes"] for r in steps), "final_loss": steps[-1]["loss"]}


def report(state: dict) -> str:
    a, runs = state["args"], state["runs"]
    by = {name: [r for r in runs if r["name"] == name] for name in WAYS}
    whole = statistics.median(r["holdup_s"] for r in by["whole"])
    text = (f"{state['params'] / 1e6:.1f}M-parameter Llama ({a['model']}), the corpus seen once, ZeRO-0, fp32, micro "
            f"batch 8 x 128 tokens, {a['steps']} steps, DiLoCo H={EVERY} int4 with plain averaging; one CPU rank in "
            f"each of two network namespaces joined by a veth pair; {runs[0]['shaping']}. {platform.machine()}, "
            f"{os.cpu_count()} cores, {len(by['whole'])} run(s) of each, interleaved: medians over them. The last "
            f"step (a whole-model sync in every run) left out. Hold-up: the steps' time above the median step, "
            f"summed, per {EVERY} steps (one sync of the whole model's worth). The mean bytes differ by where the run "
            f"stops: the fragments sync through each {EVERY} steps, the whole model at their end (over a long run, "
            f"the same).\n\n"
            "| way | bytes/step (mean) | bytes in the largest step | median step | hold-up per 25 steps | "
            "against whole |\n|---|---|---|---|---|---|\n")
    for name, rs in by.items():
        holdup = statistics.median(r["holdup_s"] for r in rs)
        text += (f"| {name} | {statistics.median(r['bytes_mean'] for r in rs) / 1e3:,.0f} kB | "
                 f"{statistics.median(r['bytes_peak'] for r in rs) / 1e6:,.2f} MB | "
                 f"{statistics.median(r['median_s'] for r in rs):.3f} s | {holdup:.2f} s | "
                 f"{holdup / whole:.2f}x |\n")
    return text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=tuple(MODELS), default="30m")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--rate", default="100mbit")
    parser.add_argument("--delay", default="10ms")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--write", action="store_true", help="update docs/benchmarks.md and the JSON")
    parser.add_argument("--report", action="store_true", help="only print (and with --write, write) the saved results")
    parser.add_argument("--more", action="store_true", help="add --repeats runs of each to the saved results")
    args = parser.parse_args()
    if args.report:
        state = json.loads(RESULTS.read_text())
    else:
        work = Path(tempfile.mkdtemp(prefix="dstrain-streaming-"))
        try:
            state = {"args": {"model": args.model, "steps": args.steps, "rate": args.rate, "delay": args.delay},
                     "runs": []}
            if args.more:
                state = json.loads(RESULTS.read_text())
                args.model, args.steps, args.rate, args.delay = (state["args"][k] for k in
                                                                 ("model", "steps", "rate", "delay"))
            state["params"] = make_llama(work / "model", **MODELS[args.model]) if MODELS[args.model] else \
                make_model(work / "model")
            data = make_corpus(work / "corpus")
            for _ in range(args.repeats):
                for name in WAYS:
                    began = time.time()
                    state["runs"].append(run(name, work / "model", data, work, args))
                    r = state["runs"][-1]
                    print(f"  {name}: {time.time() - began:.0f} s, median step {r['median_s']:.3f} s, hold-up "
                          f"{r['holdup_s']:.2f} s per {EVERY} steps, peak {r['bytes_peak'] / 1e6:.2f} MB",
                          file=sys.stderr)
        finally:
            shutil.rmtree(work, ignore_errors=True)
        if args.write:
            RESULTS.write_text(json.dumps(state, indent=1))
    text = report(state)
    print(text)
    if args.write:
        write_section("bench/streaming.py", "Streaming DiLoCo across a slow link", text)


if __name__ == "__main__":
    main()
