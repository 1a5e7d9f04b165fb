#!/usr/bin/env python3
"""dstrain's train.py against a plain PyTorch loop and the Hugging Face Trainer on the same job, side by side.

The plain loop (bench/plain_loop.py, eager and torch.compile'd) is the floor: what the chip does with no framework,
on the same model, blocks, data order, schedule, weight decay and clipping, so train.py's losses equal its step by
step (fp32) and every speed is also a ratio against it.

Same model (random init from one saved checkpoint), data (data/tiny packed into seq_len blocks, documents
joined by EOS), sequence length, global batch, optimizer and schedule (AdamW, cosine to 10% of the peak LR
after a linear warm-up) and DeepSpeed JSON (default ds_configs/zero2.json, with its scheduler left to each
side and bf16 set to the run's precision). Both run under the `deepspeed` launcher; the runs alternate
(A B, B A, ...) and every run starts with empty tokenization caches.

Measured the same way for both, outside their own logging:
  tokens/s          global tokens per step x steps / wall time between the end of step `--skip` and the last
                    step (train.py's metrics.jsonl rows and a Trainer callback both stamp step ends): the
                    steady state, after warm-up (train.compile compiles in the background while the first
                    steps run eager; the run records the step it switched at, and the table flags a window
                    that started before it)
  first step        launch of the `deepspeed` command -> end of the first optimizer step
  last step         launch -> end of the last step: the whole job, start-up and warm-up included
  peak memory       each rank's VmHWM (peak RSS) polled from /proc; on GPUs also nvidia-smi's per-process use and
                    rank 0's torch.cuda.max_memory_allocated() over the whole run (train.py's memory.json: the
                    larger of set-up's and training's peaks; the others report it at their end)
  MFU               on GPUs with a known bf16 peak: tokens/s x dstrain.flops' FLOPs per token / (ranks x peak)
  step time ratio   train.py's seconds per step over the plain loop's (its overhead; the inverse of the tokens/s
                    ratio), eager against eager and compiled against compiled
  loss gap          the largest per-step |loss difference| between train.py and the plain loop (first runs)
  final loss        mean training loss of the last 5 steps
The Trainer's run must have built a DeepSpeedEngine (checked from trainer.model_wrapped), or the bench stops.

    python bench/speed.py [--preset cpu|large|gpu-1b] [--repeats 3] [--ds_config zero2.json] [--write]
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from common import free_port, make_llama, write_section

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
RESULTS = ROOT / "docs" / "speed_bench.json"
CHART = ROOT / "docs" / "speed_vs_trainer.png"
PRESETS = {
    # a few minutes on 2 CPU cores: ~3M parameters, 2 ranks x 8 x 256 tokens per step
    "cpu": dict(sizes=dict(hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=8,
                           num_key_value_heads=4, head_dim=32),
                seq_len=256, micro_batch_size=8, grad_accum_steps=1, steps=64, skip=36, precision="fp32"),
    # ~0.3M parameters and half the tokens: the suite's check that the bench runs (tests/e2e/test_bench_speed.py), its
    # steps a fifth of `cpu`'s; no speed figure worth quoting
    "cpu-check": dict(sizes=dict(hidden_size=128, intermediate_size=344, num_hidden_layers=2, num_attention_heads=4,
                                 num_key_value_heads=2, head_dim=32),
                      seq_len=256, micro_batch_size=8, grad_accum_steps=1, steps=12, skip=2, precision="fp32"),
    # ~100M parameters: minutes per run on CPU, seconds on a GPU
    "large": dict(sizes=dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=12,
                             num_key_value_heads=12, head_dim=64),
                  seq_len=512, micro_batch_size=4, grad_accum_steps=2, steps=30, skip=10, precision="bf16"),
    # Llama-3.2-1B's shape (1.24B parameters with its 128k vocabulary), seq 2048: the GPU MFU target
    "gpu-1b": dict(sizes=dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                              num_key_value_heads=8, head_dim=64, vocab_size=128256, max_position_embeddings=2048,
                              tie_word_embeddings=True),
                   seq_len=2048, micro_batch_size=4, grad_accum_steps=1, steps=30, skip=5, precision="bf16"),
}
SYSTEMS = {  # name: (label, compiled); the Trainer with torch_compile only with --peer-compile
    "plain": ("plain PyTorch loop", False), "plain_compile": ("plain PyTorch loop, torch.compile", True),
    "dstrain": ("dstrain train.py", False), "dstrain_compile": ("dstrain train.py, train.compile=true", True),
    "hf_trainer": ("HF Trainer", False), "hf_trainer_compile": ("HF Trainer, torch_compile=True", True)}
RATIOS = (("dstrain", "plain"), ("dstrain_compile", "plain_compile"), ("dstrain_compile", "plain"),
          ("dstrain", "hf_trainer"), ("dstrain_compile", "hf_trainer"), ("dstrain_compile", "hf_trainer_compile"))


def gpu_count() -> int:
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return 0
    return sum(1 for line in out.splitlines() if line.startswith("GPU"))


def bench_ds_config(name: str, precision: str, out: Path) -> Path:
    """The shipped JSON both sides get: its scheduler left to each side's own cosine, bf16 as the run's."""
    path = Path(name) if Path(name).exists() else ROOT / "ds_configs" / name
    cfg = json.loads(path.read_text())
    cfg.pop("scheduler", None)
    cfg.setdefault("bf16", {})["enabled"] = precision == "bf16"
    if not gpu_count():  # torch's AdamW, which train.py takes on CPU ranks (ds_config.py): the same update, and the
        # Trainer's DeepSpeed would otherwise JIT-build its CPU FusedAdam (41 s here) inside the comparison
        cfg.setdefault("optimizer", {}).setdefault("params", {})["torch_adam"] = True
    out.write_text(json.dumps(cfg, indent=1))
    return out


def launch_measured(system: str, index: int, cmd: list[str], out: Path, port: int, env: dict,
                    cwd: Path) -> tuple[float, PeakMemory]:
    """One side of a peer bench (bench/dpo.py, bench/grpo.py): its launcher started in `cwd` with output in
    out/log.txt, every rank's peak memory polled; DeepSpeed's shared-memory files the peers leave removed; a failed
    run stops the bench with its last lines. Returns (launch time, the polled memory)."""
    launched = time.time()
    with open(out / "log.txt", "w") as log:
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT)
        with PeakMemory(proc.pid) as memory:
            proc.wait()
    for leaked in glob.glob(f"/dev/shm/deepspeed_allreduce_buffer_*_{port}_*"):  # the peer leaves its own
        os.unlink(leaked)
    if proc.returncode:
        raise SystemExit(f"{system} run {index} failed ({proc.returncode}); last lines of {out / 'log.txt'}:\n"
                         + "\n".join((out / "log.txt").read_text().splitlines()[-25:]))
    return launched, memory


def measured_side(system: str, index: int, cmd: list[str], out: Path, port: int, steps: int, skip: int,
                  per_step: float, figure: tuple[str, str], names: tuple[str, str],
                  extra_env: dict | None = None) -> dict:
    """One run of a peer bench (bench/dpo.py, grpo.py, vlm.py): `cmd` launched in the repository with empty caches,
    then its step end times and a per-step figure, from train.py's metrics.jsonl (`figure[0]`, e.g. loss) or the
    peer's result.json (`figure[1]`, e.g. losses). Returns, under `names`, the rate (per_step units over the steps
    after `skip`) and the figure's mean over the last 5 steps, with launch to first step and the peak memory."""
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", WANDB_MODE="disabled", DSTRAIN_CACHE=str(out / "cache"),
               HF_DATASETS_CACHE=str(out / "hf_datasets"), OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    env.update(extra_env or {})
    # no MALLOC_MMAP_THRESHOLD_ default (it slows CPU steps ~1.5x, docs/planning.md): both sides get the caller's
    launched, memory = launch_measured(system, index, cmd, out, port, env, ROOT)
    if system.startswith("dstrain"):
        rows, cuda_peak = dstrain_side(out)
        ends, values = [r["time"] for r in rows], [r[figure[0]] for r in rows]
    else:
        result = peer_side(out)
        ends, values, cuda_peak = result["step_end"], result[figure[1]], result.get("peak_cuda_bytes") or 0
    if len(ends) != steps:
        raise SystemExit(f"{system} run {index}: {len(ends)} step times for {steps} steps")
    return {"system": system, "run": index, names[0]: per_step * (steps - skip) / (ends[-1] - ends[skip - 1]),
            "first_step_s": ends[0] - launched, names[1]: statistics.mean(values[-5:]),
            "peak_rss_bytes": max(memory.rss.values() or [0]), "peak_cuda_bytes": cuda_peak}


