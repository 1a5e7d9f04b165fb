#!/usr/bin/env python3
"""Expert parallelism against replicated and ZeRO-3-partitioned experts, side by side on one MoE model.

One Mixtral-shaped model (8 experts of which 2 run per token; the experts hold ~93% of the parameters) trains the
same steps at 2 ranks under three DeepSpeed configs, each through the real `deepspeed` launcher: ep2_zero2.json
(DeepSpeed's AutoEP: each rank holds 4 of every layer's 8 experts, tokens travel to them by all-to-all; ZeRO-2
for the rest), zero2.json (every rank holds every expert; gradients and optimizer states partitioned) and
zero3.json (weights partitioned too, gathered for each layer's forward and backward). Per config: median
tokens/s over the steps after --skip, rank 0's peak memory above its baseline (run_dir/memory.json, glibc's mmap
threshold fixed as bench/memory.py does), and the median bytes rank 0 sends per step (metrics.jsonl comm_bytes,
of which comm_bytes_all_to_all), with the model-state bytes per rank that mixed-precision Adam needs under each
layout beside them: ZeRO-2 2 + 14/N bytes per parameter, ZeRO-3 16/N, EP E: an expert's 16 bytes on one rank of
E (its expert-data-parallel group holds 1 rank at E = N) and ZeRO-2 for the rest.

    python bench/moe.py [--layers 4] [--steps 8] [--skip 3] [--write]
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

from common import ROOT, free_port, write_section

CONFIGS = ("ep2_zero2.json", "zero2.json", "zero3.json")
RANKS = 2


def make_moe(out: Path, layers: int) -> tuple[int, int]:
    """A Mixtral of width 512 with the tiny recipe's tokenizer, random weights: (parameters, expert parameters)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    tiny = AutoConfig.from_pretrained(ROOT / "recipes/tiny/model")
    config = AutoConfig.for_model("mixtral", vocab_size=tiny.vocab_size, hidden_size=512, intermediate_size=1024,
                                  num_hidden_layers=layers, num_attention_heads=8, num_key_value_heads=4,
                                  head_dim=64, num_local_experts=8, num_experts_per_tok=2,
                                  max_position_embeddings=512, tie_word_embeddings=True,
                                  bos_token_id=tiny.bos_token_id, eos_token_id=tiny.eos_token_id,
                                  pad_token_id=tiny.pad_token_id)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(ROOT / "recipes/tiny/model" / name, out / name)
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    return sum(p.numel() for p in model.parameters()), experts


def model_state_bytes(config: str, params: int, experts: int) -> float:
    """Per rank, bf16 weights and gradients, fp32 master weights and Adam moments (the ZeRO paper's 16 bytes)."""
    dense = params - experts
    if config == "zero3.json":
        return 16 * params / RANKS
    zero2 = 2 + 14 / RANKS
    if config == "ep2_zero2.json":  # each expert on one rank of 2, its states whole there
        return zero2 * dense + 16 * experts / 2
    return zero2 * params


def run(config: str, model: Path, work: Path, steps: int) -> dict:
    out = work / config.removesuffix(".json")
    cmd = [str(Path(sys.executable).parent / "deepspeed"), "--num_gpus", str(RANKS), "--master_port",
           str(free_port()), "train.py", "--ds_config", config, "--output_dir", str(out),
           f"--model.name_or_path={model}", "--train.precision=bf16", f"--train.max_steps={steps}",
           "--train.micro_batch_size=4", "--train.grad_accum_steps=1", "--train.seq_len=128", "--eval.every=0",
           "--log.wandb=false", "--log.progress_bar=false", "--checkpoint.every=0", "--checkpoint.export_hf=false",
           "--fault.sdc_check_every=0"]
    env = dict(os.environ, OMP_NUM_THREADS="1", DSTRAIN_CACHE=str(work / "cache"), MALLOC_MMAP_THRESHOLD_="131072")
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"{config} failed:\n{proc.stderr[-3000:]}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {"rows": [r for r in rows if "loss" in r], "memory": json.loads((out / "memory.json").read_text()),
            "said": proc.stderr}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4, help="4 layers of width 512: 54M parameters")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--skip", type=int, default=3, help="steps left out of the medians (start-up)")
    parser.add_argument("--write", action="store_true", help="update docs/benchmarks.md")
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="dstrain-bench-moe-"))
    try:
        params, experts = make_moe(work / "model", args.layers)
        got = {config: run(config, work / "model", work, args.steps) for config in CONFIGS}
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if "expert parallelism:" not in got["ep2_zero2.json"]["said"]:
        raise SystemExit("the EP run did not report its expert parallelism")

    table = []
    for config, result in got.items():
        rows = result["rows"][args.skip:]
        table.append({"config": config, "tokens_per_s": statistics.median(r["tokens_per_s"] for r in rows),
                      "peak": result["memory"]["peak_above_baseline_bytes"],
                      "bytes": statistics.median(r["comm_bytes"] for r in rows),
                      "all_to_all": statistics.median(r.get("comm_bytes_all_to_all", 0.0) for r in rows),
                      "states": model_state_bytes(config, params, experts)})
    mib = 2 ** 20
    lines = [f"{params / 1e6:.1f}M-parameter Mixtral ({experts / params:.0%} of it in 8 experts per layer, 2 per "
             f"token, {args.layers} layers of width 512), bf16, {RANKS} CPU ranks (gloo), micro batch 4 x 128 "
             f"tokens, {args.steps} steps (medians over the last {args.steps - args.skip}), "
             f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores.", "",
             "| config | tokens/s | peak MiB per rank | model states MiB (16 B/param rule) | MiB sent per step | "
             "of which all-to-all |", "|---|---|---|---|---|---|"]
    for t in table:
        lines.append(f"| {t['config']} | {t['tokens_per_s']:,.0f} | {t['peak'] / mib:,.0f} | {t['states'] / mib:,.0f} "
                     f"| {t['bytes'] / mib:,.1f} | {t['all_to_all'] / mib:,.1f} |")
    ep, z2, z3 = table
    lines += ["", f"EP against ZeRO-2 with every expert on every rank: peak memory {ep['peak'] / z2['peak']:.2f}x "
              f"(model states {ep['states'] / z2['states']:.2f}x), tokens/s {ep['tokens_per_s'] / z2['tokens_per_s']:.2f}x, "
              f"bytes sent {ep['bytes'] / z2['bytes']:.2f}x; against ZeRO-3: peak memory {ep['peak'] / z3['peak']:.2f}x, "
              f"tokens/s {ep['tokens_per_s'] / z3['tokens_per_s']:.2f}x, bytes sent {ep['bytes'] / z3['bytes']:.2f}x."]
    text = "\n".join(lines) + "\n"
    print(text)
    print(json.dumps({"params": params, "experts": experts, "table": table}))
    if args.write:
        write_section("bench/moe.py", "Expert parallelism against replicated and partitioned experts", text)


if __name__ == "__main__":
    main()
