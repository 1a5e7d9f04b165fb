"""Checkpoints written in the background (`checkpoint.background`): the training step waits only while the state
is copied off the device; a thread per rank writes the files, fsyncs and hashes them, and the checkpoint is
published (complete.json, then the atomic rename: dstrain/run/checkpoint.py) at a later step boundary, once every
rank's writer has finished. At most one save is in flight: a save due while the previous one is still being
written waits for it first.

Why a writer of our own (issue 32 asked to prefer an existing engine):
- DeepSpeed 0.19.8's DecoupledCheckpointEngine hands the live tensors to a spawned writer process (shared memory or
  CUDA IPC, no copy), so it must hold the next optimizer step until the write has ended: with steps shorter than
  the write, the stall is the write. Its commit runs inside engine.step(), where the all-rank manifest and the
  atomic rename that resume relies on cannot run, and it writes through the aio op's FastFileWriter.
- torch.distributed.checkpoint's async_save has the shape used here (stage to host memory, write in the
  background), but writes DCP's format, which DeepSpeed's load_checkpoint, its universal conversion and
  zero_to_fp32 (the export) do not read.
So the files stay DeepSpeed's, written through DeepSpeed's own seam for this, the checkpoint engine: while a save
runs, engine.checkpoint_engine is a HostCopyEngine, whose save(state_dict, path) queues a host copy instead of
calling torch.save (ds_internals.checkpoint_engine_base, ds_internals.using_checkpoint_engine).

The engine's state in host memory (CPU ranks, an offloaded optimizer) is not even copied at the save: nothing but
the optimizer step changes it, so a copy thread copies it while the next step's forward and backward run, and the
step waits for that copy only before its optimizer update (Writer.wait_copied, from steps.train_step). Device
tensors are copied at the save (one D2H copy, synchronised there), and so is everything else a rank saves (RNG
states, the components' state, such as error-feedback buffers that the next backward changes).
"""
from __future__ import annotations

import copy
import os
import queue
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..parallel import ds_internals
from . import faults

_SEAL = object()


def _new_storage(nbytes: int, pinned: bool):
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned).untyped_storage()


class HostPages:
    """Page-locked host buffers of exactly the size asked, for the copies off a GPU.

    Written by hand because PyTorch's pinned allocator (pin_memory=True) rounds every block up to a power of two
    and caches it: gpu-1b's copy, four flat buffers of 17.3 GB together, took 28.0 GiB of host memory on an H200
    and on an H100 (docs/benchmarks.md). Here the buffer is ordinary host memory, allocated at its size, and
    registered with CUDA (cudaHostRegister, which PyTorch's allocator itself uses under
    PYTORCH_ALLOC_CONF=pinned_use_cuda_host_register) so that the copies into it are asynchronous DMA. A registered
    buffer must be unregistered before its memory is freed: this object holds every buffer it registered until
    release(), which unregisters it first. Where registration fails, the buffer stays pageable (the copy into it
    is then synchronous, the bytes the same)."""

    def __init__(self, register=None, unregister=None) -> None:
        if register is None:
            cudart = torch.cuda.cudart()
            register = lambda ptr, n: int(cudart.cudaHostRegister(ptr, n, 0)) == 0  # noqa: E731
            unregister = lambda ptr: cudart.cudaHostUnregister(ptr)  # noqa: E731
        self.register, self.unregister = register, unregister
        self.held: dict[int, object] = {}  # data_ptr -> storage, registered

    def new(self, nbytes: int):
        storage = torch.empty(nbytes, dtype=torch.uint8).untyped_storage()
        if nbytes and self.register(storage.data_ptr(), nbytes):
            self.held[storage.data_ptr()] = storage
        return storage

    def release(self, storage) -> None:
        """storage is no longer needed: unregistered while this object still keeps its memory alive."""
        held = self.held.pop(storage.data_ptr(), None)
        if held is not None:
            self.unregister(storage.data_ptr())
        del held  # the memory may be freed from here on


