"""Memory: a per-rank estimate before launch (`train.py --preflight`), and the measured peak of a run.

Model states per rank (psi parameters on the rank after pipeline/tensor splitting, N data-parallel
replicas, w bytes per training-precision element): the ZeRO paper's terms plus the copies DeepSpeed
really makes. With any ZeRO stage (and in 16-bit without one) the optimizer works on an fp32 copy of this
rank's 1/N partition, which has its own fp32 gradient:
  parameters  w*psi, or w*psi/N under ZeRO-3
  gradients   w*psi (ZeRO-0/1), w*psi/N (ZeRO-2/3)
  optimizer   Adam moments 8*psi/N + fp32 partition 4*psi/N (fp32 ZeRO-0: moments 8*psi, no copy). With Muon
              (train.optimizer=muon) its matrices keep one fp32 momentum instead of two moments (psi_m of
              them: every parameter but the embeddings, the untied head and the 2L+1 norms' vectors), except
              that ZeRO-1/2 also keep a staged copy of it (stage_1_and_2._muon_staging_momentum): 8 bytes there
Transient, in two phases that do not overlap (the peak is the persistent part plus the larger phase):
  backward    activations, the gradient reduce bucket, ZeRO-3's gathered live parameters and prefetch
  step        the fp32 partition's gradient 4*psi/N, torch AdamW's foreach temporary (one fp32 element
              per updated element), ZeRO-1/2's all-gather bucket
  DiLoCo sync (after the step) a slice of the model, a few buckets and its largest parameter (_diloco); its
              persistent state, the shared weights and the outer momentum, is 8*psi/S on each rank of a replica
              of S (in host memory when the optimizer is offloaded)
Buckets count at most psi elements: on CPU only written pages are resident.
Offloaded parameters / optimizer states move from the device to host memory.
LoRA (psi_a adapter parameters on a frozen base of psi): parameters are w*(psi + psi_a) (ZeRO-3: /N), while
gradients, optimizer states and the reduce/all-gather buckets count psi_a only. QLoRA stores the base's linear
weights in 4-bit NF4 with double quantization: 0.5 byte + an 8-bit scale per 64 + an fp32 scale per 64 x 256
elements, about 0.516 byte each (norms, embeddings and the head stay in w bytes).
Activations per micro-batch of b sequences of s tokens, hidden h, MLP width f, vocabulary V:
  each decoder layer keeps about s*b*(8h + 4f) elements for backward (inputs of the norms, q/k/v,
  attention output, MLP projections; fused/flash attention keeps no s x s matrix); with activation
  checkpointing a layer keeps only its input s*b*h, plus one layer recomputed at a time;
  the LM head keeps logits s*b*V in w bytes plus 12 bytes of fp32 softmax/loss state per logit; with
  train.loss_chunk_tokens=c (components/chunked_loss.py) only c*V logits exist at a time (w-byte matmul output, fp32
  copy, w-byte gradient) plus the gradients it keeps for backward: s*b*h for the hidden states, V*h weight.
  train.mlp_chunk_tokens=m (DeepSpeed's TiledMLP) keeps the MLP's 4f intermediates for m tokens only.
  Ulysses sequence parallelism: s is the rank's slice, seq_len/sp (attention's all-to-all buffers are the size of
  q/k/v, already counted).
A Mixture-of-Experts layer's MLP activations are those of the k routed experts a token runs: f = k x an expert's
width. Expert parallelism over E ranks (AutoEP): a rank holds psi_d dense parameters and 1/E of the routed
experts' psi_e, whose gradients and optimizer states ZeRO partitions over the N/E ranks holding the same experts;
each MoE layer's dispatch and combine all-to-alls hold 4 s*b*k*h elements at a time (send and receive, k experts
per token).
A vision-language model: its tower and projector count as parameters, frozen ones (model.train_vision_tower /
train_projector, off by default) with no gradient or optimizer state. The tower's activations are a decoder
layer's terms at its width h_v and MLP width f_v for P patches per micro-batch, P = b*s*m at most (every token an
image token, each standing for m patches: the merger's, pixel shuffle's or pooling's factor, vision.tower_shape),
plus their pixels: every layer's for a tower that trains (checkpointed: each layer's input, one recomputed), one
layer's at a time for a frozen one (no gradients).
"""
from __future__ import annotations

import json
import os
import resource
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .. import env, vision
from ..parallel.layout import Layout

GiB = 1024 ** 3
BACKWARD = ("activations", "buffers", "all_to_all_buffers")  # alive during forward/backward only
STEP = ("optimizer_step",)                   # alive during the optimizer step only
OUTER = ("diloco_sync",)                     # alive during DiLoCo's outer step only (after the optimizer step)
ROLLOUT = ("rollout_kv_cache",)              # alive while RL samples completions, before the step's forwards
# Configs tried, most memory-hungry first, when a recipe does not fit.
LADDER = ["zero1.json", "zero2.json", "zero3.json", "zero2_offload.json", "zero3_offload.json", "zero3_nvme.json"]


