"""The step-time model: candidates for a recipe on a world, and for each its memory fit and predicted step time.

step = compute + exposed communication + optimizer (+ offload transfers), per optimizer step:
  compute      accumulation x one micro-batch's forward + backward (measured per layer and for the head,
               probe.py; + one layer forward each under activation checkpointing). Tensor parallelism divides the
               layers' time by its size; a pipeline of p stages runs (accumulation + p - 1) stage-slots of
               layers / p each (the 1F1B bubble).
  communication  what DeepSpeed 0.19 sends per step, as collectives over full tensors of the training dtype:
      ZeRO-0   all-reduce of the gradients at the accumulation boundary (bf16/fp16 ZeRO-0 runs the
               partitioned 16-bit optimizer: then also an all-gather of the updated parameters)
      ZeRO-1   all-reduce of the gradient buckets at the boundary (DeepSpeed's use_multi_rank_bucket_allreduce,
               its default; reduce to the owners without it), all-gather of the updated parameters
      ZeRO-2   the same reduction in every micro-batch's backward, all-gather after the step
      ZeRO-3   per micro-batch two all-gathers of the parameters (forward, backward) and a reduce-scatter
      compression  (ZeRO-0/1) powersgd: all-reduce of P and Q (rank r) per matrix + the uncompressed vectors and
               embedding; sign: all-gather of 1 bit + 1/32 scale byte per element (after warm-up); topk: all-gather
               of an int32 index and an fp32 value per kept entry (topk_fraction of each matrix)
      DiLoCo   (one replica per node) the config's traffic inside the replica, on the node's link; every H steps
               each rank's slice of the pseudo-gradient all-gathered across the replicas (int8/bf16/fp32) and the
               new weights' slices broadcast in turn inside the replica (counted as the all-gather of the same
               bytes), 1/H of it per step; diloco.warmup_steps' N
               averaged steps (a sync each, bf16 for int8/int4) count as N/max_steps of the run's steps
      tensor parallel  all-reduces of a micro-batch's activations per layer: 2 forward, 2 backward (Megatron)
               or one per column-parallel linear (AutoTP: 5 in a Llama layer); the forward's again when recomputed
      pipeline  each stage boundary passes a micro-batch's activations forward and their gradient back, over
               one rank's share of the link between nodes once a model replica spans nodes
    Each collective takes the measured time of its size at its link level (within a node when its group is,
    else the world's). Exposed: on CPU ranks (gloo) a collective blocks the rank, so all of it; on GPUs with
    overlap_comm the backward reduce-scatter (ZeRO-2/3) and ZeRO-3's prefetched gathers hide behind compute
    and only what exceeds it shows.
  update       elements this rank updates / the measured AdamW rate (CPU Adam's under optimizer offload), plus
               the device-host copies of offload at the measured copy rate (none on CPU ranks), plus the
               gradient compressor's arithmetic (measured on the model's gradient shapes).
Memory: dstrain/planner/memory.py's estimate (the preflight), against the device's memory.
"""
from __future__ import annotations

import copy
import functools
import json
from dataclasses import dataclass, field, replace
from pathlib import Path

from ..errors import UserError
from ..parallel.layout import Layout, parallel_sizes
from .probe import Measurements

ROOT_CONFIGS = ("zero0.json", "zero1.json", "zero2.json", "zero3.json", "zero2_offload.json", "zero3_offload.json",
                "tp2_zero1.json", "pipe2_zero1.json")
# the repository's gradient compression (a recipe section) on the configs it works with
COMPRESSED = (("zero0.json", "powersgd"), ("zero1.json", "powersgd"), ("zero1.json", "sign"), ("zero0.json", "topk"),
              ("zero1.json", "topk"))
# DiLoCo (H, pseudo-gradient dtype, outer (lr, momentum) or None for the recipe's, diloco.warmup_steps, (fragments,
# overlap)) on these configs, one replica per node: the settings bench/compression.py and bench/slow_links.py
# measured (from the fourth: plain averaging, measured best for short runs; H=25 int4 sends what H=50 int8 does,
# twice as often; then with 8 averaged bf16 steps first; then that streamed, 5 fragments landing a step late)
DILOCO = ((10, "fp32", None, 0, (1, 0)), (50, "fp32", None, 0, (1, 0)), (50, "bf16", None, 0, (1, 0)),
          (50, "int8", (1.0, 0.0), 0, (1, 0)), (25, "int4", (1.0, 0.0), 0, (1, 0)), (25, "int4", (1.0, 0.0), 8, (1, 0)),
          (25, "int4", (1.0, 0.0), 8, (5, 1)))
DILOCO_CONFIGS = ("zero1.json", "zero2.json")