def peer_table(got: dict, systems: dict, rate: tuple[str, str], final: tuple[str, str]) -> list[str]:
    """A peer bench's table and its ratio lines: a row per system (`systems`: key -> name) of the medians in `got`,
    the rate column (`rate`: key, heading such as pairs/s) and the final figure (`final`: key, heading); then
    dstrain against each other system."""
    gpus = gpu_count()
    lines = [f"| | {rate[1]} | launch to first step, s | peak RSS per rank, MiB | {final[1]} |"
             + (" max allocated GiB (rank 0) |" if gpus else ""), "|---|---|---|---|---|" + ("---|" if gpus else "")]
    for s in got:
        g = got[s]
        lines.append(f"| {systems[s]} | {g[rate[0]]:.1f} | {g['first_step_s']:.1f} | "
                     f"{g['peak_rss_bytes'] / 2**20:,.0f} | {g[final[0]]:.4f} |"
                     + (f" {g['peak_cuda_bytes'] / 2**30:.1f} |" if gpus else ""))
    mine = [s for s in got if s.startswith("dstrain")]
    if mine:
        lines.append("")
    for me in mine:
        ours = got[me]
        for peer in (s for s in got if not s.startswith("dstrain")):
            lines.append(f"- {'dstrain' if me == 'dstrain' else systems[me]} / {systems[peer]}: {rate[1]} {ours[rate[0]] / got[peer][rate[0]]:.2f}x, "
                         f"peak RSS {ours['peak_rss_bytes'] / got[peer]['peak_rss_bytes']:.2f}x, "
                         f"time to first step {ours['first_step_s'] / got[peer]['first_step_s']:.2f}x")
    return lines


