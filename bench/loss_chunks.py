#!/usr/bin/env python3
"""train.loss_chunk_tokens on a large vocabulary: per-rank peak memory, tokens/s and loss, side by side.

A Llama with Llama-3's 128,256-token vocabulary and a small body (so the head and its logits dominate, as
they do for 1B-class models at long sequences) trains a few steps under torchrun with
2 ranks and ZeRO-2, once per setting, alternating, `--repeats` times. Peak memory is rank 0's peak above its
pre-model baseline (run_dir/memory.json); tokens/s is the median over steps after the first. Prints a table
and, with --write, replaces its section of docs/benchmarks.md.

    python bench/loss_chunks.py [--chunks 0 4096 1024] [--repeats 2] [--steps 4] [--write] [--results F]
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


def run(chunk: int, model: Path, work: Path, args: argparse.Namespace, tag: str) -> dict:
    out = work / f"chunk{chunk}-{tag}"
    # torchrun: the ranks start 3-4 s sooner than under the deepspeed runner (which imports deepspeed twice first)
    cmd = [str(Path(sys.executable).parent / "torchrun"), "--nproc_per_node", "2", "--master_port", str(free_port()),
           "train.py", "--ds_config", "zero2.json", "--output_dir", str(out), f"--model.name_or_path={model}",
           f"--train.precision={args.precision}", f"--train.max_steps={args.steps}",
           f"--train.micro_batch_size={args.micro_batch}", f"--train.seq_len={args.seq_len}",
           f"--train.loss_chunk_tokens={chunk}", "--train.warmup_steps=1", "--eval.every=0", "--eval.max_batches=1",
           "--log.wandb=false", "--log.progress_bar=false", "--log.plot=false", "--checkpoint.export_hf=false",
           "--checkpoint.every=0"]
    # a fixed mmap threshold returns freed large tensors to the OS, so RSS peaks are live memory (bench/memory.py)
    env = dict(os.environ, OMP_NUM_THREADS="1", DSTRAIN_CACHE=str(work / "cache"), MALLOC_MMAP_THRESHOLD_="131072")
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"loss_chunk_tokens={chunk} failed:\n{proc.stderr[-3000:]}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "loss" in r]
    memory = json.loads((out / "memory.json").read_text())
    shutil.rmtree(out / "checkpoints", ignore_errors=True)
    return {"peak_mib": memory["peak_above_baseline_bytes"] / 2**20,
            "tokens_per_s": statistics.median(r["tokens_per_s"] for r in steps[1:]),
            "step_s": statistics.median(r["step_s"] for r in steps[1:]),
            "losses": [r["loss"] for r in steps]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chunks", type=int, nargs="+", default=[0, 4096, 1024], help="0 = full logits")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--micro_batch", type=int, default=4)
    parser.add_argument("--seq_len", type=int, default=512)
    parser.add_argument("--precision", default="fp32", help="fp32 (fast on CPU) or bf16")
    parser.add_argument("--write", action="store_true", help="update docs/benchmarks.md")
    parser.add_argument("--results", type=Path, help="also write every run's figures to this JSON file")
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="dstrain-bench-loss-"))
    try:
        params = make_llama(work / "model", vocab_size=args.vocab, hidden_size=256, intermediate_size=688,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                            tie_word_embeddings=False)
        results: dict[int, list[dict]] = {c: [] for c in args.chunks}
        for repeat in range(args.repeats):  # alternating: the machine's drift hits every setting alike
            for chunk in args.chunks:
                results[chunk].append(run(chunk, work / "model", work, args, str(repeat)))
                r = results[chunk][-1]
                print(f"  loss_chunk_tokens={chunk}: peak {r['peak_mib']:,.0f} MiB, {r['tokens_per_s']:,.0f} tok/s, "
                      f"losses {r['losses'][0]:.4f} -> {r['losses'][-1]:.4f}", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    def med(chunk: int, key: str) -> float:
        return statistics.median(r[key] for r in results[chunk])

    base = args.chunks[0]
    tokens = args.micro_batch * args.seq_len
    header = (f"{params / 1e6:.1f}M-parameter Llama (hidden 256, 2 layers, untied head) with a {args.vocab:,}-token "
              f"vocabulary, {args.precision}, ZeRO-2, 2 CPU ranks (gloo), micro batch {args.micro_batch} x "
              f"{args.seq_len} tokens ({tokens:,} tokens: full fp32 logits are {tokens * args.vocab * 4 / 2**20:,.0f} "
              f"MiB), {args.steps} steps, medians of {args.repeats} alternating runs, "
              f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores. Peak: rank 0's RSS above its "
              f"pre-model baseline; tokens/s: steps 2-{args.steps}.\n\n"
              f"| train.loss_chunk_tokens | peak MiB | vs {base} | tokens/s | vs {base} | final loss |\n"
              "|---|---|---|---|---|---|\n")
    table = header + "".join(
        f"| {c} | {med(c, 'peak_mib'):,.0f} | {med(c, 'peak_mib') / med(base, 'peak_mib'):.2f}x | "
        f"{med(c, 'tokens_per_s'):,.0f} | {med(c, 'tokens_per_s') / med(base, 'tokens_per_s'):.2f}x | "
        f"{statistics.median(r['losses'][-1] for r in results[c]):.4f} |\n" for c in args.chunks)
    gaps = max(abs(a - b) / b for c in args.chunks for r, ref in zip(results[c], results[base])
               for a, b in zip(r["losses"], ref["losses"]))
    table += f"\nLargest relative gap of any step's loss to the full-logits run of the same repeat: {gaps:.1e}.\n"
    print(table)
    if args.results:
        args.results.write_text(json.dumps({"runs": {str(c): results[c] for c in args.chunks}, "loss_gap": gaps,
                                            "peak_mib": {str(c): med(c, "peak_mib") for c in args.chunks},
                                            "tokens_per_s": {str(c): med(c, "tokens_per_s") for c in args.chunks}},
                                           indent=1))
    if args.write:
        write_section("bench/loss_chunks.py", "Chunked LM head + cross-entropy, large vocabulary", table)


if __name__ == "__main__":
    main()
