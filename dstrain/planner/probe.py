"""What `train.py --plan` measures on the real ranks, all at once (ranks that share a node share it here too).

- compute: forward + backward of the model's own decoder layer and of its embedding/head/loss, in the run's
  precision, at each candidate micro-batch size (a 1-layer and a 2-layer copy of the model, from its config:
  the difference is one layer), and the optimizer's update rate (AdamW elements/s; DeepSpeed's CPU Adam for
  offload when its op is built);
- links: all-reduce, all-gather and reduce-scatter over message sizes, within each node (its ranks), across
  nodes (one rank per node) and over the whole world; nccl-tests' convention: algbw = bytes / time, busbw =
  algbw x 2(n-1)/n for all-reduce and x (n-1)/n for all-gather / reduce-scatter (bytes: the full tensor);
- memory: per device (GPU memory, or host RAM shared by the node's ranks), host RAM per node.
Sizes grow by 4x from 1 MB to 256 MB and stop early once one call takes longer than a per-op budget (a slow
link would otherwise spend minutes on 256 MB); the cost model extrapolates beyond with the measured rate.
The slowest rank's figure is kept: a step waits for it.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass, field
from functools import partial

import torch
import torch.distributed as tdist

MB = 1 << 20
OPS = ("all_reduce", "all_gather", "reduce_scatter")
BUS_FACTOR = {"all_reduce": lambda n: 2 * (n - 1) / n, "all_gather": lambda n: (n - 1) / n,
              "reduce_scatter": lambda n: (n - 1) / n}


@dataclass
class LinkCurve:
    """One collective at one link level: ranks in the group and (bytes, seconds) per message size."""
    ranks: int
    points: list = field(default_factory=list)  # [[bytes, seconds], ...], bytes = the full (output) tensor

    def busbw(self, op: str) -> list[float]:
        return [b * BUS_FACTOR[op](self.ranks) / t for b, t in self.points]

    def seconds(self, op: str, nbytes: float) -> float:
        """Time of one call over nbytes: interpolated between measured sizes, latency + bytes / rate outside."""
        if self.ranks <= 1 or nbytes <= 0:
            return 0.0
        pts = sorted(self.points)
        if not pts:
            return 0.0
        if nbytes <= pts[0][0]:
            return pts[0][1] * max(nbytes / pts[0][0], _latency_share(pts))
        for (b0, t0), (b1, t1) in zip(pts, pts[1:]):
            if nbytes <= b1:
                return t0 + (t1 - t0) * (nbytes - b0) / (b1 - b0)
        b_last, t_last = pts[-1]
        rate = b_last / t_last if len(pts) == 1 else (pts[-1][0] - pts[-2][0]) / max(pts[-1][1] - pts[-2][1], 1e-12)
        rate = min(rate, b_last / t_last * 4)  # a noisy last segment must not promise a faster link
        return t_last + (nbytes - b_last) / rate


def _latency_share(pts: list) -> float:
    """The part of the smallest call's time that does not shrink with the message (from the two smallest)."""
    if len(pts) < 2:
        return 0.0
    (b0, t0), (b1, t1) = pts[0], pts[1]
    per_byte = max((t1 - t0) / (b1 - b0), 0.0)
    return max(0.0, min(1.0, (t0 - per_byte * b0) / t0))


@dataclass
class Compute:
    """Seconds of forward + backward per micro-batch size (str keys: JSON) on the slowest rank."""
    layer: dict = field(default_factory=dict)        # one decoder layer, forward + backward
    layer_forward: dict = field(default_factory=dict)  # one decoder layer, forward (recomputed under AC)
    rest: dict = field(default_factory=dict)         # embeddings, final norm, head and loss, forward + backward
    adam_elements_per_s: float = 0.0                 # torch AdamW (DeepSpeed's configs use torch_adam on CPU)
    cpu_adam_elements_per_s: float = 0.0             # DeepSpeedCPUAdam on the host (offload), when built
    host_copy_bytes_per_s: float = 0.0               # device <-> host (offload transfers); 0 on CPU ranks
    matmul_flops: float = 0.0                        # best of the model's own projection shapes, FLOP/s
    compression: dict = field(default_factory=dict)  # method -> seconds per step of compressing the gradients
    copy_bytes_per_s: float = 0.0                    # device memory copies (DeepSpeed's gradient buckets)
    engine_overhead: dict = field(default_factory=dict)  # ZeRO stage -> seconds per micro-batch per parameter
    #                                                   tensor that DeepSpeed's engine adds (hooks, bucket copies)
    notes: list = field(default_factory=list)        # why a figure is not a plain measurement (said by --plan)

    def micro_seconds(self, micro: int, layers: float, checkpointing: bool) -> float:
        """One micro-batch's forward + backward for `layers` decoder layers and the head."""
        layer = _interpolate(self.layer, micro)
        if checkpointing:
            layer += _interpolate(self.layer_forward, micro)
        return layers * layer + _interpolate(self.rest, micro)


