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
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from common import free_port, make_llama, write_section
from speed import (
    PRESETS,
    bench_ds_config,
    dstrain_side,
    gpu_count,
    launch_measured,
    peer_machine,
    peer_medians,
    peer_side,
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
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", WANDB_MODE="disabled", DSTRAIN_CACHE=str(out / "cache"),
               HF_DATASETS_CACHE=str(out / "hf_datasets"), OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    # no MALLOC_MMAP_THRESHOLD_ default (it slows CPU steps ~1.5x, docs/planning.md): both sides get the caller's
    launched, memory = launch_measured(system, index, cmd, out, port, env, ROOT)
    if system == "dstrain":
        rows, cuda_peak = dstrain_side(out)
        ends, losses = [r["time"] for r in rows], [r["loss"] for r in rows]
    else:
        result = peer_side(out)
        ends, losses, cuda_peak = result["step_end"], result["losses"], result.get("peak_cuda_bytes") or 0
    if len(ends) != args.steps:
        raise SystemExit(f"{system} run {index}: {len(ends)} step times for {args.steps} steps")
    return {"system": system, "run": index,
            "pairs_per_s": pairs * (args.steps - args.skip) / (ends[-1] - ends[args.skip - 1]),
            "first_step_s": ends[0] - launched, "final_loss": statistics.mean(losses[-5:]),
            "peak_rss_bytes": max(memory.rss.values() or [0]), "peak_cuda_bytes": cuda_peak}


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
    parser.add_argument("--ds_config", default="zero2.json")
    parser.add_argument("--systems", nargs="+", default=list(SYSTEMS))
    parser.add_argument("--write", action="store_true")
    args = parser.parse_args()
    args.ranks = gpu_count() or 2
    args.precision = "bf16" if gpu_count() else "fp32"
    sizes = PRESETS["gpu-1b"]["sizes"] if args.preset == "gpu-1b" else dict(
        hidden_size=args.hidden, intermediate_size=int(args.hidden * 2.6875), num_hidden_layers=args.layers,
        num_attention_heads=4, num_key_value_heads=2)
    with tempfile.TemporaryDirectory(prefix="bench-dpo-") as tmp:
        work = Path(tmp)
        params = make_llama(work / "model", **sizes)
        ds_json = bench_ds_config(args.ds_config, args.precision, work / "ds_config.json")
        runs = []
        for index in range(args.repeats):
            for system in args.systems:
                runs.append(run(system, args, work / "model", ds_json, work, index))
                r = runs[-1]
                print(f"{system} {index}: {r['pairs_per_s']:.1f} pairs/s, first step {r['first_step_s']:.1f} s, "
                      f"peak RSS {r['peak_rss_bytes'] / 2**20:,.0f} MiB, final loss {r['final_loss']:.4f}",
                      flush=True)
    got = peer_medians(runs, args.systems, ("pairs_per_s", "first_step_s", "peak_rss_bytes", "final_loss", "peak_cuda_bytes"))
    machine = peer_machine(args.ranks)
    lines = [f"{time.strftime('%Y-%m-%d')}, {machine}, `{args.ds_config}` (scheduler dropped), {args.precision}; "
             f"a {params / 1e6:.1f}M-parameter Llama ({sizes['num_hidden_layers']} x {sizes['hidden_size']}); "
             f"data/tiny_dpo; "
             f"{args.micro_batch_size} pairs per rank per step, seq_len/max_length {args.seq_len}; {args.steps} "
             f"steps, pairs/s over steps {args.skip + 1}-{args.steps}; medians of {args.repeats} alternating runs.",
             "", "| | pairs/s | launch to first step, s | peak RSS per rank, MiB | final loss (last 5) |"
             + (" max allocated GiB (rank 0) |" if gpu_count() else ""),
             "|---|---|---|---|---|" + ("---|" if gpu_count() else "")]
    for s in args.systems:
        g = got[s]
        lines.append(f"| {SYSTEMS[s]} | {g['pairs_per_s']:.1f} | {g['first_step_s']:.1f} | "
                     f"{g['peak_rss_bytes'] / 2**20:,.0f} | {g['final_loss']:.4f} |"
                     + (f" {g['peak_cuda_bytes'] / 2**30:.1f} |" if gpu_count() else ""))
    if "dstrain" in got:
        lines.append("")
        for peer in ("trl", "trl_fast"):
            if peer in got:
                ratio = got["dstrain"]["pairs_per_s"] / got[peer]["pairs_per_s"]
                lines.append(f"- dstrain / {SYSTEMS[peer]}: pairs/s {ratio:.2f}x, "
                             f"peak RSS {got['dstrain']['peak_rss_bytes'] / got[peer]['peak_rss_bytes']:.2f}x, "
                             f"time to first step {got['dstrain']['first_step_s'] / got[peer]['first_step_s']:.2f}x")
    body = "\n".join(lines) + "\n"
    print(body)
    if args.write:
        write_section("bench/dpo.py", "Preference training against TRL", body + "\n")


if __name__ == "__main__":
    main()
