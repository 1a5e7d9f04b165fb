#!/usr/bin/env python3
"""Pretraining data at scale: prepare_data throughput and bytes per token, and what a prepared corpus of GBs costs a
training run at start (launch to first step, peak RSS per rank) next to the tiny one, side by side.

    python bench/prepare_data.py [--gb 2.0] [--workdir /tmp/dstrain-bench-data]   (make bench-prepare-data)

The corpus is generated here from a seeded generator (words of the shipped tiny corpus, so the tiny tokenizer
fits it), written as 8 jsonl parts, never shipped. Throughput with 1 and 2 workers is measured on the same part
(one eighth of the corpus, ~2 min each); the whole corpus is prepared with 2 workers. Then train.py runs 3 steps on
2 CPU ranks on each prepared corpus, alternating, twice each; medians are printed.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import psutil
from common import write_section

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable


def generate(folder: Path, total_bytes: float, parts: int = 8, seed: int = 0) -> None:
    if (folder / "done").exists():
        return
    folder.mkdir(parents=True, exist_ok=True)
    text = (ROOT / "data/tiny/train.jsonl").read_text()
    words = np.array(sorted(set(re.findall(r"[a-z]+", " ".join(json.loads(line)["text"] for line in
                                                               text.splitlines()).lower()))))
    rng = np.random.default_rng(seed)
    for p in range(parts):
        written = 0
        with open(folder / f"part-{p}.jsonl", "w") as f:
            while written < total_bytes / parts:
                lengths = rng.integers(50, 600, size=1000)
                picks = words[rng.integers(0, len(words), size=int(lengths.sum()))]
                at = 0
                lines = []
                for n in lengths:
                    lines.append(json.dumps({"text": " ".join(picks[at:at + n])}))
                    at += n
                chunk = "\n".join(lines) + "\n"
                f.write(chunk)
                written += len(chunk)
    (folder / "done").write_text("ok\n")


SHARD_DOCUMENTS = 20_000  # ~8 shards a part: a kill mid-way leaves some finished


def _command(source: Path, output: Path, workers: int) -> list[str]:
    return [PY, "-m", "dstrain.data.prepare_corpus", f"--data.path={source}", "--data.val_fraction=0.001",
            f"--output={output}", f"--workers={workers}", f"--shard_documents={SHARD_DOCUMENTS}"]


def prepare(source: Path, output: Path, workers: int) -> dict:
    """Run prepare_data; its summary line's figures."""
    cmd = _command(source, output, workers)
    started = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=dict(os.environ, TOKENIZERS_PARALLELISM="false"))
    wall = time.perf_counter() - started
    if proc.returncode:
        raise SystemExit(proc.stderr[-3000:])
    m = re.search(r"wrote \d+ shards: ([\d,]+) documents, ([\d,]+) tokens, ([\d,.]+) MiB \(([\d.]+) bytes/token\) in "
                  r"([\d.]+) s: ([\d,]+) tokens/s", proc.stderr)
    if not m:  # everything already written (a rerun of the bench)
        return {"wall_s": wall}
    docs, tokens, mib, bpt, secs, tps = m.groups()
    return {"documents": int(docs.replace(",", "")), "tokens": int(tokens.replace(",", "")), "MiB": float(mib.replace(",", "")),
            "bytes_per_token": float(bpt), "tokenize_s": float(secs), "tokens_per_s": int(tps.replace(",", "")),
            "wall_s": wall}


def kill_and_rerun(source: Path, output: Path, reference: Path, after_s: float = 15.0) -> dict:
    """SIGKILL prepare_data (2 workers, its whole process group) mid-way, run it again: the same bytes as `reference`."""
    import signal
    subprocess.run(["rm", "-rf", str(output)])
    cmd = _command(source, output, 2)
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    time.sleep(after_s)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    kept = len(list(output.glob("train-*.json")))
    partial = len(list(output.glob("*.partial")))
    rerun = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    same = subprocess.run(["diff", "-r", str(output), str(reference)], capture_output=True).returncode == 0
    return {"killed_after_s": after_s, "shards_finished_before_kill": kept, "partial_files_left": partial,
            "rerun_exit": rerun.returncode, "byte_identical_to_uninterrupted": same}


