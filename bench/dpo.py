#!/usr/bin/env python3
"""The same DPO job through train.py and through TRL's DPOTrainer (bench/trl_dpo_peer.py), side by side.

Same model (a Llama of --layers x --hidden with the tiny tokenizer, random weights as the base and reference), the
same pairs (data/tiny_dpo), global batch, DeepSpeed JSON (its scheduler left to each side's own cosine), steps,
lr, beta, fp32, 2 CPU ranks under the `deepspeed` launcher; runs alternate. TRL twice: as its quick start writes it
(the reference model run beside the policy every step) and with its own fastest settings (precompute_ref_log_probs;
its padding_free is unavailable in TRL 1.16). Medians over --repeats: pairs/s over the steps after --skip, peak RSS
per rank, launch to first step (both reference passes included), mean loss of the last 5 steps (the sides differ
in AdamW betas and schedule floor, so losses are indicative). Target (issue 31): >= 1.3x TRL's default pairs/s and
no slower than its fastest, at no more memory. --write replaces this script's section of docs/benchmarks.md.

On a GPU machine every GPU is a rank and both sides run in bf16; `--preset gpu-1b` takes bench/speed.py's
Llama-3.2-1B shape, and the table adds each side's torch.cuda.max_memory_allocated() (rank 0).

    python bench/dpo.py [--preset cpu|gpu-1b] [--repeats 3] [--steps 30] [--write]
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

from common import free_port, make_llama, write_section
from speed import (
    PRESETS,
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
SYSTEMS = {"dstrain": "dstrain train.py", "trl": "TRL DPOTrainer (quick start)",
           "trl_fast": "TRL DPOTrainer, precompute_ref_log_probs"}


def run(system: str, args, model: Path, ds_json: Path, work: Path, index: int) -> dict:
    out = work / f"{system}-{index}"
    out.mkdir(parents=True)
    port = free_port()
    common = [str(BIN / "deepspeed"), "--num_gpus", str(args.ranks), "--master_port", str(port)]
    lr, beta, pairs = "5e-4", "0.1", args.micro_batch_size * 2
    if system == "dstrain":
        cmd = common + ["train.py", "--ds_config", str(ds_json), "--output_dir", str(out),
                        f"--model.name_or_path={model}", "--data.path=data/tiny_dpo", "--data.format=preference",
                        "--data.val_fraction=0", f"--preference.beta={beta}", f"--train.max_steps={args.steps}",
                        f"--train.seq_len={args.seq_len}", f"--train.micro_batch_size={args.micro_batch_size}",
                        f"--train.precision={args.precision}", f"--train.lr={lr}", "--train.warmup_steps=2",
                        "--train.min_lr_ratio=0", "--train.weight_decay=0", "--log.wandb=false",
                        "--log.progress_bar=false", "--log.plot=false", "--checkpoint.every=0",
                        "--checkpoint.export_hf=false"]
    else:
        cmd = common + ["bench/trl_dpo_peer.py", "--model", str(model), "--data", str(ROOT / "data/tiny_dpo"),
                        "--ds_config", str(ds_json), "--output_dir", str(out), "--result", str(out / "result.json"),
                        f"--max_steps={args.steps}", f"--max_length={args.seq_len}",
                        f"--micro_batch_size={args.micro_batch_size}", f"--lr={lr}", f"--beta={beta}",
                        f"--precision={args.precision}", *(["--fast"] if system == "trl_fast" else [])]
    return measured_side(system, index, cmd, out, port, args.steps, args.skip, pairs, ("loss", "losses"),
                         ("pairs_per_s", "final_loss"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=("cpu", "gpu-1b"), default="cpu",
                        help="gpu-1b: bench/speed.py's Llama-3.2-1B shape (--layers/--hidden ignored)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--skip", type=int, default=5, help="steps left out of pairs/s (warm-up)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--seq_len", type=int, default=64, help="dstrain's train.seq_len, TRL's max_length")
    parser.add_argument("--micro_batch_size", type=int, default=8, help="pairs per rank per step")
    args = peer_arguments(parser, SYSTEMS)
    sizes = PRESETS["gpu-1b"]["sizes"] if args.preset == "gpu-1b" else dict(
        hidden_size=args.hidden, intermediate_size=int(args.hidden * 2.6875), num_hidden_layers=args.layers,
        num_attention_heads=4, num_key_value_heads=2)
    with tempfile.TemporaryDirectory(prefix="bench-dpo-") as tmp:
        work = Path(tmp)
        params = make_llama(work / "model", **sizes)
        ds_json = bench_ds_config(args.ds_config, args.precision, work / "ds_config.json")
        runs = alternating_runs(args, lambda system, index: run(system, args, work / "model", ds_json, work, index),
                                ("pairs_per_s", "pairs/s", 1), ("final_loss", "final loss", 4))
    got = peer_medians(runs, args.systems, ("pairs_per_s", "first_step_s", "peak_rss_bytes", "final_loss", "peak_cuda_bytes"))
    machine = peer_machine(args.ranks)
    lines = [f"{time.strftime('%Y-%m-%d')}, {machine}, `{args.ds_config}` (scheduler dropped), {args.precision}; "
             f"a {params / 1e6:.1f}M-parameter Llama ({sizes['num_hidden_layers']} x {sizes['hidden_size']}); "
             f"data/tiny_dpo; "
             f"{args.micro_batch_size} pairs per rank per step, seq_len/max_length {args.seq_len}; {args.steps} "
             f"steps, pairs/s over steps {args.skip + 1}-{args.steps}; medians of {args.repeats} alternating runs.",
             "", *peer_table(got, {s: SYSTEMS[s] for s in args.systems}, ("pairs_per_s", "pairs/s"),
                             ("final_loss", "final loss (last 5)"))]
    body = "\n".join(lines) + "\n"
    print(body)
    if args.write:
        write_section("bench/dpo.py", "Preference training against TRL", body + "\n")


if __name__ == "__main__":
    main()