def peer_arguments(parser, systems: dict):
    """The arguments every peer bench ends with (its DeepSpeed JSON, the systems to run, --write), parsed, with the
    ranks (every GPU, or 2 CPU ranks) and the precision (bf16 on GPUs, fp32 on CPUs) the machine gives."""
    parser.add_argument("--ds_config", default="zero2.json")
    parser.add_argument("--systems", nargs="+", default=list(systems))
    parser.add_argument("--write", action="store_true")
    args = parser.parse_args()
    args.ranks = gpu_count() or 2
    args.precision = "bf16" if gpu_count() else "fp32"
    return args


def alternating_runs(args, one, rate: tuple[str, str, int], final: tuple[str, str, int]) -> list[dict]:
    """Every system once per repeat, in turn (A B, A B, ...): `one(system, index)` measures a run, whose rate
    (key, unit, decimals) and final figure (key, label, decimals) are printed as it ends."""
    runs = []
    for index in range(args.repeats):
        for system in args.systems:
            r = one(system, index)
            runs.append(r)
            print(f"{system} {index}: {r[rate[0]]:.{rate[2]}f} {rate[1]}, first step {r['first_step_s']:.1f} s, "
                  f"peak RSS {r['peak_rss_bytes'] / 2**20:,.0f} MiB, {final[1]} {r[final[0]]:.{final[2]}f}",
                  flush=True)
    return runs


def peer_medians(runs: list[dict], systems: list[str], keys: tuple) -> dict:
    """A peer bench's figures: per system, the median of each key over its runs."""
    return {s: {k: statistics.median(r[k] for r in runs if r["system"] == s) for k in keys} for s in systems}


def peer_machine(ranks: int) -> str:
    """The machine a peer bench ran on, for its table's first line."""
    if gpu_count():
        return subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                              text=True).stdout.splitlines()[0] + f" x {ranks}"
    return f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, 2 CPU ranks"


