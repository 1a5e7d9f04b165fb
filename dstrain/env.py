"""Every environment variable dstrain reads, read here and nowhere else (docs/reference/environment.md is
generated from DOCUMENTED).

Launchers (deepspeed, torchrun, srun via launch/, accelerate) set the rank variables; users set the rest.
Writing os.environ elsewhere is fine (dist.init fills in a world of one for plain `python train.py`).
"""
from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

# name -> what it means; docs/reference/environment.md's table is generated from it (scripts/gen_reference_docs.py)
DOCUMENTED = {
    "RANK": "this process's global rank (set by the launcher; 0 when absent)",
    "LOCAL_RANK": "this process's rank on its node (set by the launcher)",
    "WORLD_SIZE": "number of ranks (set by the launcher; 1 when absent)",
    "LOCAL_WORLD_SIZE": "ranks on this node (torchrun); LOCAL_SIZE is the deepspeed launcher's name for it",
    "LOCAL_SIZE": "ranks on this node (the deepspeed launcher)",
    "MASTER_ADDR": "address of the rendezvous store (rank 0's host)",
    "MASTER_PORT": "port of the rendezvous store",
    "TORCHELASTIC_RESTART_COUNT": "torchrun's restart counter: keeps the watchdog's keys apart across restarts when "
                                  "the ranks' store is the agent's (which outlives restarts)",
    "TORCHELASTIC_USE_AGENT_STORE": "set by torchrun: True when the ranks' store is the agent's (it outlives "
                                    "restarts); False under launch/elastic.sh, where each rendezvous round starts a "
                                    "new store",
    "ACCELERATE_DEEPSPEED_CONFIG_FILE": "the DeepSpeed JSON under `accelerate launch` (when --ds_config is absent)",
    "DSTRAIN_CACHE": "where tokenized datasets are cached (default ~/.cache/dstrain)",
    "DSTRAIN_FAULT": "failure injection for the fault-tolerance tests (dstrain/run/faults.py); unset in real runs",
    "WANDB_API_KEY": "with log.wandb=true: log online; without it wandb writes offline runs into the run dir",
    "TORCH_EXTENSIONS_DIR": "where DeepSpeed's JIT-built ops live, one directory per op and build setting "
                            "(`<op>-<key>`: two environments never rebuild each other's op); stale build locks there "
                            "are cleared at start",
    "OMP_NUM_THREADS": "threads per CPU rank; when unset, ranks sharing a node split its cores (DeepSpeed's launcher "
                       "leaves it unset, and 2 ranks x all cores each ran matmuls 5-10x slower)",
    "TORCH_CUDA_ARCH_LIST": "the GPU architectures DeepSpeed's JIT-built CUDA ops are compiled for (default: the "
                            "visible GPUs'); a Hopper/Blackwell suffix (9.0a, 10.0f) is dropped for those builds, "
                            "which DeepSpeed 0.19 cannot parse",
    "CXX": "the C++ compiler DeepSpeed's JIT-built ops are compiled with (part of their build directory's key)",
    "MALLOC_MMAP_THRESHOLD_": "glibc's, read only to label memory.json on CPU ranks: set (e.g. 131072), freed tensors "
                              "leave RSS at once and the peak is the live memory, at 1.5x slower steps; unset (the "
                              "launch scripts' default) the peak includes glibc's reusable heap (docs/planning.md)",
    "CUDA_VISIBLE_DEVICES": "the GPUs a sweep worker (`python -m dstrain.sweep`) shares among its trials, each trial "
                            "given its own `ranks_per_trial` of them (default: every GPU `nvidia-smi -L` lists)",
    "SLURM_ARRAY_TASK_ID": "prepare_data in a SLURM array job: this task's id (it writes its share of the shards)",
    "SLURM_ARRAY_TASK_COUNT": "prepare_data in a SLURM array job: how many tasks share the shards",
    "SLURM_ARRAY_TASK_MIN": "prepare_data in a SLURM array job: the first task id (0 when absent)",
    "DSTRAIN_ELASTIC": "set to 1 by `python -m dstrain.run.elastic_run` (launch/elastic.sh): a world the DeepSpeed "
                       "config or the checkpoint cannot use is fitted (the largest usable subset trains, the other "
                       "ranks stand by) instead of refused; set it yourself under a bare elastic `torchrun`",
    "HF_ENDPOINT": "the Hugging Face Hub's address (default https://huggingface.co): probed once before a Hub id is "
                   "loaded; unreachable, the run goes offline (cached files only) instead of retrying",
    "HF_HUB_OFFLINE": "huggingface_hub's offline mode; set by dstrain for its own processes when the Hub is "
                      "unreachable",
    "DSTRAIN_EXIT_BARRIER_TIMEOUT": "`python -m dstrain.run.elastic_run` (launch/elastic.sh): seconds torch's elastic "
                                    "agent waits at the end for the other agents, which may be gone (default 30; "
                                    "torchrun's own is 300)",
}


