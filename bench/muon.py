#!/usr/bin/env python3
"""Muon against AdamW on real text nobody here wrote: the tiny model trained from scratch on Python's standard
library source, the same steps, data and schedule, each optimizer at the best learning rate of a small sweep.

Data: the .py files of the interpreter's standard library (tests, idlelib, turtledemo and site-packages left
out), one document each, in sorted order, capped at --chars characters; 5% of the documents are the validation
split (data.val_fraction, seeded). Model: recipes/tiny/model (4 layers, hidden 128, its 576-token tokenizer),
random weights (seed 42). Each run: train.py on --ranks CPU ranks (or GPUs), ZeRO-2, fp32 on CPU (bf16 on GPU),
--steps steps of ranks x 8 x 256 tokens, 20 warm-up steps then cosine to 10%, eval loss over the whole validation
split at the end. AdamW: lr in --adamw-lrs, clipping 1.0 (the recipe default). Muon: muon_lr in --muon-lrs, its
AdamW half (embeddings, head, norms) at AdamW's best lr, no clipping (refused with Muon under ZeRO-2, see
docs/strategies.md). Reported per run: eval loss and the median step time over the steps after the first 20;
then each optimizer's best, their difference and step-time ratio.

    python bench/muon.py [--steps 400] [--ranks 2] [--write]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

from common import ROOT, free_port

BIN = Path(sys.executable).parent
SKIP_DIRS = {"test", "tests", "idlelib", "turtledemo", "site-packages", "lib2to3", "__pycache__"}


def write_data(out: Path, chars: int) -> dict:
    """The standard library's source as a jsonl of {"text": file}: (documents, characters, root)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    docs, total = [], 0
    for path in sorted(root.rglob("*.py")):
        if SKIP_DIRS & set(path.relative_to(root).parts[:-1]):
            continue
        text = path.read_text(errors="replace")
        if not text.strip():
            continue
        docs.append(text)
        total += len(text)
        if total >= chars:
            break
    with open(out, "w") as f:
        for text in docs:
            f.write(json.dumps({"text": text}) + "\n")
    return {"documents": len(docs), "characters": total, "root": str(root)}


def train(name: str, extra: list[str], args, data: Path, work: Path) -> dict:
    out = work / name
    gpus = _gpus()
    precision = "bf16" if gpus else "fp32"
    cmd = [str(BIN / "torchrun"), "--nproc_per_node", str(args.ranks), "--master_port", str(free_port()), "train.py",
           "--ds_config", "zero2.json", "--output_dir", str(out), "--model.name_or_path=recipes/tiny/model",
           "--model.from_scratch=true", f"--data.path={data}", "--data.format=text", "--data.val_fraction=0.05",
           f"--train.max_steps={args.steps}", "--train.seq_len=256", "--train.micro_batch_size=8",
           "--train.warmup_steps=20", "--train.lr_schedule=cosine", f"--train.precision={precision}",
           f"--eval.every={args.steps}", "--log.wandb=false", "--log.progress_bar=false", "--log.plot=false",
           "--checkpoint.every=0", "--checkpoint.export_hf=false", *extra]
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", WANDB_MODE="disabled", DSTRAIN_CACHE=str(work / "cache"))
    if not gpus:
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 2) // args.ranks)))
    began = time.time()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"{name} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step_s"] for r in rows if "loss" in r]
    evals = [r["eval_loss"] for r in rows if "eval_loss" in r]
    proof = next((line for line in proc.stderr.splitlines() if line.startswith("muon: ")), None)
    return {"name": name, "eval_loss": evals[-1], "train_loss": [r["loss"] for r in rows if "loss" in r][-1],
            "median_step_s": statistics.median(steps[min(20, len(steps) // 2):]), "steps": len(steps), "wall_s": time.time() - began,
            "proof": proof}


def _gpus() -> int:
    import torch
    return torch.cuda.device_count()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--chars", type=int, default=12_000_000)
    parser.add_argument("--adamw-lrs", default="1e-3,3e-3,1e-2")
    parser.add_argument("--muon-lrs", default="0.01,0.02,0.04")
    parser.add_argument("--write", action="store_true", help="replace this script's section of docs/benchmarks.md")
    args = parser.parse_args()
    import deepspeed
    import torch
    import transformers

    work = Path(tempfile.mkdtemp(prefix="bench-muon-"))
    data = work / "stdlib.jsonl"
    corpus = write_data(data, args.chars)
    print(f"data: {corpus['documents']} files, {corpus['characters']:,} characters of {corpus['root']}", flush=True)
    results = []
    for lr in args.adamw_lrs.split(","):
        results.append(train(f"adamw lr={lr}", ["--train.optimizer=adamw", f"--train.lr={lr}"], args, data, work))
        print(json.dumps(results[-1]), flush=True)
    best_adamw = min((r for r in results), key=lambda r: r["eval_loss"])
    adam_lr = best_adamw["name"].split("=")[1]
    for lr in args.muon_lrs.split(","):
        results.append(train(f"muon muon_lr={lr}", ["--train.optimizer=muon", f"--train.muon_lr={lr}",
                                                    f"--train.lr={adam_lr}"], args, data, work))
        print(json.dumps(results[-1]), flush=True)
    best_muon = min((r for r in results if r["name"].startswith("muon")), key=lambda r: r["eval_loss"])

    device = torch.cuda.get_device_name() if _gpus() else f"{args.ranks} CPU ranks ({os.cpu_count()} cores)"
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()
    lines = [f"Standard-library source of Python {sys.version.split()[0]} ({corpus['documents']} files, "
             f"{corpus['characters']:,} characters), recipes/tiny/model from scratch, {args.ranks} ranks x 8 x 256 "
             f"tokens, {args.steps} steps, ZeRO-2, {device}, commit {commit}; torch {torch.__version__}, deepspeed "
             f"{deepspeed.__version__}, transformers {transformers.__version__}; one seed (42). Eval loss over the "
             "whole validation split (5% of the files) after the last step; step time: median after step 20.", "",
             "| run | eval loss | train loss (last step) | median step (s) |", "|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r['name']} | {r['eval_loss']:.4f} | {r['train_loss']:.4f} | {r['median_step_s']:.3f} |")
    diff = best_muon["eval_loss"] - best_adamw["eval_loss"]
    lines += ["", f"Best AdamW: {best_adamw['name']} ({best_adamw['eval_loss']:.4f}); best Muon: {best_muon['name']} "
              f"({best_muon['eval_loss']:.4f}, its AdamW half at lr={adam_lr}). Muon - AdamW = {diff:+.4f} eval loss "
              f"({'Muon' if diff < 0 else 'AdamW'} ahead); step time Muon / AdamW = "
              f"{best_muon['median_step_s'] / best_adamw['median_step_s']:.2f}.", "",
              f"The run's proof line: `{best_muon['proof']}`", ""]
    body = "\n".join(lines)
    print(body)
    if args.write:  # docs/muon_bench.json: what docs/strategies.md quotes (tests/unit/test_docs.py checks it)
        from common import write_section
        write_section("bench/muon.py", "Muon against AdamW on Python's standard library", body + "\n")
        meta = {"steps": args.steps, "ranks": args.ranks, "chars": args.chars, "documents": corpus["documents"],
                "characters": corpus["characters"], "python": sys.version.split()[0], "commit": commit,
                "adamw_lrs": args.adamw_lrs, "muon_lrs": args.muon_lrs, "seed": 42}
        (ROOT / "docs" / "muon_bench.json").write_text(json.dumps({"args": meta, "runs": results}, indent=1) + "\n")


if __name__ == "__main__":
    main()