def dstrain_side(out: Path) -> tuple[list[dict], int]:
    """train.py's side of a peer bench: its metrics.jsonl step rows, and on CUDA its peak allocated bytes (the larger
    of the set-up and training peaks, memory.json)."""
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    mem = json.loads((out / "memory.json").read_text())
    cuda_peak = max(mem["peak_bytes"], mem["baseline_bytes"] + mem["setup_peak_above_baseline_bytes"]) \
        if mem["device"] == "cuda" else 0
    return [r for r in rows if "loss" in r], cuda_peak


def peer_side(out: Path) -> dict:
    """A Trainer peer's side: its result.json, refused if no DeepSpeed engine was built."""
    result = json.loads((out / "result.json").read_text())
    if not result["deepspeed_engine"]:
        raise SystemExit("the peer did not build a DeepSpeed engine: the comparison would be meaningless")
    return result


class PeakMemory:
    """Polls the peak RSS (VmHWM) of every rank process under a launcher, and nvidia-smi's per-process use."""

    def __init__(self, root_pid: int, interval: float = 0.05):
        self.root, self.interval = root_pid, interval
        self.rss: dict[int, int] = {}  # rank pid -> bytes
        self.gpu: dict[int, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()

    def _ranks(self) -> list[int]:
        children: dict[int, list[int]] = {}
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                try:
                    ppid = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
                except (OSError, IndexError, ValueError):
                    continue
                children.setdefault(ppid, []).append(int(entry))
        found, todo = [], [self.root]
        while todo:
            pid = todo.pop()
            for child in children.get(pid, []):
                todo.append(child)
                try:
                    if b"--local_rank" in Path(f"/proc/{child}/cmdline").read_bytes():
                        found.append(child)
                except OSError:
                    pass
        return found

    def _run(self) -> None:
        polls = 0
        while not self._stop.is_set():
            for pid in self._ranks():
                try:
                    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                        if line.startswith("VmHWM:"):
                            self.rss[pid] = max(self.rss.get(pid, 0), int(line.split()[1]) * 1024)
                except OSError:
                    pass
            if polls % 10 == 0 and shutil.which("nvidia-smi"):
                self._poll_gpu()
            polls += 1
            self._stop.wait(self.interval)

    def _poll_gpu(self) -> None:
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True).stdout
        for line in out.splitlines():
            pid, used = (int(x) for x in line.split(","))
            if pid in self.rss:
                self.gpu[pid] = max(self.gpu.get(pid, 0), used * 2**20)


