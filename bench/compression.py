#!/usr/bin/env python3
"""What gradient compression buys: bytes per step, convergence, and step time on a slow link.

Part 1 trains a ~3M-parameter Llama on the shipped corpus (data/tiny) with 2 CPU ranks (gloo) under the
`deepspeed` launcher, ZeRO-0, four ways: fp32 all-reduce, bf16 all-reduce (communication_data_type),
PowerSGD rank 4, signs and TopK at 1% and 0.1% (all with error feedback). train.py's --log.comm_bytes counts, at the
torch.distributed collective calls, the bytes each rank sends per step (ring algorithms). Reported: the
median over the compressed steps, its ratio to fp32, the eval loss after the same number of steps and a
loss-curve PNG (docs/compression_loss.png).

Part 2 (--slow-link, root with iproute2): two network namespaces joined by a veth pair, each end limited
with tc (netem rate + delay when the kernel has sch_netem, else tbf rate only), one rank in each, and the
median step time of each method. The veths' own tx counters give the bytes that really crossed the link.
The namespaces are created and deleted here.

Part 1 with --seeds 42,1,2 repeats the runs with other data orders (train.seed; 42 is the recipe default and
the one the main table and the PNG show): the eval loss of one run at one step moves by a few percent with the
order alone, so the per-seed table says whether a method's gap is more than that. Runs add to the saved
results (--methods picks some: fp32,bf16,powersgd,sign,topk1,topk01).

    python bench/compression.py [--steps 300] [--seeds 42] [--methods ...] [--slow-link] [--rate 100mbit]
                                [--delay 1ms] [--write]
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
import time
from pathlib import Path

from common import free_port, make_llama, write_section

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
RESULTS = ROOT / "docs" / "compression_bench.json"  # every figure of the section; each part updates its own
DEFAULT_SEED = 42  # the recipes' train.seed
SHORT = {"fp32": "fp32 all-reduce", "bf16": "bf16 all-reduce", "powersgd": "PowerSGD rank 4", "sign": "sign + EF",
         "topk1": "TopK 1% + EF", "topk01": "TopK 0.1% + EF", "diloco10": "DiLoCo H=10", "diloco50": "DiLoCo H=50",
         "diloco50bf16": "DiLoCo H=50 bf16", "diloco50int8": "DiLoCo H=50 int8",
         "diloco50avg": "DiLoCo H=50 bf16, outer lr 1, no momentum",
         "diloco50m5": "DiLoCo H=50 bf16, outer lr 1, momentum 0.5",
         "diloco50m7": "DiLoCo H=50 bf16, outer lr 0.7, momentum 0.5",
         "diloco25int8avg": "DiLoCo H=25 int8, outer lr 1, no momentum",
         "diloco50int8avg": "DiLoCo H=50 int8, outer lr 1, no momentum",
         "diloco25int4avg": "DiLoCo H=25 int4, outer lr 1, no momentum",
         "diloco50int4avg": "DiLoCo H=50 int4, outer lr 1, no momentum",
         "diloco25int4avgw8": "DiLoCo H=25 int4, outer lr 1, no momentum, 8 averaged steps first (bf16)",
         "diloco25int4avgw8s5": "Streaming DiLoCo H=25 int4, 5 fragments, 1 step overlapped (mix 0.5), outer lr 1, "
                                "no momentum, 8 averaged steps first (bf16)"}
METHODS = {  # name: train.py arguments on top of zero0.json
    "fp32 all-reduce": [],
    "bf16 all-reduce": ["--ds.communication_data_type=bf16"],
    "PowerSGD rank 4": ["--compression.method=powersgd", "--compression.rank=4"],
    "sign + EF": ["--compression.method=sign"],
    "TopK 1% + EF": ["--compression.method=topk", "--compression.topk_fraction=0.01"],
    "TopK 0.1% + EF": ["--compression.method=topk", "--compression.topk_fraction=0.001"],
    # two replicas of one rank; outer Nesterov SGD at the paper's lr 0.7 and momentum 0.9
    "DiLoCo H=10": ["--diloco.every=10", "--diloco.replicas=2"],
    "DiLoCo H=50": ["--diloco.every=50", "--diloco.replicas=2"],
    "DiLoCo H=50 bf16": ["--diloco.every=50", "--diloco.replicas=2", "--diloco.dtype=bf16"],
    "DiLoCo H=50 int8": ["--diloco.every=50", "--diloco.replicas=2", "--diloco.dtype=int8"],
    # the outer step for short runs: the paper's lr 0.7 / momentum 0.9 was tuned for thousands of inner steps
    "DiLoCo H=50 bf16, outer lr 1, no momentum": ["--diloco.every=50", "--diloco.replicas=2", "--diloco.dtype=bf16",
                                                  "--diloco.outer_lr=1", "--diloco.outer_momentum=0"],
    "DiLoCo H=50 bf16, outer lr 1, momentum 0.5": ["--diloco.every=50", "--diloco.replicas=2", "--diloco.dtype=bf16",
                                                   "--diloco.outer_lr=1", "--diloco.outer_momentum=0.5"],
    "DiLoCo H=50 bf16, outer lr 0.7, momentum 0.5": ["--diloco.every=50", "--diloco.replicas=2",
                                                     "--diloco.dtype=bf16", "--diloco.outer_lr=0.7",
                                                     "--diloco.outer_momentum=0.5"],
    "DiLoCo H=25 int8, outer lr 1, no momentum": ["--diloco.every=25", "--diloco.replicas=2", "--diloco.dtype=int8",
                                                  "--diloco.outer_lr=1", "--diloco.outer_momentum=0"],
    "DiLoCo H=50 int8, outer lr 1, no momentum": ["--diloco.every=50", "--diloco.replicas=2", "--diloco.dtype=int8",
                                                  "--diloco.outer_lr=1", "--diloco.outer_momentum=0"],
    "DiLoCo H=25 int4, outer lr 1, no momentum": ["--diloco.every=25", "--diloco.replicas=2", "--diloco.dtype=int4",
                                                  "--diloco.outer_lr=1", "--diloco.outer_momentum=0"],
    "DiLoCo H=50 int4, outer lr 1, no momentum": ["--diloco.every=50", "--diloco.replicas=2", "--diloco.dtype=int4",
                                                  "--diloco.outer_lr=1", "--diloco.outer_momentum=0"],
    # a synchronous-like start: the replicas' weights averaged after each of the first 8 steps, sent in bf16
    # (diloco.warmup_wire; in int4 they cost H = 25 int4 6 points at step 300 on order 42, docs/benchmarks.md)
    "DiLoCo H=25 int4, outer lr 1, no momentum, 8 averaged steps first (bf16)": [
        "--diloco.every=25", "--diloco.replicas=2", "--diloco.dtype=int4", "--diloco.outer_lr=1",
        "--diloco.outer_momentum=0", "--diloco.warmup_steps=8"],
    # the same, streamed: a fifth of the model syncs every 5 steps, landing a step later while training goes on
    SHORT["diloco25int4avgw8s5"]: [
        "--diloco.every=25", "--diloco.replicas=2", "--diloco.dtype=int4", "--diloco.outer_lr=1",
        "--diloco.outer_momentum=0", "--diloco.warmup_steps=8", "--diloco.fragments=5", "--diloco.overlap=1"],
}


def make_model(out: Path) -> int:
    return make_llama(out, hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=8,
                      num_key_value_heads=4, head_dim=32)


def train_args(model: Path | str, out: Path, steps: int, warmup: int, extra: list[str]) -> list[str]:
    """`model`: the bench's model directory, or `recipe:NAME` for a shipped recipe's own model and init."""
    chosen = ["--recipe", str(model)[len("recipe:"):]] if str(model).startswith("recipe:") else \
        [f"--model.name_or_path={model}"]
    return ["train.py", "--ds_config", "zero0.json", "--output_dir", str(out), *chosen,
            f"--train.max_steps={steps}", "--train.precision=fp32", f"--compression.warmup_steps={warmup}",
            f"--eval.every={max(steps // 6, 1)}", "--eval.max_batches=8", "--log.wandb=false",
            "--log.progress_bar=false", "--log.comm_bytes=true", "--checkpoint.every=0",
            "--checkpoint.export_hf=false", *extra]


def environment(work: Path, **extra) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", DSTRAIN_CACHE=str(work / "cache"),
               WANDB_MODE="offline")
    # timed as users run: a low glibc mmap threshold (for honest RSS) made these steps 1.7x slower (docs/planning.md)
    env.pop("MALLOC_MMAP_THRESHOLD_", None)
    env.update(extra)
    return env


def read_metrics(out: Path, warmup: int) -> dict:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "loss" in r]
    late = [r for r in steps if r["step"] > warmup + 1]  # past warm-up and the first compressed step
    return {"losses": [r["loss"] for r in steps], "evals": [(r["step"], r["eval_loss"]) for r in rows if "eval_loss" in r],
            "bytes": statistics.median(r["comm_bytes"] for r in late),
            "mean_bytes": statistics.mean(r["comm_bytes"] for r in late),
            "warmup_bytes": statistics.median(r["comm_bytes"] for r in steps if r["step"] <= warmup),
            "step_s": statistics.median(r["step_s"] for r in late)}


def part1(model: Path, work: Path, steps: int, warmup: int, seed: int, names: list[str]) -> dict:
    results = {}
    for name in names:
        out = work / f"p1-{seed}-{len(results)}"
        cmd = [str(BIN / "deepspeed"), "--num_gpus", "2", "--master_port", str(free_port())]
        began = time.time()
        proc = subprocess.run(cmd + train_args(model, out, steps, warmup, METHODS[name] + [f"--train.seed={seed}"]),
                              cwd=ROOT, env=environment(work), capture_output=True, text=True)
        if proc.returncode:
            raise SystemExit(f"{name} failed:\n{proc.stderr[-3000:]}")
        results[name] = read_metrics(out, warmup)
        print(f"  seed {seed}, {name}: {time.time() - began:.0f} s, eval loss {results[name]['evals'][-1][1]:.4f}, "
              f"{results[name]['bytes'] / 1e6:.3f} MB/step", file=sys.stderr)
    return results


class SlowLink:
    """Two network namespaces and a veth pair, each end shaped with tc (rate None: unshaped); removed on exit."""

    def __init__(self, rate: str | None, delay: str):
        tag = os.getpid() % 10000
        self.ns = [f"dstrain-a{tag}", f"dstrain-b{tag}"]
        self.dev = [f"dsa{tag}", f"dsb{tag}"]
        self.addr = ["10.231.0.1", "10.231.0.2"]
        self.rate, self.delay, self.shaping = rate, delay, ""

    def __enter__(self) -> SlowLink:
        def ip(*args):
            subprocess.run(["ip", *args], check=True, capture_output=True, text=True)
        try:
            for ns in self.ns:
                ip("netns", "add", ns)
            ip("link", "add", self.dev[0], "type", "veth", "peer", "name", self.dev[1])
            for ns, dev, addr in zip(self.ns, self.dev, self.addr):
                ip("link", "set", dev, "netns", ns)
                ip("-n", ns, "addr", "add", f"{addr}/30", "dev", dev)
                ip("-n", ns, "link", "set", dev, "up")
                ip("-n", ns, "link", "set", "lo", "up")
                self.shaping = self._shape(ns, dev) if self.rate else "no shaping (the veth's own speed)"
        except (subprocess.CalledProcessError, FileNotFoundError) as e:
            self.__exit__()
            detail = getattr(e, "stderr", "") or str(e)
            raise SystemExit(f"cannot build the slow link (needs root and iproute2): {detail.strip()}") from None
        return self

    def _shape(self, ns: str, dev: str) -> str:
        netem = ["tc", "qdisc", "add", "dev", dev, "root", "netem", "delay", self.delay, "rate", self.rate,
                 "limit", "10000"]
        if subprocess.run(["ip", "netns", "exec", ns, *netem], capture_output=True).returncode == 0:
            return f"netem rate {self.rate}, delay {self.delay} each way"
        tbf = ["tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", self.rate, "burst", "64kb", "latency", "100ms"]
        subprocess.run(["ip", "netns", "exec", ns, *tbf], check=True, capture_output=True, text=True)
        return f"tbf rate {self.rate} each way, no added delay (this kernel has no sch_netem)"

    def __exit__(self, *exc) -> None:
        for ns in self.ns:  # deleting a namespace deletes its end of the veth, and so the pair
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def two_nodes(cmd: list[str], rate: str | None, delay: str, work: Path, name: str) -> tuple[str, list[str]]:
    """Runs train.py's `cmd` as one rank in each namespace of a SlowLink (rate None: unshaped); returns the
    shaping it had and each rank's stderr (bench/slow_links.py, streaming.py and planner.py launch this way)."""
    with SlowLink(rate, delay) as link:
        port = str(free_port())
        procs = []
        for rank in range(2):
            env = environment(work, RANK=str(rank), LOCAL_RANK="0", WORLD_SIZE="2", LOCAL_WORLD_SIZE="1",
                              MASTER_ADDR=link.addr[0], MASTER_PORT=port, GLOO_SOCKET_IFNAME=link.dev[rank])
            procs.append(subprocess.Popen(["ip", "netns", "exec", link.ns[rank], sys.executable, *cmd], cwd=ROOT,
                                          env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
        errors = [p.communicate()[1] for p in procs]
        if any(p.returncode for p in procs):
            raise SystemExit(f"{name} failed:\n{errors[0][-3000:]}\n{errors[1][-3000:]}")
        return link.shaping, errors


def part2(model: Path, work: Path, steps: int, warmup: int, rate: str, delay: str) -> tuple[dict, str]:
    results = {}
    with SlowLink(rate, delay) as link:
        for name, extra in METHODS.items():
            if name.startswith("DiLoCo"):  # its step time on the link needs runs of many H (not yet measured)
                continue
            out = work / f"p2-{len(results)}"
            port = str(free_port())
            procs = []
            for rank in range(2):
                env = environment(work, RANK=str(rank), LOCAL_RANK="0", WORLD_SIZE="2", LOCAL_WORLD_SIZE="1",
                                  MASTER_ADDR=link.addr[0], MASTER_PORT=port, GLOO_SOCKET_IFNAME=link.dev[rank])
                procs.append(subprocess.Popen(["ip", "netns", "exec", link.ns[rank], sys.executable,
                                               *train_args(model, out, steps, warmup, extra)],
                                              cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                              text=True))
            marks = _watch(procs, out / "metrics.jsonl", link.dev)  # link bytes when each step ends
            errors = [p.communicate()[1] for p in procs]
            if any(p.returncode for p in procs):
                raise SystemExit(f"{name} on the slow link failed:\n{errors[0][-3000:]}\n{errors[1][-3000:]}")
            end = max(marks, default=0)  # normally `steps`; a busy machine may miss the last row
            on_link = (marks[end] - marks[warmup + 1]) / (end - warmup - 1) if end > warmup + 1 and \
                warmup + 1 in marks else float("nan")  # the compressed steps after the first
            results[name] = dict(read_metrics(out, warmup), link_bytes_per_step=on_link)
            print(f"  slow link, {name}: {results[name]['step_s']:.3f} s/step", file=sys.stderr)
        return results, link.shaping


def _watch(procs: list, metrics: Path, devs: list[str]) -> dict[int, float]:
    """{steps done: mean bytes the two veth ends had sent} sampled every 5 ms while the ranks run.
    /proc/<pid>/net/dev shows the counters of that process's network namespace."""
    marks: dict[int, float] = {}
    while all(p.poll() is None for p in procs):
        try:
            done = metrics.read_text().count('"loss"') if metrics.exists() else 0
            sent = [_tx(p.pid, dev) for p, dev in zip(procs, devs)]
        except (OSError, ValueError):  # not yet inside its namespace, or just exited
            time.sleep(0.005)
            continue
        marks.setdefault(done, sum(sent) / 2)
        time.sleep(0.005)
    return marks


def _tx(pid: int, dev: str) -> int:
    for line in Path(f"/proc/{pid}/net/dev").read_text().splitlines():
        name, _, fields = line.partition(":")
        if name.strip() == dev:
            return int(fields.split()[8])
    raise ValueError(dev)


def plot(results: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (train_ax, eval_ax) = plt.subplots(1, 2, figsize=(11, 4))
    for name, r in results.items():
        train_ax.plot(range(1, len(r["losses"]) + 1), r["losses"], label=name, linewidth=0.8)
        eval_ax.plot(*zip(*r["evals"]), marker="o", label=name)
    train_ax.set(xlabel="step", ylabel="train loss", title="training loss", yscale="log")
    eval_ax.set(xlabel="step", ylabel="eval loss", title="eval loss")
    eval_ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--warmup", type=int, default=20, help="uncompressed steps first (compression.warmup_steps)")
    parser.add_argument("--seeds", default=str(DEFAULT_SEED), help="part 1 data-order seeds, comma-separated")
    parser.add_argument("--methods", default=",".join(SHORT), help=f"part 1 methods, of {','.join(SHORT)}")
    parser.add_argument("--slow-link", action="store_true", help="also time each method between two namespaces")
    parser.add_argument("--link-steps", type=int, default=30)
    parser.add_argument("--rate", default="100mbit")
    parser.add_argument("--delay", default="1ms")
    parser.add_argument("--link-only", action="store_true", help="skip part 1 (a quick check of the slow link)")
    parser.add_argument("--recipe", default=None,
                        help="part 1 on a shipped recipe's own model (e.g. tiny/pretrain) instead of the 3M bench "
                             "model: a table of its own beside the 3M one")
    parser.add_argument("--write", action="store_true", help="update docs/benchmarks.md and the PNG")
    args = parser.parse_args()
    try:
        seeds = [int(seed) for seed in args.seeds.split(",")]
        names = [SHORT[key] for key in args.methods.split(",")]
    except (ValueError, KeyError):
        parser.error(f"--seeds takes integers and --methods names of {', '.join(SHORT)}, comma-separated")

    saved = RESULTS if args.write else Path(tempfile.gettempdir()) / "dstrain-compression-bench.json"
    work = Path(tempfile.mkdtemp(prefix="dstrain-bench-"))
    try:
        params = make_model(work / "model")
        state = json.loads(saved.read_text()) if saved.exists() else {}
        state["params"] = params
        if args.recipe:  # the same methods and steps on a recipe as a user copies the README's flags onto it
            mine = state.setdefault("recipes", {}).setdefault(args.recipe, {})
            mine["args"] = {"steps": args.steps, "warmup": args.warmup, "seed": seeds[0]}
            mine.setdefault("results", {}).update(
                part1(f"recipe:{args.recipe}", work, args.steps, args.warmup, seeds[0], names))
            saved.write_text(json.dumps(state, indent=1))
        elif not args.link_only:
            print(f"part 1: {params / 1e6:.2f}M parameters, {args.steps} steps per method", file=sys.stderr)
            if state.get("part1_args") != {"steps": args.steps, "warmup": args.warmup}:  # older runs do not compare
                state.pop("part1", None), state.pop("by_seed", None)
            state["part1_args"] = {"steps": args.steps, "warmup": args.warmup}
            state.setdefault("by_seed", {}).setdefault(str(DEFAULT_SEED), {}).update(
                {name: r["evals"][-1][1] for name, r in state.get("part1", {}).items()})
            for seed in seeds:
                results = part1(work / "model", work, args.steps, args.warmup, seed, names)
                finals = state.setdefault("by_seed", {}).setdefault(str(seed), {})
                finals.update({name: r["evals"][-1][1] for name, r in results.items()})
                if seed == DEFAULT_SEED:
                    state.setdefault("part1", {}).update(results)
                    state["part1"] = {name: state["part1"][name] for name in METHODS if name in state["part1"]}
                saved.write_text(json.dumps(state, indent=1))  # a failure later keeps what ran
            if DEFAULT_SEED in seeds:
                plot(state["part1"], ROOT / "docs" / "compression_loss.png" if args.write else work / "loss.png")
        if args.slow_link or args.link_only:
            state["link"], state["shaping"] = part2(work / "model", work, args.link_steps, 5, args.rate, args.delay)
            state["link_args"] = {"steps": args.link_steps}
            saved.write_text(json.dumps(state, indent=1))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    text = report(state)
    print(text)
    if args.write:
        write_section("bench/compression.py", "Gradient compression", text)


def report(state: dict) -> str:
    """The markdown section from the saved results of the parts run so far."""
    params = state["params"]
    results, link, shaping = state.get("part1", {}), state.get("link", {}), state.get("shaping", "")
    text = (f"{params / 1e6:.2f}M-parameter Llama (4 layers, width 256, the embedding matrix sent uncompressed), "
            f"data/tiny, ZeRO-0, fp32, 2 CPU ranks (gloo), micro batch 8 x 128 tokens; {platform.machine()}, "
            f"{os.cpu_count()} cores. Bytes: what each rank sends per step, counted at the torch.distributed calls "
            f"(ring algorithms), median over the compressed steps; DiLoCo's is the mean over the steps (one model's "
            f"pseudo-gradients every H steps, nothing between), with two replicas of one rank.\n\n")
    if results:
        args = argparse.Namespace(**state["part1_args"])
        base = results["fp32 all-reduce"]
        text += (f"{args.steps} steps, compression after {args.warmup} uncompressed steps, data order seed "
                 f"{DEFAULT_SEED} (one run each; the table after it has three orders).\n\n"
                 "| method | bytes/step | less than fp32 | final eval loss | vs fp32 |\n|---|---|---|---|---|\n")
        for name, r in results.items():
            sent = r.get("mean_bytes", r["bytes"]) if name.startswith("DiLoCo") else r["bytes"]
            text += (f"| {name} | {sent / 1e6:.3f} MB | {base['bytes'] / sent:.1f}x | "
                     f"{r['evals'][-1][1]:.4f} | {r['evals'][-1][1] / base['evals'][-1][1] - 1:+.2%} |\n")
        text += "\nLoss curves: [compression_loss.png](compression_loss.png)\n"
    text += _seed_table(state.get("by_seed", {}))
    for recipe, mine in (state.get("recipes") or {}).items():
        got, args = mine["results"], mine["args"]
        if "fp32 all-reduce" not in got:
            continue
        base = got["fp32 all-reduce"]
        text += (f"\nThe same flags on the shipped recipe `{recipe}` (its own model and from-scratch init, data and "
                 f"batch; ZeRO-0, fp32, {args['steps']} steps, compression after {args['warmup']}, seed "
                 f"{args['seed']}), beside the 3M model's seed-{DEFAULT_SEED} row:\n\n"
                 "| method | bytes/step | less than fp32 | final eval loss | vs fp32 | 3M model: less than fp32, vs fp32 "
                 "|\n|---|---|---|---|---|---|\n")
        for name, r in got.items():
            three = results.get(name)
            other = (f"{results['fp32 all-reduce']['bytes'] / three['bytes']:.1f}x, "
                     f"{three['evals'][-1][1] / results['fp32 all-reduce']['evals'][-1][1] - 1:+.2%}") if three else ""
            text += (f"| {name} | {r['bytes'] / 1e6:.3f} MB | {base['bytes'] / r['bytes']:.1f}x | "
                     f"{r['evals'][-1][1]:.4f} | {r['evals'][-1][1] / base['evals'][-1][1] - 1:+.2%} | {other} |\n")
    if link:
        args = argparse.Namespace(link_steps=state["link_args"]["steps"])
        plain = link["fp32 all-reduce"]
        text += (f"\nSlow link: one rank in each of two network namespaces joined by a veth pair, {shaping}; "
                 f"{args.link_steps} steps, compression after 5; median step time over the compressed steps. "
                 f"'on the link': the veths' own tx counters (mean of the two ends) over the compressed steps, per step.\n\n"
                 "| method | s/step | speed-up vs fp32 | counted bytes/step | on the link/step |\n|---|---|---|---|---|\n")
        for name, r in link.items():
            text += (f"| {name} | {r['step_s']:.3f} | {plain['step_s'] / r['step_s']:.2f}x | "
                     f"{r['bytes'] / 1e6:.3f} MB | {r['link_bytes_per_step'] / 1e6:.3f} MB |\n")
    return text


def _seed_table(by_seed: dict) -> str:
    """Final eval loss per data-order seed; each method's mean against fp32's mean over the same seeds."""
    seeds = sorted(by_seed, key=int)
    if len(seeds) < 2:
        return ""
    text = ("\nFinal eval loss by data order (train.seed): the same model and steps, only the order of the "
            "batches changes.\n\n| method | " + " | ".join(f"seed {s}" for s in seeds) +
            " | mean | mean vs fp32 mean, same seeds |\n|---|" + "---|" * (len(seeds) + 2) + "\n")
    for name in METHODS:
        have = [s for s in seeds if name in by_seed[s]]
        if not have:
            continue
        cells = " | ".join(f"{by_seed[s][name]:.4f}" if name in by_seed[s] else "" for s in seeds)
        mean = statistics.mean(by_seed[s][name] for s in have)
        paired = [s for s in have if "fp32 all-reduce" in by_seed[s]]
        gap = (mean / statistics.mean(by_seed[s]["fp32 all-reduce"] for s in paired) - 1) \
            if paired and len(paired) == len(have) else None
        text += f"| {name} | {cells} | {mean:.4f} | {'' if gap is None else f'{gap:+.2%}'} |\n"
    fp32 = [by_seed[s]["fp32 all-reduce"] for s in seeds if "fp32 all-reduce" in by_seed[s]]
    if len(fp32) > 1:
        text += (f"\nfp32 alone, across its {len(fp32)} orders: {min(fp32):.4f} to {max(fp32):.4f} "
                 f"({max(fp32) / min(fp32) - 1:.1%} apart).\n")
    return text


if __name__ == "__main__":
    main()
