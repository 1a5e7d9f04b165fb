#!/usr/bin/env python3
"""Per-rank peak memory of ZeRO 0/1/2/3 at 2 ranks with a ~100M-parameter Llama, next to the ZeRO paper.

Each configuration trains a few steps under the real `deepspeed` launcher; every rank's peak memory above
its own baseline (measured just before the model is built) comes from run_dir/memory.json. The paper's
model-state bytes per parameter for mixed-precision Adam at N data-parallel ranks: ZeRO-0 16, ZeRO-1
4+12/N, ZeRO-2 2+14/N, ZeRO-3 16/N. Activations are kept small (micro batch 1 x 128 tokens) so the
comparison is about model states. Prints a table and, with --write, replaces its section of
docs/benchmarks.md.

    python bench/memory.py [--params 100] [--stages 0 1 2 3] [--write]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from common import free_port, make_llama, write_section

ROOT = Path(__file__).resolve().parent.parent
PAPER = {0: lambda n: 16, 1: lambda n: 4 + 12 / n, 2: lambda n: 2 + 14 / n, 3: lambda n: 16 / n}


def make_model(out: Path, layers: int) -> int:
    return make_llama(out, hidden_size=768, intermediate_size=2048, num_hidden_layers=layers,
                      num_attention_heads=12, num_key_value_heads=12, head_dim=64)


def run(stage: int, model: Path, work: Path, extra: list[str]) -> dict:
    port = free_port()
    out = work / f"zero{stage}"
    cmd = [str(Path(sys.executable).parent / "deepspeed"), "--num_gpus", "2", "--master_port", str(port), "train.py",
           "--ds_config", f"zero{stage}.json", "--output_dir", str(out), f"--model.name_or_path={model}",
           "--train.precision=bf16", "--train.max_steps=2", "--train.micro_batch_size=1", "--train.seq_len=128",
           "--eval.every=0", "--eval.max_batches=1", "--log.wandb=false", "--log.progress_bar=false",
           "--checkpoint.export_hf=false", "--checkpoint.every=0", *extra]
    # glibc's adaptive mmap threshold keeps freed large tensors in the heap, so RSS overstates live memory by
    # hundreds of MiB; a fixed threshold returns them (the Makefile sets it for CPU runs too).
    env = dict(os.environ, OMP_NUM_THREADS="1", DSTRAIN_CACHE=str(work / "cache"), MALLOC_MMAP_THRESHOLD_="131072")
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"zero{stage} failed:\n{proc.stderr[-3000:]}")
    return json.loads((out / "memory.json").read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=14, help="14 layers of width 768 = ~100M parameters")
    parser.add_argument("--stages", type=int, nargs="+", default=[0, 1, 2, 3])
    parser.add_argument("--write", action="store_true", help="update docs/benchmarks.md")
    parser.add_argument("ds_args", nargs="*", help="extra train.py arguments, e.g. --ds.zero_optimization.x=y")
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="dstrain-bench-"))
    try:
        params = make_model(work / "model", args.layers)
        rows = []
        for stage in args.stages:
            m = run(stage, work / "model", work, args.ds_args)
            measured = m["peak_above_baseline_bytes"] / params
            paper = PAPER[stage](2)
            rows.append((stage, m["peak_above_baseline_bytes"] / 2**20, measured, paper, measured / paper,
                         m["estimated_device_bytes"] / params))
    finally:
        shutil.rmtree(work, ignore_errors=True)

    header = (f"Per-rank peak memory above the process baseline, {params / 1e6:.1f}M-parameter Llama, bf16, "
              f"2 CPU ranks (gloo), micro batch 1 x 128 tokens, {platform.processor() or platform.machine()}, "
              f"{os.cpu_count()} cores.\n\n"
              "| config | peak MiB | bytes/param measured | ZeRO paper | measured / paper | preflight estimate |\n"
              "|---|---|---|---|---|---|\n")
    table = header + "".join(f"| zero{s}.json | {mib:,.0f} | {b:.2f} | {p:.2f} | {r:.2f}x | {e:.2f} |\n"
                             for s, mib, b, p, r, e in rows)
    print(table)
    if args.write:
        write_section("bench/memory.py", "Memory per rank, ZeRO stages", table)


if __name__ == "__main__":
    main()