def host_copy(obj, memo: dict | None = None, alloc=_new_storage, later: list | None = None):
    """A copy of obj whose tensors live in host memory and share nothing with the training state (which the next
    optimizer step changes in place). Views keep sharing: each storage is copied once and the views rebuilt on
    the copy, so torch.save writes the same bytes it would have written from the live state (ZeRO's module
    weights, for one, are views of one flat buffer). alloc(nbytes, pinned) gives the host storages. With `later`
    (a list), storages already in host memory are not copied yet: (host storage, live storage) pairs are appended
    for a copy thread, and the copy's tensors hold their bytes once those copies are done."""
    memo = {} if memo is None else memo
    if isinstance(obj, torch.Tensor):
        t = obj.detach()
        storage = t.untyped_storage()
        key = (storage.device, storage.data_ptr(), storage.nbytes())
        if key not in memo:
            pinned = storage.device.type != "cpu" and torch.cuda.is_available()
            memo[key] = alloc(storage.nbytes(), pinned)
            if later is not None and storage.device.type == "cpu":
                later.append((memo[key], storage))
            else:
                memo[key].copy_(storage, non_blocking=pinned)  # synchronised at seal
        return torch.empty(0, dtype=t.dtype).set_(memo[key], t.storage_offset(), t.size(), t.stride())
    if isinstance(obj, dict):
        out = copy.copy(obj)
        for key, value in obj.items():
            out[key] = host_copy(value, memo, alloc, later)
        return out
    if isinstance(obj, list):
        return [host_copy(v, memo, alloc, later) for v in obj]
    if isinstance(obj, tuple):
        items = [host_copy(v, memo, alloc, later) for v in obj]  # torch.Size and named tuples keep their type
        return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
    return copy.deepcopy(obj)


@dataclass
class Job:
    """One checkpoint's files on this rank."""
    step: int
    folder: Path
    records: dict = field(default_factory=dict)  # file name (relative to folder) -> {"size", "crc32"}
    error: BaseException | None = None
    done: threading.Event = field(default_factory=threading.Event)
    copy_s: float = 0.0  # what the training step waited for: the copy off the device
    write_s: float = 0.0  # what the thread took: writing, fsync, hashing
    storages: list = field(default_factory=list)  # the host buffers of its copies (kept for the next save)
    later: list = field(default_factory=list)  # (host storage, live host storage): copied by the copy thread
    waiting: list = field(default_factory=list)  # (copy, path) to write once `later` is copied
    copied: threading.Event = field(default_factory=threading.Event)  # every byte is in the host copy


