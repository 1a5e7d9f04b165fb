"""Ring attention: causal self-attention over a sequence split across the ranks of a ring (context parallelism).

Each of the C ranks of a ring holds the queries, keys and values of two chunks of every sequence, in zigzag
("llama3") order: the sequence is cut into 2C chunks and ring rank k holds chunks k and 2C-1-k, so every rank has
the same amount of causal work. The key/value blocks travel round the ring point to point (sent to the next
rank, received from the previous, the next block's transfer in flight while this one is computed); each block's
partial output is merged into the running one with its log-sum-exp (the online softmax), and the backward pass
sends the key/value gradients round with their blocks until they are back with their owner.

Masks come from positions, not from a 4-D mask: a token's global index is known from its ring rank, and its
document is (global index - position id), so packed rows (position ids restarting at each document) never attend
across documents and RoPE sees the positions the data gave.

Written by hand because nothing that runs on CPU ranks does it: torch's context parallel
(torch.distributed.tensor.experimental) dispatches only the CUDA flash/efficient SDPA ops and only plain causal
masks, and ring-flash-attn needs flash-attn's CUDA kernels. Each block runs through torch's CPU flash attention
(which returns the log-sum-exp the merge needs) on CPU ranks, and as plain matmuls in float32 elsewhere (memory
O(block^2) per head while a block is computed); on GPUs the next step is a fused block kernel that returns the
log-sum-exp (flash-attn's varlen, or torch's efficient attention with an additive mask)."""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..parallel import ds_internals
from ..parallel.layout import zigzag_index


