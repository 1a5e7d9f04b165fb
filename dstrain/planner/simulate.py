"""`--plan --simulate`: the step-time model on paper, for hardware this machine is not.

Compute and links come from tables (or from a plan.json that `--plan` measured on real ranks), the candidates
and the model from cost.py: for 1, 2, 4, ... --max_gpus GPUs, the fastest candidate that fits, its tokens/s and
the scaling efficiency (tokens/s per GPU against the smallest world that fits).

The tables are inputs, not measurements, each with where it comes from:
- GPU dense bf16 peak: dstrain/flops.py (vendor data sheets); memory: dstrain/planner/memory.py DEVICES.
- HBM bandwidth: vendor data sheets. Large-GEMM efficiency (the fraction of peak a big bf16 matmul reaches):
  assumed from public cuBLAS/GEMM benchmarks, about 0.8 on V100/A100 and 0.7 on H100/H200 (their peaks are harder
  to reach); non-matmul work (norms, activations, softmax) is costed as activation traffic over HBM.
- Links: busbw = 0.85 x the line rate (nccl-tests reach about that on a healthy fabric); NVLink busbw per GPU
  from NVIDIA's published all-reduce figures (V100 DGX-2 ~130 GB/s, A100 ~230 GB/s, H100 ~370 GB/s, B200 ~700
  GB/s); across nodes a ring's busbw is the node's aggregate NIC rate (one ring per NIC), capped by NVLink.
"""
from __future__ import annotations

import copy
import math
from dataclasses import dataclass, replace

from ..errors import EXIT_OK, UserError, closest
from . import cost
from .probe import OPS, Compute, LinkCurve, Measurements

GB = 1e9


@dataclass(frozen=True)
class Gpu:
    peak_key: str  # in flops.GPU_PEAK_BF16
    hbm: float  # bytes/s
    gemm: float  # fraction of peak a large bf16 matmul reaches (assumed, see module docstring)
    intra: float  # busbw within a node, bytes/s per GPU
    host_link: float  # device <-> host, bytes/s (PCIe)


# keys as in memory.DEVICES
GPUS = {
    "v100-32gb": Gpu("V100", 0.9e12, 0.8, 130 * GB, 12 * GB),
    "a100-40gb": Gpu("A100", 1.555e12, 0.8, 230 * GB, 25 * GB),
    "a100-80gb": Gpu("A100", 2.0e12, 0.8, 230 * GB, 25 * GB),
    "h100-80gb": Gpu("H100", 3.35e12, 0.7, 370 * GB, 50 * GB),
    "h200-141gb": Gpu("H200", 4.8e12, 0.7, 370 * GB, 50 * GB),
    "b200-180gb": Gpu("B200", 8.0e12, 0.7, 700 * GB, 50 * GB),
    "l40s-48gb": Gpu("L40S", 0.864e12, 0.7, 20 * GB, 25 * GB),  # PCIe only, no NVLink
}

# between nodes: aggregate line rate per node (bytes/s) and per-collective latency (s)
INTERCONNECTS = {
    "ib-ndr": (8 * 400e9 / 8, 20e-6),  # 8 x NDR 400 Gb/s (DGX H100)
    "ib-hdr": (8 * 200e9 / 8, 20e-6),  # 8 x HDR 200 Gb/s (DGX A100, Selene)
    "ib-edr": (8 * 100e9 / 8, 25e-6),  # 8 x EDR 100 Gb/s (DGX-2)
    "400gbe": (400e9 / 8, 40e-6),  # one 400 GbE NIC per node
    "100gbe": (100e9 / 8, 50e-6),  # one 100 GbE NIC per node
}
LINK_EFFICIENCY = 0.85
CPU_ADAM_PER_GPU = 2e9  # DeepSpeedCPUAdam elements/s per GPU's share of the host (1.5e9 on one core measured here)