def train(data_dir: Path, run_dir: Path) -> dict:
    """Launch to first step and peak RSS of each rank (sampled every 0.1 s) of a 3-step run on 2 CPU ranks."""
    subprocess.run(["rm", "-rf", str(run_dir)])
    cmd = [str(Path(PY).parent / "deepspeed"), "--num_gpus", "2", "train.py", f"--data.path={data_dir}",
           "--train.max_steps=3", "--eval.every=0", "--eval.max_batches=1", "--log.wandb=false",
           "--log.progress_bar=false", "--checkpoint.every=0", "--output_dir", str(run_dir), "--resume", "never"]
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", MALLOC_MMAP_THRESHOLD_="131072")
    started = time.time()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    peak: dict[int, int] = {}
    while proc.poll() is None:
        try:
            for child in psutil.Process(proc.pid).children(recursive=True):
                if "--local_rank=" in " ".join(child.cmdline()):
                    rank = int(next(a for a in child.cmdline() if a.startswith("--local_rank=")).split("=")[1])
                    peak[rank] = max(peak.get(rank, 0), child.memory_info().rss)
        except psutil.Error:
            pass
        time.sleep(0.1)
    err = proc.stderr.read()
    if proc.returncode:
        raise SystemExit(err[-3000:])
    first = json.loads(next(line for line in (run_dir / "metrics.jsonl").read_text().splitlines() if '"loss"' in line))
    return {"first_step_s": first["time"] - first["step_s"] - started, "peak_rss_mib": [peak[r] / 2**20 for r in sorted(peak)]}


