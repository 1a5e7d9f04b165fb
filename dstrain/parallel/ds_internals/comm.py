"""DeepSpeed's gradient reductions (ZeRO-0's all-reduce, ZeRO-1's buckets) replaced by gradient compression, and
torch's collective handle and backend types the communication counter times."""
from __future__ import annotations

from collections.abc import Callable

import torch


def replace_zero0_allreduce(engine, average_: Callable[[list[torch.Tensor]], None]) -> None:
    """ZeRO-0's data-parallel gradient averaging goes through engine.allreduce_and_copy(small_bucket, group)."""
    def allreduce_and_copy(small_bucket, dp_group, dp_world_size=None):
        average_(list(small_bucket))
    engine.allreduce_and_copy = allreduce_and_copy


def replace_zero1_reduction(optimizer, average_: Callable[[list[torch.Tensor]], None]) -> None:
    """ZeRO-1's bucket reduction: DeepSpeedZeroOptimizer.gradient_reduction_w_predivide(flat, dtype), whose
    flat bucket is laid out as ipg_buckets[dtype].params lists (indices into bit16_groups)."""
    def gradient_reduction_w_predivide(tensor, communication_data_type):
        average_(_zero1_bucket_views(optimizer, tensor, communication_data_type))
        return tensor
    optimizer.gradient_reduction_w_predivide = gradient_reduction_w_predivide


def _zero1_bucket_views(optimizer, flat: torch.Tensor, dtype) -> list[torch.Tensor]:
    params = []
    large = getattr(optimizer, "extra_large_param_to_reduce", {}).get(dtype)
    if large is not None and large.numel() == flat.numel():
        params = [large]
    else:
        for group_idx, param_idx, _ in optimizer.ipg_buckets[dtype].params:
            params.append(optimizer.bit16_groups[group_idx][param_idx])
    if sum(p.numel() for p in params) != flat.numel():
        raise RuntimeError(f"ZeRO-1 bucket of {flat.numel()} elements does not match its parameters")
    views, offset = [], 0
    for p in params:
        views.append(flat.narrow(0, offset, p.numel()).view(p.shape))
        offset += p.numel()
    return views


def comm_backend():
    """DeepSpeed's communication backend object (deepspeed.comm.comm.cdb), which keeps its own references to
    all_gather_into_tensor / reduce_scatter_tensor; None before init or without deepspeed."""
    try:
        from deepspeed.comm import comm
        return comm.cdb
    except Exception:
        return None


def collective_work_type():
    """torch's handle class of an asynchronous collective (torch.distributed returns it with async_op=True and
    waits on it inside a synchronous one). Private in torch; CommCounter times its wait()."""
    return torch._C._distributed_c10d.Work


def cpu_devices_are_the_nodes_ranks(ranks_on_node: int) -> None:
    """DeepSpeed's CPU accelerator answers device_count() from LOCAL_SIZE, which only DeepSpeed's own launcher sets
    (to the node's rank count); under torchrun, Slurm or a warm fork it ran `numactl --hardware` in a child process
    instead, at every ZeRO-3 gradient reduce-scatter (stage3.__avg_scatter_grads: 1.3% of a ZeRO-3 CPU run's
    samples here, a fork of the whole rank each time), and answered the NUMA node count, so ZeRO-3 saw another number
    of nodes than under DeepSpeed's launcher. Set as that launcher sets it, where it is unset."""
    import os

    from deepspeed.accelerator import get_accelerator

    if get_accelerator().device_name() == "cpu":
        os.environ.setdefault("LOCAL_SIZE", str(ranks_on_node))