@dataclass
class Estimate:
    parameters: int
    params_per_rank: int
    device: dict = field(default_factory=dict)      # bytes on the accelerator (host RAM on CPU), by kind
    host: dict = field(default_factory=dict)        # bytes offloaded to host RAM
    activations_checkpointed: int = 0
    activations_full: int = 0

    @property
    def device_total(self) -> int:
        """The peak: persistent states plus the larger of the backward phase and the optimizer-step phase."""
        persistent = sum(v for k, v in self.device.items() if k not in BACKWARD + STEP + OUTER + ROLLOUT)
        backward = sum(self.device.get(k, 0) for k in BACKWARD)
        step = sum(self.device.get(k, 0) for k in STEP)
        outer = sum(self.device.get(k, 0) for k in OUTER)
        rollout = sum(self.device.get(k, 0) for k in ROLLOUT) + self.device.get("buffers", 0)
        return persistent + max(backward, step, outer, rollout)


def dims(config) -> tuple[int, int, int, int]:
    config = vision.text_config(config)  # a vision-language model: its language model's (the tower's not yet)
    hidden = getattr(config, "hidden_size", None) or config.n_embd
    layers = getattr(config, "num_hidden_layers", None) or config.n_layer
    ffn = getattr(config, "intermediate_size", None) or getattr(config, "n_inner", None) or 4 * hidden
    return hidden, layers, ffn, config.vocab_size


def count_parameters(config) -> int:
    """Parameters of the model a config describes, built on the meta device (no memory, any size). The class is
    built directly: inside a ZeRO-3 run (the teacher's count for memory.json) from_config would take transformers'
    zero.Init path, which cannot initialise meta tensors."""
    from transformers import MODEL_FOR_CAUSAL_LM_MAPPING, MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING, AutoModelForCausalLM

    with torch.device("meta"):
        if vision.is_vision(config):  # the vision tower and projector count too
            model = MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING[type(config)](config)
        elif type(config) in MODEL_FOR_CAUSAL_LM_MAPPING:
            model = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)](config)
        else:  # a model whose code comes with it (trust_remote_code)
            model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


NF4_BYTES = 0.5 + 1 / 64 + 4 / (64 * 256)  # bitsandbytes 4-bit, double-quantized scales, per weight