@dataclass
class Candidate:
    config: str  # the shipped JSON it starts from
    ds: dict  # the raw DeepSpeed config (auto values kept: train.py fills them)
    micro: int
    accum: int
    checkpointing: bool
    tensor_style: str = "autotp"  # how tensor parallelism splits a layer: DeepSpeed's AutoTP or Megatron's
    compression: str = "none"  # compression.method
    recipe_compression: str = "none"  # the recipe's own compression.method (overrides() says when it changes)
    diloco_every: int = 0  # DiLoCo's H (0: off), one replica per node
    diloco_dtype: str = "fp32"
    diloco_outer: tuple | None = None  # (outer_lr, outer_momentum), or None: the recipe's
    recipe_diloco: int = 0  # the recipe's own diloco.every
    diloco_warmup: int = 0  # diloco.warmup_steps: the first N steps each end with a plain average (bf16 for int8/int4)
    diloco_stream: tuple = (1, 0)  # (diloco.fragments, diloco.overlap): streaming DiLoCo
    extra: tuple = ()  # more overrides the candidate needs (eval/checkpoint intervals that are multiples of H)

    @property
    def name(self) -> str:
        sizes = parallel_sizes(self.ds)
        tp, pp = sizes.tensor, sizes.pipeline
        base = self.config.removesuffix(".json")
        if tp > 1 and not base.startswith(f"tp{tp}"):
            base = f"tp{tp}_" + base.split("_", 1)[-1]
        if pp > 1 and not base.startswith(f"pipe{pp}"):
            base = f"pipe{pp}_" + base.split("_", 1)[-1]
        if self.diloco_every:
            dtype = "" if self.diloco_dtype == "fp32" else f"_{self.diloco_dtype}"
            warmup = f"_w{self.diloco_warmup}" if self.diloco_warmup else ""
            stream = "_s{}o{}".format(*self.diloco_stream) if self.diloco_stream != (1, 0) else ""
            return f"{base}_diloco{self.diloco_every}{dtype}{'_avg' if self.diloco_outer else ''}{warmup}{stream}"
        return base if self.compression == "none" else f"{base}_{self.compression}"

    def overrides(self) -> list[str]:
        out = [f"--train.micro_batch_size={self.micro}", f"--train.grad_accum_steps={self.accum}",
               f"--train.activation_checkpointing={str(self.checkpointing).lower()}"]
        changed = self.compression != self.recipe_compression
        out += [f"--compression.method={self.compression}"] if changed else []
        if self.diloco_every:
            out += [f"--diloco.every={self.diloco_every}", f"--diloco.dtype={self.diloco_dtype}",
                    f"--diloco.warmup_steps={self.diloco_warmup}", f"--diloco.fragments={self.diloco_stream[0]}",
                    f"--diloco.overlap={self.diloco_stream[1]}", *self.extra]
            if self.diloco_outer:
                out += [f"--diloco.outer_lr={self.diloco_outer[0]:g}",
                        f"--diloco.outer_momentum={self.diloco_outer[1]:g}"]
        elif self.recipe_diloco:
            out.append("--diloco.every=0")
        return out


@dataclass
class Prediction:
    candidate: Candidate
    fits: bool
    memory_bytes: int = 0
    host_bytes: int = 0  # offloaded states per node
    compute_s: float = 0.0
    comm_s: float = 0.0  # all communication
    exposed_comm_s: float = 0.0  # what the step waits for
    optimizer_s: float = 0.0  # the update, with offload's copies
    comm_bytes: float = 0.0  # per rank per step, CommCounter's ring convention (metrics.jsonl comm_bytes)
    tokens: int = 0  # per step, all ranks
    reason: str = ""  # why it does not fit or cannot run
    detail: dict = field(default_factory=dict)
    price: float | None = 0.0  # eval loss relative to exact training, measured (convergence_price)

    @property
    def step_s(self) -> float:
        return self.compute_s + self.exposed_comm_s + self.optimizer_s

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.step_s if self.step_s > 0 else 0.0

    @property
    def comm_fraction(self) -> float:
        return self.exposed_comm_s / self.step_s if self.step_s > 0 else 0.0

    def to_dict(self) -> dict:
        return {"name": self.candidate.name, "config": self.candidate.config, "micro_batch_size": self.candidate.micro,
                "grad_accum_steps": self.candidate.accum, "activation_checkpointing": self.candidate.checkpointing,
                "compression": self.candidate.compression, "diloco_every": self.candidate.diloco_every,
                "diloco_dtype": self.candidate.diloco_dtype, "diloco_warmup_steps": self.candidate.diloco_warmup,
                "fits": self.fits, "reason": self.reason, "memory_bytes": self.memory_bytes,
                "host_bytes": self.host_bytes, "compute_s": self.compute_s, "comm_s": self.comm_s,
                "exposed_comm_s": self.exposed_comm_s, "optimizer_s": self.optimizer_s, "step_s": self.step_s,
                "tokens_per_s": self.tokens_per_s, "comm_fraction": self.comm_fraction,
                "comm_bytes": self.comm_bytes, "convergence_price": self.price, "ds": self.candidate.ds,
                "overrides": self.candidate.overrides()}


@dataclass
class Workload:
    """What the recipe trains, independent of the strategy."""
    model_config: object
    parameters: int
    trained: int | None  # adapters (LoRA) or None: every parameter trains
    quantized: int  # QLoRA's 4-bit base weights
    matrices: list  # shapes of the trained tensors (compression's P/Q sizes)
    layer_shapes: list  # the first decoder layer's trained tensors (timing compression of a large model)
    embedding_shapes: frozenset  # sent uncompressed
    global_batch: int
    seq_len: int
    sequences_per_sample: int = 1  # a preference pair is two rows (objectives.sequences_per_sample)


# ----------------------------------------------------------------------------- candidates