def hardware(gpu: str, interconnect: str, world: int, gpus_per_node: int, model_config, seq_len: int,
             precision: str = "bf16", measured: Measurements | None = None) -> Measurements:
    """Measurements-shaped figures for `world` GPUs from the tables (or from what --plan measured)."""
    from . import memory

    per_node = min(world, gpus_per_node)
    nodes = -(-world // per_node)
    if measured is not None:
        compute = copy.deepcopy(measured.compute)
        intra = {op: c for op, c in measured.links.get("node", {}).items()}
        across = measured.links.get("world") or measured.links.get("across nodes") or {}
        links = {"node": {op: _rescale(c, per_node) for op, c in intra.items()}}
        links["world"] = {op: _rescale(c, world) for op, c in across.items()}
        return Measurements(f"measured: {measured.device}", measured.precision, world, per_node, compute, links,
                            measured.device_memory, measured.host_memory)
    spec = GPUS[gpu]
    nic, latency = INTERCONNECTS[interconnect]
    compute = _table_compute(spec, model_config, seq_len, precision)
    intra_bw = spec.intra
    inter_bw = min(intra_bw, LINK_EFFICIENCY * nic) if nodes > 1 else intra_bw
    links = {"node": {op: _curve(op, per_node, intra_bw, 10e-6) for op in OPS},
             "world": {op: _curve(op, world, inter_bw, latency if nodes > 1 else 10e-6) for op in OPS}}
    if nodes > 1:  # one GPU's share of its node's NICs, for point-to-point traffic between pipeline stages
        links["across nodes"] = {op: _curve(op, 2, LINK_EFFICIENCY * nic / per_node, latency) for op in OPS}
    return Measurements(gpu, precision, world, per_node, compute, links, memory.DEVICES[gpu] * 2**30, 1024 * 2**30)


def _rescale(curve: LinkCurve, ranks: int) -> LinkCurve:
    """A measured curve for a group of another size: the same busbw (LinkCurve's convention)."""
    return LinkCurve(ranks, [[b, t * _factor(ranks) / max(_factor(curve.ranks), 1e-9)] for b, t in curve.points])


def _factor(ranks: int) -> float:
    return 2 * (ranks - 1) / ranks if ranks > 1 else 0.0


def _curve(op: str, ranks: int, busbw: float, latency: float) -> LinkCurve:
    from .probe import BUS_FACTOR
    if ranks <= 1:
        return LinkCurve(1)
    hops = max(1.0, math.log2(ranks))  # tree-like latency growth (NCCL switches to trees at scale)
    points = [[b, 2 * hops * latency + b * BUS_FACTOR[op](ranks) / busbw] for b in (1 << 20, 1 << 24, 1 << 28, 1 << 30)]
    return LinkCurve(ranks, points)


def _table_compute(spec: Gpu, config, seq_len: int, precision: str) -> Compute:
    from .. import flops
    from . import memory

    peak = flops.table_peak(spec.peak_key, "bf16") * (1 if precision != "fp32" else 0.5 / 8)
    rate = peak * spec.gemm
    hidden, layers, ffn, vocab = memory.dims(config)
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    kv = getattr(config, "num_key_value_heads", None) or heads
    w = 4 if precision == "fp32" else 2
    gated = getattr(config, "model_type", "") not in ("gpt2", "gpt_neox", "gptj", "opt", "bloom", "falcon")
    layer_params = hidden * (heads * head_dim) * 2 + hidden * (kv * head_dim) * 2 + (3 if gated else 2) * hidden * ffn
    layer_flops = 6 * layer_params + 12 * seq_len * heads * head_dim  # per token, forward + backward
    layer_bytes = 3 * (8 * hidden + 4 * ffn) * w  # activations written, read back, and their gradients
    head_flops = 6 * vocab * hidden + 12 * vocab  # per token; the loss's softmax is memory-bound
    head_bytes = 3 * vocab * (w + 4)
    out = Compute()
    for micro in (1, 2, 4, 8, 16, 32, 64):
        tokens = micro * seq_len
        out.layer[str(micro)] = tokens * (layer_flops / rate + layer_bytes / spec.hbm)
        out.layer_forward[str(micro)] = out.layer[str(micro)] / 3
        out.rest[str(micro)] = tokens * (head_flops / rate + head_bytes / spec.hbm)
    out.adam_elements_per_s = spec.hbm / 30  # fp32 param, grad, m, v read; param, m, v and a 16-bit copy written
    out.cpu_adam_elements_per_s = CPU_ADAM_PER_GPU
    out.host_copy_bytes_per_s = spec.host_link
    out.copy_bytes_per_s = spec.hbm / 2
    out.matmul_flops = rate
    return out


def check(args) -> None:
    from . import memory
    if args.measurements:
        return
    if args.device is None or args.device.lower() not in GPUS:
        raise UserError(f"--simulate needs --device, one of {', '.join(GPUS)}"
                        + (closest(args.device.lower(), GPUS) if args.device else "")
                        + (f" ({args.device} has no compute figures in dstrain/planner/simulate.py)"
                           if args.device and args.device.lower() in memory.DEVICES else ""))
    if args.interconnect is None or args.interconnect.lower() not in INTERCONNECTS:
        raise UserError(f"--simulate needs --interconnect, one of {', '.join(INTERCONNECTS)}"
                        + (closest(args.interconnect.lower(), INTERCONNECTS) if args.interconnect else ""))
    if args.gpus_per_node < 1 or args.max_gpus < 1:
        raise UserError("--gpus_per_node and --max_gpus must be at least 1")


def run(args, recipe, ds_overrides: dict) -> int:
    from ..model import hidden_size, load_config
    from ..parallel import ds_config

    check(args)
    measured = None
    if args.measurements:
        import json
        from pathlib import Path
        path = Path(args.measurements)
        if not path.is_file():
            raise UserError(f"--measurements {path} does not exist; give the plan.json that --plan wrote")
        measured = Measurements.from_dict(json.loads(path.read_text())["measurements"])
    raw_ds = ds_config.load(recipe.ds_config, ds_overrides)
    from ..parallel.layout import parallel_sizes
    if parallel_sizes(raw_ds).expert:  # the table would be ZeRO-2's with every expert on every rank
        raise UserError(f"--simulate does not model expert parallelism yet (expert_parallel.autoep_size="
                        f"{parallel_sizes(raw_ds).expert}); simulate the config without it, or measure with "
                        f"bench/moe.py")
    model_config = load_config(recipe.model, recipe.train.seq_len)[1]
    rows = scaling(recipe, raw_ds, model_config, args.device and args.device.lower(),
                   args.interconnect and args.interconnect.lower(), args.gpus_per_node, args.max_gpus,
                   hidden_size(model_config), measured)
    print(report(rows, recipe, args, measured))
    return EXIT_OK


def scaling(recipe, raw_ds: dict, model_config, gpu, interconnect, gpus_per_node: int, max_gpus: int,
            hidden: int | None, measured: Measurements | None = None) -> list[dict]:
    from ..parallel import ds_config
    caps = ds_config.DeviceCaps("cuda", bf16=True, fp16=True)
    precision = "fp32" if recipe.train.precision == "fp32" else "bf16"
    rows = []
    world = 1
    work = cost.workload(recipe, raw_ds, 1, model_config)  # counted once (meta device)
    while world <= max_gpus:
        meas = hardware(gpu, interconnect, world, gpus_per_node, model_config, recipe.train.seq_len, precision,
                        measured)
        work = replace(work, global_batch=cost.global_batch_of(recipe, raw_ds, world))
        found = cost.candidates(recipe, raw_ds, world, model_config)
        preds = cost.rank([cost.predict(c, work, meas, recipe, caps, hidden, overlap=measured is None)
                           for c in found]) if found else []
        best = preds[0] if preds and preds[0].fits else None
        rows.append({"gpus": world, "nodes": -(-world // gpus_per_node), "best": best,
                     "global_batch": work.global_batch})
        world *= 2
    base = next((r for r in rows if r["best"]), None)
    for r in rows:
        if r["best"] and base:
            r["efficiency"] = (r["best"].tokens_per_s / r["gpus"]) / (base["best"].tokens_per_s / base["gpus"])
    return rows


def report(rows: list[dict], recipe, args, measured) -> str:
    where = f"measured figures from {args.measurements}" if measured else \
        f"{args.device} x {args.gpus_per_node} per node, {args.interconnect} between nodes (tables, simulate.py)"
    batch = (f"the recipe's global batch kept (as written for world_size {recipe.world_size})" if recipe.world_size
             else "the recipe's batch per GPU kept (it sets no world_size: weak scaling)")
    lines = [f"simulate: {recipe.model.name_or_path}, seq {recipe.train.seq_len}, {batch}, micro x accumulation "
             f"re-chosen per world; {where}",
             f"  {'GPUs':>6}{'nodes':>7}  {'best strategy':<18}{'micro x acc':>12}{'AC':>4}{'step':>10}"
             f"{'tokens/s':>13}{'per GPU':>10}{'comm %':>8}{'scaling':>9}"]
    for r in rows:
        p = r["best"]
        if p is None:
            lines.append(f"  {r['gpus']:>6}{r['nodes']:>7}  nothing fits (or the global batch of {r['global_batch']} "
                         f"does not split)")
            continue
        c = p.candidate
        lines.append(f"  {r['gpus']:>6}{r['nodes']:>7}  {c.name:<18}{f'{c.micro} x {c.accum}':>12}"
                     f"{'on' if c.checkpointing else '':>4}{p.step_s:>9.3f}s{p.tokens_per_s:>13,.0f}"
                     f"{p.tokens_per_s / r['gpus']:>10,.0f}{p.comm_fraction:>8.0%}{r.get('efficiency', 0):>9.0%}")
    return "\n".join(lines)



def predict_layout(model_config, recipe, gpu: str, interconnect: str, gpus_per_node: int, world: int, tp: int,
                   pp: int, micro: int, global_batch: int, checkpointing: bool, zero_stage: int = 0):
    """One fixed layout (tensor x pipeline x data parallel, as a published run states it) on table hardware."""
    from ..parallel import ds_config
    meas = hardware(gpu, interconnect, world, gpus_per_node, model_config, recipe.train.seq_len, "bf16")
    dp = world // (tp * pp)
    ds = {"zero_optimization": {"stage": zero_stage}, "bf16": {"enabled": True}, "fp16": {"enabled": False},
          "tensor_parallel": {"autotp_size": tp}, "pipeline": {"stages": pp}}
    candidate = cost.Candidate("published", ds, micro, global_batch // (dp * micro), checkpointing, "megatron")
    work = replace(cost.workload(recipe, {}, world, model_config), global_batch=global_batch)
    caps = ds_config.DeviceCaps("cuda", bf16=True, fp16=True)
    return cost.predict(candidate, work, meas, recipe, caps, model_config.hidden_size, overlap=True, checked=False)
