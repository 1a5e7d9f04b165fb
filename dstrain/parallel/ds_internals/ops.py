"""DeepSpeed's JIT-built C++ ops: whether a build is needed, the build directory's key, one build at a time per
machine, and the flags probed once."""
from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from ... import env


def jit_build_needed(builder) -> bool:
    """True when DeepSpeed's JIT load of this op will compile it: no <name>.so yet where torch's cpp_extension
    builds it (torch.utils.cpp_extension._get_build_directory; a stale one is rebuilt silently, not counted)."""
    from torch.utils.cpp_extension import _get_build_directory

    return not (Path(_get_build_directory(builder.name, False)) / f"{builder.name}.so").exists()


def jit_build_key(builder) -> str:
    """A digest of everything that goes into the op's build.ninja (sources, include paths, compiler and linker
    flags, the torch and Python it builds against, the compiler). torch keeps one build directory per op name
    and rebuilds, silently, whenever the flags differ from the last build: two environments sharing
    ~/.cache/torch_extensions (two venvs or checkouts, launchers that set different variables) rebuilt the
    shm_comm op back and forth, 25-73 s per run (issue 29). Keyed by this digest, each variant is built once.
    The ninja torch runs (the first on PATH) is part of it: pip's ninja (1.13 in .venv/bin) and Debian's (1.11) hash
    a build's commands differently in .ninja_log, so runs with and without the venv on PATH (a sweep's trials, then
    its printed `torchrun` command) rebuilt the op each time they alternated: 23 s a run here."""
    import shutil
    import sysconfig

    def _safe(call):
        try:
            return builder.strip_empty_entries(call())
        except Exception as error:  # noqa: BLE001 - e.g. the oneCCL builder raises without CCL_ROOT
            return f"unavailable: {type(error).__name__}"

    import deepspeed
    parts = [builder.name, deepspeed.__version__, torch.__version__, str(Path(torch.__file__).parent),
             sysconfig.get_paths().get("include", ""), env.compiler(), shutil.which("ninja"),
             [os.path.abspath(builder.deepspeed_src_path(p)) for p in _safe(builder.sources) or []],
             [os.path.abspath(builder.deepspeed_src_path(p)) for p in _safe(builder.include_paths) or []],
             _safe(builder.cxx_args), _safe(builder.extra_ldflags)]
    return hashlib.sha256(json.dumps(parts, default=str).encode()).hexdigest()[:12]


def jit_build_dir_root(builder) -> Path:
    """TORCH_EXTENSIONS_DIR for one op: <torch extensions dir>/<op>-<jit_build_key>."""
    return env.torch_extensions_dir() / f"{builder.name}-{jit_build_key(builder)}"


def announce_jit_builds(say: Callable[[str], None]) -> None:
    """Every JIT load of a DeepSpeed op (OpBuilder.jit_load) builds in a directory keyed by its build inputs
    (jit_build_key), and one line is said before it compiles: the first run on a machine otherwise sat silent
    for 1-3 minutes of gcc (shm_comm at process-group start, cpu_adam with offload). Install it on every rank
    (they must agree on the directory). Ranks take turns (build_turn): the one that builds says so, the others
    find the op built; whichever finds a dead build's lock file says it removed it."""
    from deepspeed.ops.op_builder.builder import OpBuilder

    if getattr(OpBuilder.jit_load, "dstrain_announces", False):
        OpBuilder.jit_load.dstrain_say[0] = say
        return
    original = OpBuilder.jit_load
    said = [say]

    def jit_load(self, verbose=True):
        from torch.utils.cpp_extension import _get_build_directory

        settle_flags(self)
        with cuda_arch_list_deepspeed_parses():
            root = jit_build_dir_root(self)
            with env.overridden("TORCH_EXTENSIONS_DIR", str(root)):  # torch builds in <root>/<op name>
                with build_turn(Path(_get_build_directory(self.name, False))) as stale:
                    if stale:
                        said[0](f"removed {stale}: a build or load of DeepSpeed's {self.name} op was cut short "
                                f"there (its process is gone), and torch would have waited for it forever")
                    if jit_build_needed(self):
                        said[0](f"building DeepSpeed's {self.name} op with the compiler into {root}: once per "
                                f"machine and build setting, 1-3 minutes (`make setup` builds them ahead)")
                    return original(self, verbose)
    jit_load.dstrain_announces = True
    jit_load.dstrain_say = said
    OpBuilder.jit_load = jit_load


