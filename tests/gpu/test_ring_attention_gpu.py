"""Ring attention on one GPU (issue 57's GPU check): a ring of 4 processes sharing the GPU (gloo, passes staged
through host memory) in bf16 against torch's SDPA over the whole sequence, both measured against an fp32 SDPA:
the ring's error must be of bf16's size. Prints the forward+backward time of each (the ring's here includes the
host staging and 4 processes on one GPU: an upper bound, not NCCL's figure). Skips without CUDA."""
from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

SIZE, LENGTH, HEADS, KV_HEADS, DIM = 4, 8192, 8, 2, 64


def _inputs(dtype):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, HEADS, LENGTH, DIM, generator=g)
    k, v = (torch.randn(1, KV_HEADS, LENGTH, DIM, generator=g) for _ in range(2))
    grad = torch.randn(1, HEADS, LENGTH, DIM, generator=g)
    return [t.to("cuda", dtype) for t in (q, k, v, grad)]


def _sdpa(dtype, repeats: int = 0):
    q, k, v, grad = _inputs(dtype)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    groups = HEADS // KV_HEADS
    seconds = []
    for _ in range(repeats + 1):
        for t in (q, k, v):
            t.grad = None
        torch.cuda.synchronize()
        start = time.perf_counter()
        out = torch.nn.functional.scaled_dot_product_attention(
            q, k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1), is_causal=True)
        out.backward(grad)
        torch.cuda.synchronize()
        seconds.append(time.perf_counter() - start)
    return [out.detach().float().cpu()] + [t.grad.float().cpu() for t in (q, k, v)], min(seconds[1:] or seconds)


def _worker(rank: int, init: str, results) -> None:
    from dstrain.components.ring_attention import Ring, ring_attention
    from dstrain.parallel.layout import zigzag_order
    torch.cuda.set_device(0)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=SIZE)
    try:
        q, k, v, grad = _inputs(torch.bfloat16)
        local = LENGTH // SIZE
        mine = zigzag_order(LENGTH, SIZE)[rank * local:(rank + 1) * local].cuda()
        ring = Ring(dist.new_group(list(range(SIZE))), list(range(SIZE)), rank)
        positions = mine[None]
        seconds = []
        for _ in range(3):
            q_, k_, v_ = (t[:, :, mine].clone().requires_grad_() for t in (q, k, v))
            dist.barrier()
            torch.cuda.synchronize()
            start = time.perf_counter()
            out = ring_attention(q_, k_, v_, positions, ring, DIM ** -0.5)
            out.backward(grad[:, :, mine])
            torch.cuda.synchronize()
            seconds.append(time.perf_counter() - start)
        results[rank] = (mine.cpu(), out.detach().float().cpu(), q_.grad.float().cpu(), k_.grad.float().cpu(),
                         v_.grad.float().cpu(), min(seconds[1:]))
    finally:
        dist.destroy_process_group()


def test_ring_of_4_on_one_gpu_matches_sdpa_within_bf16(tmp_path):
    exact, _ = _sdpa(torch.float32)
    bf16, sdpa_s = _sdpa(torch.bfloat16, repeats=2)
    results = mp.get_context("spawn").Manager().dict()
    mp.spawn(_worker, args=(f"file://{tmp_path}/store", results), nprocs=SIZE)
    ring = [torch.zeros_like(t) for t in exact]
    for rank in range(SIZE):
        mine, *parts, _ = results[rank]
        for full, part in zip(ring, parts):
            full[:, :, mine] = part
    ring_s = max(results[r][-1] for r in range(SIZE))
    for name, want, base, got in zip(("output", "dq", "dk", "dv"), exact, bf16, ring):
        sdpa_err, ring_err = float((base - want).abs().max()), float((got - want).abs().max())
        print(f"{name}: max |error| vs fp32 SDPA: bf16 SDPA {sdpa_err:.3e}, bf16 ring of {SIZE} {ring_err:.3e}")
        assert ring_err <= 2 * sdpa_err + 1e-2, name
    print(f"{LENGTH} tokens, {HEADS} heads ({KV_HEADS} kv) x {DIM}: forward+backward SDPA {sdpa_s * 1e3:.1f} ms, "
          f"ring of {SIZE} processes on this GPU {ring_s * 1e3:.1f} ms (host-staged gloo passes)")
