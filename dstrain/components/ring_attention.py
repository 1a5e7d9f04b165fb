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
masks, and ring-flash-attn needs flash-attn's CUDA kernels. The block kernel here is plain matmuls in float32
(memory O(block^2) per head while a block is computed); on GPUs the next step is a fused block kernel that
returns the log-sum-exp (flash-attn's varlen, or torch's efficient attention with an additive mask).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..layout import zigzag_index


class Ring:
    """This rank's ring: the process group of its C ranks and its neighbours' global ranks."""

    def __init__(self, group, ranks: list[int], rank: int):
        self.group, self.ranks, self.size = group, ranks, len(ranks)
        self.index = ranks.index(rank)
        self.next = ranks[(self.index + 1) % self.size]
        self.prev = ranks[(self.index - 1) % self.size]

    def start_pass(self, tensors: list[torch.Tensor]):
        """Send tensors to the next rank and receive the previous rank's: (received, requests to wait on)."""
        # isend/irecv one by one, not batch_isend_irecv: comm_counter wraps them to count the ring's bytes, and
        # batch_isend_irecv refuses wrapped functions
        tensors = [t.contiguous() for t in tensors]
        received = [torch.empty_like(t) for t in tensors]
        requests = [dist.isend(t, self.next, self.group) for t in tensors]
        requests += [dist.irecv(r, self.prev, self.group) for r in received]
        return received, requests

    def pass_along(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        received, requests = self.start_pass(tensors)
        for request in requests:
            request.wait()
        return received


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


def _block_forward(q, k, v, mask, scale):
    """Attention of q over one key/value block: (output, log-sum-exp), float32; rows with no key: 0 and -inf."""
    scores = torch.matmul(_wide(q), _wide(_expand(k, q.shape[1])).transpose(-1, -2)) * scale
    scores = scores.masked_fill(~mask[:, None], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - torch.where(torch.isinf(lse), 0.0, lse).unsqueeze(-1))
    return torch.matmul(probs, _wide(_expand(v, q.shape[1]))), lse


def _block_backward(q, k, v, mask, scale, lse, grad_out, delta):
    """Gradients of one block from the final log-sum-exp: (dq, dk, dv), float32, dk/dv per key/value head."""
    heads, kv_heads = q.shape[1], k.shape[1]
    kf, vf = _wide(_expand(k, heads)), _wide(_expand(v, heads))
    scores = torch.matmul(_wide(q), kf.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~mask[:, None], float("-inf"))
    probs = torch.exp(scores - lse.unsqueeze(-1))
    grad_v = torch.matmul(probs.transpose(-1, -2), grad_out)
    grad_scores = probs * (torch.matmul(grad_out, vf.transpose(-1, -2)) - delta.unsqueeze(-1))
    grad_q = torch.matmul(grad_scores, kf) * scale
    grad_k = torch.matmul(grad_scores.transpose(-1, -2), _wide(q)) * scale
    if kv_heads != heads:  # sum the repeated heads back onto their key/value head
        shape = (grad_k.shape[0], kv_heads, heads // kv_heads) + grad_k.shape[2:]
        grad_k, grad_v = grad_k.view(shape).sum(2), grad_v.view(shape).sum(2)
    return grad_q, grad_k, grad_v


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


class RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, positions, ring: Ring, scale: float):
        b, heads, length, dim = q.shape
        index = zigzag_index(ring.index, ring.size, length, q.device)
        starts = index[None] - positions  # a token's document: where it starts in the whole sequence
        out = torch.zeros(b, heads, length, dim, dtype=_wide(q[:0]).dtype, device=q.device)
        lse = torch.full((b, heads, length), float("-inf"), dtype=_wide(q[:0]).dtype, device=q.device)
        block, owner = [k, v, starts], ring.index
        for step in range(ring.size):
            pending = ring.start_pass(block) if step < ring.size - 1 else None
            qs, ks = _pieces(ring.index, owner, length)
            k_index = zigzag_index(owner, ring.size, length, q.device)
            mask = _mask(index[qs], k_index[ks], starts[:, qs], block[2][:, ks])
            part, part_lse = _block_forward(q[:, :, qs], block[0][:, :, ks], block[1][:, :, ks], mask, scale)
            merged = torch.logaddexp(lse[:, :, qs], part_lse)
            keep = torch.exp(lse[:, :, qs] - merged).nan_to_num(0.0)  # both -inf: nothing yet, nothing here
            take = torch.exp(part_lse - merged).nan_to_num(0.0)
            out[:, :, qs] = out[:, :, qs] * keep.unsqueeze(-1) + part * take.unsqueeze(-1)
            lse[:, :, qs] = merged
            if pending is not None:
                received, requests = pending
                for request in requests:
                    request.wait()
                block, owner = received, (owner - 1) % ring.size
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, starts, out, lse)
        ctx.ring, ctx.scale = ring, scale
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, starts, out, lse = ctx.saved_tensors
        ring, scale = ctx.ring, ctx.scale
        length = q.shape[2]
        grad_out = _wide(grad_out)
        delta = (grad_out * _wide(out)).sum(-1)
        index = zigzag_index(ring.index, ring.size, length, q.device)
        grad_q = torch.zeros_like(_wide(q))
        block, owner = [k, v, starts], ring.index
        grads = [torch.zeros_like(_wide(k)), torch.zeros_like(_wide(v))]
        for step in range(ring.size):
            pending = ring.start_pass(block) if step < ring.size - 1 else None
            qs, ks = _pieces(ring.index, owner, length)
            k_index = zigzag_index(owner, ring.size, length, q.device)
            mask = _mask(index[qs], k_index[ks], starts[:, qs], block[2][:, ks])
            dq, dk, dv = _block_backward(q[:, :, qs], block[0][:, :, ks], block[1][:, :, ks], mask, scale,
                                         lse[:, :, qs], grad_out[:, :, qs], delta[:, :, qs])
            grad_q[:, :, qs] += dq
            grads[0][:, :, ks] += dk
            grads[1][:, :, ks] += dv
            # the block's gradients travel on with it; after `size` passes they are back with their owner
            grads = ring.pass_along(grads)
            if pending is not None:
                received, requests = pending
                for request in requests:
                    request.wait()
                block, owner = received, (owner - 1) % ring.size
        return grad_q.to(q.dtype), grads[0].to(k.dtype), grads[1].to(v.dtype), None, None, None


def ring_attention(q, k, v, positions, ring: Ring, scale: float) -> torch.Tensor:
    """[b, heads, L, d] queries and [b, kv_heads, L, d] keys/values of this rank's two zigzag chunks, positions
    [b, L]: the causal, document-masked attention output over the whole sequence, [b, heads, L, d]."""
    if q.shape[2] % 2:
        raise RuntimeError(f"ring attention needs an even number of local tokens (two zigzag chunks), got "
                           f"{q.shape[2]}")
    return RingAttention.apply(q, k, v, positions, ring, scale)
