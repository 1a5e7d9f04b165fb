"""Bytes sent and seconds waited in collectives, counted on every rank of every run: the comm_bytes, comm_s and
comm_fraction columns of metrics.jsonl (metrics.py logs them), the planner's measured byte counts (planner/probe.py)
and the communication warning. It wraps torch.distributed's functions while active, so DeepSpeed's collectives and
the gradient compressors' are counted alike (it lived in compression.py, where it did not belong)."""
from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
import torch.distributed as tdist

from . import ds_internals


def _wire_bytes(op: str, nbytes: int, world: int) -> float:
    """Bytes one rank sends for a collective over `nbytes` of input, ring algorithms."""
    if op in ("send", "isend"):  # point to point (pipeline stages): the tensor itself
        return float(nbytes)
    if world <= 1 or op in ("recv", "irecv"):
        return 0.0
    if op == "all_reduce":
        return 2 * (world - 1) / world * nbytes
    if op in ("all_gather", "all_gather_into_tensor", "_all_gather_base"):
        return (world - 1) * nbytes
    return (world - 1) / world * nbytes  # reduce, reduce_scatter, broadcast


class CommCounter:
    """Counts every torch.distributed collective (and point-to-point send/recv) while active: calls, input bytes,
    the bytes each rank sends under ring algorithms, and the seconds the caller spent in them. DeepSpeed's
    collectives go through the same functions.

    Seconds: gloo (CPU ranks) blocks the calling thread in a synchronous collective and in the wait() of an
    asynchronous one, so the host time in those calls is exactly the time the step waited for communication
    (including waiting for a slower peer). NCCL returns at once on the host: there CUDA events on the current
    stream bracket each call, which measures how long the compute stream waited for it."""
    OPS = ("all_reduce", "reduce", "broadcast", "all_gather", "all_gather_into_tensor", "reduce_scatter",
           "reduce_scatter_tensor", "_all_gather_base", "_reduce_scatter_base", "all_to_all_single", "send", "recv",
           "isend", "irecv")

    def __init__(self) -> None:
        self.calls = 0
        self.input_bytes = 0
        self.wire_bytes = 0.0
        self.all_to_all_bytes = 0.0  # of wire_bytes: all_to_all_single's (expert parallelism, Ulysses)
        self._seconds = 0.0
        self._events: list = []  # (start, end) CUDA events not yet read
        self._depth = 0  # a synchronous collective waits on its own work: time the outermost call only
        self._active = None

    def start(self) -> CommCounter:
        self._active = self.active()
        self._active.__enter__()
        return self

    def stop(self) -> None:
        if self._active is not None:
            self._active.__exit__(None, None, None)
            self._active = None

    @property
    def seconds(self) -> float:
        """Time spent in collectives so far (reads pending CUDA events, which waits for them)."""
        if self._events:
            for begin, end in self._events:
                end.synchronize()
                self._seconds += begin.elapsed_time(end) / 1000
            self._events.clear()
        return self._seconds

    def snapshot(self) -> tuple[float, float, float]:
        return self.wire_bytes, self.seconds, self.all_to_all_bytes

    def since(self, snapshot: tuple[float, float, float]) -> dict:
        """{comm_bytes, comm_s, comm_bytes_all_to_all} since `snapshot` (one optimizer step, in train.py)."""
        return {"comm_bytes": self.wire_bytes - snapshot[0], "comm_s": self.seconds - snapshot[1],
                "comm_bytes_all_to_all": self.all_to_all_bytes - snapshot[2]}

    def _record(self, op: str, tensor, group) -> None:
        if tensor is None:
            return
        tensors = tensor if isinstance(tensor, (list, tuple)) else [tensor]
        nbytes = sum(t.numel() * t.element_size() for t in tensors if torch.is_tensor(t))
        self.calls += 1
        self.input_bytes += nbytes
        wire = _wire_bytes(op, nbytes, tdist.get_world_size(group))
        self.wire_bytes += wire
        if op == "all_to_all_single":
            self.all_to_all_bytes += wire

    def _timed(self, fn: Callable, args, kwargs, cuda: bool):
        if self._depth:
            return fn(*args, **kwargs)
        self._depth += 1
        try:
            if cuda:
                begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                begin.record()
                out = fn(*args, **kwargs)
                end.record()
                self._events.append((begin, end))
                return out
            began = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self._seconds += time.perf_counter() - began
        finally:
            self._depth -= 1

    @contextmanager
    def active(self) -> Iterator[CommCounter]:
        originals = {op: getattr(tdist, op) for op in self.OPS if hasattr(tdist, op)}

        def wrap(op: str, fn: Callable) -> Callable:
            def counted(*args, **kwargs):
                if op in ("all_gather", "all_gather_into_tensor", "_all_gather_base"):
                    tensor = kwargs.get("tensor", kwargs.get("input_tensor", args[1] if len(args) > 1 else None))
                elif op in ("reduce_scatter", "reduce_scatter_tensor", "_reduce_scatter_base", "all_to_all_single"):
                    tensor = kwargs.get("input", kwargs.get("input_list", args[1] if len(args) > 1 else None))
                else:
                    tensor = kwargs.get("tensor", args[0] if args else None)
                self._record(op, tensor, kwargs.get("group"))
                cuda = torch.is_tensor(tensor) and tensor.is_cuda
                return self._timed(fn, args, kwargs, cuda)
            return counted

        backend = ds_internals.comm_backend()
        cached = {}
        for op, fn in originals.items():
            setattr(tdist, op, wrap(op, fn))
        if backend is not None:  # DeepSpeed keeps its own references to these two
            for attr, op in (("all_gather_function", "all_gather_into_tensor"),
                             ("reduce_scatter_function", "reduce_scatter_tensor")):
                if getattr(backend, attr, None) is not None:
                    cached[attr] = getattr(backend, attr)
                    setattr(backend, attr, wrap(op, cached[attr]))
        work = ds_internals.collective_work_type()  # an asynchronous collective is waited for here
        wait = work.wait
        work.wait = lambda handle, *args, **kwargs: self._timed(wait, (handle, *args), kwargs, False)
        try:
            yield self
        finally:
            work.wait = wait
            for op, fn in originals.items():
                setattr(tdist, op, fn)
            for attr, fn in cached.items():
                setattr(backend, attr, fn)