def _get(name: str, default: str = "") -> str:
    assert name in DOCUMENTED, f"{name} is read but not documented in dstrain/env.py"
    return os.environ.get(name, default)


def rank() -> int:
    return int(_get("RANK", "0"))


def local_rank() -> int:
    return int(_get("LOCAL_RANK", "0"))


def world_size(default: int = 1) -> int:
    return int(_get("WORLD_SIZE") or default)


def elastic_restart() -> int:
    """How many times torchrun's agent has restarted its ranks (0 outside torchrun)."""
    return int(_get("TORCHELASTIC_RESTART_COUNT") or 0)


def elastic() -> bool:
    return _get("DSTRAIN_ELASTIC") == "1"


def exit_barrier_timeout() -> float:
    return float(_get("DSTRAIN_EXIT_BARRIER_TIMEOUT") or 30)


def launched() -> bool:
    """True under a launcher (RANK set); False for a plain `python train.py`."""
    return "RANK" in os.environ


def ranks_per_node() -> int:
    """Ranks on this node (torchrun: LOCAL_WORLD_SIZE, the deepspeed launcher: LOCAL_SIZE)."""
    return int(_get("LOCAL_WORLD_SIZE") or _get("LOCAL_SIZE") or 1)


def master() -> tuple[str, str]:
    """(MASTER_ADDR, MASTER_PORT) as strings, '' where unset."""
    return _get("MASTER_ADDR"), _get("MASTER_PORT")


def restart_count() -> str:
    return _get("TORCHELASTIC_RESTART_COUNT", "0")


def store_generation() -> str:
    """What keeps one attempt's store keys apart from an earlier attempt's in the same store: torchrun's restart
    count where the store is its agent's (it outlives restarts, and every agent of a static job restarts
    together). Not otherwise: each agent counts its own restarts, so in an elastic round an agent that joined
    late (count 0) and one that has restarted twice disagree, and the ranks' watchdogs never saw each other's
    keys (each waited fault.peer_timeout at the end); there each round has a new store anyway."""
    return restart_count() if _get("TORCHELASTIC_USE_AGENT_STORE") == "True" else "0"


def accelerate_ds_config() -> str | None:
    return _get("ACCELERATE_DEEPSPEED_CONFIG_FILE") or None


def cache_root() -> Path:
    return Path(_get("DSTRAIN_CACHE") or Path.home() / ".cache" / "dstrain")


def fault_spec() -> str:
    return _get("DSTRAIN_FAULT")


def wandb_online() -> bool:
    return bool(_get("WANDB_API_KEY"))


def visible_gpus() -> list[str] | None:
    """CUDA_VISIBLE_DEVICES as a list, or None when it is not set."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return None if visible is None else [d.strip() for d in visible.split(",") if d.strip()]


def omp_threads() -> str:
    return _get("OMP_NUM_THREADS")


def compiler() -> str:
    return _get("CXX", "c++")


def hub_endpoint() -> str:
    return _get("HF_ENDPOINT") or "https://huggingface.co"


def malloc_mmap_threshold() -> str:
    return _get("MALLOC_MMAP_THRESHOLD_")


def export(name: str, value: str) -> None:
    """os.environ[name] = value, for this process and the ones it starts."""
    assert name in DOCUMENTED, f"{name} is set but not documented in dstrain/env.py"
    os.environ[name] = value


@contextmanager
def overridden(name: str, value: str) -> Iterator[None]:
    """os.environ[name] = value inside the block, restored (or removed) after it."""
    assert name in DOCUMENTED, f"{name} is set but not documented in dstrain/env.py"
    saved = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = saved


def deepspeed_cuda_arch_list() -> str | None:
    """TORCH_CUDA_ARCH_LIST without architecture-specific suffixes ("9.0a;10.0f+PTX" -> "9.0;10.0+PTX"), or None
    when it has none. DeepSpeed 0.19's CUDA op builders parse each entry as digits and raised ValueError on "9.0a",
    the value CUDA images for Hopper set (seen on an H200 image): every run with a fused op failed at start."""
    import re

    value = _get("TORCH_CUDA_ARCH_LIST")
    if not value:
        return None
    stripped = re.sub(r"(\d+\.\d+)[a-z]+", r"\1", value)
    return stripped if stripped != value else None


def torch_extensions_dir() -> Path:
    return Path(_get("TORCH_EXTENSIONS_DIR") or Path.home() / ".cache" / "torch_extensions")


def array_task() -> tuple[int, int] | None:
    """(this task's index from 0, task count) inside a SLURM array job, else None."""
    if not (_get("SLURM_ARRAY_TASK_ID") and _get("SLURM_ARRAY_TASK_COUNT")):
        return None
    first = int(_get("SLURM_ARRAY_TASK_MIN", "0"))
    return int(_get("SLURM_ARRAY_TASK_ID")) - first, int(_get("SLURM_ARRAY_TASK_COUNT"))
