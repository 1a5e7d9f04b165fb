#!/usr/bin/env python3
"""Where a launched test's time goes: one short train.py job (the tiny recipe's Llama, 2 ranks, 2 steps, an
evaluation, a checkpoint and the Hugging Face export, as most launched tests run it) started the ways the suite
starts runs, side by side in one run: the deepspeed runner, torchrun, and warm ranks (tests/warm.py: forks of a
process that imported torch, DeepSpeed, transformers and dstrain once).

The split of one launch, from the medians: the launcher's own start (torchrun's or the runner's total less the warm
launch's, less the imports), a rank's imports (a fresh interpreter importing what tests/warm_preload.py imports),
train.py's set-up up to its first step (from the warm launch's start to the run's `start` event in events.jsonl,
which train.py writes once the engine is built and any checkpoint loaded), the steps with their evaluations, the
last checkpoint and the export (from that event to summary.json, written last), and the ranks' exit.

    PYTHONPATH=. python bench/launches.py [--repeats 5] [--write]    # (make bench-launches) tests/ importable
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import ROOT, write_section

ARGS = ["--train.max_steps=2", "--train.warmup_steps=1", "--train.micro_batch_size=2", "--train.seq_len=32",
        "--eval.max_batches=1", "--log.wandb=false", "--log.progress_bar=false"]
LAUNCHERS = ("deepspeed", "torchrun", "warm")


def one(launcher: str, cache: Path, scratch: Path) -> dict:
    from tests.helpers import launch
    run = Path(tempfile.mkdtemp(dir=scratch)) / "run"
    began = time.time()
    launch([*ARGS, "--output_dir", str(run)], cache, launcher=launcher)
    total = time.time() - began
    start = json.loads((run / "events.jsonl").read_text().splitlines()[0])["time"]
    summary = (run / "summary.json").stat().st_mtime  # written last, after the final checkpoint and the export
    return {"total": total, "to_start": start - began, "steps": summary - start}


def imports() -> float:
    began = time.time()
    subprocess.run([sys.executable, "-c", "import tests.warm_preload"], cwd=ROOT, check=True, capture_output=True)
    return time.time() - began


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--write", action="store_true", help="write the table into docs/benchmarks.md")
    args = parser.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="bench-launches-"))
    cache = scratch / "cache"
    cache.mkdir()
    from tests.helpers import launch
    launch([*ARGS, "--output_dir", str(scratch / "warmup")], cache, launcher="warm")  # tokenized data, forkserver
    rows: dict[str, list[dict]] = {name: [] for name in LAUNCHERS}
    import_s = []
    for _ in range(args.repeats):  # interleaved, so a slow minute of the machine falls on every launcher alike
        for name in LAUNCHERS:
            rows[name].append(one(name, cache, scratch))
        import_s.append(imports())
    med = {name: {k: statistics.median(r[k] for r in rows[name]) for k in ("total", "to_start", "steps")}
           for name in LAUNCHERS}
    imp = statistics.median(import_s)
    warm = med["warm"]
    lines = ["| launcher | median s per launch | against warm |", "|---|---|---|"]
    lines += [f"| {name} | {med[name]['total']:.1f} | {med[name]['total'] / warm['total']:.2f}x |"
              for name in LAUNCHERS]
    split = {"launcher (torchrun)": med["torchrun"]["total"] - warm["total"] - imp,
             "launcher (deepspeed runner)": med["deepspeed"]["total"] - warm["total"] - imp,
             "a rank's imports": imp, "set-up to the first step": warm["to_start"],
             "steps, evaluations, the last checkpoint and the export": warm["steps"],
             "the ranks' exit": warm["total"] - warm["to_start"] - warm["steps"]}
    from dstrain.flops import cpu_name
    body = (f"{cpu_name()}, 2 cores, {len(import_s)} repeats interleaved, medians; the job: "
            f"the tiny recipe's Llama on 2 CPU ranks, 2 steps, 1 evaluation batch, a checkpoint and the export "
            f"(`{' '.join(ARGS)}`).\n\n" + "\n".join(lines) + "\n\n| part of one launch | s |\n|---|---|\n" +
            "".join(f"| {k} | {v:.1f} |\n" for k, v in split.items()) + "\n")
    print(body)
    if args.write:
        write_section("bench/launches.py", "Where a launched test's time goes", body)


if __name__ == "__main__":
    main()