def run(system: str, args, preset: dict, model: Path, ds_json: Path, work: Path, ranks: int, index: int) -> dict:
    out = work / f"{system}-{index}"
    steps = preset["steps"]
    compiled = SYSTEMS[system][1]
    port = free_port()
    common = [str(BIN / "deepspeed"), "--num_gpus", str(ranks), "--master_port", str(port)]
    if system.startswith("dstrain"):
        cmd = common + ["train.py", "--ds_config", str(ds_json), "--output_dir", str(out),
                        f"--model.name_or_path={model}", f"--train.max_steps={steps}",
                        f"--train.seq_len={preset['seq_len']}", f"--train.micro_batch_size={preset['micro_batch_size']}",
                        f"--train.grad_accum_steps={preset['grad_accum_steps']}",
                        f"--train.precision={preset['precision']}", "--train.lr=3e-3", "--train.warmup_steps=10",
                        "--eval.max_batches=0", "--log.wandb=false", "--log.progress_bar=false", "--log.plot=false",
                        "--checkpoint.every=0", "--checkpoint.export_hf=false", f"--train.compile={str(compiled).lower()}",
                        *args.dstrain_args]
    elif system.startswith("plain"):
        cmd = common + ["bench/plain_loop.py", "--model", str(model), "--data", str(ROOT / "data/tiny"),
                        "--result", str(out / "result.json"), f"--max_steps={steps}", f"--seq_len={preset['seq_len']}",
                        f"--micro_batch_size={preset['micro_batch_size']}",
                        f"--grad_accum_steps={preset['grad_accum_steps']}", f"--precision={preset['precision']}",
                        "--lr=3e-3", "--warmup_steps=10", *(["--compile"] if compiled else []),
                        *getattr(args, "plain_args", [])]
    else:
        cmd = common + ["bench/hf_trainer_peer.py", "--model", str(model), "--data", str(ROOT / "data/tiny"),
                        "--ds_config", str(ds_json), "--output_dir", str(out), "--result", str(out / "result.json"),
                        f"--max_steps={steps}", f"--seq_len={preset['seq_len']}",
                        f"--micro_batch_size={preset['micro_batch_size']}",
                        f"--grad_accum_steps={preset['grad_accum_steps']}", f"--precision={preset['precision']}",
                        "--lr=3e-3", "--warmup_steps=10", *(["--torch_compile"] if compiled else []),
                        *getattr(args, "peer_args", [])]
    out.mkdir(parents=True)
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", WANDB_MODE="disabled",
               DSTRAIN_CACHE=str(out / "cache"), HF_DATASETS_CACHE=str(out / "hf_datasets"),  # cold caches,
               TORCHINDUCTOR_CACHE_DIR=str(out / "inductor"))  # compiled kernels too: each run pays a first launch
    # no MALLOC_MMAP_THRESHOLD_ default: on CPU ranks it makes steps ~1.5x slower (docs/planning.md); both sides
    # get whatever the caller set
    if ranks > 1 and "OMP_NUM_THREADS" not in os.environ and not gpu_count():
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 2) // ranks))
    launched = time.time()
    with open(out / "log.txt", "w") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        with PeakMemory(proc.pid) as memory:
            proc.wait()
    # DeepSpeed's CPU backend leaves a 64 MiB /dev/shm buffer per rank; train.py removes its own, the peer not
    for leaked in glob.glob(f"/dev/shm/deepspeed_allreduce_buffer_*_{port}_*"):
        os.unlink(leaked)
    if proc.returncode:
        raise SystemExit(f"{system} run {index} failed ({proc.returncode}); last lines of {out / 'log.txt'}:\n"
                         + "\n".join((out / "log.txt").read_text().splitlines()[-25:]))
    if system.startswith("dstrain"):
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        rows = [r for r in rows if "loss" in r]
        ends, losses, tokens = [r["time"] for r in rows], [r["loss"] for r in rows], rows[0]["tokens"]
        stage = json.loads((out / "ds_config.json").read_text())["zero_optimization"]["stage"]
        engine = "DeepSpeedEngine"
        mem = json.loads((out / "memory.json").read_text())
        cuda_peak = max(mem["peak_bytes"], mem["baseline_bytes"] + mem["setup_peak_above_baseline_bytes"]) \
            if mem["device"] == "cuda" else None
    elif system.startswith("plain"):
        result = json.loads((out / "result.json").read_text())
        ends, losses, stage, engine, cuda_peak = (result["step_end"], result["losses"], None, None,
                                                  result["peak_cuda_bytes"])
        tokens = preset["micro_batch_size"] * preset["grad_accum_steps"] * result["world_size"] * preset["seq_len"]
    else:
        result = json.loads((out / "result.json").read_text())
        if not result["deepspeed_engine"]:
            raise SystemExit("the Trainer did not build a DeepSpeed engine: the comparison would be meaningless")
        ends, losses, stage, engine = result["step_end"], result["losses"], result["zero_stage"], result["deepspeed_engine"]
        cuda_peak = result.get("peak_cuda_bytes")
        tokens = preset["micro_batch_size"] * preset["grad_accum_steps"] * result["world_size"] * preset["seq_len"]
    if len(ends) != steps:
        raise SystemExit(f"{system} run {index}: {len(ends)} step times for {steps} steps")
    skip = args.skip
    switched = re.search(r"in the background; steps from (\d+) use them", (out / "log.txt").read_text())
    return {"system": system, "run": index, "master_port": port, "tokens_per_step": tokens, "zero_stage": stage, "engine": engine,
            "tokens_per_s": tokens * (steps - skip) / (ends[-1] - ends[skip - 1]),
            "first_step_s": ends[0] - launched, "last_step_s": ends[-1] - launched,
            "compiled_from_step": int(switched.group(1)) if switched else None, "final_loss": statistics.mean(losses[-5:]), "losses": losses,
            "peak_rss_bytes": sorted(memory.rss.values()), "peak_gpu_bytes": sorted(memory.gpu.values()),
            "peak_cuda_allocated_bytes": cuda_peak}


