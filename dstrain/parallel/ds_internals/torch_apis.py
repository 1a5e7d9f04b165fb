"""Private or undocumented torch APIs: the elastic agent's exit barrier, inductor's cache directory, the CPU flash
attention kernels with their log-sum-exp."""
from __future__ import annotations

from pathlib import Path

import torch


def elastic_agent_exit_barrier(seconds: float) -> None:
    """torchrun's agent waits up to 300 s at its exit barrier for every agent of the last round, also for one whose
    node died after the round formed, and torchrun has no flag for it. Its launch_agent builds
    torch.distributed.launcher.api.LocalElasticAgent (not public API): replaced by a subclass with this timeout."""
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
    from torch.distributed.launcher import api

    class Agent(LocalElasticAgent):
        def __init__(self, *args, **kwargs):
            kwargs.setdefault("exit_barrier_timeout", seconds)
            super().__init__(*args, **kwargs)

    api.LocalElasticAgent = Agent


def inductor_cache_dir() -> Path:
    """The folder inductor caches compiled kernels in (shared by a node's ranks). No public API names it:
    torch._inductor.runtime.cache_dir_utils.cache_dir."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir
    return Path(cache_dir())


def cpu_flash_attention(q, k, v, causal: bool, mask, scale: float):
    """torch's CPU flash attention with its log-sum-exp: (output [b, h, sq, d], lse [b, h, sq], float32 or
    float64). aten._scaled_dot_product_flash_attention_for_cpu (private: what F.scaled_dot_product_attention
    dispatches to on CPU, which returns no lse). `mask`: additive, the query's dtype, or None. A row whose keys
    are all masked comes back as output 0 and lse 0: the caller marks it."""
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, attn_mask=mask,
                                                                       scale=scale)


def cpu_flash_attention_backward(grad_out, q, k, v, out, lse, causal: bool, mask, scale: float):
    """(dq, dk, dv) of cpu_flash_attention's block from the output and lse it is normalised by (ring attention
    passes the merged ones). aten._scaled_dot_product_flash_attention_for_cpu_backward."""
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        grad_out, q, k, v, out, lse, 0.0, causal, attn_mask=mask, scale=scale)