def global_batch_of(recipe, raw_ds: dict, world: int) -> int:
    """The recipe's global batch: as written for its world_size, else what it makes on `world` ranks."""
    written = Layout.from_ds_config(raw_ds, recipe.world_size or world)
    return written.global_batch(recipe.train.micro_batch_size, recipe.train.grad_accum_steps)


def candidates(recipe, raw_ds: dict, world: int, model_config, load=None,
               ranks_per_node: int | None = None) -> list[Candidate]:
    """Every shipped strategy (and tensor/pipeline sizes that divide the world), each with every micro batch x
    accumulation that keeps the recipe's global batch; the recipe's precision and optimizer stay as written.
    On more than one node (ranks_per_node given), DiLoCo with one replica per node too."""
    from ..components import tensor_parallel
    from ..parallel import ds_config

    load = load or ds_config.load
    heads = getattr(model_config, "num_attention_heads", 1)
    kv = getattr(model_config, "num_key_value_heads", None) or heads
    layers = getattr(model_config, "num_hidden_layers", None) or getattr(model_config, "n_layer", 1)
    global_batch = global_batch_of(recipe, raw_ds, world)
    # gradient compression sends less between data-parallel ranks; on one rank nothing is sent and it only adds its
    # error (issue 85: --plan on 1 rank ranked zero0 + PowerSGD, +0.9% eval loss, above plain zero0)
    bases: list[tuple[str, dict, str]] = [(name, _keep_recipe_choices(load(name), raw_ds), method)
                                          for name, method in COMPRESSED if world > 1]
    for name in ROOT_CONFIGS:
        raw = _keep_recipe_choices(load(name), raw_ds)
        if name.startswith(("tp2", "pipe2")):
            key, field_ = ("tensor_parallel", "autotp_size") if name.startswith("tp") else ("pipeline", "stages")
            for size in (2, 4, 8) if key == "tensor_parallel" else (2, 4, 8, 16, 32, 64):
                if world % size or (key == "tensor_parallel" and (heads % size or kv % size)) or \
                        (key == "pipeline" and layers < size) or recipe.lora.enabled:
                    continue
                if key == "tensor_parallel" and tensor_parallel.refusal(model_config, raw.get(key) or {},
                                                                        recipe.model.check_layouts):
                    continue  # the family is refused tensor parallelism (docs/models.md)
                sized = copy.deepcopy(raw)
                sized[key][field_] = size
                bases.append((name, sized, "none"))
        else:
            bases.append((name, raw, "none"))
    diloco = [(name, _keep_recipe_choices(load(name), raw_ds), "none", *setting) for name in DILOCO_CONFIGS
              for setting in DILOCO if setting[0] <= recipe.train.max_steps] \
        if ranks_per_node and world // ranks_per_node >= 2 else []
    out = []
    for name, raw, method, every, dtype, outer, warmup, stream in \
            [(n, r, m, 0, "fp32", None, 0, (1, 0)) for n, r, m in bases] + diloco:
        layout = Layout.from_ds_config(raw, world)
        if global_batch % layout.data_parallel:
            continue
        per_rank = global_batch // layout.data_parallel
        extra = _diloco_intervals(recipe, every) if every and stream == (1, 0) else ()
        for micro in [m for m in range(1, min(per_rank, 64) + 1) if per_rank % m == 0]:
            for checkpointing in sorted({recipe.train.activation_checkpointing, True}):
                out.append(Candidate(name, raw, micro, per_rank // micro, checkpointing, compression=method,
                                     recipe_compression=recipe.compression.method, diloco_every=every,
                                     diloco_dtype=dtype, diloco_outer=outer, recipe_diloco=recipe.diloco.every,
                                     diloco_warmup=warmup, diloco_stream=stream, extra=extra))
    return out


def _diloco_intervals(recipe, every: int) -> tuple:
    """eval.every and checkpoint.every as multiples of H (DiLoCo evaluates and saves at syncs), near the recipe's."""
    out = []
    for key, value in (("eval.every", recipe.eval.every), ("checkpoint.every", recipe.checkpoint.every)):
        if value == "auto" or (isinstance(value, int) and value % every):
            out.append(f"--{key}={every * max(1, round(value / every)) if isinstance(value, int) else every}")
    return tuple(out)


def _keep_recipe_choices(candidate: dict, raw_ds: dict) -> dict:
    """The user's precision, optimizer, scheduler and clipping go into every candidate (the planner chooses the
    parallel strategy, not the training's numerics)."""
    out = copy.deepcopy(candidate)
    for key in ("bf16", "fp16", "optimizer", "scheduler", "gradient_clipping", "communication_data_type"):
        if key in raw_ds:
            out[key] = copy.deepcopy(raw_ds[key])
        elif key in ("bf16", "fp16"):
            out.pop(key, None)
    return out


# ----------------------------------------------------------------------------- the model

