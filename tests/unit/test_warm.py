"""The warm rank processes launched tests run on (tests/warm.py): the forkserver a rank is forked from holds no
thread a fork would lose and no state a run would inherit, an environment a fork cannot give launches for real, and
a failing rank is reported with its own traceback."""
from __future__ import annotations

import multiprocessing.forkserver as forkserver
import os

import pytest

from tests import warm

# the forkserver's threads: its own, and pyarrow's jemalloc background thread (imported by datasets), which jemalloc
# itself re-creates after a fork (its pthread_atfork handlers); a thread pool of torch, gloo or tokenizers would be
# lost in every fork and is not allowed
ALLOWED_THREADS = {"python", "jemalloc_bg_thd"}


def _state(rank: int) -> dict:
    import torch
    import torch.distributed as dist
    from deepspeed import comm
    return {"rank": dist.get_rank(), "world": dist.get_world_size(), "threads": torch.get_num_threads(),
            "deepspeed_comm": comm.is_initialized(), "pid": os.getpid()}


def _fails(rank: int) -> None:
    if rank == 1:
        raise ValueError("rank 1 says no")


def test_the_forkserver_holds_only_threads_a_fork_keeps_and_each_fork_starts_fresh():
    first = warm.run_ranks(_state, 2)
    pid = forkserver._forkserver._forkserver_pid
    names = [open(f"/proc/{pid}/task/{t}/comm").read().strip() for t in os.listdir(f"/proc/{pid}/task")]
    assert set(names) <= ALLOWED_THREADS and names.count("python") == 1, names
    second = warm.run_ranks(_state, 2)
    for run in (first, second):  # each launch its own group; DeepSpeed's comm never initialised in the forkserver
        assert [(r["rank"], r["world"], r["threads"], r["deepspeed_comm"]) for r in run] == \
            [(0, 2, 1, False), (1, 2, 1, False)]
    assert {r["pid"] for r in first}.isdisjoint(r["pid"] for r in second)


def _added(rank: int) -> dict:
    from tests import warm_preload
    return warm_preload.ADDED


def test_the_variables_the_imports_set_are_set_in_every_fork():
    """What the forkserver's imports add to its environment is warm._set_by_import (a library that starts setting
    another variable at import is caught here); a launch holding those values, or lacking them, still forks: a
    worker that imported deepspeed itself (test_errors' in-process checks) made every later launch a real one."""
    added = warm.run_ranks(_added, 1)[0]
    started = warm._started_with
    assert added == {k: v for k, v in warm._set_by_import().items() if started.get(k) != v}, added
    assert warm.can_fork({**started, **warm._set_by_import()})
    assert warm.can_fork({k: v for k, v in started.items() if k not in warm._set_by_import()})
    assert warm.can_fork({**started, "TORCHINDUCTOR_CACHE_DIR": "/tmp/another-inductor-cache"})  # read when used
    # set by inductor in the process that loads a compiled kernel, before the kernel reads it: a worker that compiled
    # in-process holds its own pointer from then on
    assert warm.can_fork({**started, "_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR": "140000000000000"})


def test_an_environment_a_fork_cannot_give_launches_for_real():
    # the forkserver's own environment: this worker's may have changed since it started (an in-process test may have
    # set a variable, as dstrain.hub sets HF_HUB_OFFLINE; seen in a fresh clone), and launches then run for real
    base = dict(warm._started_with) if warm._started_with is not None else dict(os.environ)
    assert warm.can_fork(base)
    assert warm.can_fork({**base, "DSTRAIN_FAULT": "step:stall:rank=1:step=5", "WANDB_MODE": "offline",
                          "OMP_NUM_THREADS": "2", "PYTEST_CURRENT_TEST": "another"})  # read when train.py asks
    assert warm.can_fork({**base, "HF_HUB_OFFLINE": "1" if base.get("HF_HUB_OFFLINE") != "1" else "0"})  # _offline
    # glibc's mmap threshold: set in a fork by mallopt (test below), where the forkserver started without it
    assert warm.can_fork({**base, "MALLOC_MMAP_THRESHOLD_": "131072"}) == ("MALLOC_MMAP_THRESHOLD_" not in base)
    for name, value in (("MALLOC_ARENA_MAX", "2"), ("LD_PRELOAD", "x.so"),
                        ("HF_DATASETS_CACHE", "/tmp/elsewhere"), ("TORCH_LOGS", "+dynamo")):
        value = value if base.get(name) != value else value + "0"  # a change, whatever the forkserver started with
        assert not warm.can_fork({**base, name: value}), name  # read at import or at a process's start
        assert warm.unforkable({**base, name: value}) == [name]  # named in the launch log and the suite's report


