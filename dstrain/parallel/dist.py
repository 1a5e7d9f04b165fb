"""Process groups and rank facts (read through dstrain.env); works under deepspeed, torchrun,
accelerate launch and plain `python` (one process)."""
from __future__ import annotations

import logging
import os
import socket
import sys
from dataclasses import dataclass
from typing import NoReturn

import torch

from .. import env


@dataclass(frozen=True)
class DistContext:
    rank: int
    local_rank: int
    world_size: int

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def is_local_main(self) -> bool:
        return self.local_rank == 0


def env_context() -> DistContext:
    """Rank layout from the launcher's environment, before any process group exists."""
    return DistContext(rank=env.rank(), local_rank=env.local_rank(), world_size=env.world_size())



def free_port(low: int = 10000, high: int = 32768, start: int | None = None) -> int:
    """A free TCP port in [low, high), which lies below the kernel's ephemeral range (32768-60999 on Linux).

    A port from bind(0) comes from the ephemeral range, where every outgoing connection (gloo's, among them)
    takes its local port: between the pick and the launch's bind one of them can take it (CI: "port 36155 on
    127.0.0.1 is already in use"). Below that range only a bind takes a port. The scan begins at `start`
    (a random place when None) and wraps around."""
    import random

    span = high - low
    start = random.randrange(span) if start is None else start
    for i in range(span):
        port = low + (start + i) % span
        with socket.socket() as s:
            try:
                s.bind(("", port))
            except OSError:
                continue
        return port
    raise RuntimeError(f"no free port in {low}-{high - 1}")


def init() -> DistContext:
    """Start the process group (gloo on CPU, nccl on CUDA: DeepSpeed's accelerator decides)."""
    import warnings

    import deepspeed

    # DeepSpeed 0.19.8 calls torch.distributed's all_gather_into_tensor / reduce_scatter_tensor, which torch 2.13
    # deprecates with a FutureWarning per call: a 2-step ZeRO-3 run under torchrun printed 134 of them, none a
    # user can act on
    warnings.filterwarnings("ignore", message=r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` "
                            r"is deprecated", category=FutureWarning)

    if not env.launched():  # plain `python train.py`: a world of one
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1")
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
    ctx = env_context()
    if torch.cuda.is_available():
        torch.cuda.set_device(ctx.local_rank)
    else:
        share_cores(ctx)
    from .ds_internals import announce_jit_builds, cpu_devices_are_the_nodes_ranks, remember_cpu_info
    # every rank: they must agree on the op's build directory; ranks take turns (build_turn), so only the one that
    # builds says so, once per node
    announce_jit_builds(lambda text: print(text, file=sys.stderr, flush=True))
    remember_cpu_info()  # DeepSpeed's CPU ops ask py-cpuinfo, 1.2 CPU-seconds a question: asked once per machine
    cpu_devices_are_the_nodes_ranks(env.ranks_per_node())  # as DeepSpeed's launcher says it, under every launcher
    try:
        deepspeed.init_distributed(dist_init_required=True, verbose=False)
    except Exception as error:  # DistNetworkError's traceback told users nothing they could act on
        if "address already in use" not in str(error).lower():
            raise
        from ..errors import UserError
        addr, port = env.master()
        raise UserError(f"port {port} on {addr} is already in use (another run, or one still exiting); pass a "
                        f"free one: deepspeed --master_port N, torchrun --master_port N, or MASTER_PORT=N") from None
    _unlink_shm_buffer(ctx)
    return ctx


def share_cores(ctx: DistContext) -> None:
    """CPU ranks on one node split its cores when OMP_NUM_THREADS is unset. torchrun sets it to 1 and the Makefile
    to cores / ranks; DeepSpeed's launcher leaves it unset, so each of 2 ranks ran as many threads as the machine
    has cores: OpenMP threads then wait on each other across ranks, and matmuls ran 5-10x slower (issue 29: a
    measured peak of 0.018-0.045 TFLOP/s against 0.16-0.30 under torchrun)."""
    if env.omp_threads():
        return
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    ranks = max(env.ranks_per_node(), 1)
    per_rank = max(1, cores // ranks)
    if per_rank < torch.get_num_threads():
        torch.set_num_threads(per_rank)
        if ctx.is_main:
            print(f"OMP_NUM_THREADS is not set: {per_rank} thread(s) per rank for the {ranks} ranks sharing this "
                  f"node's {cores} cores (set OMP_NUM_THREADS to choose)", file=sys.stderr, flush=True)


def shutdown() -> None:
    """Tear the process groups down (no collective: gloo's destroy is local)."""
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def leave(code: int) -> NoReturn:
    """End a rank whose work is done and whose files are closed: flush, then os._exit, skipping interpreter
    teardown. That teardown destroys the C++ threads of gloo (DeepSpeed keeps its process groups referenced
    after destroy_process_group: 4 gloo worker threads and 2 transport loops were still running after it)
    and the TCPStore server, and stops Python's daemon threads (tqdm's monitor), in no fixed order. It
    aborted a finished rank about once in a few hundred launches with "terminate called without an active
    exception" (SIGABRT; twice in CI, once with destroy_process_group already called): the launcher then
    reported the job failed and killed the other ranks, one of them possibly still exporting."""
    shutdown()
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def shm_buffer_path(rank: int) -> str:
    """Where DeepSpeed's CPU shared-memory allreduce keeps this rank's 64 MiB workspace."""
    addr, port = env.master()
    return f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_{addr}_{port}_{rank}"


def _unlink_shm_buffer(ctx: DistContext) -> None:
    """DeepSpeed's CPU backend creates one /dev/shm file per rank and never removes it: each run
    leaked 64 MiB of RAM per rank until /dev/shm filled and the OOM killer came. Once every rank has
    mapped its peers' files (init returns only after that, the barrier makes it true for all), the
    names can go: the mappings stay valid and the memory is freed when the processes exit, even
    when they are killed."""
    barrier()
    try:
        os.unlink(shm_buffer_path(ctx.rank))
    except FileNotFoundError:  # not every launcher turns the shm path on (torchrun does not)
        pass


def looks_like_comm_failure(error: BaseException) -> bool:
    """A collective or store operation failed (usually because a peer died), not this rank's own work."""
    text = str(error)
    return isinstance(error, torch.distributed.DistError) or any(
        s in text for s in ("gloo", "Connection closed", "Connection reset", "NCCL", "timed out", "Broken pipe"))


def barrier() -> None:
    if torch.distributed.is_initialized():
        torch.distributed.barrier()


def all_reduce_sum(values: list[float], device: torch.device, group=None) -> list[float]:
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    if torch.distributed.is_initialized():
        torch.distributed.all_reduce(tensor, group=group)
    return tensor.tolist()


def all_gather_objects(obj) -> list:
    """[obj of rank 0, obj of rank 1, ...] on every rank (picklable objects)."""
    if not torch.distributed.is_initialized():
        return [obj]
    out = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(out, obj)
    return out


def broadcast_object(obj, src: int = 0):
    if not torch.distributed.is_initialized():
        return obj
    box = [obj]
    torch.distributed.broadcast_object_list(box, src=src)
    return box[0]
