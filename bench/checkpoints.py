"""Save stall and throughput: synchronous against background checkpoints (checkpoint.background), side by side.

    python bench/checkpoints.py [--stages 2 3] [--steps 30] [--every 10] [--repeats 1] [--write]

On the ~100M-parameter bench model (bench/speed.py's `large` shape), 2 ranks (or the GPUs), ZeRO-2 and ZeRO-3:
for each stage, one run without saves (checkpoint.every=0), one saving every `--every` steps synchronously and one
in the background. Figures: each save's stall (what the training loop waited: the whole save, or the copy to host
memory), the background write's own time, and tokens/s over the steps after `--skip` (step-end to step-end, so the
stalls of the saves in between count). Targets (issue 32): the background stall at most 10% of the synchronous
one; tokens/s with a save every 10 steps within 5% of no saves.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from common import free_port, make_llama, write_section
from speed import PRESETS, gpu_count

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
MODES = {"none": ["--checkpoint.every=0"], "sync": ["--checkpoint.background=false"],
         "background": ["--checkpoint.background=true"]}


def run(work: Path, model: Path, stage: int, mode: str, args, ranks: int, index: int) -> dict:
    out = work / f"zero{stage}-{mode}-{index}"
    cmd = [str(BIN / "deepspeed"), "--num_gpus", str(ranks), "--master_port", str(free_port()), "train.py",
           "--ds_config", f"zero{stage}.json", "--output_dir", str(out), f"--model.name_or_path={model}",
           f"--train.max_steps={args.steps}", f"--train.seq_len={args.seq_len}",
           f"--train.micro_batch_size={args.micro_batch_size}", "--train.grad_accum_steps=1",
           f"--train.precision={'bf16' if gpu_count() else 'fp32'}", "--train.warmup_steps=5", "--eval.every=0",
           "--eval.max_batches=0", "--log.wandb=false", "--log.progress_bar=false", "--log.plot=false",
           "--checkpoint.export_hf=false", f"--checkpoint.every={args.every}", "--checkpoint.keep_last=1",
           *MODES[mode]]
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", WANDB_MODE="disabled", DSTRAIN_CACHE=str(work / "cache"))
    if not gpu_count():
        env.setdefault("OMP_NUM_THREADS", str(args.threads_per_rank or max(1, (os.cpu_count() or 2) // ranks)))
    with open(work / f"{out.name}.log", "w") as log:
        code = subprocess.run(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT).returncode
    if code:
        tail = (work / f"{out.name}.log").read_text().splitlines()[-25:]
        raise SystemExit(f"zero{stage} {mode} failed ({code}):\n" + "\n".join(tail))
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "loss" in r]
    ends, tokens = [r["time"] for r in rows], rows[0]["tokens"]
    saves = json.loads((out / "summary.json").read_text())["saves"]
    in_run = saves["stall_s"][:-1] if mode != "none" else []  # the last one is the run's end, after every step
    res = {"stage": stage, "mode": mode, "run": index,
           "tokens_per_s": tokens * (len(ends) - 1 - args.skip) / (ends[-1] - ends[args.skip]),
           "stall_s": in_run, "write_s": saves["write_s"], "step_s": statistics.median(
               b - a for a, b in zip(ends[args.skip:], ends[args.skip + 1:]))}
    # in-run: tokens/s against the rate of this run's own median step (the steps a save did not touch), so that
    # runs on a shared machine, whose steps differ by several percent from one run to the next, need no pairing
    res["vs_own_median"] = res["tokens_per_s"] * res["step_s"] / tokens
    return res


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", type=int, nargs="+", default=[2, 3])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--every", type=int, default=10)
    parser.add_argument("--skip", type=int, default=5, help="steps left out of tokens/s (warm-up)")
    parser.add_argument("--seq_len", type=int, default=256)
    parser.add_argument("--micro_batch_size", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--write", action="store_true", help="update docs/benchmarks.md")
    parser.add_argument("--results", default=None, help="also write every figure to this JSON file")
    parser.add_argument("--ranks", type=int, default=None, help="default: the GPUs, or 2 CPU ranks")
    parser.add_argument("--threads_per_rank", type=int, default=None,
                        help="CPU ranks' OMP_NUM_THREADS (default: the cores shared out); fewer leaves cores to the "
                             "checkpoint threads, as a GPU host's idle cores")
    args = parser.parse_args()
    ranks = args.ranks or gpu_count() or 2
    work = Path(tempfile.mkdtemp(prefix="dstrain-ckpt-bench-"))
    params = make_llama(work / "model", **PRESETS["large"]["sizes"])
    print(f"{params / 1e6:.0f}M parameters, {ranks} ranks, seq {args.seq_len} x micro {args.micro_batch_size}, "
          f"{args.steps} steps, a save every {args.every}; work in {work}", flush=True)
    runs = []
    for index in range(args.repeats):
        for stage in args.stages:
            for mode in (MODES if index % 2 == 0 else list(MODES)[::-1]):
                runs.append(run(work, work / "model", stage, mode, args, ranks, index))
                r = runs[-1]
                print(f"zero{stage} {mode:10s} {r['tokens_per_s']:,.0f} tokens/s ({r['vs_own_median']:.3f} of its median "
                      f"step's rate), step {r['step_s']:.2f} s, stalls "
                      f"{', '.join(f'{s:.2f}' for s in r['stall_s']) or '-'} s", flush=True)
    lines = ["| ZeRO | saves | tokens/s | vs no saves | vs its own median step | stall per save, s (median) | "
             "stall vs synchronous | background write, s |", "|---|---|---|---|---|---|---|---|"]
    summary = {}
    for stage in args.stages:
        def pick(mode, key, stage=stage):
            return [r[key] for r in runs if r["stage"] == stage and r["mode"] == mode]
        base = statistics.median(pick("none", "tokens_per_s"))
        sync_stall = statistics.median(sum(pick("sync", "stall_s"), []))
        for mode in MODES:
            rate = statistics.median(pick(mode, "tokens_per_s"))
            stalls = sum(pick(mode, "stall_s"), [])
            stall = statistics.median(stalls) if stalls else None
            writes = sum(pick(mode, "write_s"), [])
            own = statistics.median(pick(mode, "vs_own_median"))
            summary[f"zero{stage}_{mode}"] = {"tokens_per_s": rate, "vs_none": rate / base, "vs_own_median": own,
                                              "stall_s": stall,
                                              "stall_vs_sync": stall / sync_stall if stall else None,
                                              "write_s": statistics.median(writes) if writes else None}
            s = summary[f"zero{stage}_{mode}"]
            saves = mode if mode == "none" else f"{mode}, every {args.every}"
            stall_s = "-" if stall is None else f"{stall:.3f}"
            ratio = "-" if stall is None else f"**{s['stall_vs_sync']:.1%}**"
            write = "-" if s["write_s"] is None else f"{s['write_s']:.2f}"
            lines.append(f"| {stage} | {saves} | {rate:,.0f} | {s['vs_none']:.3f} | {own:.3f} | {stall_s} | {ratio} | "
                         f"{write} |")
    text = "\n".join(lines)
    print(text)
    if args.results:
        Path(args.results).write_text(json.dumps({"runs": runs, "summary": summary}, indent=1))
    if args.write:
        import platform
        device = "GPU" if gpu_count() else f"{os.cpu_count()} CPU cores ({platform.processor() or platform.machine()})"
        write_section("bench/checkpoints.py", "Checkpoint stall: synchronous vs background",
                      f"{params / 1e6:.0f}M-parameter Llama (bench/speed.py's `large` shape), {ranks} ranks on "
                      f"{device}, fp32 on CPU, seq {args.seq_len} x micro {args.micro_batch_size}, {args.steps} "
                      f"steps, a save every {args.every}; tokens/s from step {args.skip} on (stalls included). "
                      f"Targets: stall at most 10% of the synchronous save; tokens/s within 5% of no saves.\n\n"
                      f"{text}\n\n`python bench/checkpoints.py --write` ({args.repeats} run each).\n\n")


if __name__ == "__main__":
    main()
