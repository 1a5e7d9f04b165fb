"""Model FLOPs per token and the device's peak, for MFU (model FLOPs utilisation).

FLOPs per trained token, PaLM's convention (Chowdhery et al. 2022, appendix B): 6 N + 12 L T A.
  N  parameters that take part in a matmul: all of them but the input embedding table (counted once when it
     is tied to the LM head, which is a matmul). 2N is the forward, 4N the backward.
  L  layers, T the sequence length, A = attention heads x head_dim: forward QK^T and AV cost 4 T A per token
     and layer, x3 with the backward, over the full T x T square as PaLM and Megatron count it.
Recomputation under activation checkpointing is not counted (model, not hardware, FLOPs utilisation).
With a frozen base and A trained adapter parameters (LoRA), the backward skips the base's weight gradients:
  2 (N + A) forward + 2 (N + A) for the activations' gradients + 2 A for the adapters' = 4 N + 6 A.
Mixture-of-Experts: N counts the parameters a token runs through, the routed experts it was sent to (top_k of
each block's experts) and the shared ones, not every expert (dstrain/moe.py finds them in the model).

Peak: a table of dense bf16/fp16 tensor-core peaks for known GPUs; anything else (CPU, fp32, an unknown GPU)
gets a measured matmul peak, taken on every rank at once so ranks sharing cores share them here too. A single
measurement is only trusted as a lower bound: taken while the other ranks still import, or on a busy machine, it
came out 5-10x low (MFU of 107-233% on the progress bar, issue 29). So the best figure ever measured for this
machine, thread count and precision is kept in the cache (PEAK_CACHE) and used when it is higher, and a step
that reaches more than the peak raises the cached figure (see record_achieved): MFU can never pass 100%.
"""
from __future__ import annotations

import json
import os
import platform
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from . import env

PEAK_CACHE = "device_peaks.json"  # in env.cache_root(): the best matmul rate seen per machine and thread count

# Dense (no sparsity) bf16 = fp16 tensor peak per device, FLOP/s, from the vendors' data sheets.
# Matched as substrings of the device name, longest first ("H100 PCIe" before "H100", "A100" before "A10").
GPU_PEAK_BF16 = {
    "B200": 2250e12, "H200": 989.4e12, "GH200": 989.4e12, "H100 NVL": 835.5e12, "H100 PCIe": 756.5e12,
    "H100": 989.4e12, "H800": 989.4e12, "A100": 312e12, "A800": 312e12, "L40S": 362.1e12, "L40": 181e12,
    "L4": 121e12, "A10": 125e12, "RTX 4090": 165.2e12, "RTX 3090": 71e12, "V100": 125e12,
    "MI300X": 1307.4e12, "MI250X": 383e12,
}


@dataclass
class Peak:
    flops: float  # FLOP/s of one device (one rank)
    source: str  # where the figure came from, for the log and run_info.json


def flops_per_token(config, parameters: int, seq_len: int, adapters: int | None = None, inactive: int = 0) -> float:
    """6 N + 12 L T A for a Hugging Face decoder config with `parameters` in total (see module docstring);
    4 N + 6 A + 12 L T A when only `adapters` parameters train on a frozen base of `parameters`. `inactive`: the
    routed experts' parameters a token does not run through (moe.inactive_parameters)."""
    hidden = config.hidden_size
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    tied = bool(getattr(config, "tie_word_embeddings", False))
    matmul_params = parameters - inactive - (0 if tied else config.vocab_size * hidden)
    attention = 12.0 * config.num_hidden_layers * seq_len * heads * head_dim
    if adapters is not None:
        return 4.0 * matmul_params + 6.0 * adapters + attention
    return 6.0 * matmul_params + attention


def table_peak(device_name: str, precision: str) -> float | None:
    if precision not in ("bf16", "fp16"):
        return None
    for key in sorted(GPU_PEAK_BF16, key=len, reverse=True):
        if key.lower() in device_name.lower():
            return GPU_PEAK_BF16[key]
    return None


DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def measure_matmul_peak(precision: str, device: torch.device, seconds: float = 0.3) -> float:
    """Best FLOP/s of square matmuls in `precision` over about `seconds` on `device`."""
    dtype = DTYPES.get(precision, torch.float32)
    n = 2048 if device.type == "cuda" else 512
    a = torch.randn(n, n, dtype=dtype, device=device)
    b = torch.randn(n, n, dtype=dtype, device=device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    a @ b
    sync()
    repeats, best, deadline = 4, 0.0, time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        began = time.perf_counter()
        for _ in range(repeats):
            a @ b
        sync()
        best = max(best, repeats * 2.0 * n ** 3 / (time.perf_counter() - began))
    return best


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def peak_key(device: torch.device, precision: str) -> str:
    """What the measured peak depends on: the device model, threads per rank (CPU), precision, torch."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_name()
    threads = f"{torch.get_num_threads()} threads" if device.type != "cuda" else "gpu"
    return f"{name} | {threads} | {precision} | torch {torch.__version__.split('+')[0]}"


def _read_cache() -> dict:
    try:
        return json.loads((env.cache_root() / PEAK_CACHE).read_text())
    except (OSError, ValueError):
        return {}


def _remember(key: str, flops: float) -> None:
    """Keep the highest figure for key (write-rename, so concurrent runs never leave half a file)."""
    cache = _read_cache()
    if cache.get(key, 0.0) >= flops:
        return
    cache[key] = flops
    path = env.cache_root() / PEAK_CACHE
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{PEAK_CACHE}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(cache, indent=1, sort_keys=True) + "\n")
        tmp.replace(path)
    except OSError:
        pass  # a read-only cache only costs the better figure next time


def device_peak(device: torch.device, precision: str) -> Peak:
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        peak = table_peak(name, precision)
        if peak is not None:
            return Peak(peak, f"{name} dense {precision} data sheet")
    key = peak_key(device, precision)
    best = _read_cache().get(key, 0.0)
    # a machine's first measurement takes 0.3 s; with a figure cached, 0.1 s is only a quiet machine's chance to raise
    # it (the suite's 280-odd launches spent 0.6 CPU-seconds each on it)
    measured = measure_matmul_peak(precision, device, seconds=0.1 if best else 0.3)
    _remember(key, measured)
    if best > measured:
        return Peak(best, f"best {precision} matmul rate measured on {key.split(' | ')[0]} with "
                          f"{torch.get_num_threads()} threads per rank (cached; {measured / 1e12:.3g} TFLOP/s now, a "
                          f"busy machine)")
    return Peak(measured, f"measured {precision} matmul on {key.split(' | ')[0]}, {torch.get_num_threads()} threads "
                          f"per rank")


def record_achieved(device: torch.device, precision: str, flops_per_rank: float) -> None:
    """A step's model FLOP/s per rank is a lower bound on the device's peak: one above the measured peak means
    the peak was measured low (a busy machine), and raises the cached figure for the next run."""
    if device.type != "cuda" or table_peak(torch.cuda.get_device_name(device), precision) is None:
        _remember(peak_key(device, precision), flops_per_rank)


def profiler_config(step: int, output_file: str) -> dict:
    """DeepSpeed's flops profiler for optimizer step `step` (1-based, as in metrics.jsonl)."""
    # DeepSpeed profiles the forward passes run while engine.global_steps == profile_step, i.e. our step + 1
    return {"enabled": True, "profile_step": step - 1, "module_depth": -1, "top_modules": 3, "detailed": True,
            "output_file": output_file}
