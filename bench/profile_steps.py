#!/usr/bin/env python3
"""Where train.py's step time goes, against a plain PyTorch loop's: torch.profiler traces of the same steady steps.

Runs train.py (`--log.trace_steps=A-B`) and bench/plain_loop.py (`--trace_steps A-B`) once each on a bench/speed.py
preset (same model, data, order and update), reads rank 0's Chrome traces and prints, per traced step:
  wall             the traced window (the end of step A-1 to the end of step B) / steps
  device busy      on GPUs: the union of kernel, memcpy and memset intervals; idle = wall - busy, with the number
                   of idle gaps over 50 us (host time the GPU waited through: launches, syncs, Python)
  kernels          on GPUs: the kernels by total time (ms per step, calls per step), both sides in one table
  CPU ops          each op's own time (its time less its child ops'), ms per step, both sides, ordered by the
                   largest difference: where train.py's extra host time goes
so the gain each lever can bring (fewer launches, no syncs, fused kernels) is known before it is built.

    python bench/profile_steps.py [--preset cpu|gpu-1b] [--steps 12] [--trace 8-10] [--keep DIR] [--results F]
"""
from __future__ import annotations

import argparse
import gzip
import json
import shutil
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

from common import make_llama
from speed import PRESETS, bench_ds_config, gpu_count, run, versions

DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
GAP_US = 50.0


def analyse(trace: Path, steps: int) -> dict:
    """Per-step figures from a Chrome trace that torch.profiler wrote (see the module docstring)."""
    events = [e for e in json.loads(trace.read_text())["traceEvents"] if e.get("ph") == "X" and "dur" in e]
    device = sorted(((float(e["ts"]), float(e["ts"]) + float(e["dur"]), e["name"]) for e in events
                     if e.get("cat") in DEVICE_CATS), key=lambda x: x[0])
    ops = [e for e in events if e.get("cat") == "cpu_op"]
    start = min(float(e["ts"]) for e in events)
    end = max(float(e["ts"]) + float(e["dur"]) for e in events)
    busy, gaps, reach = 0.0, [], None
    for begin, finish, _ in device:
        if reach is None or begin > reach:
            if reach is not None:
                gaps.append(begin - reach)
            busy += finish - begin
            reach = finish
        elif finish > reach:
            busy += finish - reach
            reach = finish
    kernels: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for begin, finish, name in device:
        kernels[name][0] += finish - begin
        kernels[name][1] += 1
    return {"wall_ms": (end - start) / steps / 1e3, "device_busy_ms": busy / steps / 1e3,
            "idle_gaps_over_50us": sum(g > GAP_US for g in gaps) / steps,
            "kernels": {k: (v[0] / steps / 1e3, v[1] / steps) for k, v in kernels.items()},
            "self_cpu": {k: v / steps / 1e3 for k, v in self_times(ops).items()}}


def self_times(ops: list[dict]) -> dict[str, float]:
    """Each op's time less its direct children's, summed by name (ops nest per thread)."""
    out: dict[str, float] = defaultdict(float)
    by_thread: dict[tuple, list[dict]] = defaultdict(list)
    for e in ops:
        by_thread[(e.get("pid"), e.get("tid"))].append(e)
    for events in by_thread.values():
        events.sort(key=lambda e: (float(e["ts"]), -float(e["dur"])))
        stack: list[list] = []  # [end, name, own time]
        for e in events:
            ts, dur = float(e["ts"]), float(e["dur"])
            while stack and stack[-1][0] <= ts:
                done = stack.pop()
                out[done[1]] += done[2]
            if stack:
                stack[-1][2] -= min(dur, stack[-1][0] - ts)
            stack.append([ts + dur, e["name"], dur])
        for done in stack:
            out[done[1]] += done[2]
    return out