def _interpolate(table: dict, micro: int) -> float:
    """Linear in the micro-batch size between measured sizes (time grows with tokens), scaled outside."""
    sizes = sorted(int(k) for k in table)
    if not sizes:
        return 0.0
    if str(micro) in table:
        return table[str(micro)]
    lower = [s for s in sizes if s < micro]
    upper = [s for s in sizes if s > micro]
    if lower and upper:
        a, b = lower[-1], upper[0]
        return table[str(a)] + (table[str(b)] - table[str(a)]) * (micro - a) / (b - a)
    near = lower[-1] if lower else upper[0]
    return table[str(near)] * micro / near


@dataclass
class Measurements:
    device: str
    precision: str
    world_size: int
    ranks_per_node: int
    compute: Compute
    links: dict  # level -> op -> LinkCurve   (levels: "node", "across nodes", "world")
    device_memory: int  # bytes one rank may use
    host_memory: int  # bytes of RAM per node
    seconds: float = 0.0  # how long the probe took

    @property
    def nodes(self) -> int:
        return max(1, self.world_size // max(1, self.ranks_per_node))

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, raw: dict) -> Measurements:
        links = {level: {op: LinkCurve(**curve) for op, curve in ops.items()} for level, ops in raw["links"].items()}
        return cls(**{**raw, "compute": Compute(**raw["compute"]), "links": links})


def measure(model_config, precision: str, seq_len: int, micro_sizes: list[int], ctx, ranks_per_node: int,
            max_bytes: int = 256 * MB, op_budget_s: float = 1.0, log=print, compressed_shapes: tuple = ((), 1),
            embedding_shapes: frozenset = frozenset(), parameters: int = 0, stages: tuple = ()) -> Measurements:
    """Every rank takes part; rank 0 returns the joined figures (other ranks too, identical)."""
    began = time.perf_counter()
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    phase = [time.perf_counter()]

    def done(what: str) -> None:  # every phase says when it ends and what it took: no silent minutes
        now = time.perf_counter()
        log(f"plan: {what} in {now - phase[0]:.1f} s")
        phase[0] = now

    log(f"plan: measuring compute at micro-batch sizes {', '.join(map(str, micro_sizes))} x {seq_len} tokens")
    memory, host = _memory(ranks_per_node)
    compute = measure_compute(model_config, precision, seq_len, micro_sizes, device, parameters, memory)
    done("compute measured")
    log(f"plan: measuring collectives up to {max_bytes / MB:,.0f} MiB")
    links = measure_links(ctx.world_size, ctx.rank, ranks_per_node, device, max_bytes, op_budget_s)
    done("collectives measured")
    if compressed_shapes[0]:
        compute.compression = measure_compression(*compressed_shapes, embedding_shapes, ctx.world_size, ctx.rank,
                                                  device)
        done("gradient compression measured")
    if stages and ctx.world_size > 1:
        log(f"plan: measuring DeepSpeed's own cost per micro-batch under ZeRO-{', '.join(map(str, stages))}")
        compute.engine_overhead = measure_engine_overhead(model_config, precision, seq_len, micro_sizes, device,
                                                          stages)
        done("DeepSpeed's cost measured")
    compute = _slowest(compute)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu ({torch.get_num_threads()} threads)"
    return Measurements(name, precision, ctx.world_size, ranks_per_node, compute, links, memory, host,
                        time.perf_counter() - began)


def _time(fn, repeats: int, budget_s: float, sync) -> float:
    """Median seconds of fn() after one warm-up call, at most `repeats` calls or about budget_s."""
    fn()
    sync()
    times: list[float] = []
    deadline = time.perf_counter() + budget_s
    while len(times) < repeats and (len(times) < 2 or time.perf_counter() < deadline):
        began = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - began)
    return statistics.median(times)