class Ring:
    """This rank's ring: the process group of its C ranks and its neighbours' global ranks."""

    def __init__(self, group, ranks: list[int], rank: int):
        self.group, self.ranks, self.size = group, ranks, len(ranks)
        self.index = ranks.index(rank)
        self.next = ranks[(self.index + 1) % self.size]
        self.prev = ranks[(self.index - 1) % self.size]

    def start_pass(self, tensors: list[torch.Tensor]) -> _Pass:
        """Send tensors to the next rank and receive the previous rank's; the returned pass's wait() gives them.
        A gloo ring of accelerator tensors (C processes sharing one GPU, the GPU check) goes through host copies:
        gloo sends host memory only."""
        # isend/irecv one by one, not batch_isend_irecv: comm_counter wraps them to count the ring's bytes, and
        # batch_isend_irecv refuses wrapped functions
        device = tensors[0].device
        staged = device.type != "cpu" and dist.get_backend(self.group) == "gloo"
        tensors = [t.cpu() if staged else t.contiguous() for t in tensors]
        received = [torch.empty_like(t) for t in tensors]
        requests = [dist.isend(t, self.next, self.group) for t in tensors]
        requests += [dist.irecv(r, self.prev, self.group) for r in received]
        return _Pass(received, requests, device if staged else None)

    def pass_along(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        return self.start_pass(tensors).wait()


class _Pass:
    """One step of the ring in flight."""

    def __init__(self, received, requests, device):
        self.received, self.requests, self.device = received, requests, device

    def wait(self) -> list[torch.Tensor]:
        for request in self.requests:
            request.wait()
        return [t.to(self.device) for t in self.received] if self.device is not None else self.received


def _wide(t: torch.Tensor) -> torch.Tensor:
    """float32 for the block arithmetic (float64 stays: the kernel's own test runs in it)."""
    return t if t.dtype == torch.float64 else t.float()


def _mask(q_index, k_index, q_start, k_start):
    """[b, sq, sk] True where query may attend key: causal by global index, same document."""
    causal = q_index[:, None] >= k_index[None, :]
    return causal[None] & (q_start[:, :, None] == k_start[:, None, :])


def _expand(t: torch.Tensor, heads: int) -> torch.Tensor:
    """Key/value heads repeated for grouped-query attention (query head i reads key/value head i // groups)."""
    return t if t.shape[1] == heads else t.repeat_interleave(heads // t.shape[1], dim=1)


# The kernel of one block: torch's CPU flash attention (ds_internals: it returns the log-sum-exp the merge needs,
# memory O(block) per head), else plain matmuls in the wide dtype (other devices for now: memory O(block^2) per
# head while a block is computed). MATH_ONLY: the kernel test runs both on CPU.
MATH_ONLY = False


def _flash(q) -> bool:
    return q.device.type == "cpu" and not MATH_ONLY


def _additive(mask, dtype):
    """[b, sq, sk] boolean -> the [b, 1, sq, sk] additive mask the flash kernel takes, or None."""
    if mask is None:
        return None
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, float("-inf"))[:, None]


def _sum_heads(grad: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """Gradients of repeated key/value heads summed back onto their head."""
    if grad.shape[1] == kv_heads:
        return grad
    shape = (grad.shape[0], kv_heads, grad.shape[1] // kv_heads) + grad.shape[2:]
    return grad.view(shape).sum(2)


def _block_forward(q, k, v, causal: bool, mask, scale):
    """Attention of q over one key/value block (causal: the diagonal block, no documents; mask [b, sq, sk]:
    causal and documents; neither: every pair): (output, log-sum-exp) in the wide dtype; rows with no key:
    0 and -inf."""
    heads = q.shape[1]
    k, v = _expand(k, heads), _expand(v, heads)
    if _flash(q):
        out, lse = ds_internals.cpu_flash_attention(q, k, v, causal, _additive(mask, q.dtype), scale)
        if mask is not None:  # the kernel gives a row with no key lse 0: it must weigh nothing in the merge
            lse = lse.masked_fill(~mask.any(-1)[:, None], float("-inf"))
        return _wide(out), _wide(lse)
    scores = torch.matmul(_wide(q), _wide(k).transpose(-1, -2)) * scale
    allowed = _allowed(q, causal, mask, k.shape[2])
    if allowed is not None:
        scores = scores.masked_fill(~allowed, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - torch.where(torch.isinf(lse), 0.0, lse).unsqueeze(-1))
    return torch.matmul(probs, _wide(v)), lse


def _allowed(q, causal: bool, mask, keys: int):
    """The math path's boolean mask [b or 1, 1, sq, sk], or None."""
    if mask is not None:
        return mask[:, None]
    if causal:
        return torch.ones(q.shape[2], keys, dtype=torch.bool, device=q.device).tril()[None, None]
    return None


def _block_backward(q, k, v, causal: bool, mask, scale, out, lse, grad_out):
    """Gradients of one block from the merged output and log-sum-exp: (dq, dk, dv) in the wide dtype, dk/dv per
    key/value head."""
    heads, kv_heads = q.shape[1], k.shape[1]
    k, v = _expand(k, heads), _expand(v, heads)
    if _flash(q):
        dq, dk, dv = ds_internals.cpu_flash_attention_backward(
            grad_out.to(q.dtype), q, k, v, out.to(q.dtype), lse.to(torch.float64 if q.dtype == torch.float64
                                                                       else torch.float32),
            causal, _additive(mask, q.dtype), scale)
        return _wide(dq), _sum_heads(_wide(dk), kv_heads), _sum_heads(_wide(dv), kv_heads)
    kf, vf, qf, grad_out = _wide(k), _wide(v), _wide(q), _wide(grad_out)
    scores = torch.matmul(qf, kf.transpose(-1, -2)) * scale
    allowed = _allowed(q, causal, mask, k.shape[2])
    if allowed is not None:
        scores = scores.masked_fill(~allowed, float("-inf"))
    probs = torch.exp(scores - lse.unsqueeze(-1))
    delta = (grad_out * _wide(out)).sum(-1)
    grad_v = torch.matmul(probs.transpose(-1, -2), grad_out)
    grad_scores = probs * (torch.matmul(grad_out, vf.transpose(-1, -2)) - delta.unsqueeze(-1))
    grad_q = torch.matmul(grad_scores, kf) * scale
    grad_k = torch.matmul(grad_scores.transpose(-1, -2), qf) * scale
    return grad_q, _sum_heads(grad_k, kv_heads), _sum_heads(grad_v, kv_heads)


def _pieces(mine: int, owner: int, length: int):
    """(query slice, key slice) of a block that can hold any unmasked pair under zigzag order: the diagonal
    block is causal within; an earlier rank's block is wholly before both of mine's chunks in its first chunk
    only; a later rank's block is seen only by my second chunk (which comes after both of its chunks)."""
    half = length // 2
    if owner == mine:
        return slice(0, length), slice(0, length)
    if owner < mine:
        return slice(0, length), slice(0, half)
    return slice(half, length), slice(0, length)


def _block_masks(index, starts, owner_starts, mine: int, owner: int, size: int, length: int):
    """(query slice, key slice, causal, mask) of the block from `owner`: a mask only where a document boundary
    falls inside the block (packed rows); otherwise causal on the diagonal and every pair elsewhere."""
    qs, ks = _pieces(mine, owner, length)
    q_starts, k_starts = starts[:, qs], owner_starts[:, ks]
    first = q_starts[:, :1]
    if bool((q_starts == first).all()) and bool((k_starts == first).all()):
        return qs, ks, owner == mine, None
    k_index = zigzag_index(owner, size, length, index.device)
    return qs, ks, False, _mask(index[qs], k_index[ks], q_starts, k_starts)


class RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, positions, ring: Ring, scale: float):
        b, heads, length, dim = q.shape
        index = zigzag_index(ring.index, ring.size, length, q.device)
        starts = index[None] - positions  # a token's document: where it starts in the whole sequence
        wide = _wide(q[:0]).dtype
        out = torch.zeros(b, heads, length, dim, dtype=wide, device=q.device)
        lse = torch.full((b, heads, length), float("-inf"), dtype=wide, device=q.device)
        block, owner = [k, v, starts], ring.index
        for step in range(ring.size):
            pending = ring.start_pass(block) if step < ring.size - 1 else None
            qs, ks, causal, mask = _block_masks(index, starts, block[2], ring.index, owner, ring.size, length)
            part, part_lse = _block_forward(q[:, :, qs], block[0][:, :, ks], block[1][:, :, ks], causal, mask, scale)
            merged = torch.logaddexp(lse[:, :, qs], part_lse)
            keep = torch.exp(lse[:, :, qs] - merged).nan_to_num(0.0)  # both -inf: nothing yet, nothing here
            take = torch.exp(part_lse - merged).nan_to_num(0.0)
            out[:, :, qs] = out[:, :, qs] * keep.unsqueeze(-1) + part * take.unsqueeze(-1)
            lse[:, :, qs] = merged
            if pending is not None:
                block, owner = pending.wait(), (owner - 1) % ring.size
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, starts, out, lse)
        ctx.ring, ctx.scale = ring, scale
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, starts, out, lse = ctx.saved_tensors
        ring, scale = ctx.ring, ctx.scale
        length = q.shape[2]
        index = zigzag_index(ring.index, ring.size, length, q.device)
        grad_q = torch.zeros_like(_wide(q))
        block, owner = [k, v, starts], ring.index
        grads = [torch.zeros_like(_wide(k)), torch.zeros_like(_wide(v))]
        for step in range(ring.size):
            pending = ring.start_pass(block) if step < ring.size - 1 else None
            qs, ks, causal, mask = _block_masks(index, starts, block[2], ring.index, owner, ring.size, length)
            dq, dk, dv = _block_backward(q[:, :, qs], block[0][:, :, ks], block[1][:, :, ks], causal, mask, scale,
                                         out[:, :, qs], lse[:, :, qs], grad_out[:, :, qs])
            grad_q[:, :, qs] += dq
            grads[0][:, :, ks] += dk
            grads[1][:, :, ks] += dv
            # the block's gradients travel on with it; after `size` passes they are back with their owner
            grads = ring.pass_along(grads)
            if pending is not None:
                block, owner = pending.wait(), (owner - 1) % ring.size
        return grad_q.to(q.dtype), grads[0].to(k.dtype), grads[1].to(v.dtype), None, None, None


def ring_attention(q, k, v, positions, ring: Ring, scale: float) -> torch.Tensor:
    """[b, heads, L, d] queries and [b, kv_heads, L, d] keys/values of this rank's two zigzag chunks, positions
    [b, L]: the causal, document-masked attention output over the whole sequence, [b, heads, L, d]."""
    if q.shape[2] % 2:
        raise RuntimeError(f"ring attention needs an even number of local tokens (two zigzag chunks), got "
                           f"{q.shape[2]}")
    return RingAttention.apply(q, k, v, positions, ring, scale)
