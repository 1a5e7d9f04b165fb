"""Warm rank processes: train.py's ranks forked from a process that has already imported torch, DeepSpeed,
transformers and dstrain, for launched tests whose subject is not the launcher.

A real launch on 2 cores pays the launcher's own start and, per rank, an interpreter importing torch, DeepSpeed
and transformers before train.py does anything (docs/testing.md has the split). Most launched tests are about what
train.py computes, not about how it was started, so `tests.helpers.launch` runs them here: multiprocessing's
forkserver (the same arrangement DeepSpeed's own test harness uses, tests/unit/common.py) imports the heavy modules
once per pytest worker (`_PRELOAD`), and every rank of every launch is a fresh fork of that process. A fork has
never initialised a process group, loaded a model or run an op, so each launch still starts from nothing: its own
process group on its own port, its own run directory, its own environment (os.environ is replaced before
train.py runs) and train.py run as `__main__`, exactly as `python train.py` would run it.

The ranks see what torchrun gives them (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR/PORT), but no
agent: rank 0 hosts the store, as under the deepspeed runner. Like the deepspeed runner the launch's exit code is
the first failing rank's, and the others are ended once one has failed. All ranks write to one stdout and one stderr
(files opened for appending), interleaved line by line as through a launcher's inherited pipes.

What a fork cannot give, and what therefore launches for real (tests.helpers.launch decides): an environment that
differs from the forkserver's in a variable read at import or at a process's start (can_fork: LD_PRELOAD, glibc's
other MALLOC_* tunables, the Hub's HF_* but its offline switches), and anything whose subject is the launcher, a signal, a killed
process or a launcher's exit code.
"""
from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# imported once in the forkserver: what every train.py rank imports before its first step (the model families the
# tests build, the trainer and its run/ and parallel/ modules); optional ones a run may not need are left to it
_PRELOAD = "tests.warm_preload"

# What a fork cannot give. The forkserver imported torch, DeepSpeed, transformers, datasets and huggingface_hub
# under the environment it started with, and several of them read variables only then (huggingface_hub's
# HF_HUB_OFFLINE and HF_ENDPOINT, datasets' HF_DATASETS_*, glibc's MALLOC_* tunables, LD_PRELOAD, torch's
# TORCH_LOGS): a launch whose environment differs from the forkserver's in any variable not known to be read at run
# time launches for real instead. Read at run time: the variables dstrain reads (dstrain/env.py, each through
# os.environ when asked; but glibc reads MALLOC_MMAP_THRESHOLD_ at a process's start, and huggingface_hub its HF_*
# at import), wandb's (read by wandb.init), the tokenizers' parallelism, the threads per rank (set by _rank), and
# pytest's own.
_READ_AT_START = ("MALLOC_", "GLIBC_", "LD_", "HF_")
_RUNTIME_PREFIXES = ("WANDB_", "PYTEST_")
# inductor reads its cache folder each time it compiles (torch/_inductor/runtime/cache_dir_utils.py; only dynamo's
# opt-in precompile cache keeps the import's): the compiled tests' own folders, checked to hold their kernels. And
# inductor sets _TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR (a pointer of its own process) each time it loads a compiled
# kernel, just before the kernel reads it (torch/_inductor/codecache.py, _load_library_inner): a worker that compiled
# in-process (tests/unit/test_compiler.py) holds it from then on, and every later warm launch of that worker ran for
# real (a fresh clone, 2026-12-07: test_health's four, test_chat_templates' two; one failed on torchrun's exit 1)
_RUNTIME_NAMES = {"PYTHONUNBUFFERED", "TOKENIZERS_PARALLELISM", "OMP_NUM_THREADS", "TORCHINDUCTOR_CACHE_DIR",
                  "_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR"}
# Set by the preload's imports when unset, as a fresh process's imports set them: deepspeed/__init__.py's
# PYTORCH_NVML_BASED_CUDA_CHECK=1 (torch then asks NVML whether CUDA is there, at call time) and torch._dynamo's
# TORCHINDUCTOR_CACHE_DIR (its default). A launch whose environment lacks them or holds the import's value (a worker
# that imported deepspeed itself, as the refusal tests' in-process checks do) forks; each fork sets them again.
# tests/unit/test_warm.py checks the preload's imports set these and no others.
def _set_by_import() -> dict:
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir
    return {"PYTORCH_NVML_BASED_CUDA_CHECK": "1", "TORCHINDUCTOR_CACHE_DIR": default_cache_dir()}