def side_by_side(ours: dict, plain: dict, key: str, rows: int, by_difference: bool) -> list[str]:
    names = set(ours[key]) | set(plain[key])

    def ms(side, name):
        value = side[key].get(name, 0.0)
        return value[0] if isinstance(value, tuple) else value
    order = sorted(names, key=lambda n: -(ms(ours, n) - ms(plain, n)) if by_difference else -max(ms(ours, n),
                                                                                                 ms(plain, n)))
    lines = ["| | train.py ms/step | plain ms/step | difference |" if key == "self_cpu" else
             "| kernel | train.py ms/step (calls) | plain ms/step (calls) | difference |", "|---|---|---|---|"]
    for name in order[:rows]:
        a, b = ms(ours, name), ms(plain, name)
        calls = ("", "") if key == "self_cpu" else tuple(f" ({side[key].get(name, (0, 0))[1]:.0f})"
                                                          for side in (ours, plain))
        lines.append(f"| `{name[:90]}` | {a:.3f}{calls[0]} | {b:.3f}{calls[1]} | {a - b:+.3f} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="cpu")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--trace", default="8-10", help="the steps traced, A-B")
    parser.add_argument("--ds_config", default="zero2.json")
    parser.add_argument("--rows", type=int, default=25)
    parser.add_argument("--keep", default=None, help="copy both traces here, gzipped")
    parser.add_argument("--results", default=None)
    parser.add_argument("dstrain_args", nargs="*", help="extra train.py arguments, after --")
    args = parser.parse_args()
    preset = dict(PRESETS[args.preset], steps=args.steps)
    first, last = (int(x) for x in args.trace.split("-"))
    if not 2 <= first <= last < args.steps:
        raise SystemExit(f"--trace {args.trace}: steps A-B with 2 <= A <= B < --steps ({args.steps})")
    steps = last - first + 1
    gpus = gpu_count()
    ranks = gpus or 2
    if not gpus:
        preset["precision"] = "fp32"
    args.skip, args.peer_args = 1, []
    extra = list(args.dstrain_args)
    work = Path(tempfile.mkdtemp(prefix="dstrain-profile-"))
    try:
        make_llama(work / "model", **preset["sizes"])
        ds_json = bench_ds_config(args.ds_config, preset["precision"], work / "ds_config.json")
        args.dstrain_args = extra + [f"--log.trace_steps={args.trace}"]
        ours_run = run("dstrain", args, preset, work / "model", ds_json, work, ranks, 0)
        args.plain_args = [f"--trace_steps={args.trace}"]
        plain_run = run("plain", args, preset, work / "model", ds_json, work, ranks, 0)
        traces = {"train.py": work / "dstrain-0" / "trace" / "rank0.json", "plain": work / "plain-0" / "plain_rank0.json"}
        ours, plain = analyse(traces["train.py"], steps), analyse(traces["plain"], steps)
        if args.keep:
            Path(args.keep).mkdir(parents=True, exist_ok=True)
            for name, path in traces.items():
                with path.open("rb") as src, gzip.open(Path(args.keep) / f"{name}.trace.json.gz", "wb") as dst:
                    shutil.copyfileobj(src, dst)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    per_step = {name: r["tokens_per_step"] / r["tokens_per_s"] * 1e3 for name, r in (("train.py", ours_run),
                                                                                        ("plain", plain_run))}
    lines = [f"Preset `{args.preset}`, {ranks} ranks, {preset['precision']}, steps {args.trace} of {args.steps} "
             f"traced (rank 0). Versions: {versions()}.", "",
             "| | train.py | plain loop |", "|---|---|---|",
             f"| ms per step, steps 2 on (from tokens/s) | {per_step['train.py']:.1f} | {per_step['plain']:.1f} |",
             f"| ms per step, traced window | {ours['wall_ms']:.1f} | {plain['wall_ms']:.1f} |"]
    if ours["kernels"] or plain["kernels"]:
        lines += [f"| device busy ms per step | {ours['device_busy_ms']:.1f} | {plain['device_busy_ms']:.1f} |",
                  f"| device idle ms per step | {ours['wall_ms'] - ours['device_busy_ms']:.1f} | "
                  f"{plain['wall_ms'] - plain['device_busy_ms']:.1f} |",
                  f"| idle gaps over {GAP_US:.0f} us per step | {ours['idle_gaps_over_50us']:.0f} | "
                  f"{plain['idle_gaps_over_50us']:.0f} |",
                  f"| kernels per step | {sum(c for _, c in ours['kernels'].values()):.0f} | "
                  f"{sum(c for _, c in plain['kernels'].values()):.0f} |",
                  "", "Kernels by time:", ""] + side_by_side(ours, plain, "kernels", args.rows, False)
    lines += ["", "CPU ops' own time, largest excess of train.py first:", ""]
    lines += side_by_side(ours, plain, "self_cpu", args.rows, True)
    text = "\n".join(lines) + "\n"
    print(text)
    if args.results:
        Path(args.results).write_text(json.dumps({"train.py": ours, "plain": plain, "ms_per_step": per_step,
                                                  "table": text}, indent=1))


if __name__ == "__main__":
    sys.exit(main())
