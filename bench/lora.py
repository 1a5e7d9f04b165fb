#!/usr/bin/env python3
"""The same model fine-tuned in full and with LoRA, side by side: ZeRO-3, 2 CPU ranks, bf16.

For each run (the real `deepspeed` launcher, the same recipe, seed and batches): every rank's peak memory above
its own baseline (run_dir/memory.json, rank 0), the median tokens/s over the steps after the first, the bytes of
one checkpoint and the time its save took (the gap between the step that saved and the next one, minus that
step's own time, from metrics.jsonl). Targets (issue 17, r=16): a LoRA checkpoint at most 5% of the full
fine-tune's bytes, peak memory at most 60%. Prints a table; --write replaces its section of docs/benchmarks.md.

    python bench/lora.py [--layers 14] [--r 16] [--steps 8] [--write]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from common import free_port, make_llama, write_section

ROOT = Path(__file__).resolve().parent.parent
SAVE_AT = 4  # the checkpoint whose bytes and save time are reported (checkpoint.every)


def run(name: str, model: Path, work: Path, steps: int, extra: list[str]) -> dict:
    out = work / name
    cmd = [str(Path(sys.executable).parent / "deepspeed"), "--num_gpus", "2", "--master_port", str(free_port()),
           "train.py", "--ds_config", "zero3.json", "--output_dir", str(out), f"--model.name_or_path={model}",
           "--train.precision=bf16", f"--train.max_steps={steps}", "--train.micro_batch_size=2",
           "--train.seq_len=256", "--train.warmup_steps=2", "--eval.every=0", "--eval.max_batches=1",
           "--log.wandb=false", "--log.progress_bar=false", "--log.plot=false", "--checkpoint.export_hf=false",
           f"--checkpoint.every={SAVE_AT}", f"--checkpoint.keep_last={steps}", *extra]
    env = dict(os.environ, OMP_NUM_THREADS="1", DSTRAIN_CACHE=str(work / "cache"), MALLOC_MMAP_THRESHOLD_="131072")
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"{name} failed:\n{proc.stderr[-3000:]}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps_ = {r["step"]: r for r in rows if "loss" in r}
    ckpt = out / "checkpoints" / f"step_{SAVE_AT:08d}"
    memory = json.loads((out / "memory.json").read_text())
    return {"peak": memory["peak_above_baseline_bytes"], "estimate": memory["estimated_device_bytes"],
            "tokens_per_s": statistics.median(steps_[s]["tokens_per_s"] for s in sorted(steps_)[1:]),
            "ckpt_bytes": sum(f.stat().st_size for f in ckpt.rglob("*") if f.is_file()),
            "save_s": steps_[SAVE_AT + 1]["time"] - steps_[SAVE_AT]["time"] - steps_[SAVE_AT + 1]["step_s"],
            "losses": [steps_[s]["loss"] for s in sorted(steps_)],
            "trainable": json.loads((out / "run_info.json").read_text())["trainable_parameters"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=14, help="14 layers of width 768 = ~100M parameters")
    parser.add_argument("--r", type=int, default=16)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--write", action="store_true", help="update docs/benchmarks.md")
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="dstrain-bench-lora-"))
    try:
        params = make_llama(work / "model", hidden_size=768, intermediate_size=2048, num_hidden_layers=args.layers,
                            num_attention_heads=12, num_key_value_heads=12, head_dim=64)
        full = run("full", work / "model", work, args.steps, ["--train.lr=1e-4"])
        lora = run("lora", work / "model", work, args.steps, ["--train.lr=1e-3", f"--lora.r={args.r}",
                                                               f"--lora.alpha={2 * args.r}"])
    finally:
        shutil.rmtree(work, ignore_errors=True)

    def row(name, m):
        return (f"| {name} | {m['trainable'] / 1e6:,.2f}M | {m['peak'] / 2**20:,.0f} | {m['estimate'] / 2**20:,.0f} | "
                f"{m['tokens_per_s']:,.0f} | {m['ckpt_bytes'] / 2**20:,.1f} | {m['save_s']:.2f} |\n")

    ratios = {"checkpoint bytes": lora["ckpt_bytes"] / full["ckpt_bytes"], "peak memory": lora["peak"] / full["peak"],
              "tokens/s": lora["tokens_per_s"] / full["tokens_per_s"], "save time": lora["save_s"] / full["save_s"]}
    body = (f"{params / 1e6:.1f}M-parameter Llama (width 768, {args.layers} layers), ZeRO-3 (zero3.json), bf16, 2 CPU "
            f"ranks (gloo), micro batch 2 x 256 tokens, {args.steps} steps, checkpoint at step {SAVE_AT}, "
            f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores. LoRA: r={args.r}, alpha "
            f"{2 * args.r}, all-linear. Both runs in one invocation, one after the other.\n\n"
            "| run | trained params | peak MiB per rank | preflight MiB | tokens/s (median) | checkpoint MiB | "
            "save s |\n|---|---|---|---|---|---|---|\n" + row("full fine-tune", full) + row(f"LoRA r={args.r}", lora)
            + "\nLoRA / full: " + ", ".join(f"{k} {v:.3f}" for k, v in ratios.items())
            + f" (targets: checkpoint <= 0.05, peak memory <= 0.60: "
              f"{'met' if ratios['checkpoint bytes'] <= 0.05 and ratios['peak memory'] <= 0.60 else 'NOT met'}).\n")
    print(body)
    if args.write:
        write_section("bench/lora.py", "Full fine-tune against LoRA", body)


if __name__ == "__main__":
    main()