def estimate(config, parameters: int, recipe, ds_cfg: dict, layout, trained: int | None = None,
             quantized: int = 0) -> Estimate:
    """Per-rank memory. trained: adapter parameters when the base (`parameters`) is frozen (LoRA); quantized: how
    many of the base's parameters are stored in 4 bit (QLoRA)."""
    train = recipe.train
    zero = ds_cfg.get("zero_optimization") or {}
    stage = int(zero.get("stage", 0))
    n = layout.zero_shards  # ZeRO partitions over data x sequence parallelism
    sixteen_bit = bool((ds_cfg.get("bf16") or {}).get("enabled") or (ds_cfg.get("fp16") or {}).get("enabled"))
    w = 2 if sixteen_bit else 4
    psi = parameters // (layout.pipeline_stages * layout.tensor_parallel)
    offload_param = (zero.get("offload_param") or {}).get("device", "none") in ("cpu", "nvme")
    offload_opt = (zero.get("offload_optimizer") or {}).get("device", "none") in ("cpu", "nvme")

    # What DeepSpeed allocates (runtime/zero/stage_1_and_2.py, stage3.py, bf16_optimizer.py):
    split = layout.pipeline_stages * layout.tensor_parallel
    # what trains: everything but a vision-language model's frozen tower / projector (the default), or the adapters
    frozen = vision.frozen_parameters(config, recipe.model) if trained is None else 0
    psi_t = (psi - frozen // split) if trained is None else trained // split
    partitioned = stage >= 1 or sixteen_bit            # ZeRO-0 in 16 bit runs the (partitioning) BF16 optimizer
    opt_elems = psi_t // n if partitioned else psi_t   # elements the optimizer updates on this rank
    stored = w * psi if trained is None else w * (psi - quantized // split + psi_t) + NF4_BYTES * quantized // split
    params = int(stored) // (n if stage == 3 else 1)
    grads = w * psi_t // (n if stage >= 2 else 1)
    from .. import moe
    routed = _routed_experts(config) if moe.routed_experts(config) else None
    if routed is not None and layout.expert_parallel > 1:
        # AutoEP: a rank holds 1/EP of the routed experts whole; ZeRO partitions their states over the expert
        # data-parallel group (N / EP ranks), the rest of the model's over all N
        local, dense, n_e = routed[0] // layout.expert_parallel, psi - routed[0], max(1, n // layout.expert_parallel)
        psi = psi_t = dense + local
        params = w * (dense // (n if stage == 3 else 1) + local // (n_e if stage == 3 else 1))
        grads = w * (dense // (n if stage >= 2 else 1) + local // (n_e if stage >= 2 else 1))
        opt_elems = dense // n + local // n_e if partitioned else psi
    master = 4 * opt_elems if partitioned else 0       # fp32 copy of the partition
    moments = 8 * opt_elems                            # Adam exp_avg, exp_avg_sq
    if str((ds_cfg.get("optimizer") or {}).get("type", "")).lower() == "muon":  # one momentum per Muon matrix
        hidden, layers, _, vocab = dims(config)
        tied = getattr(config, "tie_word_embeddings", True)
        adamw = (vocab * hidden * (1 if tied else 2) + (2 * layers + 1) * hidden) // split
        muon_elems = max(0, psi_t - adamw) * opt_elems // max(1, psi_t)
        if stage not in (1, 2):  # ZeRO-1/2: momentum + its staged copy, as many bytes as Adam's two moments
            moments -= 4 * muon_elems
    # optimizer step only: the fp32 partition's gradient, torch AdamW's foreach temporary, and (ZeRO-1/2)
    # the all-gather bucket that redistributes updated parameters
    step = (4 * opt_elems if partitioned else 0)
    step += 4 * opt_elems if (ds_cfg.get("optimizer") or {}).get("params", {}).get("torch_adam") else 0
    if stage in (1, 2):
        step += w * min(psi_t, int(zero.get("allgather_bucket_size", 5e8)))
    # forward/backward only: gradient reduce bucket, and under ZeRO-3 the gathered live parameters + prefetch
    buffers = w * min(psi_t, int(zero.get("reduce_bucket_size", 5e8))) if stage >= 1 else 0
    if stage == 3:
        buffers += w * min(psi, int(zero.get("stage3_max_live_parameters", 1e9))
                           + int(zero.get("stage3_prefetch_bucket_size", 5e7)))
    device = {"parameters": params, "gradients": grads, "optimizer_states": moments + master,
              "optimizer_step": step, "buffers": buffers}
    host: dict = {}
    if recipe.diloco.enabled:
        hidden, _, ffn, vocab = dims(config)
        on_device, on_host = _diloco(recipe.diloco, psi_t, layout, w if stage == 3 else 0, hidden * max(vocab, ffn),
                                     offload_opt)
        device.update(on_device)
        host.update(on_host)
    if offload_opt:  # DeepSpeedCPUAdam: states, master, its gradient and the step live in host memory
        host["optimizer_states"] = device.pop("optimizer_states") + device.pop("optimizer_step")
    if offload_param and stage == 3:
        host["parameters"] = device.pop("parameters")

    hidden, layers, ffn, vocab = dims(config)
    if routed is not None:  # a token runs k routed experts of width F (intermediate_size is a dense layer's, if any)
        ffn = routed[1] * routed[2]
    from ..objectives import sequences_per_sample
    rows = train.micro_batch_size * sequences_per_sample(recipe)  # a preference pair: two rows
    tokens = rows * train.seq_len // layout.sequence_shards  # Ulysses x ring: a 1/(sp x cp) slice per rank
    layers_here = -(-layers // layout.pipeline_stages)
    mlp_tokens = min(tokens, train.mlp_chunk_tokens or tokens)  # tiled MLP: one slice's intermediates at a time
    per_layer = (tokens * 8 * hidden + mlp_tokens * 4 * ffn) * w // layout.tensor_parallel
    head = tokens * vocab * (w + 12)
    if train.loss_chunk_tokens:
        head = min(tokens, train.loss_chunk_tokens) * vocab * (2 * w + 4) + (tokens + vocab) * hidden * w
    ring = _ring(config, tokens, w) if layout.context_parallel > 1 else 0  # one layer's at a time
    full = layers_here * per_layer + head + tokens * hidden * w + ring
    checkpointed = layers_here * tokens * hidden * w + per_layer + head + tokens * hidden * w + ring
    tower_full, tower_checkpointed = vision_activations(config, recipe, rows, w, trained)
    full, checkpointed = full + tower_full, checkpointed + tower_checkpointed
    est = Estimate(parameters, psi, device, host, checkpointed, full)
    est.device["activations"] = checkpointed if train.activation_checkpointing else full
    if routed is not None and layout.expert_parallel > 1:  # one MoE layer's dispatch and combine at a time
        est.device["all_to_all_buffers"] = 4 * tokens * routed[1] * hidden * w
    if recipe.data.format == "prompt":
        est.device.update(_rl(config, recipe, stored // (n if stage == 3 else 1), w, n if stage == 3 else 1))
    return est


def _routed_experts(config) -> tuple[int, int, int]:
    """(the routed experts' parameters, the experts a token runs, an expert's width F) of an MoE model, from the
    model built on the meta device (dstrain/moe.py reads every family alike; down_proj is [E, H, F] or, in the
    transposed families, [E, F, H])."""
    from .. import moe
    with torch.device("meta"):
        model = vision.model_class(config).from_config(config)
    blocks = moe.moe_blocks(model)
    if not blocks:
        return 0, 0, 0
    down = model.get_submodule(blocks[0].name).down_proj.shape
    width = down[2] if down[1] == dims(config)[0] else down[1]
    return sum(b.expert_parameters for b in blocks), max(b.top_k for b in blocks), int(width)


def _ring(config, tokens: int, w: int) -> int:
    """What ring attention (components/ring_attention.py) holds beyond plain attention in one layer, per token of
    this rank's part: the key/value block arriving while one is computed (w bytes each) and the merged output
    in fp32. The rest of its buffers (the travelling gradients, a block's expanded heads) live one block at a
    time beside activations that are already freed: bench/long_context.py measured a ring of 2 within 6% of
    Ulysses 2 at 8k-16k tokens, and this term brings the estimate to the measured peak there."""
    q_width, kv_width = _attention_widths(config)
    return tokens * (2 * kv_width * w + q_width * 4)


def _attention_widths(config) -> tuple[int, int]:
    """(query width, key/value width) per token: heads x head_dim, key/value heads x head_dim."""
    hidden, _, _, _ = dims(config)
    heads = getattr(config, "num_attention_heads", None) or getattr(config, "n_head", 1)
    width = getattr(config, "head_dim", None) or hidden // heads
    return heads * width, (getattr(config, "num_key_value_heads", None) or heads) * width


def _rl(config, recipe, stored_params: int, w: int, shards: int) -> dict:
    """Learning from rewards (objectives/rl.py): the reference (rl.beta > 0 without LoRA: a frozen copy of the
    weights, partitioned as the policy's under ZeRO-3) and the teacher (rl.teacher: its own parameters, in the
    run's precision, partitioned likewise) for the whole run, and while the built-in sampler runs,
    the KV cache of a step's rollout (every micro-batch's prompts x rl.num_generations rows at once, keys and
    values of every layer up to train.seq_len) and one position's fp32 logits and probabilities."""
    train, rl = recipe.train, recipe.rl
    _, layers, _, vocab = dims(config)
    kv_width = _attention_widths(config)[1]
    micro_batches = train.grad_accum_steps  # a rank's micro-batches of the step: sampled together
    rows = train.micro_batch_size * rl.num_generations * micro_batches
    out = {"rollout_kv_cache": 2 * layers * rows * train.seq_len * kv_width * w + rows * vocab * 12}
    if rl.beta != 0.0 and not recipe.lora.enabled:
        out["reference_model"] = stored_params
    if rl.teacher:
        from ..config import ModelConfig
        from ..model import load_config
        teacher = load_config(ModelConfig(name_or_path=rl.teacher), train.seq_len)[1]
        out["teacher_model"] = w * count_parameters(teacher) // shards
    return out


def _diloco(cfg, psi_t: int, layout, gathered_w: int, largest: int, offloaded: bool) -> tuple[dict, dict]:
    """DiLoCo's outer state on each rank (components/diloco.py), all of it for this rank's slice of the model (one of
    the replica's S): the shared weights of the last sync (fp32), the outer momentum (fp32, when outer_momentum >
    0) and the rounding carried over (fp32, when the pseudo-gradient is sent in bf16/int8/int4). At a sync, after
    the optimizer step: this rank's slice of the pseudo-gradient, then a bucket (diloco.BUCKET elements) at a time
    either what goes on the wire from each replica and two decoded buckets, or (writing the weights, a parameter at
    a time) a broadcast bucket, one parameter's full fp32 weight and under ZeRO-3 its gathered working copy (w bytes
    each); `largest`: the largest parameter's elements (the embedding's, in a language model). With the optimizer
    offloaded the state, the slice and the decoded buckets and weight are in host memory, and the accelerator holds
    only what the collectives carry. diloco.overlap keeps the syncs in flight through the next steps: per fragment
    in flight, its part of the pseudo-gradient and its crossing codes. Returns (accelerator, host) bytes."""
    from ..components.diloco import BUCKET, WIRE_BYTES, slice_length

    size = layout.zero_shards  # the ranks of a replica that hold the same parameters (dp x sp)
    chunk = slice_length(psi_t, size)
    bucket, largest = min(chunk, BUCKET), min(largest, psi_t)
    compressed = cfg.dtype != "fp32"
    persistent = 4 * chunk * (2 if cfg.outer_momentum > 0 else 1) + (4 * chunk if compressed else 0)
    wire = int((layout.replicas + 1) * WIRE_BYTES[cfg.dtype] * bucket) if compressed else 4 * bucket
    decoded = 8 * bucket if compressed else 0
    broadcast = 4 * bucket if size > 1 else 0
    # diloco.overlap: the fragments' syncs in flight while training goes on (one sent every every/fragments steps,
    # each for `overlap` steps), each this rank's part of its pseudo-gradient and what crosses of it from every
    # replica (in place, fp32)
    part = -(-chunk // cfg.fragments)
    flying = min(cfg.fragments, -(-cfg.overlap * cfg.fragments // cfg.every)) if cfg.overlap else 0
    crossing = flying * (int((layout.replicas + 1) * WIRE_BYTES[cfg.dtype] * part) if compressed else
                         4 * part if offloaded else 0)  # fp32: reduced in place, in a copy when it is host-side
    if offloaded:
        return ({"diloco_sync": max(wire, broadcast + gathered_w * largest), **({"diloco_in_flight": crossing}
                                                                                if crossing else {})},
                {"diloco_state": persistent + 4 * flying * part + 4 * chunk + max(decoded, 4 * largest)})
    sync = 4 * chunk + max(wire + decoded, broadcast + (4 + gathered_w) * largest)
    return {"diloco_state": persistent + 4 * flying * part + crossing, "diloco_sync": sync}, {}


# Memory of common accelerators, for planning a run from a machine without them (`--preflight --device NAME`):
# the nominal size (what torch.cuda reports is up to ~1% less).
DEVICES = {"h100-80gb": 80, "h100-94gb": 94, "h200-141gb": 141, "gh200-96gb": 96, "b200-180gb": 180,
           "a100-80gb": 80, "a100-40gb": 40, "l40s-48gb": 48, "a10g-24gb": 24, "l4-24gb": 24, "rtx4090-24gb": 24,
           "v100-32gb": 32, "mi300x-192gb": 192}
_UNITS = {"": GiB, "g": GiB, "gb": 1000 ** 3, "gib": GiB, "m": 1024 ** 2, "mb": 1000 ** 2, "mib": 1024 ** 2,
          "t": 1024 ** 4, "tb": 1000 ** 4, "tib": 1024 ** 4}


def target_device(device: str | None, memory: str | None) -> tuple[int, str] | None:
    """(bytes, name) of the GPU a run is planned for, from --device and/or --device_memory; None: this machine."""
    from ..errors import UserError, closest

    if device is None and memory is None:
        return None
    capacity, name = None, device
    if device is not None:
        if device.lower() not in DEVICES:
            prefixed = [k for k in DEVICES if k.startswith(device.lower())]
            hint = f" (did you mean {' or '.join(prefixed)}?)" if prefixed else closest(device.lower(), DEVICES)
            raise UserError(f"--device {device} is not in the table{hint}; names are GPU-memory like a100-80gb "
                            f"(dstrain/planner/memory.py DEVICES), or pass --device_memory 80GiB")
        capacity, name = DEVICES[device.lower()] * GiB, device.lower()
    if memory is not None:
        import re
        match = re.fullmatch(r"\s*([0-9.]+)\s*([a-zA-Z]*)\s*", memory)
        if not match or match.group(2).lower() not in _UNITS:
            raise UserError(f"--device_memory {memory}: write a size such as 80GiB, 80GB or 24576MiB")
        capacity = int(float(match.group(1)) * _UNITS[match.group(2).lower()])
        name = f"{name or 'GPU'}, --device_memory {memory}"
    return capacity, name


def device_memory(caps_name: str, ranks_per_node: int) -> tuple[int, str]:
    """Memory one rank may use: its GPU's, or an equal share of host RAM on CPU."""
    if caps_name == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_properties(0).total_memory, torch.cuda.get_device_name(0)
    import psutil
    total = psutil.virtual_memory().total
    return total // max(1, ranks_per_node), f"host RAM / {ranks_per_node} ranks"


def _fmt(b: int) -> str:
    return f"{b / GiB:8.2f} GiB"


def report(est: Estimate, recipe, ds_name: str, layout, capacity: int, capacity_name: str, ds_cfg: dict) -> str:
    from ..parallel.ds_config import precision
    stage = int((ds_cfg.get("zero_optimization") or {}).get("stage", 0))
    held = (f"{est.params_per_rank / layout.zero_shards / 1e6:,.1f}M parameters held per rank (ZeRO-3 partitions "
            f"{est.params_per_rank / 1e6:,.1f}M over {layout.zero_shards} ranks)" if stage == 3 else
            f"{est.params_per_rank / 1e6:,.1f}M parameters per rank")
    lines = [f"preflight: {est.parameters / 1e6:,.1f}M parameters, {ds_name}, {precision(ds_cfg)}, "
             f"{layout.describe()}; {held}",
             "per rank, on the device:"]
    for kind, value in est.device.items():
        lines.append(f"  {kind:<18}{_fmt(value)}")
    lines.append(f"  {'peak':<18}{_fmt(est.device_total)}   of {_fmt(capacity).strip()} ({capacity_name}); "
                 f"buffers+activations (backward), optimizer_step"
                 f"{' and diloco_sync' if 'diloco_sync' in est.device else ''} do not coexist")
    for kind, value in est.host.items():
        lines.append(f"  offloaded to host: {kind:<18}{_fmt(value)}")
    t = recipe.train
    from ..objectives import sequences_per_sample
    rows = f"{t.micro_batch_size} pairs = {2 * t.micro_batch_size} rows" if sequences_per_sample(recipe) == 2 \
        else t.micro_batch_size
    lines.append(f"activations (micro batch {rows} x {t.seq_len} tokens): "
                 f"{_fmt(est.activations_full).strip()} without, {_fmt(est.activations_checkpointed).strip()} with "
                 f"activation checkpointing ({'on' if t.activation_checkpointing else 'off'})")
    return "\n".join(lines)


def vision_patches(config, recipe, rows: int) -> int:
    """Patches a vision tower runs per micro-batch at most: every token of every sequence an image token (the
    number of images and their sizes are the data's; a sequence holds seq_len tokens at most), each standing for
    vision.tower_shape's patches_per_token patches. 0 for a text model or a tower whose shape is not known."""
    shape = vision.tower_shape(config) if vision.is_vision(config) else None
    return int(rows * recipe.train.seq_len * shape["patches_per_token"]) if shape else 0


def vision_activations(config, recipe, rows: int, w: int, trained: int | None) -> tuple[int, int]:
    """(without, with activation checkpointing) bytes of a vision-language model's tower for one micro-batch: its
    layers' activations for vision_patches' patches, and their pixels. A layer keeps 8 h elements a patch as a
    decoder layer does (the norms' inputs, q/k/v, the attention's output and the MLP's input) and its MLP's: 4 f for
    a gated one (gate, up, the activation, their product: Qwen2.5-VL's), 2 f otherwise (the first projection's output
    and the activation's: CLIP, SigLIP, Qwen3-VL). A tower that trains (model.train_vision_tower, or LoRA's adapters
    in it with lora.vision_tower) keeps every layer's for backward (checkpointed: each layer's input, one layer
    recomputed); a frozen one runs without gradients, one layer's at a time."""
    patches = vision_patches(config, recipe, rows)
    if not patches:
        return 0, 0
    shape = vision.tower_shape(config)
    h, layers, f = shape["hidden"], shape["layers"], shape["ffn"]
    per_layer = patches * (8 * h + (4 if shape["gated"] else 2) * f) * w
    pixels = patches * shape["patch_elements"] * w
    keeps = recipe.lora.vision_tower if recipe.lora.enabled else (trained is None and recipe.model.train_vision_tower)
    if not keeps:
        return per_layer + pixels, per_layer + pixels
    return layers * per_layer + pixels, layers * patches * h * w + per_layer + pixels


def ring_bytes_per_layer(config, recipe, layout, w: int) -> int:
    """What one rank sends round its ring for one layer of one micro-batch (components/ring_attention.py): its
    key/value block C-1 times forward; in backward the block C-1 times more and the fp32 key/value gradients C
    times."""
    kv_width = _attention_widths(config)[1]
    from ..objectives import sequences_per_sample
    tokens = recipe.train.micro_batch_size * sequences_per_sample(recipe) * recipe.train.seq_len // \
        layout.sequence_shards
    c = layout.context_parallel
    block = tokens * (2 * kv_width * w + 8)  # keys, values and the tokens' document starts
    return (c - 1) * 2 * block + c * tokens * 2 * kv_width * 4


def vision_report(config, recipe, trained: int | None, w: int) -> str:
    """The preflight's lines on a vision-language model: what its tower and projector count as, and its tower's
    activations."""
    sizes = vision.part_sizes(config)
    frozen = vision.frozen_parameters(config, recipe.model)
    if recipe.lora.enabled:
        states = "as weights (LoRA's adapters are what trains)"
    elif frozen == sizes["tower"] + sizes["projector"]:
        states = "as weights only: frozen (model.train_vision_tower / train_projector to train them)"
    elif frozen:
        states = (f"with gradients and optimizer states but for the frozen {frozen / 1e6:,.1f}M "
                  f"({'tower' if not recipe.model.train_vision_tower else 'projector'}), weights only")
    else:
        states = "with gradients and optimizer states (both train)"
    text = (f"vision-language model: the vision tower's {sizes['tower'] / 1e6:,.1f}M and the projector's "
            f"{sizes['projector'] / 1e6:,.1f}M parameters are counted above {states}")
    from ..objectives import sequences_per_sample
    rows = recipe.train.micro_batch_size * sequences_per_sample(recipe)
    patches = vision_patches(config, recipe, rows)
    if not patches:
        return text + (f"; the tower's activations are not counted ({config.model_type}'s config names no patch "
                       f"merge, pixel shuffle or image-token count)")
    full, checkpointed = vision_activations(config, recipe, rows, w, trained)
    kept = full if not recipe.train.activation_checkpointing else checkpointed
    how = ("one layer's at a time (a frozen tower runs without gradients)" if full == checkpointed else
           "every layer's kept for backward" + (" (checkpointed: each layer's input)"
                                                if recipe.train.activation_checkpointing else ""))
    per_token = vision.tower_shape(config)["patches_per_token"]
    return text + (f"; the tower's activations, {how}: {_fmt(kept).strip()} for {patches:,} patches per "
                   f"micro-batch, the most its sequences can hold (every token an image token, {per_token:g} "
                   f"patches each)")


def preflight(recipe, raw_ds: dict, ds_name: str, world_size: int, ranks_per_node: int, caps,
              target: tuple[int, str] | None = None) -> tuple[bool, str]:
    """(fits, text) for the recipe and config at this world size; suggests a shipped config that fits.
    target: (bytes, name) of the GPU the run is planned for (--device / --device_memory), else this machine's."""
    from ..model import hidden_size, load_config
    from ..parallel import ds_config

    _, config = load_config(recipe.model, recipe.train.seq_len)
    parameters = count_parameters(config)
    h = hidden_size(config)
    from ..components.diloco import replicas_for
    replicas = replicas_for(recipe, world_size, ranks_per_node)  # DiLoCo: ZeRO partitions within a replica
    resolved = ds_config.resolve(raw_ds, recipe, world_size, caps, h, replicas=replicas)
    layout = Layout.from_ds_config(resolved, world_size, replicas=replicas)
    capacity, capacity_name = target or device_memory(caps.name, ranks_per_node)
    trained = quantized = None
    if recipe.lora.enabled:  # a frozen base (4-bit with lora.quantize) and adapters with full training states
        from ..components.lora import count_parameters as lora_counts
        from ..components.lora import language_model_only
        _, trained, linear = lora_counts(config, language_model_only(config, recipe.lora))
        quantized = linear if recipe.lora.quantize else 0
    est = estimate(config, parameters, recipe, resolved, layout, trained, quantized or 0)
    text = report(est, recipe, ds_name, layout, capacity, capacity_name, resolved)
    if layout.context_parallel > 1:
        sent = ring_bytes_per_layer(config, recipe, layout, w=4 if ds_config.precision(resolved) == "fp32" else 2)
        text += (f"\nring attention over {layout.context_parallel} ranks: each rank holds "
                 f"{recipe.train.seq_len // layout.sequence_shards:,} tokens of every sequence and sends "
                 f"{sent / 2**20:,.1f} MiB per layer per micro-batch (keys/values forward, and with their gradients "
                 f"backward; with activation checkpointing the forward's again)")
    if vision.is_vision(config):  # what the preflight counts of the vision tower
        text += "\n" + vision_report(config, recipe, trained, w=4 if ds_config.precision(resolved) == "fp32" else 2)
    if layout.expert_parallel > 1:
        routed, top_k, _ = _routed_experts(config)
        text += (f"\nexpert parallelism: the routed experts' {routed / 1e6:,.1f}M parameters split over "
                 f"{layout.expert_parallel} ranks ({routed / layout.expert_parallel / 1e6:,.1f}M per rank, their "
                 f"ZeRO states over {max(1, layout.zero_shards // layout.expert_parallel)}); each MoE layer sends "
                 f"and receives {est.device['all_to_all_buffers'] / 4 / 2**20:,.1f} MiB per micro-batch each way "
                 f"(the tokens' hidden states for {top_k} experts)")
    if trained is not None:
        text += (f"\nLoRA r={recipe.lora.r}: {trained / 1e6:,.1f}M adapter parameters train (gradients and optimizer "
                 f"states); the {parameters / 1e6:,.1f}M-parameter base is frozen"
                 + (f", its {quantized / 1e6:,.1f}M linear weights in 4 bit" if quantized else ""))
    if est.host:
        per_rank = sum(est.host.values())
        text += (f"\nhost memory: {per_rank * ranks_per_node / GiB:,.1f} GiB per node for what is offloaded "
                 f"({ranks_per_node} ranks x {per_rank / GiB:,.1f} GiB), besides each process's own")
    from ..run.checkpoint import background_saves, checkpoint_copy_bytes
    if background_saves(recipe.checkpoint, resolved):
        experts = _routed_experts(config)[0] if layout.expert_parallel > 1 else 0
        copy = checkpoint_copy_bytes(resolved, layout, parameters, trained, experts)
        locked = ", page-locked" if caps.name == "cuda" else ""
        text += (f"\nhost memory for background checkpoints (checkpoint.background): up to {copy / GiB:,.1f} GiB a "
                 f"rank, {copy * ranks_per_node / GiB:,.1f} GiB per node{locked}, "
                 f"kept between saves (checkpoint.background=false saves without it, the step waiting for the write)")
    longest = longest_seq_len(config, parameters, recipe, resolved, layout, trained, quantized or 0, capacity)
    lm = vision.text_config(config)  # a vision-language model: its language model's
    positions = getattr(lm, "max_position_embeddings", None) or getattr(lm, "n_positions", None)
    if longest and positions and longest > positions:
        text += (f"\nlongest train.seq_len that fits with this config: {positions:,} (the model's maximum positions; "
                 f"memory would allow {longest:,})")
    else:
        text += (f"\nlongest train.seq_len that fits with this config: {longest:,}" if longest else
                 "\nno train.seq_len fits with this config") + \
            (f" ({longest // layout.sequence_shards:,} tokens on each of {layout.sequence_shards} "
             f"sequence-parallel ranks)" if longest and layout.sequence_shards > 1 else "")
    if est.device_total <= capacity:
        return True, text + f"\nfits: {est.device_total / capacity:.0%} of the device's memory"
    for candidate in LADDER:
        for checkpointing in (recipe.train.activation_checkpointing, True):
            trial = _with(recipe, checkpointing)
            cfg = ds_config.resolve(ds_config.load(candidate), trial, world_size, caps, h, replicas=replicas)
            trial_layout = Layout.from_ds_config(cfg, world_size, replicas=replicas)
            if estimate(config, parameters, trial, cfg, trial_layout, trained,
                        quantized or 0).device_total <= capacity:
                fix = candidate + (" with --train.activation_checkpointing=true" if checkpointing and
                                   not recipe.train.activation_checkpointing else "")
                return False, text + f"\ndoes not fit; {fix} would (or lower train.micro_batch_size)"
    return False, text + "\ndoes not fit with any shipped config at this world size; add ranks or lower " \
                         "train.micro_batch_size / train.seq_len"


def longest_seq_len(config, parameters: int, recipe, ds_cfg: dict, layout, trained, quantized: int,
                    capacity: int) -> int:
    """The longest sequence (a multiple of 128 x sp) whose estimate fits in `capacity`, everything else as given;
    0 when none does. The estimate grows with seq_len, so a binary search over multiples finds it."""
    from dataclasses import replace
    unit = 128 * layout.sequence_shards * (2 if layout.context_parallel > 1 else 1)

    def fits(units: int) -> bool:
        trial = replace(recipe, train=replace(recipe.train, seq_len=units * unit))
        return estimate(config, parameters, trial, ds_cfg, layout, trained, quantized).device_total <= capacity

    if not fits(1):
        return 0
    low, high = 1, 2
    while fits(high) and high < 2 ** 20:
        low, high = high, high * 2
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if fits(middle) else (low, middle)
    return low * unit


def _with(recipe, checkpointing: bool):
    import copy
    trial = copy.deepcopy(recipe)
    trial.train.activation_checkpointing = checkpointing
    return trial


# ----------------------------------------------------------------------------- measurement

def current_bytes() -> int:
    if torch.cuda.is_available():
        return torch.cuda.memory_allocated()
    import psutil
    return psutil.Process().memory_info().rss


def peak_bytes() -> int:
    """High-water mark since process start or the last reset_peak(): the allocator's on CUDA, the kernel's max
    RSS on CPU."""
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated()
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def reset_peak() -> None:
    """Start a new high-water mark from what is resident now, so the training phase's peak is measured apart from
    loading's. On CPU, loading counts the mmapped checkpoint file's pages in RSS while it reads them (a 400 MB
    fp32 file: the peak of a whole LoRA run, whose training needs less); Linux resets the mark when the process
    writes 5 to its clear_refs (VmHWM and ru_maxrss both follow)."""
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
        return
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:  # not Linux, or no procfs: the peak then includes loading
        pass


# Below this estimate the measured/estimated ratio of a CPU rank is dominated by fixed per-process costs (issue 29:
# 2.9-5.1 on the tiny recipe, 0.87-1.24 at 100M parameters where model states dominate)
SMALL_ESTIMATE = 512 * 2**20


def record(path: Path, ctx, baseline: int, setup_peak: int, estimate: Estimate | Callable[[], Estimate]) -> None:
    """Rank 0 writes memory.json: the measured peak of the training phase (train.py resets the mark once the
    model is built and loaded) next to the estimate (bench/memory.py reads it), and the peak of setup. `estimate`
    may be a function, called once the peak is read: making one can allocate (a vision-language model's tower is
    counted on a model built on the meta device, tens of MiB of Python objects), which the peak must not hold."""
    if ctx.is_main:
        measured = peak_bytes() - baseline
        estimate = estimate() if callable(estimate) else estimate
        ratio = measured / estimate.device_total if estimate.device_total else None
        extra = {"estimated_device_bytes": estimate.device_total, "estimate": estimate.device,
                 "setup_peak_above_baseline_bytes": setup_peak - baseline,
                 "measured_over_estimated": round(ratio, 3) if ratio else None}
        if not torch.cuda.is_available():  # what a CPU rank's RSS peak holds depends on glibc's setting
            threshold = env.malloc_mmap_threshold()
            extra["allocator"] = (f"MALLOC_MMAP_THRESHOLD_={threshold}: freed tensors leave RSS at once" if threshold
                                  else "glibc's default: the peak includes freed tensors kept in its heap for reuse "
                                       "(set MALLOC_MMAP_THRESHOLD_=131072 to measure live memory; docs/planning.md)")
        if not torch.cuda.is_available() and estimate.device_total < SMALL_ESTIMATE:
            # measured on the tiny recipe: 201 MB above the baseline against 68 MB estimated (2.9x); the gap is
            # the process's own fixed cost of training, not the model's (see SMALL_ESTIMATE)
            extra["note"] = (f"the estimate ({estimate.device_total / 2**20:.0f} MiB) is below "
                             f"{SMALL_ESTIMATE / 2**20:.0f} MiB: what a CPU rank allocates beyond the model's states "
                             f"(the allocator, library workspaces, evaluation and checkpoint buffers: about 130 MiB "
                             f"above the estimate on the tiny recipe) dominates, so the ratio says little; at 100M "
                             f"parameters it was 0.87-1.24 (docs/benchmarks.md)")
        write_measurement(path, baseline, extra)


def write_measurement(path: Path, baseline: int, extra: dict | None = None) -> None:
    peak = peak_bytes()
    record = {"baseline_bytes": baseline, "peak_bytes": peak, "peak_above_baseline_bytes": peak - baseline,
              "device": "cuda" if torch.cuda.is_available() else "cpu", **(extra or {})}
    tmp = path.with_name(f".tmp-{path.name}")
    tmp.write_text(json.dumps(record, indent=1))
    os.replace(tmp, path)