@contextmanager
def build_turn(build_dir: Path) -> Iterator[Path | None]:
    """This process's turn at torch's JIT build (and load) of one op in build_dir; yields the path of a dead
    process's lock file it removed, else None.

    torch's cpp_extension guards every JIT build *and* load with a lock file (FileBaton: <build_dir>/lock, made on
    entry, removed on exit) and, while one exists, waits for it forever without a word. A process killed inside
    (SIGKILL, or a launcher's SIGTERM before train.py's handler is installed: `kill` or Ctrl-C during a first run's
    1-3 minute build) leaves it, and every later run on the machine hung at start: seen on an H100, where ZeRO++'s
    quantizer build was cut short and the next launch sat silent until its 230 s limit. The file names no owner,
    so every process of ours takes a kernel lock (flock) on a file beside it first. The kernel drops a flock when
    its holder dies, however it died: a lock file found while holding the flock is a dead process's. Written by
    hand: torch has no owner-aware lock for its extension builds (its FileBaton is the lock-file protocol above).
    The price: the ranks of a node now load a built op one after another, each running torch's up-to-date check
    (ninja) that waiting on torch's file used to skip: a 3-step 2-rank CPU run took 16.2 s against 15.6 s
    (measured twice each, 2026-11-27). Holding the kernel lock shared for loads and exclusive for builds would
    win it back, if a loader waiting inside torch's protocol can be told from a dead builder."""
    import fcntl

    build_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(build_dir.parent / f".{build_dir.name}.dstrain-turn", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)  # other ranks of this node wait here while one builds, as on torch's file
            locked = True
        except OSError:  # a file system without locks (NFS mounted nolock: ENOLCK): torch's own protocol alone
            locked = False
        lock, stale = build_dir / "lock", None
        if locked and lock.exists():
            lock.unlink(missing_ok=True)
            stale = lock
        yield stale
    finally:
        os.close(fd)  # releases the flock


CPU_INFO_CACHE = "cpu_info.json"


def cpu_info_key() -> str:
    """What py-cpuinfo's answer depends on: the processor's identity and flags as the kernel lists them (not its
    current clock), the core count and py-cpuinfo's version."""
    import platform

    import cpuinfo

    kept = ("vendor_id", "cpu family", "model", "model name", "stepping", "flags", "Features", "CPU implementer",
            "CPU part")
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        text = ""
    first = text.split("\n\n", 1)[0].splitlines()
    lines = [line for line in first if line.split(":", 1)[0].strip() in kept]
    parts = [platform.machine(), os.cpu_count(), getattr(cpuinfo, "CPUINFO_VERSION_STRING", ""), *lines]
    return hashlib.sha256(json.dumps(parts).encode()).hexdigest()[:16]


def remember_cpu_info() -> None:
    """py-cpuinfo's get_cpu_info, answered once per machine. DeepSpeed calls it from its CPU op builders (cpu_arch
    and simd_width, each JIT load) and from DeepSpeedCPUAdam's constructor; every call starts a Python process that
    times the clock by spinning: 1.2 CPU-seconds a call here (measured), three per rank of every offload run, as
    many as there are ranks at once. The answer (what DeepSpeed reads of it: the flags, the architecture, the vendor)
    is the machine's: kept in the cache root per cpu_info_key, read by every later call in any process. Written by
    hand: py-cpuinfo keeps no cache of its own."""
    import functools

    import cpuinfo

    if getattr(cpuinfo.get_cpu_info, "dstrain_remembers", False):
        return
    measure = cpuinfo.get_cpu_info

    @functools.cache
    def get_cpu_info() -> dict:
        path = env.cache_root() / CPU_INFO_CACHE
        key = cpu_info_key()
        try:
            known = json.loads(path.read_text())
        except (OSError, ValueError):
            known = {}
        if isinstance(known.get(key), dict):
            return known[key]
        info = measure()
        try:  # another process may write at the same moment: each writes a whole file, the last one stays
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f".{path.name}.{os.getpid()}")
            tmp.write_text(json.dumps({**known, key: info}, default=str))
            tmp.replace(path)
        except OSError:
            pass  # a read-only cache: measured again next time, as without this
        return info

    get_cpu_info.dstrain_remembers = True
    cpuinfo.get_cpu_info = get_cpu_info


def settle_flags(builder) -> None:
    """The op's compiler flags, computed once for this builder. DeepSpeed's CPU builders probe the CPU (py-cpuinfo)
    in every cxx_args() call, 2.3 s each here (CPUAdam, AsyncIO), and a JIT load asked twice: the build key, then
    DeepSpeed's own build; every rank of an offload run paid it. And the CPU ops are built without -g: the AsyncIO
    op (NVMe offload) compiles its 12 files with -g at -O0, 175 s of `make setup` on 2 cores, 119 s without; CPUAdam's
    two files at -O3 took 92 CPU-s with -g, 70 without (measured, 2026-12-07). Debug info changes no generated code
    (GCC's -g), and the flags are part of the build key (jit_build_key), so such a build has its own directory."""
    if "cxx_args" in vars(builder):
        return
    flags = builder.cxx_args()
    if builder.name in ("async_io", "cpu_adam"):
        flags = [flag for flag in flags if flag != "-g"]
    builder.cxx_args = lambda: list(flags)


@contextmanager
def cuda_arch_list_deepspeed_parses() -> Iterator[None]:
    """TORCH_CUDA_ARCH_LIST without the 9.0a-style suffixes CUDAOpBuilder.compute_capability_args cannot parse
    (env.deepspeed_cuda_arch_list), for one JIT build."""
    arch = env.deepspeed_cuda_arch_list()
    if arch is None:
        yield
        return
    with env.overridden("TORCH_CUDA_ARCH_LIST", arch):
        yield