def _calls(stage: int, psi: int, psi_t: int, w: int, sixteen_bit: bool, accum: int, compression,
           work: Workload, zero: dict, dp: int) -> list[tuple[str, str, float, int, str]]:
    """(op, level, bytes per call, calls per step, phase) of the data-parallel traffic; level is filled later.
    Buckets: DeepSpeed sends in buckets of reduce_bucket_size / allgather_bucket_size elements."""
    grads = psi_t * w
    reduce_bucket = int(zero.get("reduce_bucket_size", 5e8)) * w
    gather_bucket = int(zero.get("allgather_bucket_size", 5e8)) * w
    out = []

    def bucketed(op: str, total: float, bucket: int, times: int, phase: str):
        if total <= 0:
            return
        full, rest = divmod(total, bucket)
        if full:
            out.append((op, "dp", bucket, int(full) * times, phase))
        if rest:
            out.append((op, "dp", rest, times, phase))

    if compression is not None and compression.enabled:
        out.extend(_compressed_calls(compression, work, dp))
        if stage == 1 or sixteen_bit:
            bucketed("all_gather", psi_t * w, gather_bucket, 1, "boundary")
        return out
    if stage == 0 and not sixteen_bit:
        bucketed("all_reduce", grads, reduce_bucket, 1, "boundary")
    elif stage <= 2:  # DeepSpeed 0.19 all-reduces each bucket (use_multi_rank_bucket_allreduce, on by default)
        reduce = "all_reduce" if zero.get("use_multi_rank_bucket_allreduce", True) else "reduce_scatter"
        bucketed(reduce, grads, reduce_bucket, accum if stage == 2 else 1, "backward" if stage == 2 else "boundary")
        bucketed("all_gather", psi_t * w, gather_bucket, 1, "boundary")
    else:
        layers = _layers(work.model_config)
        per_layer = psi * w / max(layers, 1)  # ZeRO-3 gathers module by module
        out.append(("all_gather", "dp", per_layer, 2 * layers * accum, "gather"))
        bucketed("reduce_scatter", grads, reduce_bucket, accum, "backward")
    return out


def _compressed_calls(compression, work: Workload, dp: int) -> list:
    import math
    plain = 0  # fp32 elements all-reduced uncompressed (vectors and the embedding), once per step
    p_elems = q_elems = 0
    signed = kept = 0
    for shape in work.matrices:
        n = math.prod(shape)
        if len(shape) < 2 or (tuple(shape) in work.embedding_shapes and not compression.compress_embeddings):
            plain += n
            continue
        if compression.method == "powersgd":
            rows, cols = shape[0], n // shape[0]
            r = min(compression.rank, rows, cols)
            if (rows + cols) * r >= n:  # the factors would be larger than the matrix: sent as it is
                plain += n
                continue
            p_elems, q_elems = p_elems + rows * r, q_elems + cols * r
        elif compression.method == "topk":
            kept += math.ceil(compression.topk_fraction * n)
        else:
            signed += n
    out = []
    if compression.method == "powersgd":
        out += [("all_reduce", "dp", 4 * (p_elems + plain), 1, "boundary"), ("all_reduce", "dp", 4 * q_elems, 1,
                                                                              "boundary")]
    else:
        if plain:
            out.append(("all_reduce", "dp", 4 * plain, 1, "boundary"))
        if compression.method == "topk":  # int32 index + fp32 value per kept entry, every rank's share
            out.append(("all_gather", "dp", dp * 8 * kept, 1, "boundary"))
        else:
            out.append(("all_gather", "dp", dp * (signed / 8 + 4 * signed / 128), 1, "boundary"))
    return [c for c in out if c[2] > 0]


def _tensor_parallel_reductions(config, style: str, checkpointing: bool) -> int:
    """All-reduces of a micro-batch's activations per layer. Forward: after the attention output and the MLP's
    down projection (row-parallel). Backward: Megatron fuses q/k/v and the MLP's input projections, so 2; DeepSpeed's
    AutoTP reduces the input gradient of every column-parallel linear (q, k, v, gate, up: 5 in a Llama layer;
    counted on a 2-rank run: 7 per layer). Recomputation repeats the forward's."""
    forward = 2
    if style == "megatron":
        backward = 2
    else:
        gated = getattr(config, "model_type", "") not in ("gpt2", "gpt_neox", "gptj", "opt", "bloom", "falcon")
        fused_qkv = getattr(config, "model_type", "") in ("gpt2", "gpt_neox", "bloom", "falcon")
        backward = (1 if fused_qkv else 3) + (2 if gated else 1)
    return forward + backward + (forward if checkpointing else 0)