# read at import, but set again in each fork from the launch's environment as the import would have (_offline)
_RESET_IN_FORK = {"HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"}
# read by glibc at a process's start, given to a fork by mallopt (_malloc) where the forkserver started without it:
# the memory tests' MALLOC_MMAP_THRESHOLD_ (freed tensors leave RSS at once). mallopt cannot turn glibc's dynamic
# threshold back on, so a forkserver started with it set launches every run without it for real.
_SET_IN_FORK = {"MALLOC_MMAP_THRESHOLD_": -3}  # M_MMAP_THRESHOLD in glibc's malloc.h


def can_fork(environ: dict) -> bool:
    """Whether a fork of the forkserver can stand for a fresh process started with `environ`."""
    return not unforkable(environ)


def unforkable(environ: dict) -> list[str]:
    """The variables in which `environ` differs from the forkserver's in a way a fork cannot give (none: it forks)."""
    from dstrain.env import DOCUMENTED
    started = _started_with if _started_with is not None else dict(os.environ)

    def runtime(name: str) -> bool:
        if name in _SET_IN_FORK:
            return name not in started
        return name in _RESET_IN_FORK or not name.startswith(_READ_AT_START) and (
            name in DOCUMENTED or name in _RUNTIME_NAMES or name.startswith(_RUNTIME_PREFIXES))

    imported = _set_by_import()

    def same(name: str) -> bool:
        return environ.get(name, imported.get(name)) == started.get(name, imported.get(name))

    return sorted(name for name in set(environ) | set(started) if not same(name) and not runtime(name))


_started_with: dict | None = None  # the forkserver's environment
_context: multiprocessing.context.BaseContext | None = None


def _forkserver() -> multiprocessing.context.BaseContext:
    global _context
    if _context is None:
        _context = multiprocessing.get_context("forkserver")
        # the forkserver starts with this process's environment: the threads per rank the helpers give every launch
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        _context.set_forkserver_preload([_PRELOAD])
        global _started_with
        _started_with = dict(os.environ)
    return _context


def _rank(argv: list[str], environ: dict, out: str, err: str) -> None:
    """One rank: the environment and working directory a launcher gives, its output to two files, train.py as
    __main__. Its exit code is train.py's (dist.leave's os._exit, or sys.exit through multiprocessing)."""
    os.chdir(ROOT)
    os.environ.clear()
    os.environ.update(environ)
    for name, value in _set_by_import().items():
        os.environ.setdefault(name, value)
    for path, fd in ((out, 1), (err, 2)):  # every rank appends to the same two files, as to a launcher's pipes
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(target, fd)
        os.close(target)
    sys.stdout = open(1, "w", buffering=1, closefd=False)
    sys.stderr = open(2, "w", buffering=1, closefd=False, errors="backslashreplace")
    _offline(environ)
    _malloc(environ)
    import torch
    torch.set_num_threads(int(environ.get("OMP_NUM_THREADS") or 1))
    sys.argv = [str(ROOT / "train.py"), *argv]
    import runpy
    runpy.run_path(str(ROOT / "train.py"), run_name="__main__")


def _malloc(environ: dict) -> None:
    """glibc reads MALLOC_MMAP_THRESHOLD_ once, at a process's start: a fork sets it as that start would have
    (mallopt, which also turns the dynamic threshold off, as the variable does)."""
    for name, option in _SET_IN_FORK.items():
        if environ.get(name):
            import ctypes
            if ctypes.CDLL(None).mallopt(option, int(environ[name])) != 1:
                raise OSError(f"mallopt({option}, {environ[name]}) failed in a warm rank")


def _offline(environ: dict) -> None:
    """huggingface_hub and datasets read the offline switches once, at import (in the forkserver, with its
    environment): give their constants the values their import would have read from this launch's (the same
    expressions as huggingface_hub/constants.py and datasets/config.py). The refusals that name a missing Hub
    model run with HF_HUB_OFFLINE=1, and an in-process test that switched offline left it in the worker's
    environment: without this, each of those launched for real."""
    import datasets.config
    import huggingface_hub.constants as hub
    hub.HF_HUB_OFFLINE = hub._is_true(environ.get("HF_HUB_OFFLINE") or environ.get("TRANSFORMERS_OFFLINE"))
    own = environ.get("HF_DATASETS_OFFLINE")
    datasets.config.HF_HUB_OFFLINE = hub.HF_HUB_OFFLINE if own is None else own.upper() in datasets.config.ENV_VARS_TRUE_VALUES
    datasets.config.HF_DATASETS_OFFLINE = datasets.config.HF_HUB_OFFLINE