class Writer:
    """This rank's background writer: a thread taking (host copy, path) items in order.

    The host buffers of a save are kept when its files are written and reused by the next save (the state's sizes
    do not change between saves): most of a copy into freshly allocated memory is the kernel faulting its pages in
    (400 MB: 0.39-3.2 s into new memory, 0.09-0.11 s into memory used before, measured here), so a save's stall
    falls to the copy itself from the second save on. The price: that host memory stays taken between saves."""

    def __init__(self, rank: int, record, pages: HostPages | None = None) -> None:
        self.rank, self.record = rank, record  # record(path) -> {"size", "crc32"} (checkpoint._file_record)
        self.pages = pages  # for the copies off a GPU; made at the first one
        self.items: queue.Queue = queue.Queue()
        self.job: Job | None = None
        self.spare: dict[tuple[int, bool], list] = {}  # (nbytes, pinned) -> host storages of the last written save
        self.lock = threading.Lock()
        self.thread = threading.Thread(target=self._run, name="dstrain-checkpoint-writer", daemon=True)
        self.thread.start()
        # the copy runs at the training's own priority (the writer's is lowered): the step may be waiting for it
        self.copies: queue.Queue = queue.Queue()
        threading.Thread(target=self._copy, name="dstrain-checkpoint-copy", daemon=True).start()

    def begin(self, step: int, folder: Path) -> Job:
        self.job = Job(step, folder)
        return self.job

    def put(self, obj, path: str | Path, until_update: bool = False) -> None:
        """Queue obj to be written to path. until_update: obj is state that only the optimizer step changes (the
        engine's), so its host-memory tensors are copied in the background, before the next update."""
        began = time.perf_counter()
        later = [] if until_update else None
        copied = host_copy(obj, alloc=self._alloc, later=later)
        if later:
            self.job.later += later
            self.job.waiting.append((copied, Path(path)))
        else:
            self.items.put((self.job, copied, Path(path)))
        self.job.copy_s += time.perf_counter() - began

    def _alloc(self, nbytes: int, pinned: bool):
        with self.lock:
            spare = self.spare.get((nbytes, pinned))
            storage = spare.pop() if spare else None
        if storage is None and pinned:
            self.pages = self.pages or HostPages()
            storage = self.pages.new(nbytes)
        storage = storage if storage is not None else _new_storage(nbytes, False)
        self.job.storages.append((nbytes, pinned, storage))
        return storage

    def seal(self) -> Job:
        """Every file of the job is queued: the device copies must have landed before the thread reads them. The
        copy thread takes the job's deferred copies, then hands its files to the writer."""
        began = time.perf_counter()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.job.copy_s += time.perf_counter() - began
        self.copies.put(self.job)
        return self.job

    def wait_copied(self) -> float:
        """Before an optimizer step: wait until the save in flight holds its own copy of the state; the seconds
        waited."""
        job = self.job
        if job is None or job.copied.is_set():
            return 0.0
        began = time.perf_counter()
        job.copied.wait()
        waited = time.perf_counter() - began
        job.copy_s += waited
        return waited

    def _copy(self) -> None:
        while True:
            job = self.copies.get()
            try:
                if job.later:
                    faults.point("save:copy", self.rank, job.step)
                for host, live in job.later:
                    host.copy_(live)
            except BaseException as error:  # noqa: BLE001 -- reported at the step boundary that publishes
                job.error = error
            job.later = []
            job.copied.set()
            for copied, path in job.waiting:
                self.items.put((job, copied, path))
            job.waiting = []
            self.items.put((job, _SEAL, None))

    def _run(self) -> None:
        try:  # Linux schedules threads apart: where training keeps every core busy, the writer yields to it
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
        except (AttributeError, OSError):
            pass
        while True:
            job, obj, path = self.items.get()
            if obj is _SEAL:
                with self.lock:  # the next save reuses these buffers; the last save's unused ones are let go
                    unused = [storage for group in self.spare.values() for storage in group]
                    self.spare = {}
                    for nbytes, pinned, storage in job.storages:
                        self.spare.setdefault((nbytes, pinned), []).append(storage)
                    job.storages = []
                for storage in unused if self.pages is not None else ():
                    self.pages.release(storage)
                job.done.set()
                continue
            if job.error is not None:  # an earlier file failed: the checkpoint is lost, skip the rest
                continue
            began = time.perf_counter()
            try:
                faults.point("save:write", self.rank, job.step)
                torch.save(obj, path)  # by path, as DeepSpeed's engine does: the archive inside is named after it
                fd = os.open(path, os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
                job.records[str(path.relative_to(job.folder))] = self.record(path)
            except BaseException as error:  # noqa: BLE001 -- reported at the step boundary that publishes
                job.error = error
            finally:
                del obj
                job.write_s += time.perf_counter() - began


def engine_for(writer: Writer):
    """A DeepSpeed checkpoint engine whose save() queues a host copy on writer (DeepSpeed's other calls as its
    TorchCheckpointEngine: load, makedirs, commit)."""
    base = ds_internals.checkpoint_engine_base()

    class HostCopyEngine(base):
        def save(self, state_dict, path: str) -> None:
            writer.put(state_dict, path, until_update=True)

        def preserves_storage_sharing(self) -> bool:
            return False  # host_copy already gives each tensor its own storage: DeepSpeed need not clone first

    return HostCopyEngine()