def measure_compute(model_config, precision: str, seq_len: int, micro_sizes: list[int],
                    device: torch.device, parameters: int = 0, device_memory: int = 0) -> Compute:
    """Forward + backward of a 1-layer copy of the model and of the whole model when it fits in a fraction of one
    device (else a 2-layer copy): the difference per layer is one layer, the rest the embeddings and head. The
    whole model, where it fits, includes what a 1-vs-2-layer difference misses on CPU (the caches hold less of a
    larger model: measured 42 vs 50 ms per micro-batch of a 3.3M-parameter Llama)."""
    import copy

    from transformers import AutoModelForCausalLM

    from ..flops import DTYPES

    dtype = DTYPES.get(precision, torch.float32)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    vocab = model_config.vocab_size
    totals: dict[int, dict[int, float]] = {}
    forwards: dict[int, dict[int, float]] = {}
    torch.manual_seed(0)
    full = getattr(model_config, "num_hidden_layers", None) or getattr(model_config, "n_layer", 2)
    w = torch.finfo(dtype).bits // 8
    fits = parameters and device_memory and parameters * 3 * w < device_memory * 0.3
    depths = (1, full) if fits and full > 1 else (1, 2)
    layer_params = 0

    def time_depths(repeats: int, budget_s: float) -> None:
        nonlocal layer_params
        counts = {}
        for layers in depths:
            config = copy.deepcopy(model_config)
            for key in ("num_hidden_layers", "n_layer"):
                if hasattr(config, key):
                    setattr(config, key, layers)
            model = AutoModelForCausalLM.from_config(config, dtype=dtype).to(device).train()
            counts[layers] = sum(p.numel() for p in model.parameters())
            totals.setdefault(layers, {})
            forwards.setdefault(layers, {})
            for micro in micro_sizes:
                ids = torch.randint(0, vocab, (micro, seq_len), device=device)
                batch = {"input_ids": ids, "labels": ids}
                # the fastest of the rounds: interference (other processes, the other ranks) only adds time
                total = _time(partial(_forward_backward, model, batch), repeats, budget_s, sync)
                forward = _time(partial(_forward, model, batch), repeats, budget_s / 2, sync)
                totals[layers][micro] = min(totals[layers].get(micro, total), total)
                forwards[layers][micro] = min(forwards[layers].get(micro, forward), forward)
            del model
        layer_params = (counts[depths[1]] - counts[1]) // (depths[1] - 1)

    deeper, extra = depths[1], depths[1] - 1

    def per_layer(table: dict) -> dict:
        return {micro: (table[deeper][micro] - table[1][micro]) / extra for micro in micro_sizes}

    time_depths(3, 2.0)
    problem = inconsistent_layer_times(per_layer(totals), totals[1])
    if problem:  # a busy machine: measure again, longer, and keep the faster figures
        time_depths(7, 4.0)
        problem = inconsistent_layer_times(per_layer(totals), totals[1])
    compute = Compute()
    layer_times, forward_times = per_layer(totals), per_layer(forwards)
    if problem:
        # still noise: a layer's time from its FLOPs at the matmul rate measured at the model's own shapes
        rate = _matmul_rate(model_config, dtype, device, sync, max(micro_sizes) * seq_len)
        from .memory import dims
        hidden = dims(model_config)[0]
        for micro in micro_sizes:
            flops = micro * seq_len * (6.0 * layer_params + 12.0 * seq_len * hidden)
            layer_times[micro], forward_times[micro] = flops / rate, flops / rate / 3
        compute.notes.append(f"one layer's forward+backward was timed inconsistently twice ({problem}; a busy "
                             f"machine?): layer times are estimated from its FLOPs at the measured matmul rate "
                             f"instead, and predictions are less certain")
    for micro in micro_sizes:
        layer = max(layer_times[micro], 1e-6)
        compute.layer[str(micro)] = layer
        compute.layer_forward[str(micro)] = max(forward_times[micro], 1e-6)
        compute.rest[str(micro)] = max(totals[1][micro] - layer, 0.0)
    compute.adam_elements_per_s = _adam_rate(device, cpu_adam=False)
    if device.type == "cuda":
        compute.cpu_adam_elements_per_s = _adam_rate(torch.device("cpu"), cpu_adam=True)
        compute.host_copy_bytes_per_s = _host_copy_rate(device)
    else:
        compute.cpu_adam_elements_per_s = _adam_rate(device, cpu_adam=True) or compute.adam_elements_per_s
    compute.copy_bytes_per_s = _copy_rate(device)
    compute.matmul_flops = _matmul_rate(model_config, dtype, device, sync, max(micro_sizes) * seq_len)
    return compute