def summarize(runs: list[dict], flops_per_token: float, peak_flops: float | None) -> dict:
    """Medians per system; MFU when the device's peak is known (`peak_flops`: all ranks together); ratios of
    each pair in RATIOS that ran; the loss gap of train.py to the plain loop (the same job: ~1e-6 in fp32)."""
    out: dict = {"systems": {}, "flops_per_token": flops_per_token, "peak_flops": peak_flops}
    for system in dict.fromkeys(r["system"] for r in runs):
        mine = [r for r in runs if r["system"] == system]
        tokens_per_s = statistics.median(r["tokens_per_s"] for r in mine)
        cuda = [r["peak_cuda_allocated_bytes"] for r in mine if r.get("peak_cuda_allocated_bytes")]
        out["systems"][system] = {
            "tokens_per_s": tokens_per_s, "step_s": mine[0]["tokens_per_step"] / tokens_per_s,
            "mfu": tokens_per_s * flops_per_token / peak_flops if peak_flops else None,
            "first_step_s": statistics.median(r["first_step_s"] for r in mine),
            "last_step_s": statistics.median(r["last_step_s"] for r in mine),
            "peak_rss_bytes": statistics.median(max(r["peak_rss_bytes"] or [0]) for r in mine),
            "peak_gpu_bytes": statistics.median(max(r["peak_gpu_bytes"] or [0]) for r in mine),
            "peak_cuda_allocated_bytes": statistics.median(cuda) if cuda else None,
            "final_loss": statistics.median(r["final_loss"] for r in mine),
            "zero_stage": mine[0]["zero_stage"], "engine": mine[0]["engine"]}
    got = out["systems"]
    out["ratios"] = {f"{ours} / {peer}": {"tokens_per_s": got[ours]["tokens_per_s"] / got[peer]["tokens_per_s"],
                                          "step_s": got[ours]["step_s"] / got[peer]["step_s"],
                                          "first_step_s": got[ours]["first_step_s"] / got[peer]["first_step_s"],
                                          "last_step_s": got[ours]["last_step_s"] / got[peer]["last_step_s"]}
                     for ours, peer in RATIOS if ours in got and peer in got}
    out["loss_gap_to_plain"] = {}
    for ours, peer in (("dstrain", "plain"), ("dstrain_compile", "plain_compile"), ("hf_trainer", "plain")):
        if ours in got and peer in got:
            a, b = (next(r["losses"] for r in runs if r["system"] == name) for name in (ours, peer))
            gaps = [abs(x - y) for x, y in zip(a, b)]
            out["loss_gap_to_plain"][f"{ours} - {peer}"] = {"max": max(gaps), "final": got[ours]["final_loss"]
                                                              - got[peer]["final_loss"]}
    return out


