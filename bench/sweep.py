#!/usr/bin/env python3
"""What a sweep costs and what its two savings buy: sweeps/tiny_lr.yaml (6 trials of the tiny recipe, 40 steps, random
search over learning rate and warm-up) run three ways, one after the other on this machine:
  as shipped        2 trials at a time (1 rank each), median pruning from step 20
  one at a time     --parallel=1
  no pruning        --pruner.type=none
Reported per way: wall time of `python -m dstrain.sweep` (worker start to its report), optimizer steps all trials ran
together, trials pruned, the best trial and its eval loss; then the ratios of wall time. Every way draws the same
trials (parameters depend on the seed and the trial number only), so the best trial is the same unless pruning
stopped it. On CPU ranks each trial's launch (imports, model build) is a large share of its time.

    python bench/sweep.py [--write]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import ROOT

WAYS = {"as shipped": [], "one at a time": ["--parallel=1"], "no pruning": ["--pruner.type=none"]}


def run(name: str, extra: list[str], work: Path) -> dict:
    out = work / name.replace(" ", "_")
    began = time.time()
    proc = subprocess.run([sys.executable, "-m", "dstrain.sweep", "sweeps/tiny_lr.yaml", f"--output_dir={out}",
                           *extra], cwd=ROOT, capture_output=True, text=True,
                          env=dict(os.environ, DSTRAIN_CACHE=str(work / "cache"), WANDB_MODE="offline"))
    seconds = time.time() - began
    if proc.returncode != 0:
        sys.exit(f"{name}: exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    found = json.loads((out / "best.json").read_text())
    steps = sum(t["steps"] or 0 for t in found["trials"])
    return {"seconds": round(seconds, 1), "steps": steps,
            "pruned": sum(t["state"] == "pruned" for t in found["trials"]),
            "best_trial": found["best"]["trial"], "best_eval_loss": found["best"]["value"],
            "trials": [{k: t[k] for k in ("trial", "state", "value", "params", "steps")} for t in found["trials"]]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="save the figures to docs/sweep_bench.json")
    args = parser.parse_args()
    results = {}
    with tempfile.TemporaryDirectory(prefix="dstrain-sweep-bench-") as tmp:
        for name, extra in WAYS.items():
            results[name] = run(name, extra, Path(tmp))
            r = results[name]
            print(f"{name:14s} {r['seconds']:6.1f} s  {r['steps']:4d} steps  {r['pruned']} pruned  best trial "
                  f"{r['best_trial']} eval_loss {r['best_eval_loss']:.4f}", flush=True)
    shipped = results["as shipped"]["seconds"]
    ratios = {"one at a time / as shipped": results["one at a time"]["seconds"] / shipped,
              "no pruning / as shipped": results["no pruning"]["seconds"] / shipped}
    for name, value in ratios.items():
        print(f"{name}: {value:.2f}x wall time")
    if args.write:
        machine = {"cpus": os.cpu_count(), "python": sys.version.split()[0]}
        (ROOT / "docs" / "sweep_bench.json").write_text(json.dumps(
            {"machine": machine, "ways": results, "ratios": ratios}, indent=2) + "\n")


if __name__ == "__main__":
    main()