def section(r: dict) -> str:
    one, two, whole = r["part0_workers1"], r["part0_workers2"], r["whole_workers2"]
    tiny, big = r["train_tiny"], r["train_whole"]
    kill = r["kill_and_rerun"]
    gib = r["corpus_bytes"] / 2**30
    return f"""Generated corpus: {gib:.2f} GiB of jsonl (8 parts, seeded words of the shipped corpus), recipes/tiny/model's
tokenizer (vocabulary under 65,500: uint16 tokens), `--shard_documents {SHARD_DOCUMENTS}`, x86_64, 2 cores.
tokens/s is prepare_data's own figure (tokenizing and writing shards, after `datasets` has loaded the jsonl);
wall includes start-up and loading (the jsonl already in `datasets` Arrow cache from an earlier run).

| prepare_data | documents | tokens | tokens/s | wall s | shard MiB | bytes/token |
|---|---|---|---|---|---|---|
| one part, 1 worker | {one['documents']:,} | {one['tokens']:,} | {one['tokens_per_s']:,} | {one['wall_s']:.0f} | {one['MiB']:,.1f} | {one['bytes_per_token']:.2f} |
| one part, 2 workers | {two['documents']:,} | {two['tokens']:,} | {two['tokens_per_s']:,} ({two['tokens_per_s'] / one['tokens_per_s']:.2f}x) | {two['wall_s']:.0f} | {two['MiB']:,.1f} | {two['bytes_per_token']:.2f} |
| whole corpus, 2 workers | {whole['documents']:,} | {whole['tokens']:,} | {whole['tokens_per_s']:,} | {whole['wall_s']:.0f} | {whole['MiB']:,.1f} | {whole['bytes_per_token']:.2f} |

1 and 2 workers wrote byte-identical shards: {r['part0_byte_identical_1_vs_2_workers']}. Killed (SIGKILL to the
process group) {kill['killed_after_s']:.0f} s into a 2-worker run of one part, with {kill['shards_finished_before_kill']}
shards finished and {kill['partial_files_left']} partial files left, then run again: exit {kill['rerun_exit']},
byte-identical to the uninterrupted run: {kill['byte_identical_to_uninterrupted']}.

Training on the prepared whole corpus against the prepared tiny corpus (shipped data/tiny, ~0.3M tokens), the
tiny recipe, 3 steps on 2 CPU ranks (gloo), runs alternating, medians of {len(tiny['runs'])}:

| corpus | tokens | launch to first step s | peak RSS rank 0 / rank 1 MiB |
|---|---|---|---|
| tiny | {r['tiny_tokens']:,} | {tiny['first_step_s_median']:.1f} | {tiny['peak_rss_mib_median_per_rank'][0]:.0f} / {tiny['peak_rss_mib_median_per_rank'][1]:.0f} |
| {gib:.1f} GiB | {r['whole_tokens']:,} | {big['first_step_s_median']:.1f} | {big['peak_rss_mib_median_per_rank'][0]:.0f} / {big['peak_rss_mib_median_per_rank'][1]:.0f} |

Launch to first step is mostly imports and DeepSpeed's engine; opening a prepared corpus maps its shards and
reads the manifest. The {r['whole_tokens'] // 128:,} sequences of the big corpus at seq_len 128 are past
2^20, so its epoch order is the lazy permutation (no per-sample index held in memory).
"""


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--gb", type=float, default=2.0)
    parser.add_argument("--workdir", default="/tmp/dstrain-bench-data")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--from_json", default=None, help="only write docs/benchmarks.md's section from this results file")
    args = parser.parse_args()
    if args.from_json:
        results = json.loads(Path(args.from_json).read_text())
        write_section("bench/prepare_data.py", "Pretraining data: prepare_data and memory-mapped shards", section(results))
        return
    work = Path(args.workdir)
    corpus = work / "corpus"
    t = time.perf_counter()
    generate(corpus, args.gb * 2**30)
    size = sum(p.stat().st_size for p in corpus.glob("*.jsonl"))
    print(f"corpus: {size / 2**30:.2f} GiB of jsonl in 8 parts ({time.perf_counter() - t:.0f} s to generate)")
    part = work / "part0"
    part.mkdir(exist_ok=True)
    if not (part / "part-0.jsonl").exists():
        os.link(corpus / "part-0.jsonl", part / "part-0.jsonl")
    results: dict = {"corpus_bytes": size}
    for workers in (1, 2):
        out = work / f"part0-w{workers}"
        subprocess.run(["rm", "-rf", str(out)])
        results[f"part0_workers{workers}"] = prepare(part, out, workers)
        print(f"one part, {workers} worker(s): {results[f'part0_workers{workers}']}", flush=True)
    identical = subprocess.run(["diff", "-r", str(work / "part0-w1"), str(work / "part0-w2")]).returncode == 0
    results["part0_byte_identical_1_vs_2_workers"] = identical
    results["kill_and_rerun"] = kill_and_rerun(part, work / "part0-killed", work / "part0-w2")
    print(f"killed mid-way and rerun: {results['kill_and_rerun']}", flush=True)
    subprocess.run(["rm", "-rf", str(work / "whole")])
    results["whole_workers2"] = prepare(corpus, work / "whole", 2)
    print(f"whole corpus, 2 workers: {results['whole_workers2']}", flush=True)
    tiny = work / "tiny"
    if not (tiny / "manifest.json").exists():
        prepare(ROOT / "data/tiny", tiny, 1)
    runs: dict = {"tiny": [], "whole": []}
    for _ in range(args.repeats):
        for name in ("tiny", "whole"):
            runs[name].append(train(work / name, work / f"run-{name}"))
            print(f"train on {name}: {runs[name][-1]}", flush=True)
    for name, rows in runs.items():
        results[f"train_{name}"] = {"first_step_s_median": statistics.median(r["first_step_s"] for r in rows),
                                    "peak_rss_mib_median_per_rank": [statistics.median(r["peak_rss_mib"][k] for r in rows)
                                                                     for k in range(2)], "runs": rows}
    manifest = json.loads((work / "whole" / "manifest.json").read_text())
    results["whole_tokens"] = manifest["splits"]["train"]["tokens"]
    results["tiny_tokens"] = json.loads((tiny / "manifest.json").read_text())["splits"]["train"]["tokens"]
    results["whole_bin_idx_bytes"] = manifest["splits"]["train"]["bytes"]
    a, b = results["train_tiny"], results["train_whole"]
    print(f"launch to first step: tiny {a['first_step_s_median']:.1f} s, {size / 2**30:.1f} GiB corpus "
          f"{b['first_step_s_median']:.1f} s; peak RSS per rank (MiB): tiny {a['peak_rss_mib_median_per_rank']}, "
          f"big {b['peak_rss_mib_median_per_rank']}")
    (ROOT / "docs" / "prepare_data_bench.json").write_text(json.dumps(results, indent=1) + "\n")
    write_section("bench/prepare_data.py", "Pretraining data: prepare_data and memory-mapped shards", section(results))


if __name__ == "__main__":
    main()