def measure_compression(shapes: list, repeat: int, exempt: frozenset, world: int, rank: int,
                        device: torch.device) -> dict:
    """Seconds per step that each gradient compressor (dstrain/components/compression.py) spends computing on `shapes`
    (x `repeat`: one layer's shapes stand for all layers of a large model), on a group of this rank alone so no
    link time is included."""
    from ..components.compression import METHODS, Reducer
    from ..config import CompressionSection

    alone = None
    for r in range(world):  # every rank creates every group
        group = tdist.new_group([r])
        if r == rank:
            alone = group
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    out = {}
    generator = torch.Generator().manual_seed(0)
    grads = [torch.randn(*shape, generator=generator).to(device) for shape in shapes]
    for method in METHODS[1:]:
        reducer = Reducer(CompressionSection(method, warmup_steps=0), group=alone, exempt_shapes=exempt)
        out[method] = repeat * _time(lambda r=reducer: r.average_([g.clone() for g in grads]), 3, 1.0, sync)
    # sign decodes every rank's bits: one more decode per further data-parallel rank
    elements = sum(g.numel() for g in grads if tuple(g.shape) not in exempt)
    out["sign_per_rank"] = repeat * _time(partial(_decode_signs, elements, device), 3, 1.0, sync)
    return out


def _decode_signs(elements: int, device) -> None:
    from ..components.compression import SIGN_BLOCK, _unpack_bits
    blocks = -(-elements // SIGN_BLOCK)
    packed = torch.zeros(blocks * SIGN_BLOCK // 8, dtype=torch.uint8, device=device)
    total = torch.zeros(blocks, SIGN_BLOCK, device=device)
    signs = _unpack_bits(packed, blocks * SIGN_BLOCK).view(blocks, SIGN_BLOCK).float() * 2 - 1
    total += signs * torch.ones(blocks, 1, device=device)


def measure_engine_overhead(model_config, precision: str, seq_len: int, micro_sizes: list[int], device,
                            stages: tuple) -> dict:
    """What a DeepSpeed ZeRO engine adds to a micro-batch's forward + backward besides its communication: per-
    parameter hooks, ZeRO-3's fetch and release, copies into gradient buckets. A 1-layer copy of the model runs
    under an engine of each stage (accumulation never reaching a boundary) and plain; the difference less the time
    counted in collectives, per parameter tensor. On CPU ranks this was the main miss of the first model: ZeRO-3
    took 0.15 s per step more than predicted on a 3.3M-parameter Llama."""
    import copy

    import deepspeed
    from transformers import AutoModelForCausalLM

    from ..flops import DTYPES
    from ..parallel import ds_internals
    from ..parallel.comm_counter import CommCounter

    dtype = DTYPES.get(precision, torch.float32)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    config = copy.deepcopy(model_config)
    for key in ("num_hidden_layers", "n_layer"):
        if hasattr(config, key):
            setattr(config, key, 1)
    micro = max([m for m in micro_sizes if m <= 8] or [min(micro_sizes)])
    ids = torch.randint(0, config.vocab_size, (micro, seq_len), device=device)
    batch = {"input_ids": ids, "labels": ids}
    out = {}
    for stage in stages:
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype).to(device).train()
        tensors = sum(1 for _ in model.parameters())
        plain = _time(partial(_forward_backward, model, batch), 3, 1.0, sync)
        ds = {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": 1 << 20,
              "zero_optimization": {"stage": stage}, "bf16": {"enabled": precision == "bf16"},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}}, "steps_per_print": 1 << 30}
        ds_internals.defer_muon_compile()
        engine = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds)[0]
        counter = CommCounter().start()
        step = partial(_engine_micro_batch, engine, batch)
        step()
        sync()
        began, waited = time.perf_counter(), counter.seconds
        for _ in range(3):
            step()
        sync()
        engine_s = (time.perf_counter() - began - (counter.seconds - waited)) / 3
        counter.stop()
        out[str(stage)] = max(engine_s - plain, 0.0) / tensors
        engine.destroy()
        del engine, model
    return out