def table(summary: dict, runs: list[dict], setup: str, skip: int) -> str:
    got = summary["systems"]
    gpu = any(s["peak_gpu_bytes"] for s in got.values())
    mem, key = ("peak GPU MiB per rank (nvidia-smi)", "peak_gpu_bytes") if gpu else ("peak RSS MiB per rank (max)",
                                                                                      "peak_rss_bytes")
    cuda = any(s["peak_cuda_allocated_bytes"] for s in got.values())
    mfu = summary["peak_flops"] is not None
    lines = [setup, "",
             f"| | tokens/s (median) | s/step | {'MFU | ' if mfu else ''}launch to first step, s | launch to last step, s"
             f" | {mem} | {'max allocated GiB (rank 0) | ' if cuda else ''}final loss (last 5 steps) | engine, ZeRO |",
             "|---|---|---|" + ("---|" if mfu else "") + "---|---|---|" + ("---|" if cuda else "") + "---|---|"]
    for system, s in got.items():
        lines.append(f"| {SYSTEMS[system][0]} | {s['tokens_per_s']:,.0f} | {s['step_s']:.3f} | "
                     + (f"{s['mfu']:.1%} | " if mfu else "")
                     + f"{s['first_step_s']:.1f} | {s['last_step_s']:.1f} | {s[key] / 2**20:,.0f} | "
                     + (f"{(s['peak_cuda_allocated_bytes'] or 0) / 2**30:.1f} | " if cuda else "")
                     + f"{s['final_loss']:.4f} | " + (f"{s['engine']}, {s['zero_stage']} |" if s["engine"] else
                                                      "none (torch DDP past 1 rank) |"))
    lines += ["", "| ratio | tokens/s | step time (train.py's overhead against the plain loop) | time to first step "
                  "| launch to last step |", "|---|---|---|---|---|"]
    lines += [f"| {pair} | **{r['tokens_per_s']:.2f}x** | {r['step_s']:.3f} | {r['first_step_s']:.2f} | "
              f"{r['last_step_s']:.2f} |" for pair, r in summary["ratios"].items()]
    for pair, gap in summary["loss_gap_to_plain"].items():
        lines.append(f"\nLoss, {pair}: largest per-step difference {gap['max']:.2e}, final loss {gap['final']:+.4f}"
                     + (" (the Trainer's own blocks, data order, schedule and weight decay: bench/loss_gap.py "
                        "measures each)." if pair.startswith("hf_trainer") else
                        " (the same blocks, order and update: only the order of summation differs)."))
    switches = [r["compiled_from_step"] for r in runs if r["compiled_from_step"] is not None]
    never = [r["run"] for r in runs if r["system"] == "dstrain_compile" and r["compiled_from_step"] is None]
    if never:
        lines += ["", f"WARNING: train.compile's run {', '.join(map(str, never))} never switched to the compiled "
                      f"blocks (its log says why): its tokens/s is eager"]
    if switches:
        lines += ["", f"train.compile switched to the compiled blocks at step {', '.join(map(str, switches))} "
                      f"(tokens/s counts steps {skip + 1} on)."]
        if max(switches) > skip + 1:
            lines.append(f"WARNING: a compiled run switched after step {skip + 1}: its tokens/s mixes eager steps; "
                         f"use more --steps and --skip")
    lines += ["", "Each run, in launch order (tokens/s / first step s / last step s): " + "; ".join(
        f"{r['system']} {r['tokens_per_s']:,.0f} / {r['first_step_s']:.1f} / {r['last_step_s']:.1f}"
        for r in runs), ""]
    return "\n".join(lines) + "\n"


