#!/usr/bin/env python3
"""The same vision-language SFT job through train.py and through TRL's SFTTrainer (bench/trl_vlm_peer.py), side by
side: recipes/tiny/vlm_sft.yaml's job.

Same model (recipes/tiny/vlm_model's LLaVA, random weights saved once and loaded by both), the same rows
(data/tiny_vlm: TRL's vision layout, one image per row), every part trained (the tiny recipe's setting: its tower
is random), loss on the assistant's tokens only (TRL's assistant_only_loss from the same template with
`{% generation %}` tags), global batch, DeepSpeed JSON (its scheduler left to each side's own cosine), steps, lr,
no weight decay, fp32 on 2 CPU ranks under the `deepspeed` launcher; runs alternate. TRL twice: with SFTConfig's
default activation checkpointing (as its guide runs it) and without it (the same work as train.py's run). Where the
time goes differs by design: train.py turns every row's images into pixels once, into its tokenized cache (on the
first run: each run here starts with an empty cache, so its launch-to-first-step and peak memory include it; the
`dstrain_cached` row is the same command again on the cache the round's first run built), TRL's collator opens and
processes every row's images at every step. Medians over --repeats: rows/s over the steps after --skip,
peak RSS per rank, launch to first step, mean loss of the last 5 steps (the sides differ in AdamW's betas and
the schedule's floor: indicative). --write replaces this script's section of docs/benchmarks.md.

On a GPU machine every GPU is a rank and both sides run in bf16, and the table adds each side's
torch.cuda.max_memory_allocated() (rank 0).

    python bench/vlm.py [--repeats 3] [--steps 100] [--write]
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

from common import free_port, write_section
from speed import (
    alternating_runs,
    bench_ds_config,
    measured_side,
    peer_arguments,
    peer_machine,
    peer_medians,
    peer_table,
)

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
SYSTEMS = {"dstrain": "dstrain train.py", "dstrain_cached": "dstrain train.py, its data cache built",
           "trl": "TRL SFTTrainer (SFTConfig's activation checkpointing)",
           "trl_same": "TRL SFTTrainer, activation checkpointing off"}
DATA = ROOT / "data" / "tiny_vlm" / "train.jsonl"


def make_model(out: Path, seed: int = 0) -> int:
    """recipes/tiny/vlm_model's config and processor with random weights, saved: both sides load the same ones."""
    import torch
    from transformers import AutoConfig, AutoModelForImageTextToText, AutoProcessor

    source = ROOT / "recipes" / "tiny" / "vlm_model"
    torch.manual_seed(seed)
    model = AutoModelForImageTextToText.from_config(AutoConfig.from_pretrained(source))
    model.save_pretrained(out)
    AutoProcessor.from_pretrained(source).save_pretrained(out)
    return sum(p.numel() for p in model.parameters())


def run(system: str, args, model: Path, ds_json: Path, work: Path, index: int) -> dict:
    out = work / f"{system}-{index}"
    out.mkdir(parents=True)
    port = free_port()
    common = [str(BIN / "deepspeed"), "--num_gpus", str(args.ranks), "--master_port", str(port)]
    if system.startswith("dstrain"):
        cmd = common + ["train.py", "--recipe", "tiny/vlm_sft", "--ds_config", str(ds_json), "--output_dir", str(out),
                        f"--model.name_or_path={model}", f"--data.path={DATA}", "--data.val_fraction=0",
                        f"--train.max_steps={args.steps}", f"--train.micro_batch_size={args.micro_batch_size}",
                        f"--train.precision={args.precision}", f"--train.lr={args.lr}",
                        f"--train.warmup_steps={args.warmup}", "--train.min_lr_ratio=0", "--train.weight_decay=0",
                        "--eval.every=0", "--log.wandb=false", "--log.progress_bar=false", "--log.plot=false",
                        "--checkpoint.every=0", "--checkpoint.export_hf=false"]
    else:
        cmd = common + ["bench/trl_vlm_peer.py", "--model", str(model), "--data", str(DATA), "--ds_config",
                        str(ds_json), "--output_dir", str(out), "--result", str(out / "result.json"),
                        f"--max_steps={args.steps}", f"--micro_batch_size={args.micro_batch_size}",
                        f"--lr={args.lr}", f"--warmup_steps={args.warmup}", f"--precision={args.precision}",
                        *(["--no_checkpointing"] if system == "trl_same" else [])]
    # dstrain_cached: the run after `dstrain` of the same round, on the tokenized cache (pixels included) that one
    # built; every other run starts with an empty cache
    reuse = {"DSTRAIN_CACHE": str(work / f"dstrain-{index}" / "cache")} if system == "dstrain_cached" else None
    return measured_side(system, index, cmd, out, port, args.steps, args.skip, args.micro_batch_size * args.ranks,
                         ("loss", "losses"), ("rows_per_s", "final_loss"), reuse)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=100)  # steps of ~0.1 s here: 30 gave rows/s 0.85-1.27x run to run
    parser.add_argument("--skip", type=int, default=5, help="steps left out of rows/s (warm-up)")
    parser.add_argument("--micro_batch_size", type=int, default=8, help="rows per rank per step")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--warmup", type=int, default=6)
    args = peer_arguments(parser, SYSTEMS)
    with tempfile.TemporaryDirectory(prefix="bench-vlm-") as tmp:
        work = Path(tmp)
        params = make_model(work / "model")
        ds_json = bench_ds_config(args.ds_config, args.precision, work / "ds_config.json")
        runs = alternating_runs(args, lambda system, index: run(system, args, work / "model", ds_json, work, index),
                                ("rows_per_s", "rows/s", 1), ("final_loss", "final loss", 4))
    got = peer_medians(runs, args.systems, ("rows_per_s", "first_step_s", "peak_rss_bytes", "final_loss",
                                            "peak_cuda_bytes"))
    lines = [f"{time.strftime('%Y-%m-%d')}, {peer_machine(args.ranks)}, `{args.ds_config}` (scheduler dropped), "
             f"{args.precision}; recipes/tiny/vlm_model's LLaVA ({params / 1e6:.2f}M parameters, random weights, all "
             f"trained), data/tiny_vlm (one 28 px image per row); {args.micro_batch_size} rows per rank per step; "
             f"{args.steps} steps, rows/s over steps {args.skip + 1}-{args.steps}; medians of {args.repeats} "
             "alternating runs.", "", *peer_table(got, {s: SYSTEMS[s] for s in args.systems},
                                                   ("rows_per_s", "rows/s"), ("final_loss", "final loss (last 5)"))]
    body = "\n".join(lines) + "\n"
    print(body)
    if args.write:
        write_section("bench/vlm.py", "Vision-language SFT against TRL", body + "\n")


if __name__ == "__main__":
    main()
