#!/usr/bin/env python3
"""The same GRPO job through train.py and through TRL's GRPOTrainer (bench/trl_grpo_peer.py), side by side.

Same model (by default the default recipe's export, runs/tiny-pretrain/hf from `make train`, so completions end
and rewards move; --random takes a random Llama of --layers x --hidden instead), the same prompts
(data/tiny_grpo), reward functions (recipes/tiny/rewards.py), prompts per rank, num_generations,
max_completion_length, temperature 1 (no top-p/top-k), DeepSpeed JSON (its scheduler left to each side's own
cosine), steps, lr, fp32 on 2 CPU ranks under the `deepspeed` launcher (bf16 on GPUs); runs alternate. Medians over
--repeats: prompts/s over the steps after --skip (sampling, scoring and the update: the whole step), peak RSS per
rank, launch to first step, mean reward of the last 5 steps (each side samples its own completions, so rewards are
indicative). Target (issue 56): >= 1.3x TRL's prompts/s at no more memory. --write replaces this script's section
of docs/benchmarks.md. On a GPU machine the table adds each side's torch.cuda.max_memory_allocated() (rank 0).

    python bench/grpo.py [--repeats 3] [--steps 20] [--write]
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

from common import free_port, make_llama, write_section
from speed import (
    alternating_runs,
    bench_ds_config,
    gpu_count,
    measured_side,
    peer_arguments,
    peer_machine,
    peer_medians,
)

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
SYSTEMS = {"dstrain": "dstrain train.py", "trl": "TRL GRPOTrainer (quick start, transformers generate)"}
REWARDS = ROOT / "recipes/tiny/rewards.py"


def run(system: str, args, model: Path, ds_json: Path, work: Path, index: int) -> dict:
    out = work / f"{system}-{index}"
    out.mkdir(parents=True)
    port = free_port()
    common = [str(BIN / "deepspeed"), "--num_gpus", str(args.ranks), "--master_port", str(port)]
    lr = "1e-4"
    if system == "dstrain":
        cmd = common + ["train.py", "--ds_config", str(ds_json), "--output_dir", str(out),
                        f"--model.name_or_path={model}", "--data.path=data/tiny_grpo", "--data.format=prompt",
                        "--data.val_fraction=0",
                        f"--rl.reward_funcs=[{REWARDS}:says_the_count,{REWARDS}:one_sentence]",
                        f"--rl.num_generations={args.generations}",
                        f"--rl.max_completion_length={args.completion}", "--rl.log_completions_every=0",
                        f"--train.max_steps={args.steps}", f"--train.seq_len={args.seq_len}",
                        f"--train.micro_batch_size={args.prompts}", f"--train.precision={args.precision}",
                        f"--train.lr={lr}", "--train.warmup_steps=2", "--train.min_lr_ratio=0",
                        "--train.weight_decay=0", "--log.wandb=false", "--log.progress_bar=false",
                        "--log.plot=false", "--checkpoint.every=0", "--checkpoint.export_hf=false"]
    else:
        cmd = common + ["bench/trl_grpo_peer.py", "--model", str(model), "--data", str(ROOT / "data/tiny_grpo"),
                        "--rewards", str(REWARDS), "--ds_config", str(ds_json), "--output_dir", str(out),
                        "--result", str(out / "result.json"), f"--max_steps={args.steps}",
                        f"--prompts_per_rank={args.prompts}", f"--num_generations={args.generations}",
                        f"--max_completion_length={args.completion}", f"--lr={lr}", f"--precision={args.precision}"]
    return measured_side(system, index, cmd, out, port, args.steps, args.skip, args.prompts * args.ranks,
                         ("reward", "rewards"), ("prompts_per_s", "final_reward"), {"TRL_EXPERIMENTAL_SILENCE": "1"})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--skip", type=int, default=5, help="steps left out of prompts/s (warm-up)")
    parser.add_argument("--model", default=str(ROOT / "runs/tiny-pretrain/hf"))
    parser.add_argument("--random", action="store_true", help="a random Llama of --layers x --hidden instead")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--prompts", type=int, default=4, help="prompts per rank per step")
    parser.add_argument("--generations", type=int, default=8)
    parser.add_argument("--completion", type=int, default=32, help="max_completion_length")
    parser.add_argument("--seq_len", type=int, default=96, help="dstrain's train.seq_len (prompt + completion)")
    args = peer_arguments(parser, SYSTEMS)
    with tempfile.TemporaryDirectory(prefix="bench-grpo-") as tmp:
        work = Path(tmp)
        if args.random:
            model = work / "model"
            params = make_llama(model, hidden_size=args.hidden, intermediate_size=int(args.hidden * 2.6875),
                                num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=2)
            described = f"a random {params / 1e6:.1f}M-parameter Llama ({args.layers} x {args.hidden})"
        else:
            model = Path(args.model)
            if not (model / "config.json").is_file():
                raise SystemExit(f"{model} is not a model directory: run `make train` first, or pass --random")
            described = f"{model.relative_to(ROOT) if model.is_relative_to(ROOT) else model}"
        ds_json = bench_ds_config(args.ds_config, args.precision, work / "ds_config.json")
        runs = alternating_runs(args, lambda system, index: run(system, args, model, ds_json, work, index),
                                ("prompts_per_s", "prompts/s", 2), ("final_reward", "final reward", 3))
    got = peer_medians(runs, args.systems, ("prompts_per_s", "first_step_s", "peak_rss_bytes", "final_reward", "peak_cuda_bytes"))
    machine = peer_machine(args.ranks)
    lines = [f"{time.strftime('%Y-%m-%d')}, {machine}, `{args.ds_config}` (scheduler dropped), {args.precision}; "
             f"{described}; data/tiny_grpo with recipes/tiny/rewards.py; {args.prompts} prompts per rank per step x "
             f"{args.generations} completions of at most {args.completion} tokens, temperature 1; {args.steps} "
             f"steps, prompts/s over steps {args.skip + 1}-{args.steps}; medians of {args.repeats} alternating runs.",
             "", "| | prompts/s | launch to first step, s | peak RSS per rank, MiB | reward (last 5 steps) |"
             + (" max allocated GiB (rank 0) |" if gpu_count() else ""),
             "|---|---|---|---|---|" + ("---|" if gpu_count() else "")]
    for s in args.systems:
        g = got[s]
        lines.append(f"| {SYSTEMS[s]} | {g['prompts_per_s']:.2f} | {g['first_step_s']:.1f} | "
                     f"{g['peak_rss_bytes'] / 2**20:,.0f} | {g['final_reward']:.3f} |"
                     + (f" {g['peak_cuda_bytes'] / 2**30:.1f} |" if gpu_count() else ""))
    if "dstrain" in got and "trl" in got:
        ratio = got["dstrain"]["prompts_per_s"] / got["trl"]["prompts_per_s"]
        lines += ["", f"- dstrain / {SYSTEMS['trl']}: prompts/s {ratio:.2f}x, "
                      f"peak RSS {got['dstrain']['peak_rss_bytes'] / got['trl']['peak_rss_bytes']:.2f}x, "
                      f"time to first step {got['dstrain']['first_step_s'] / got['trl']['first_step_s']:.2f}x"]
    body = "\n".join(lines) + "\n"
    print(body)
    if args.write:
        write_section("bench/grpo.py", "Learning from rewards against TRL", body + "\n")


if __name__ == "__main__":
    main()