def chart(summary: dict, runs: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    systems = list(summary["systems"])
    names = [SYSTEMS[s][0].replace(", ", ",\n") for s in systems]
    got = summary["systems"]
    key = "peak_gpu_bytes" if any(s["peak_gpu_bytes"] for s in got.values()) else "peak_rss_bytes"
    fig, axes = plt.subplots(1, 5, figsize=(21, 4))
    for ax, field, title, scale in ((axes[0], "tokens_per_s", "tokens/s (dots: runs, bar: median)", 1),
                                    (axes[1], "first_step_s", "launch to first step, s", 1),
                                    (axes[2], "last_step_s", "launch to last step, s", 1),
                                    (axes[3], key, "peak memory per rank, MiB", 2**20)):
        for i, system in enumerate(systems):
            ax.bar(i, got[system][field] / scale, color=f"C{i}", alpha=0.6)
            if field != key:
                values = [r[field] for r in runs if r["system"] == system]
                ax.plot([i] * len(values), values, "k.")
        ax.set_xticks(range(len(systems)), names, fontsize=7)
        ax.set_title(title, fontsize=10)
    for i, system in enumerate(systems):
        first = next(r for r in runs if r["system"] == system)
        axes[4].plot(range(1, len(first["losses"]) + 1), first["losses"], color=f"C{i}", label=SYSTEMS[system][0])
    axes[4].set_title("training loss (first run of each)", fontsize=10)
    axes[4].set_xlabel("optimizer step")
    axes[4].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="cpu")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each system, alternating")
    parser.add_argument("--steps", type=int, default=None, help="optimizer steps per run (default: the preset's)")
    parser.add_argument("--skip", type=int, default=None, help="steps left out of tokens/s (warm-up; default: "
                                                                "the preset's)")
    parser.add_argument("--ds_config", default="zero2.json")
    parser.add_argument("--systems", nargs="+", choices=sorted(SYSTEMS), default=["plain", "plain_compile", "dstrain", "dstrain_compile", "hf_trainer"])
    parser.add_argument("--peer-compile", action="store_true", help="also run the Trainer with torch_compile=True")
    parser.add_argument("--write", action="store_true", help=f"update docs/benchmarks.md, {CHART.name}, {RESULTS.name}")
    parser.add_argument("--results", default=None, help="also write every figure to this JSON file")
    parser.add_argument("--keep", action="store_true", help="keep the run directories and logs (printed)")
    parser.add_argument("dstrain_args", nargs="*", help="extra train.py arguments, after --")
    args = parser.parse_args()
    preset = dict(PRESETS[args.preset], **({"steps": args.steps} if args.steps else {}))
    args.skip = preset["skip"] if args.skip is None else args.skip
    gpus = gpu_count()
    ranks = gpus or 2
    if not gpus and preset["precision"] == "bf16":
        preset["precision"] = "fp32"  # the CPU accelerator emulates bf16 (docs/strategies.md, "Precision")
    if preset["steps"] <= args.skip + 1:
        raise SystemExit(f"--steps must exceed --skip + 1 ({args.skip + 1})")

    systems = args.systems + (["hf_trainer_compile"] if args.peer_compile else [])
    work = Path(tempfile.mkdtemp(prefix="dstrain-speed-"))
    try:
        params = make_llama(work / "model", **preset["sizes"])
        from transformers import AutoConfig

        from dstrain import flops
        flops_per_token = flops.flops_per_token(AutoConfig.from_pretrained(work / "model"), params, preset["seq_len"])
        ds_json = bench_ds_config(args.ds_config, preset["precision"], work / "ds_config.json")
        print(f"{args.preset}: {params / 1e6:.1f}M parameters, {ranks} ranks, seq {preset['seq_len']}, global batch "
              f"{preset['micro_batch_size'] * preset['grad_accum_steps'] * ranks}, {preset['steps']} steps, "
              f"{preset['precision']}, {args.ds_config}", flush=True)
        runs = []
        for index in range(args.repeats):
            for system in (systems if index % 2 == 0 else systems[::-1]):
                runs.append(run(system, args, preset, work / "model", ds_json, work, ranks, index))
                r = runs[-1]
                print(f"  {system:10s} run {index}: {r['tokens_per_s']:,.0f} tokens/s, first step "
                      f"{r['first_step_s']:.1f} s, peak RSS {max(r['peak_rss_bytes'] or [0]) / 2**20:,.0f} MiB, "
                      f"final loss {r['final_loss']:.4f}", flush=True)
    finally:
        if args.keep:
            print(f"runs kept in {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)

    device = (subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True).stdout.splitlines()[0] if gpus else
              f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, CPU ranks (gloo)")
    peak = flops.table_peak(device, preset["precision"]) if gpus else None  # a CPU has no data-sheet peak
    summary = summarize(runs, flops_per_token, peak * ranks if peak else None)
    setup = (f"Preset `{args.preset}`: {params / 1e6:.1f}M-parameter Llama, {ranks} ranks on {device}, "
             f"{preset['precision']}, seq {preset['seq_len']}, micro batch {preset['micro_batch_size']} x accum "
             f"{preset['grad_accum_steps']} (global {preset['micro_batch_size'] * preset['grad_accum_steps'] * ranks}"
             f" sequences), {preset['steps']} steps per run (tokens/s over steps {args.skip + 1}-{preset['steps']}), "
             f"{args.repeats} runs of each alternating, `{args.ds_config}` for both DeepSpeed sides"
             + (f"; MFU at {flops_per_token / 1e9:.2f} GFLOP/token over {peak / 1e12:.1f} TFLOP/s per GPU" if peak
                else "") + ". "
             f"Versions: {versions()}.")
    text = table(summary, runs, setup, args.skip)
    print(text)
    record = {"setup": setup, "summary": summary, "runs": runs}
    if args.results:
        Path(args.results).write_text(json.dumps(record, indent=1))
    if args.write:
        chart(summary, runs, CHART)
        RESULTS.write_text(json.dumps(record, indent=1))
        write_section("bench/speed.py", "Speed against a plain PyTorch loop and the Hugging Face Trainer",
                      text + f"\n![tokens/s, first step, memory and loss of each system]({CHART.name})\n")


def versions() -> str:
    import deepspeed
    import torch
    import transformers
    return f"torch {torch.__version__}, deepspeed {deepspeed.__version__}, transformers {transformers.__version__}"


if __name__ == "__main__":
    main()