def _engine_micro_batch(engine, batch: dict) -> None:
    from ..objectives.causal_lm import loss_sum
    engine.backward(loss_sum(engine, batch))
    engine.step()  # no optimizer step before the accumulation boundary


def _forward_backward(model, batch: dict) -> None:
    from ..objectives.causal_lm import loss_sum
    loss_sum(model, batch).backward()  # what steps.train_step runs per micro-batch (fp32 loss over the logits)


@torch.no_grad()
def _forward(model, batch: dict) -> None:
    from ..objectives.causal_lm import loss_sum
    loss_sum(model, batch)


def _adam_rate(device: torch.device, cpu_adam: bool, elements: int = 1 << 22) -> float:
    """Parameter elements one optimizer step updates per second (fp32 master, as DeepSpeed keeps it)."""
    param = torch.nn.Parameter(torch.zeros(elements, device=device))
    param.grad = torch.full_like(param, 1e-3)
    if cpu_adam:
        try:
            from deepspeed.ops.adam import DeepSpeedCPUAdam
            optimizer = DeepSpeedCPUAdam([param], lr=1e-3)
        except Exception:  # the op is not built (no compiler) or not loadable: offload is then not measured
            return 0.0
    else:
        optimizer = torch.optim.AdamW([param], lr=1e-3, foreach=True)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    return elements / _time(optimizer.step, 3, 1.0, sync)