def test_the_suite_report_counts_warm_launches_run_for_real(tmp_path, capsys):
    """scripts/suite_report.py says how many warm launches ran for real for their environment, and why: a worker's
    changed environment made them silently (test_health's four in a fresh clone, 2026-12-07)."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("suite_report", warm.ROOT / "scripts" / "suite_report.py")
    report = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(report)
    (tmp_path / "launches.log").write_text("warm\ttorchrun\t5.0\ttests/e2e/a.py::t\t\n"
                                           "torchrun\ttorchrun\t9.0\ttests/e2e/b.py::u\tLD_PRELOAD,TORCH_LOGS\n")
    report.machine_speed = lambda: 1.0
    report.main(tmp_path)
    out = capsys.readouterr().out
    assert "warm launches run for real for their environment: 1 (variables LD_PRELOAD, TORCH_LOGS; tests " \
           "tests/e2e/b.py::u)" in out, out
    assert "launches through tests.helpers.launch: torchrun 1, warm 1" in out


# glibc's allocator after a 1 MiB block was freed: is a 256 KiB block then mmapped (a fixed threshold of 128 KiB, as
# MALLOC_MMAP_THRESHOLD_=131072 sets it) or taken from the heap (the dynamic threshold, raised to 1 MiB by the free)?
MMAP_PROBE = """
import ctypes
class Info(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
                                               "uordblks", "fordblks", "keepcost")]
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.free.argtypes, libc.mallinfo2.restype = ctypes.c_void_p, [ctypes.c_void_p], Info
libc.free(libc.malloc(16 << 20))  # glibc's dynamic threshold rises to 16 MiB, unless the variable (or mallopt) fixed it
size = libc.mallinfo2().fordblks + (1 << 20)  # more than the arena's free chunks together: never from one of them
before = libc.mallinfo2().hblks
block = libc.malloc(size)
mmapped = libc.mallinfo2().hblks > before
libc.free(block)
"""
# (a probe of 256 KiB after 1 MiB read False under the variable in a process whose imports (torchvision's) had left
# a free chunk that size in the arena: glibc serves a request from a free chunk before it considers mmap)


def _mmapped(rank: int, environ: dict) -> bool:
    warm._malloc(environ)
    scope = {}
    exec(MMAP_PROBE, scope)
    return scope["mmapped"]


def test_a_fork_allocates_as_a_fresh_process_started_with_the_mmap_threshold():
    """The memory tests set MALLOC_MMAP_THRESHOLD_ (freed tensors leave RSS at once) and run on warm ranks: glibc reads
    it at a process's start, so a fork sets it with mallopt (warm._malloc). A fresh interpreter is the reference."""
    import subprocess
    import sys
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    fresh = {}
    for value in ("", "131072"):
        env = {**clean, **({"MALLOC_MMAP_THRESHOLD_": value} if value else {})}
        fresh[value] = subprocess.run([sys.executable, "-c", MMAP_PROBE + "print(mmapped)"], env=env,
                                      capture_output=True, text=True, check=True).stdout.strip()
    assert fresh == {"": "False", "131072": "True"}  # the probe tells the two apart
    for value in ("", "131072"):
        got = warm.run_ranks(_mmapped, 1, {"MALLOC_MMAP_THRESHOLD_": value} if value else {})[0]
        assert str(got) == fresh[value], value


@pytest.mark.parametrize("switches", [{}, {"HF_HUB_OFFLINE": "1"}, {"TRANSFORMERS_OFFLINE": "yes",
                                                                     "HF_DATASETS_OFFLINE": "0"}])
def test_a_fork_is_offline_exactly_when_a_fresh_process_would_be(switches):
    """huggingface_hub and datasets read their offline switches at import: a fork sets their constants from the
    launch's environment (warm._offline) to what a fresh interpreter's import gives, the reference here."""
    import subprocess
    import sys

    import datasets.config
    import huggingface_hub.constants as hub
    clean = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE",
                                                               "HF_DATASETS_OFFLINE")}
    fresh = subprocess.run([sys.executable, "-c", "import huggingface_hub.constants as h, datasets.config as d; "
                            "print(h.HF_HUB_OFFLINE, d.HF_HUB_OFFLINE, d.HF_DATASETS_OFFLINE)"],
                           env={**clean, **switches}, capture_output=True, text=True, check=True).stdout.split()
    saved = hub.HF_HUB_OFFLINE, datasets.config.HF_HUB_OFFLINE, datasets.config.HF_DATASETS_OFFLINE
    try:
        warm._offline({**clean, **switches})
        got = [str(v) for v in (hub.HF_HUB_OFFLINE, datasets.config.HF_HUB_OFFLINE,
                                datasets.config.HF_DATASETS_OFFLINE)]
    finally:
        hub.HF_HUB_OFFLINE, datasets.config.HF_HUB_OFFLINE, datasets.config.HF_DATASETS_OFFLINE = saved
    assert got == fresh, (switches, got, fresh)


def test_a_failing_rank_is_reported_with_its_traceback():
    with pytest.raises(AssertionError, match=r"rank 1: Traceback[\s\S]*ValueError: rank 1 says no"):
        warm.run_ranks(_fails, 2)


def _import_time_nodes(tree):
    """The nodes of a module that run when it is imported: its statements outside function bodies (class bodies
    included) and every function's default values and decorators."""
    import ast
    stack = list(tree.body)
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            stack += [*node.args.defaults, *[d for d in node.args.kw_defaults if d], *node.decorator_list]
            continue
        if isinstance(node, ast.ClassDef):
            stack += [*node.body, *node.decorator_list, *node.bases]
            continue
        yield node
        stack += [child for child in ast.iter_child_nodes(node) if not isinstance(child, ast.Lambda)]


def test_dstrain_reads_no_environment_variable_when_imported():
    """A warm rank is a fork of a process that imported dstrain before the rank's environment was set: a variable
    read at import is the forkserver's, not the launch's. dstrain/run/faults.py read DSTRAIN_FAULT at import, and in
    warm ranks no injected fault fired (seen: the background-save and health tests failed). Every variable is read
    when asked (dstrain/env.py's functions, os.environ) and nothing at import."""
    import ast

    found = []
    for path in sorted((warm.ROOT / "dstrain").rglob("*.py")):
        if path.name == "env.py":
            continue
        for node in _import_time_nodes(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
                    isinstance(node.func.value, ast.Name) and node.func.value.id == "env":
                found.append(f"{path.relative_to(warm.ROOT)}:{node.lineno}: env.{node.func.attr}()")
            if isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv") and \
                    isinstance(node.value, ast.Name) and node.value.id == "os":
                found.append(f"{path.relative_to(warm.ROOT)}:{node.lineno}: os.{node.attr}")
    assert not found, found