def _engine_copies(stage: int, psi: int, psi_t: int, w: int, dp: int, accum: int, sixteen_bit: bool,
                   per_micro: bool = True) -> float:
    """Bytes DeepSpeed's ZeRO optimizers copy on the device per step besides the math (runtime/zero/
    stage_1_and_2.py, stage3.py): each micro-batch's gradients into the contiguous reduce bucket (and, ZeRO-2/3,
    this rank's share accumulated into its partition), the updated fp32 partition back into the training-dtype
    parameters, ZeRO-1/2's all-gathered parameters into the model, ZeRO-3's gathered parameters per micro-batch.
    fp32 ZeRO-0 accumulates in .grad and copies nothing. Measured gap without it: ZeRO-2 +28 ms per micro-batch
    of a 3.3M-parameter Llama on CPU ranks. per_micro=False: the probe measured the per-micro-batch part."""
    if stage == 0 and not sixteen_bit:
        return 0.0
    micro_bytes = psi_t * w + (psi_t // dp * 4 if stage >= 2 else 0)
    boundary = psi_t // dp * (4 + w) + (psi * w if stage <= 2 else 0)
    if stage == 3:
        micro_bytes += 2 * psi * w
    return (accum * micro_bytes if per_micro else 0) + boundary


def _layers(config) -> int:
    return getattr(config, "num_hidden_layers", None) or getattr(config, "n_layer", 1)


def _wire(op: str, nbytes: float, ranks: int) -> float:
    """Bytes one rank sends (CommCounter's ring convention; nbytes: the full tensor)."""
    if ranks <= 1:
        return 0.0
    if op == "all_reduce":
        return 2 * (ranks - 1) / ranks * nbytes
    return (ranks - 1) / ranks * nbytes


def predict(candidate: Candidate, work: Workload, meas: Measurements, recipe, caps, hidden: int | None,
            overlap: bool | None = None, checked: bool = True) -> Prediction:
    """Fit and step time of one candidate. overlap: whether communication can hide behind compute (GPUs); by
    default from the measurements' device. checked=False takes candidate.ds as resolved (a layout DeepSpeed's
    engine here does not offer, such as Megatron's tensor x pipeline x data for published runs)."""
    from ..components.compression import check_combination
    from ..parallel import ds_config
    from . import memory

    trial = _recipe_for(recipe, candidate)
    tokens = work.global_batch * work.seq_len * work.sequences_per_sample
    replicas = meas.nodes if candidate.diloco_every else 1  # one replica per node
    try:
        resolved = ds_config.resolve(candidate.ds, trial, meas.world_size, caps, hidden, meas.ranks_per_node,
                                     replicas=replicas) if checked else candidate.ds
        if checked:
            check_combination(resolved, trial.compression)
    except UserError as error:
        return Prediction(candidate, False, tokens=tokens, reason=str(error))
    layout = Layout.from_ds_config(resolved, meas.world_size, replicas=replicas)
    est = memory.estimate(work.model_config, work.parameters, trial, resolved, layout, work.trained, work.quantized)
    host = sum(est.host.values()) * meas.ranks_per_node
    pred = Prediction(candidate, True, est.device_total, host, tokens=tokens,
                      price=convergence_price(candidate, recipe))
    if est.device_total > meas.device_memory:
        pred.fits, pred.reason = False, f"needs {est.device_total / 2**30:.2f} GiB per rank"
    elif host > 0.8 * meas.host_memory:
        pred.fits, pred.reason = False, f"offload needs {host / 2**30:.1f} GiB of host RAM per node"

    zero = resolved.get("zero_optimization") or {}
    stage = int(zero.get("stage", 0))
    precision = ds_config.precision(resolved)
    w = 4 if precision == "fp32" else 2
    tp, pp, dp = layout.tensor_parallel, layout.pipeline_stages, layout.replica_data_parallel
    psi = work.parameters // (tp * pp)
    psi_t = psi if work.trained is None else work.trained // (tp * pp)
    overlap = meas.device.startswith("cpu") is False if overlap is None else overlap

    # compute
    layers = _layers(work.model_config)
    micro_s = meas.compute.micro_seconds(candidate.micro * work.sequences_per_sample, layers / pp / tp,
                                         candidate.checkpointing)
    if work.trained is not None:  # a frozen base skips the weight gradients: 4N + 6A of 6N (flops.py)
        micro_s *= (4 * work.parameters + 6 * work.trained) / (6 * work.parameters)
    slots = candidate.accum + pp - 1 if pp > 1 else candidate.accum
    pred.compute_s = slots * micro_s
    backward_s = candidate.accum * micro_s * 2 / 3

    # communication
    compression = trial.compression
    calls = _calls(stage, psi, psi_t, w, precision != "fp32", candidate.accum, compression, work, zero, dp) \
        if dp > 1 else []
    activation = candidate.micro * work.sequences_per_sample * work.seq_len * (hidden or 0) * w
    # train_step's two small all-reduces (token counts before, the loss after), over the whole world
    calls += [("all_reduce", "world", 16, 1, "boundary"), ("all_reduce", "world", 8, 1, "boundary")] \
        if meas.world_size > 1 else []
    if tp > 1:
        per_layer = _tensor_parallel_reductions(work.model_config, candidate.tensor_style, candidate.checkpointing)
        calls.append(("all_reduce", "tp", activation, per_layer * layers // pp * candidate.accum, "tp"))
    if pp > 1:
        calls.append(("all_gather", "pp", 2 * activation, 2 * candidate.accum, "pp"))  # a 2-rank exchange
        if getattr(work.model_config, "tie_word_embeddings", False):  # first and last stage sum the tied gradient
            vocab_h = work.model_config.vocab_size * (hidden or 0) * w
            calls.append(("all_reduce", "pp", vocab_h, 1, "boundary"))
    averaged = candidate.diloco_warmup / recipe.train.max_steps if candidate.diloco_every else 0.0
    if candidate.diloco_every:
        calls += _diloco_calls(psi_t, dp, replicas, candidate.diloco_every, candidate.diloco_dtype, averaged,
                               streamed=candidate.diloco_stream[1] > 0)
    total = exposed = 0.0
    hidden_behind = {"backward": backward_s if overlap else 0.0, "gather": pred.compute_s / 3 if overlap else 0.0}
    if candidate.diloco_every and overlap:  # diloco.overlap: each fragment's crossing hides behind `overlap` steps'
        # compute, fragments / H of them a step (on CPUs nothing: bench/streaming.py measured no hiding there)
        fragments, steps = candidate.diloco_stream
        hidden_behind["streamed"] = steps * fragments / candidate.diloco_every * (1 - averaged) * pred.compute_s
    by_phase: dict = {}
    for op, level, nbytes, count, phase in calls:
        ranks = {"dp": dp, "tp": tp, "pp": 2, "world": meas.world_size, "across": replicas}[level]
        curve = _curve(meas, op, ranks, "replica" if level == "dp" and replicas > 1 else level, layout)
        seconds = count * curve.seconds(op, nbytes) * _rank_scale(curve, ranks, op)
        total += seconds
        by_phase[phase] = by_phase.get(phase, 0.0) + seconds
        pred.comm_bytes += count * _wire(op, nbytes, ranks)

    for phase, seconds in by_phase.items():
        exposed += max(0.0, seconds - hidden_behind.get(phase, 0.0))
    pred.comm_s, pred.exposed_comm_s = total, exposed

    # optimizer and offload
    offload_opt = (zero.get("offload_optimizer") or {}).get("device", "none") != "none"
    offload_param = (zero.get("offload_param") or {}).get("device", "none") != "none"
    partitioned = stage >= 1 or precision != "fp32"
    elements = psi_t // dp if partitioned else psi_t
    rate = meas.compute.cpu_adam_elements_per_s if offload_opt else meas.compute.adam_elements_per_s
    if offload_opt and not rate and meas.compute.adam_elements_per_s:  # measured, and no CPU Adam
        pred.fits, pred.reason = False, "DeepSpeed's CPU Adam op is not built here (offload untested)"
        rate = meas.compute.adam_elements_per_s
    pred.optimizer_s = elements / rate if rate else 0.0
    overhead = meas.compute.engine_overhead.get(str(stage))
    # the engine runs its ZeRO machinery also with one rank per replica (DiLoCo's replicas, TP or pipeline only):
    # counted only for dp > 1 before, DiLoCo's trials were 7-43% slower than predicted
    if overhead is not None:  # measured per parameter tensor: hooks and per-micro-batch bucket copies
        pred.compute_s += candidate.accum * overhead * len(work.matrices) / (tp * pp)
    copies = _engine_copies(stage, psi, psi_t, w, dp, candidate.accum, precision != "fp32",
                            per_micro=overhead is None)
    pred.compute_s += copies / meas.compute.copy_bytes_per_s if meas.compute.copy_bytes_per_s else 0.0
    if compression.enabled and dp > 1:  # the compressor's own arithmetic (measured)
        pred.optimizer_s += meas.compute.compression.get(compression.method, 0.0)
        if compression.method == "sign":
            pred.optimizer_s += (dp - 1) * meas.compute.compression.get("sign_per_rank", 0.0)
    copy_rate = meas.compute.host_copy_bytes_per_s
    if copy_rate and offload_opt:  # gradients down in fp32, updated parameters back in the training dtype
        pred.optimizer_s += elements * (4 + w) / copy_rate
    if copy_rate and offload_param:  # each micro-batch fetches the partition for forward and backward
        pred.optimizer_s += 2 * candidate.accum * psi // dp * w / copy_rate
    if candidate.diloco_every and meas.compute.copy_bytes_per_s:  # the outer step: read, subtract, update, write
        # back the full fp32 weights (about 6 passes over them), once per H steps (each averaged step's too)
        syncs = (1 - averaged) / candidate.diloco_every + averaged
        pred.optimizer_s += 6 * 4 * psi_t / meas.compute.copy_bytes_per_s * syncs
    pred.detail = {"micro_s": micro_s, "calls": [list(c) for c in calls], "stage": stage, "dp": dp, "tp": tp, "pp": pp,
                   "averaged_share": averaged}
    return pred


def _diloco_calls(psi_t: int, size: int, replicas: int, every: int, dtype: str, averaged: float = 0.0,
                  streamed: bool = False) -> list:
    """A sync's traffic (components/diloco.py), 1/H of it per step: each rank's INT8_BLOCK-aligned slice of the
    pseudo-gradient all-gathered across the replicas, then the new weights' fp32 slices broadcast in turn in the
    replica (S broadcasts of a slice: counted as one all-gather of the same bytes).
    averaged: the share of the run's steps that diloco.warmup_steps ends with a sync of its own (in warmup_wire's
    type); the other steps sync every H. streamed (diloco.overlap): those syncs cross while training goes on
    (the "streamed" phase); fragments change when, not how much, is sent."""
    from ..components.diloco import WIRE_BYTES, slice_length, warmup_wire
    chunk = slice_length(psi_t, size)
    out = []
    for wire, per_step, phase in ((dtype, (1 - averaged) / every, "streamed" if streamed else "boundary"),
                                  (warmup_wire(dtype), averaged, "boundary")):
        if per_step:
            out.append(("all_reduce" if wire == "fp32" else "all_gather", "across",
                        chunk * WIRE_BYTES[wire] * (1 if wire == "fp32" else replicas), per_step, phase))
    if size > 1:
        out.append(("all_gather", "dp", 4.0 * chunk * size, (1 - averaged) / every + averaged, "boundary"))
    return out


def _curve(meas: Measurements, op: str, ranks: int, level: str, layout: Layout):
    """The measured link level a group of `ranks` uses: within a node when it fits in one (tensor parallel
    groups are consecutive ranks; a DiLoCo replica is a node), else the world's (a data-parallel group spans the
    nodes); DiLoCo's replicas talk across nodes, one rank per node."""
    from .probe import LinkCurve
    node = meas.links.get("node", {}).get(op)
    world = meas.links.get("world", {}).get(op)
    if level == "across":
        return meas.links.get("across nodes", {}).get(op) or world or LinkCurve(1)
    if level == "replica":
        return node or world or LinkCurve(1)
    if level == "pp":  # point to point between neighbouring stages: across nodes once a replica spans nodes
        spans = layout.model_parallel > meas.ranks_per_node and meas.nodes > 1
        across = meas.links.get("across nodes", {}).get(op)
        return (across or world or LinkCurve(1)) if spans else (node or world or LinkCurve(1))
    if level == "tp" or ranks <= meas.ranks_per_node and meas.nodes == 1:
        return node or world or LinkCurve(1)
    return world or node or LinkCurve(1)


def _rank_scale(curve, ranks: int, op: str) -> float:
    """A group of `ranks` on a link measured with curve.ranks: same bus bandwidth, so time scales with the bus
    factor (nccl-tests' busbw is independent of the rank count for ring algorithms)."""
    from .probe import BUS_FACTOR
    if curve.ranks <= 1 or ranks <= 1:
        return 0.0 if ranks <= 1 else 1.0
    return BUS_FACTOR[op](ranks) / BUS_FACTOR[op](curve.ranks)


def _recipe_for(recipe, candidate: Candidate):
    train = replace(recipe.train, micro_batch_size=candidate.micro, grad_accum_steps=candidate.accum,
                    activation_checkpointing=candidate.checkpointing)
    diloco = replace(recipe.diloco, every=candidate.diloco_every, dtype=candidate.diloco_dtype, replicas=0,
                     warmup_steps=candidate.diloco_warmup, fragments=candidate.diloco_stream[0],
                     overlap=candidate.diloco_stream[1])
    if candidate.diloco_outer:
        diloco = replace(diloco, outer_lr=candidate.diloco_outer[0], outer_momentum=candidate.diloco_outer[1])
    return replace(recipe, train=train, compression=replace(recipe.compression, method=candidate.compression),
                   diloco=diloco)


def workload(recipe, raw_ds: dict, world: int, model_config, model=None) -> Workload:
    """The recipe's model counted on the meta device (any size, no memory)."""
    import torch

    from ..components.compression import embedding_shapes
    from ..vision import model_class

    if model is None:
        with torch.device("meta"):
            model = model_class(model_config).from_config(model_config)
    parameters = sum(p.numel() for p in model.parameters())
    trained = quantized = None
    shapes = [tuple(p.shape) for p in model.parameters() if p.requires_grad]
    first = [tuple(p.shape) for name, p in model.named_parameters() if ".0." in name]
    if recipe.lora.enabled:
        from ..components.lora import count_parameters as lora_counts
        from ..components.lora import language_model_only
        _, trained, linear = lora_counts(model_config, language_model_only(model_config, recipe.lora))
        quantized = linear if recipe.lora.quantize else 0
        shapes = first = [(trained,)]  # adapters: many small matrices, counted as one uncompressed vector
    global_batch = global_batch_of(recipe, raw_ds, world)
    from ..objectives import sequences_per_sample
    return Workload(model_config, parameters, trained, quantized or 0, shapes, first, embedding_shapes(model),
                    global_batch, recipe.train.seq_len, sequences_per_sample(recipe))


def compression_sample(work: Workload, limit: int = 32 * 2**20) -> tuple[list, int]:
    """(shapes, repeat) whose compression the probe times: every trained tensor of a small model, one decoder
    layer's x the number of layers for a large one (the embedding goes uncompressed either way)."""
    import math
    if sum(math.prod(s) for s in work.matrices) <= limit:
        return work.matrices, 1
    return work.layer_shapes, _layers(work.model_config)


BENCH = Path(__file__).resolve().parents[2] / "docs" / "compression_bench.json"
ONCE = BENCH.with_name("slow_links_once_bench.json")


def convergence_price(candidate: Candidate, recipe) -> float | None:
    """What the candidate costs in eval loss, measured: bench/slow_links.py --corpus once (a corpus seen once,
    1,000 steps: the mean over its data orders of the gap at the last step) where it ran that setting (DiLoCo's,
    TopK's); otherwise bench/compression.py (the tiny recipe, 300 steps, 2 ranks: the mean eval loss over the
    measured data orders relative to the fp32 all-reduce's, minus 1; for DiLoCo H=50 int8 -8% there, -3.9% seen
    once). 0.0 for the strategies that compute the same update (ZeRO, offload, tensor and pipeline parallelism);
    None where not measured (another setting, DiLoCo on LoRA adapters, or no bench results beside the code)."""
    if candidate.compression == "none" and not candidate.diloco_every:
        return 0.0
    if candidate.diloco_every and recipe.lora.enabled:  # measured on full training only
        return None
    method, fraction = candidate.compression, recipe.compression.topk_fraction
    row = {"powersgd": "PowerSGD rank 4" if recipe.compression.rank == 4 else None, "sign": "sign + EF",
           "topk": {0.01: "TopK 1% + EF", 0.001: "TopK 0.1% + EF"}.get(fraction)}.get(method)
    if candidate.diloco_every:
        outer = candidate.diloco_outer or (recipe.diloco.outer_lr, recipe.diloco.outer_momentum)
        row = {(10, "fp32", (0.7, 0.9)): "DiLoCo H=10", (50, "fp32", (0.7, 0.9)): "DiLoCo H=50",
               (50, "bf16", (0.7, 0.9)): "DiLoCo H=50 bf16",
               (50, "int8", (1.0, 0.0)): "DiLoCo H=50 int8, outer lr 1, no momentum",
               (25, "int4", (1.0, 0.0)): "DiLoCo H=25 int4, outer lr 1, no momentum",
               (25, "int4", (1.0, 0.0), 8): "DiLoCo H=25 int4, outer lr 1, no momentum, 8 averaged steps first (bf16)",
               (25, "int4", (1.0, 0.0), 8, (5, 1)):
                   "Streaming DiLoCo H=25 int4, 5 fragments, 1 step overlapped (mix 0.5), outer lr 1, no momentum, "
                   "8 averaged steps first (bf16)"}\
            .get((candidate.diloco_every, candidate.diloco_dtype, tuple(float(x) for x in outer))
                 + ((candidate.diloco_warmup,) if candidate.diloco_warmup else ())
                 + ((candidate.diloco_stream,) if candidate.diloco_stream != (1, 0) else ()))
    once = _once_ratios().get(row)
    if once:
        return sum(once) / len(once) - 1
    by_seed = _bench_finals()
    ratios = [finals[row] / finals["fp32 all-reduce"] for finals in by_seed.values()
              if row in finals and "fp32 all-reduce" in finals]
    return sum(ratios) / len(ratios) - 1 if ratios else None


@functools.cache
def _once_ratios() -> dict:
    """bench/slow_links.py --corpus once: each setting's eval loss at the last step over the synchronous run's, one
    ratio per data order measured (the timed runs' order, then --loss-seeds' others; runs stopped early left out)."""
    try:
        state = json.loads(ONCE.read_text())
        steps, ref = state["args"]["steps"], "fp32 all-reduce"
        orders = {str(state["args"]["seed"]): {r["name"]: r["evals"][-1][1] for r in state["runs"]
                                               if r["evals"][-1][0] == steps}}
        for seed, by_name in state.get("loss_seeds", {}).items():  # an order's runs join its timed ones
            orders[seed] = {**orders.get(seed, {}),
                            **{name: evals[str(steps)] for name, evals in by_name.items() if str(steps) in evals}}
        out: dict = {}
        for finals in orders.values():
            for name, loss in finals.items():
                if ref in finals:
                    out.setdefault(name, []).append(loss / finals[ref])
        return out
    except (OSError, ValueError, KeyError, IndexError):
        return {}


@functools.cache
def _bench_finals() -> dict:
    try:
        return json.loads(BENCH.read_text())["by_seed"]
    except (OSError, ValueError, KeyError):
        return {}


def rank(preds: list[Prediction]) -> list[Prediction]:
    """Fitting candidates fastest first (ties: fewer bytes on the wire), then the ones that do not fit."""
    return sorted(preds, key=lambda p: (not p.fits, p.step_s if p.fits else p.memory_bytes, p.comm_bytes))


# ----------------------------------------------------------------------------- advice during a run

def remedy(ds_cfg: dict, recipe: dict) -> str:
    """The cheapest change to try when a run's steps wait on communication (said once by metrics.py)."""
    zero = ds_cfg.get("zero_optimization") or {}
    stage = int(zero.get("stage", 0))
    accum = int((recipe.get("train") or {}).get("grad_accum_steps", 1) or 1)
    # an expert-parallel run keeps its JSON and changes the stage alone: zero1.json has no expert_parallel section,
    # and gradient compression does not run with it (issue 85: the advice dropped expert parallelism)
    experts = bool((ds_cfg.get("expert_parallel") or {}).get("enabled"))

    def to_stage(n: int) -> str:
        return (f"--ds.zero_optimization.stage={n} (expert parallelism kept)" if experts
                else f"--ds_config zero{n}.json")
    if stage >= 2 and accum > 1:
        tip = (f"ZeRO-{stage} reduces gradients in every one of the {accum} micro-batches, ZeRO-1 once per step: "
               f"try {to_stage(1)} if it fits (train.py --preflight says)")
    elif stage == 3:
        tip = f"ZeRO-3 gathers every parameter twice per micro-batch: try {to_stage(2)} if it fits (--preflight says)"
    elif (recipe.get("compression") or {}).get("method", "none") == "none" and parallel_sizes(ds_cfg).pipeline == 1 \
            and not experts:
        tip = ("gradient compression sends ~30x fewer gradient bytes: try --ds_config zero1.json "
               "--compression.method=powersgd, or raise train.grad_accum_steps (a larger global batch sends the same "
               "bytes once per step)")
    else:
        tip = ("raise train.grad_accum_steps: a larger global batch sends the same gradient bytes once per "
               "optimizer step")
    return tip + "; `train.py --plan` ranks the alternatives on this cluster"


def dumps(obj) -> str:
    return json.dumps(obj, indent=1, default=str)
