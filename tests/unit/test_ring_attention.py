"""Ring attention's kernel on C gloo ranks against torch's SDPA over the whole sequence in one process: the
output and the gradients of queries, keys and values, for plain and packed rows (position ids restarting), grouped
and single key/value heads, rings of 2 and 4 (and 3: an odd ring, every block of the zigzag path taken)."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dstrain.components.ring_attention import Ring, ring_attention, zigzag_index, zigzag_order


def _inputs(length: int, kv_heads: int):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, length, 8, generator=g, dtype=torch.float64)
    k = torch.randn(2, kv_heads, length, 8, generator=g, dtype=torch.float64)
    v = torch.randn(2, kv_heads, length, 8, generator=g, dtype=torch.float64)
    grad = torch.randn(2, 4, length, 8, generator=g, dtype=torch.float64)
    positions = torch.arange(length).repeat(2, 1)
    cut = length // 3 + 1  # row 1 packs three documents of uneven length
    positions[1, cut:] = torch.arange(length - cut)
    positions[1, 2 * cut:] = torch.arange(length - 2 * cut)
    return q, k, v, grad, positions


def _reference(length: int, kv_heads: int):
    q, k, v, grad, positions = _inputs(length, kv_heads)
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    index = torch.arange(length)
    starts = index[None] - positions
    mask = (index[:, None] >= index[None, :])[None] & (starts[:, :, None] == starts[:, None, :])
    groups = 4 // kv_heads
    out = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1), attn_mask=mask[:, None], scale=0.3)
    out.backward(grad)
    return out.detach(), q.grad, k.grad, v.grad


def _worker(rank: int, size: int, length: int, kv_heads: int, init: str, results) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=size)
    try:
        q, k, v, grad, positions = _inputs(length, kv_heads)
        order = zigzag_order(length, size)
        local = length // size
        mine = order[rank * local:(rank + 1) * local]
        assert torch.equal(mine, zigzag_index(rank, size, local))
        q, k, v = (t[:, :, mine].clone().requires_grad_() for t in (q, k, v))
        ring = Ring(dist.new_group(list(range(size))), list(range(size)), rank)
        out = ring_attention(q, k, v, positions[:, mine], ring, 0.3)
        out.backward(grad[:, :, mine])
        results[rank] = (mine, out.detach(), q.grad, k.grad, v.grad)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("size,kv_heads", [(2, 2), (4, 1), (3, 4)])
def test_ring_equals_sdpa_over_the_whole_sequence(tmp_path, size, kv_heads):
    length = 8 * size
    results = mp.Manager().dict()
    mp.spawn(_worker, args=(size, length, kv_heads, f"file://{tmp_path}/store", results), nprocs=size)
    want = _reference(length, kv_heads)
    got = [torch.zeros_like(t) for t in want]
    for rank in range(size):
        mine, *parts = results[rank]
        for full, part in zip(got, parts):
            full[:, :, mine] = part
    for name, g, w in zip(("output", "dq", "dk", "dv"), got, want):
        torch.testing.assert_close(g, w, rtol=1e-9, atol=1e-10, msg=name)