def launch(args: list[str], environ: dict, nproc: int, port: int | None, timeout: float,
           distributed: bool = True) -> subprocess.CompletedProcess:
    """train.py with `args` on `nproc` forked ranks (distributed: torchrun's rank variables; otherwise one process
    with none, as `python train.py`). Raises TimeoutError (after ending every rank) past `timeout` seconds."""
    context = _forkserver()
    logs = Path(tempfile.mkdtemp(prefix="dstrain-warm-"))
    ranks = []
    for rank in range(nproc):
        rank_env = dict(environ)
        if distributed:
            rank_env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nproc),
                            LOCAL_WORLD_SIZE=str(nproc), GROUP_RANK="0", MASTER_ADDR="127.0.0.1",
                            MASTER_PORT=str(port))
        process = context.Process(target=_rank, args=(args, rank_env, str(logs / "out"), str(logs / "err")),
                                  name=f"rank{rank}")
        process.start()
        ranks.append(process)
    code, deadline, failed_at = None, time.monotonic() + timeout, None
    try:
        while any(p.exitcode is None for p in ranks):
            multiprocessing.connection.wait([p.sentinel for p in ranks if p.exitcode is None], timeout=0.5)
            for process in ranks:
                if process.exitcode not in (None, 0) and code is None:
                    code, failed_at = process.exitcode, time.monotonic()
            # as the deepspeed runner does, a failed rank ends the job (after a moment for the others' last words)
            if failed_at is not None and time.monotonic() - failed_at > 10:
                _end(ranks)
            if time.monotonic() > deadline:
                _end(ranks)
                raise TimeoutError(f"ran past {timeout}s\n--- stderr\n{_read(logs / 'err')[-6000:]}")
        # the first failing rank's code; a rank ended by a signal -N, as subprocess reports a child
        return subprocess.CompletedProcess(["warm", "train.py", *args], code or 0, _read(logs / "out"),
                                           _read(logs / "err"))
    finally:
        _end(ranks)
        shutil.rmtree(logs, ignore_errors=True)


def _end(ranks: list) -> None:
    for process in ranks:
        if process.exitcode is None:
            process.kill()
    for process in ranks:
        process.join(timeout=30)


def _read(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else ""


def run_ranks(fn, world: int, *args, timeout: float = 120) -> list:
    """fn(rank, *args) on `world` warm processes joined in one gloo process group (a file store: no port); each
    rank's return value, in rank order. For unit tests of a collective seam (evaluate()'s reduction, ...): a fork
    of the forkserver starts in well under a second, a spawned process imports torch for seconds. `fn` must be
    importable by name (a module-level function)."""
    context = _forkserver()
    folder = Path(tempfile.mkdtemp(prefix="dstrain-ranks-"))
    ranks = [context.Process(target=_ranked, args=(fn, rank, world, str(folder), args)) for rank in range(world)]
    for process in ranks:
        process.start()
    deadline = time.monotonic() + timeout
    try:
        for process in ranks:
            process.join(timeout=max(0.0, deadline - time.monotonic()))
    finally:
        _end(ranks)
    failed = [(rank, (folder / f"{rank}.err").read_text() if (folder / f"{rank}.err").exists() else
               f"exit {process.exitcode}") for rank, process in enumerate(ranks) if process.exitcode != 0]
    if failed:
        raise AssertionError("\n".join(f"rank {rank}: {why}" for rank, why in failed))
    import torch
    return [torch.load(folder / f"{rank}.pt", weights_only=False) for rank in range(world)]


def _ranked(fn, rank: int, world: int, folder: str, args: tuple) -> None:
    import traceback

    import torch
    import torch.distributed as tdist
    torch.set_num_threads(1)
    try:
        tdist.init_process_group("gloo", init_method=f"file://{folder}/store", rank=rank, world_size=world)
        torch.save(fn(rank, *args), f"{folder}/{rank}.pt")
        tdist.barrier()  # gloo aborts when a peer tears down while the other still reads its socket
        code = 0
    except BaseException:  # noqa: BLE001 - the parent reads it
        Path(folder, f"{rank}.err").write_text(traceback.format_exc())
        code = 1
    # no interpreter teardown: it destroys gloo's threads in no fixed order (dist.leave says why)
    sys.stdout.flush(), sys.stderr.flush()
    os._exit(code)
