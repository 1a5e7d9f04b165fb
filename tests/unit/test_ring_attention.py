"""Ring attention's kernel on C gloo ranks against torch's SDPA over the whole sequence in one process: the
output and the gradients of queries, keys and values, for plain and packed rows (position ids restarting), grouped
and single key/value heads, rings of 2 and 4 (and 3: an odd ring, every block of the zigzag path taken)."""
from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dstrain.components.ring_attention import Ring, ring_attention
from dstrain.parallel.layout import zigzag_index, zigzag_order


def _inputs(length: int, kv_heads: int, packed: bool = True):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, length, 8, generator=g, dtype=torch.float64)
    k = torch.randn(2, kv_heads, length, 8, generator=g, dtype=torch.float64)
    v = torch.randn(2, kv_heads, length, 8, generator=g, dtype=torch.float64)
    grad = torch.randn(2, 4, length, 8, generator=g, dtype=torch.float64)
    positions = torch.arange(length).repeat(2, 1)
    if packed:
        cut = length // 3 + 1  # row 1 packs three documents of uneven length
        positions[1, cut:] = torch.arange(length - cut)
        positions[1, 2 * cut:] = torch.arange(length - 2 * cut)
    return q, k, v, grad, positions


def _reference(length: int, kv_heads: int, packed: bool):
    q, k, v, grad, positions = _inputs(length, kv_heads, packed)
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    index = torch.arange(length)
    starts = index[None] - positions
    mask = (index[:, None] >= index[None, :])[None] & (starts[:, :, None] == starts[:, None, :])
    groups = 4 // kv_heads
    out = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1), attn_mask=mask[:, None], scale=0.3)
    out.backward(grad)
    return out.detach(), q.grad, k.grad, v.grad


def _worker(rank: int, size: int, length: int, kv_heads: int, init: str, results, math_only: bool,
            packed: bool) -> None:
    from dstrain.components import ring_attention as module
    module.MATH_ONLY = math_only
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=size)
    try:
        q, k, v, grad, positions = _inputs(length, kv_heads, packed)
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


@pytest.mark.parametrize("size,kv_heads,math_only,packed", [(2, 2, False, True), (4, 1, False, True),
                                                            (3, 4, False, False), (2, 1, True, True),
                                                            (3, 2, True, False)])
def test_ring_equals_sdpa_over_the_whole_sequence(tmp_path, size, kv_heads, math_only, packed):
    """math_only: the plain-matmul block kernel (other devices) instead of torch's CPU flash attention."""
    length = 8 * size
    results = mp.Manager().dict()
    mp.spawn(_worker, args=(size, length, kv_heads, f"file://{tmp_path}/store", results, math_only, packed),
             nprocs=size)
    want = _reference(length, kv_heads, packed)
    got = [torch.zeros_like(t) for t in want]
    for rank in range(size):
        mine, *parts = results[rank]
        for full, part in zip(got, parts):
            full[:, :, mine] = part
    for name, g, w in zip(("output", "dq", "dk", "dv"), got, want):
        torch.testing.assert_close(g, w, rtol=1e-9, atol=1e-10, msg=name)


def test_layout_puts_rings_across_ulysses_groups():
    """world 8 = dp 2 x ring 2 x Ulysses 2: Ulysses pairs are consecutive ranks (DeepSpeed's groups), a ring joins
    the same Ulysses rank of two pairs; the 4 ranks of a replica read the same samples, DeepSpeed counts dp x ring."""
    from dstrain.parallel.layout import Layout
    layouts = [Layout(8, sequence_parallel=2, context_parallel=2, rank=r) for r in range(8)]
    assert layouts[0].ring_groups() == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert [x.data_parallel_rank for x in layouts] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert [x.sequence_shard for x in layouts] == [0, 1, 2, 3, 0, 1, 2, 3]
    assert [x.engine_data_parallel_rank for x in layouts] == [0, 0, 1, 1, 2, 2, 3, 3]
    lay = layouts[0]
    assert (lay.data_parallel, lay.zero_shards, lay.gradients_averaged_over) == (2, 8, 4)
    assert lay.global_batch(4, 2) == 16 and lay.replica_batch(4, 2) == 32  # DeepSpeed's train_batch_size
    assert "context-parallel (ring) 2 x sequence-parallel 2" in lay.describe()