def _copy_rate(device: torch.device, nbytes: int = 64 * MB) -> float:
    """Bytes per second that one tensor copy moves on the device (read + write counted once, as copy_ does)."""
    source = torch.ones(nbytes // 4, device=device)
    target = torch.empty_like(source)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    return nbytes / _time(partial(target.copy_, source), 3, 0.5, sync)


def _host_copy_rate(device: torch.device, nbytes: int = 256 * MB) -> float:
    host = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
    gpu = torch.empty(nbytes, dtype=torch.uint8, device=device)
    return nbytes / _time(lambda: gpu.copy_(host, non_blocking=True), 3, 1.0, torch.cuda.synchronize)


def _matmul_rate(config, dtype, device, sync, tokens: int) -> float:
    """FLOP/s of the model's own projections (hidden x hidden, hidden x MLP width) at the micro-batch's tokens."""
    from .memory import dims

    hidden, _, ffn, _ = dims(config)
    tokens = min(tokens, 8192)
    best = 0.0
    for n in (hidden, ffn):
        a = torch.randn(tokens, hidden, dtype=dtype, device=device)
        b = torch.randn(hidden, n, dtype=dtype, device=device)
        best = max(best, 2.0 * tokens * hidden * n / _time(partial(torch.matmul, a, b), 5, 0.5, sync))
    return best


def _groups(world: int, rank: int, ranks_per_node: int) -> dict:
    """level -> (group or None, ranks in it, whether this rank is in it). Every rank creates every group."""
    per_node = max(1, min(ranks_per_node, world))
    nodes = world // per_node
    node = rank // per_node
    levels = {}
    if per_node > 1:
        mine = None
        for n in range(nodes):  # new_group must be called by all ranks, for every group, in the same order
            group = tdist.new_group(list(range(n * per_node, (n + 1) * per_node)))
            if n == node:
                mine = group
        levels["node"] = (mine, per_node, True)
    if nodes > 1 and per_node > 1:
        leaders = [n * per_node for n in range(nodes)]
        levels["across nodes"] = (tdist.new_group(leaders), nodes, rank in leaders)
    if world > 1:
        levels["world"] = (None, world, True)
    return levels


def measure_links(world: int, rank: int, ranks_per_node: int, device: torch.device, max_bytes: int,
                  op_budget_s: float) -> dict:
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    out: dict = {}
    for level, (group, ranks, member) in _groups(world, rank, ranks_per_node).items():
        out[level] = {}
        for op in OPS:
            curve = LinkCurve(ranks)
            size = MB
            while size <= max_bytes:
                seconds = _collective_seconds(op, size, ranks, group, device, sync) if member else 0.0
                curve.points.append([size, seconds])
                # the decision to go on must be the same on every rank: the slowest rank's time decides
                longest = torch.tensor([seconds], dtype=torch.float64)
                tdist.all_reduce(longest, op=tdist.ReduceOp.MAX)
                curve.points[-1][1] = longest.item() if member else 0.0
                if longest.item() > op_budget_s:
                    break
                size *= 4
            out[level][op] = curve
    # every rank keeps the slowest member's curve (non-members hold zeros): the maximum over ranks
    for level in out:
        for curve in out[level].values():
            times = torch.tensor([t for _, t in curve.points], dtype=torch.float64)
            tdist.all_reduce(times, op=tdist.ReduceOp.MAX)
            curve.points = [[b, t] for (b, _), t in zip(curve.points, times.tolist())]
    return out


def _collective_seconds(op: str, nbytes: int, ranks: int, group, device, sync) -> float:
    elements = nbytes // 4 // ranks * ranks  # fp32, divisible by the group
    full = torch.ones(elements, device=device)
    part = torch.ones(elements // ranks, device=device)
    calls = {"all_reduce": lambda: tdist.all_reduce(full, group=group),
             "all_gather": lambda: tdist.all_gather_into_tensor(full, part, group=group),
             "reduce_scatter": lambda: tdist.reduce_scatter_tensor(part, full, group=group)}
    return _time(calls[op], 3, 1.0, sync)


def inconsistent_layer_times(layer: dict, whole: dict) -> str | None:
    """Why per-layer times (micro-batch size -> seconds) cannot be right, or None: a layer lost in the noise of the
    whole model's time, or a larger micro-batch timed faster than a smaller one (less than 0.8x) or far slower than
    its extra work explains (more than 2x the proportional time)."""
    sizes = sorted(layer)
    for micro in sizes:
        if layer[micro] <= 0.02 * whole[micro]:
            return (f"{1e3 * layer[micro]:.2f} ms at micro-batch {micro}, within the noise of the "
                    f"{1e3 * whole[micro]:.1f} ms of the 1-layer model")
    for small, large in zip(sizes, sizes[1:]):
        if layer[large] < 0.8 * layer[small] or layer[large] > 2.0 * (large / small) * layer[small]:
            return (f"{1e3 * layer[small]:.2f} ms at micro-batch {small} but {1e3 * layer[large]:.2f} ms at "
                    f"{large}")
    return None


def _slowest(compute: Compute) -> Compute:
    """The slowest rank's compute times and the lowest rates: one all-reduce of a flat vector."""
    if not tdist.is_initialized() or tdist.get_world_size() == 1:
        return compute
    keys = sorted(compute.layer, key=int)
    times = [compute.layer[k] for k in keys] + [compute.layer_forward[k] for k in keys] + \
        [compute.rest[k] for k in keys]
    methods = sorted(compute.compression)
    times += [compute.compression[m] for m in methods]
    stages = sorted(compute.engine_overhead)
    times += [compute.engine_overhead[st] for st in stages]
    rates = [compute.adam_elements_per_s, compute.cpu_adam_elements_per_s, compute.host_copy_bytes_per_s,
             compute.matmul_flops, compute.copy_bytes_per_s]
    flat = torch.tensor(times + [-r for r in rates], dtype=torch.float64)  # max of -rate = -(min rate)
    tdist.all_reduce(flat, op=tdist.ReduceOp.MAX)
    values = flat.tolist()
    n, k = len(keys), len(methods)
    e = len(stages)
    adam, cpu_adam, host_copy, matmul, copies = [-v for v in values[3 * n + k + e:]]
    return Compute({m: values[i] for i, m in enumerate(keys)}, {m: values[n + i] for i, m in enumerate(keys)},
                   {m: values[2 * n + i] for i, m in enumerate(keys)}, adam, cpu_adam, host_copy, matmul,
                   compression={m: values[3 * n + i] for i, m in enumerate(methods)}, copy_bytes_per_s=copies,
                   engine_overhead={st: values[3 * n + k + i] for i, st in enumerate(stages)}, notes=compute.notes)


def _memory(ranks_per_node: int) -> tuple[int, int]:
    """(bytes one rank may use, the preflight's figure; host RAM per node)."""
    import psutil

    from .memory import device_memory
    device = device_memory("cuda" if torch.cuda.is_available() else "cpu", ranks_per_node)[0]
    return device, psutil.virtual_memory().total
