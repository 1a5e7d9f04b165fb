#!/usr/bin/env python3
"""What the quiet-failure checks (dstrain/run/: non-finite steps, spikes, slow ranks, silent data corruption)
cost a step, measured side by side on one machine in one sitting.

bench/speed.py's preset (cpu: ~3M-parameter Llama, 2 ranks x 8 x 256 tokens, ZeRO-2, fp32) is trained with:
- `fewest`: the checks that cannot be turned off (the non-finite gate and the step's judgement) with slow-rank
  and SDC checks off (fault.straggler_every=0, fault.sdc_check_every=0);
- `defaults`: the shipped settings (spikes logged, slow ranks compared every 20 steps, SDC every 100);
- `spike_skip`: fault.on_spike=skip (the step's loss all-reduced before the update instead of after);
- `sdc_every_4`: the replica checksum and the replay of the first micro-batch every 4 steps;
- `stragglers_every_1`: the compute times all-gathered every step.
Runs alternate (--repeats rounds). Reported per setting: the median step time over the steps that count (the
preset's `skip` first steps carry warm-up), its ratio to `fewest`, and the checks' own host time per step as
train.py measured it (summary.json health.check_s, every collective and replay inside it). The cost of one SDC
check and one straggler comparison is derived from the runs that do them often; the defaults' overhead is then
their share at the default intervals. --busy-minutes M also runs the defaults for M minutes beside a busy loop
(a third process on the ranks' cores) and reports every rank it named slow (it should name none).

    python bench/health.py [--preset cpu] [--repeats 2] [--busy-minutes 10] [--write]
"""
from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import make_llama, write_section
from speed import PRESETS, bench_ds_config, gpu_count, run, versions

SETTINGS = {
    "fewest": ["--fault.straggler_every=0", "--fault.sdc_check_every=0"],
    "defaults": [],
    "spike_skip": ["--fault.on_spike=skip"],
    "sdc_every_4": ["--fault.sdc_check_every=4"],
    "stragglers_every_1": ["--fault.straggler_every=1"],
}


def measure(name: str, args, preset: dict, model: Path, ds_json: Path, work: Path, ranks: int, index: int,
            extra: list[str]) -> dict:
    args.dstrain_args = SETTINGS.get(name, []) + extra
    out = run("dstrain", args, preset, model, ds_json, work, ranks, index)
    run_dir = work / f"dstrain-{index}"
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step_s"] for r in rows if "loss" in r][preset["skip"]:]
    summary = json.loads((run_dir / "summary.json").read_text())
    checks = summary["health"]
    return {"median_step_s": statistics.median(steps), "check_s_per_step": checks["check_s"] / len(rows),
            "sdc_replays": checks.get("sdc_replays", 0), "sdc_replica_checks": checks.get("sdc_replica_checks", 0),
            "slow_ranks": checks.get("slow_ranks", []), "steps": len(steps), "final_loss": out["final_loss"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="cpu")
    parser.add_argument("--ds_config", default="zero2.json")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--busy-minutes", type=float, default=0.0)
    parser.add_argument("--write", action="store_true", help="update docs/benchmarks.md")
    args = parser.parse_args()
    preset = dict(PRESETS[args.preset])
    ranks = gpu_count() or 2
    if not gpu_count():
        preset["precision"] = "fp32"
    args.skip = 1
    work = Path(tempfile.mkdtemp(prefix="dstrain-health-"))
    try:
        make_llama(work / "model", **preset["sizes"])
        ds_json = bench_ds_config(args.ds_config, preset["precision"], work / "ds_config.json")
        results: dict[str, list[dict]] = {name: [] for name in SETTINGS}
        index = 0
        for _ in range(args.repeats):
            for name in SETTINGS:
                results[name].append(measure(name, args, preset, work / "model", ds_json, work, ranks, index, []))
                index += 1
                print(name, results[name][-1], flush=True)
        busy = None
        if args.busy_minutes:
            loop = subprocess.Popen([sys.executable, "-c", "while True: pass"])
            try:
                began = time.time()
                per_step = statistics.median(r["median_step_s"] for r in results["defaults"])
                long = dict(preset, steps=max(int(args.busy_minutes * 60 / per_step), 40))
                busy = measure("defaults", args, long, work / "model", ds_json, work, ranks, index, [])
                busy["minutes"] = round((time.time() - began) / 60, 1)
            finally:
                loop.kill()
        report(results, busy, preset, args, ranks)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def report(results: dict, busy: dict | None, preset: dict, args, ranks: int) -> None:
    med = {name: statistics.median(r["median_step_s"] for r in runs) for name, runs in results.items()}
    own = {name: statistics.median(r["check_s_per_step"] for r in runs) for name, runs in results.items()}
    # one SDC check (checksum + replay) and one straggler comparison, from the runs that do them often
    sdc_checks = statistics.median(r["sdc_replays"] for r in results["sdc_every_4"]) or 1
    steps = preset["steps"]
    per_sdc = (own["sdc_every_4"] - own["fewest"]) * steps / sdc_checks
    per_gather = (own["stragglers_every_1"] - own["fewest"]) * steps / steps
    default_share = (own["fewest"] + per_sdc / 100 + per_gather / 20) / med["fewest"]
    lines = [f"Setting: preset `{args.preset}` ({preset['sizes']['num_hidden_layers']} layers, hidden "
             f"{preset['sizes']['hidden_size']}), {ranks} ranks x {preset['micro_batch_size']} x {preset['seq_len']} "
             f"tokens, {args.ds_config}, {preset['precision']}, {preset['steps']} steps (the first {preset['skip']} "
             f"not counted), {args.repeats} runs of each setting, alternating; {versions()}.", "",
             "| setting | median step (s) | vs fewest | the checks' own host time per step (s) |",
             "|---|---|---|---|"]
    for name in results:
        lines.append(f"| `{name}` | {med[name]:.4f} | {med[name] / med['fewest']:.3f}x | {own[name]:.5f} |")
    lines += ["", f"One SDC check (the replica checksum and the replay of a micro-batch): {per_sdc * 1000:.1f} ms "
              f"({per_sdc / med['fewest']:.1%} of a step); one slow-rank comparison: {per_gather * 1000:.2f} ms. "
              f"The defaults' checks (judging every step, a comparison every 20 steps, an SDC check every 100): "
              f"{default_share:.2%} of the step time."]
    if busy is not None:
        named = busy["slow_ranks"]
        lines.append(f"Beside a busy loop for {busy['minutes']} min ({busy['steps'] + preset['skip']} steps, the "
                     f"defaults): {len(named)} rank(s) named slow" + (f": {named}" if named else "") + ".")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.write:
        write_section("bench/health.py", "What the quiet-failure checks cost", text)


if __name__ == "__main__":
    main()