def test_shard_sequence_gives_each_rank_its_zigzag_chunks():
    """ring 2 x Ulysses 2 over 16 tokens: 4 chunks of 4, ring rank 0 holds chunks 0 and 3 (tokens 0-3, 12-15),
    split between its Ulysses pair; every label once; shift_labels cut after the shift."""
    from dstrain.data.stream import shard_sequence
    ids = torch.arange(16).view(1, 16)
    parts = [shard_sequence({"input_ids": ids, "labels": ids.clone()}, r, 4, ring=2) for r in range(4)]
    assert [p["input_ids"].tolist()[0] for p in parts] == [[0, 1, 2, 3], [12, 13, 14, 15], [4, 5, 6, 7],
                                                           [8, 9, 10, 11]]
    assert [p["shift_labels"].tolist()[0] for p in parts] == [[1, 2, 3, 4], [13, 14, 15, -100], [5, 6, 7, 8],
                                                              [9, 10, 11, 12]]
    assert torch.equal(torch.cat([p["position_ids"] for p in parts], 1).sort().values, ids)


def _validate(overrides: list[str], cfg: dict, world: int = 4, model: dict | None = None):
    from pathlib import Path

    from transformers import AutoConfig

    from dstrain import components
    from dstrain.config import load_recipe, parse_overrides
    from dstrain.parallel.dist import DistContext
    from dstrain.parallel.ds_config import DeviceCaps, resolve
    from dstrain.parallel.layout import Layout
    from tests.conftest import ROOT
    recipe = load_recipe("tiny/pretrain", parse_overrides(overrides))
    resolve(cfg, recipe, world, DeviceCaps("cpu", True, True), hidden_size=128)
    config = AutoConfig.from_pretrained(ROOT / "recipes/tiny/model")
    config.update(model or {})
    setup = components.Setup(recipe, Layout.from_ds_config(cfg, world), cfg, "fp32", config, Path("/nonexistent"),
                             DistContext(0, 0, world), print)
    components.validate_all(components.build(recipe, cfg), setup)


RING = {"zero_optimization": {"stage": 3}, "context_parallel_size": 2}


@pytest.mark.parametrize("overrides,cfg,model,message", [
    (["--train.seq_len=66"], RING, None, r"train.seq_len=66 does not split into 2 zigzag chunks per ring rank .* "
                                         r"choose a multiple of 4"),
    (["--train.seq_len=68"], dict(RING, sequence_parallel_size=2), None, "choose a multiple of 8"),
    (["--model.attn_implementation=eager"], RING, None, "takes the place of sdpa or flash attention, not eager"),
    ([], dict(RING, pipeline={"stages": 2}), None, "context_parallel_size=2 together with pipeline stages"),
    ([], dict(RING, tensor_parallel={"autotp_size": 2}), None, "context_parallel_size=2 together with tensor"),
    (["--diloco.every=5", "--diloco.replicas=2"], RING, None, "diloco with context_parallel_size=2"),
    (["--train.compile=true"], RING, None, "train.compile with context_parallel_size=2"),
    (["--train.seq_len=128"], RING, {"sliding_window": 64}, "sliding window of 64 tokens"),
    ([], RING, {"attention_dropout": 0.1}, "no attention dropout"),
    ([], dict(RING, context_parallel_size=0), None, "context_parallel_size=0 must be a positive integer"),
])
def test_what_cannot_work_is_one_line_before_anything_is_built(overrides, cfg, model, message):
    from dstrain.errors import UserError
    with pytest.raises(UserError, match=message) as error:
        _validate(overrides, json.loads(json.dumps(cfg)), model=model)
    assert "\n" not in str(error.value)
