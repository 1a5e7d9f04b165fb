"""Every use of a private (underscore or undocumented) DeepSpeed, torch or datasets API, in one place.

Each function names what it reaches into; tests/unit/test_ds_internals.py checks each against the installed
versions and fails with a sentence naming the version when an internal moved. Public APIs are used
wherever one exists (engine.data_parallel_group for the data-parallel group, for example).
Supported range: deepspeed 0.19.8 - 0.19.x, torch 2.4 - 2.13, datasets 5.x (requirements.txt).
"""
from __future__ import annotations

import functools
import hashlib
import json
import math
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import torch

from .. import env


def consolidated_16bit_state_dict(engine) -> dict:
    """The full 16-bit weights, gathered: every rank must call it; rank 0 receives the dict. No public API
    returns it (save_16bit_model writes a file instead). DeepSpeedEngine._consolidated_16bit_state_dict."""
    return engine._consolidated_16bit_state_dict()


def model_parallel_unit(layout):
    """What deepspeed.initialize takes as `mpu`: DeepSpeed's group registry for AutoTP runs, Ulysses' sequence-
    parallel state for sequence parallelism (its groups made by register_with_transformers, see
    components/sequence_parallel.py), DiLoCo's replica groups, else None (the pipeline engine brings its own
    topology)."""
    if layout.replicas > 1:
        unit = ReplicaUnit(layout)
        if layout.is_pipeline:  # the pipeline engine's mpu is its module's grid (pipeline_in_replicas)
            return None
        if layout.tensor_parallel > 1:
            use_replica_groups_for_tensor_parallel(unit)
        if layout.sequence_parallel > 1:  # Ulysses' state is the mpu; ZeRO's group (dp x sp) is the replica's
            return UlyssesInReplicas(unit)
        return unit
    if layout.sequence_parallel > 1:
        return sequence_parallel_state()
    return init_tensor_parallel_groups(layout.tensor_parallel) if layout.tensor_parallel > 1 else None


def sequence_parallel_state():
    """DeepSpeed's Ulysses group module (public module, module-level state): what `mpu` is for sequence parallelism."""
    import deepspeed.runtime.sequence_parallel.parallel_state_sp as state
    return state


def init_tensor_parallel_groups(tensor_parallel: int):
    """DeepSpeed's process-group registry with AutoTP groups made, passed to deepspeed.initialize as `mpu` so
    its batch arithmetic counts data-parallel replicas. deepspeed.utils.groups._init_tp_mesh_device: the
    mesh (data_parallel, tensor_parallel), row-major, which dstrain.parallel.layout's rank formula follows."""
    from deepspeed.utils import groups
    groups._init_tp_mesh_device(tensor_model_parallel_size=tensor_parallel)
    return groups


_REPLICA_UNIT = None  # the ReplicaUnit model_parallel_unit made (one engine a process)


def replica_unit():
    """DiLoCo's replica groups: the ReplicaUnit that model_parallel_unit made. It is the engine's mpu only without
    model parallelism: AutoTP sets engine.mpu to DeepSpeed's groups module (given the unit's groups), and under
    Ulysses the mpu is UlyssesInReplicas (Ulysses' state with the unit's replica group)."""
    return _REPLICA_UNIT


def use_replica_groups_for_tensor_parallel(unit) -> None:
    """AutoTP inside DiLoCo replicas. DeepSpeed's engine replaces the mpu with its own groups module and builds a
    (data, tensor) mesh over the whole world, whose data-parallel groups would average gradients across replicas.
    Its registry's private globals are set to the replica's groups first (deepspeed.utils.groups
    _TENSOR_MODEL_PARALLEL_GROUP, _MODEL_PARALLEL_GROUP, _DATA_PARALLEL_GROUP: _init_tp_mesh_device returns early
    when the tensor group exists): tensor-parallel groups of consecutive ranks, as its mesh makes them, and
    data-parallel groups of the replica's ranks with the same tensor-parallel rank."""
    from deepspeed.utils import groups

    groups._TENSOR_MODEL_PARALLEL_GROUP = groups._MODEL_PARALLEL_GROUP = unit.tensor_group
    groups._DATA_PARALLEL_GROUP = unit.replica_group


def pipeline_in_replicas(replicas: int):
    """Pipeline stages inside DiLoCo replicas: (the PipelineModule class, the topology) to build the module with.
    DeepSpeed's pipeline topology has axes [pipe, data] over the whole world (rank = stage x dp + dp_rank): a
    replica of consecutive ranks would hold one stage, and every data-parallel group would span the replicas. A
    topology with axes [replica, pipe, data] makes the grid's (runtime/pipe/topology.PipelineParallelGrid)
    data-parallel and pipe groups stay inside a replica. Three things of the grid and module assume two axes and
    are set here (private: runtime/pipe/module.py and topology.py of DeepSpeed 0.19):
    - the grid's model-parallel group (ds_model_proc_group, _world_size, _rank), over which gradient norms and
      overflow are reduced and which names the checkpoint files, is made of the ranks with this rank's data index:
      every replica's stages. It is set to this replica's pipe group (what it is under two axes).
    - PipelineModule._index_tied_modules makes the tied layers' groups (the embedding on the first and last stage)
      from stage_to_global, which keeps this rank's replica: each replica would create different groups in the same
      new_group call. It is run once per replica, every rank creating every replica's groups.
    - the layer files' names (topology.get_rank_repr) leave the replica out, as they leave the data index out: each
      replica saves under its own tag, and a replica that joins loads another's files."""
    from deepspeed.pipe import PipelineModule
    from deepspeed.runtime.pipe.topology import ProcessTopology

    class ReplicaPipeTopology(ProcessTopology):
        def __init__(self, stages: int, data: int):
            super().__init__(axes=["replica", "pipe", "data"], dims=[replicas, stages, data])

        def get_rank_repr(self, rank, omit_axes=("data", "pipe"), inner_sep="_", outer_sep="-"):
            return super().get_rank_repr(rank, [*omit_axes, "replica"], inner_sep, outer_sep)

    class PipelineInReplicas(PipelineModule):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            grid = self._grid
            grid.ds_model_proc_group, grid.ds_model_world_size = grid.pp_proc_group, grid.pipe_parallel_size
            grid.ds_model_rank = grid.stage_id

        def _index_tied_modules(self):
            grid, comms, mine = self._grid, {}, self._grid.stage_to_global
            try:
                for k in range(replicas):
                    grid.stage_to_global = functools.partial(mine, replica=k)
                    comms.update(super()._index_tied_modules())  # only this rank's replica has its tied layers
            finally:
                del grid.stage_to_global  # the class's method again
            return comms

    return PipelineInReplicas, ReplicaPipeTopology


class UlyssesInReplicas:
    """Ulysses inside DiLoCo replicas: what deepspeed.initialize takes as `mpu`. Ulysses' state module
    (parallel_state_sp) made its sequence-data-parallel group, over which ZeRO partitions and averages, over the
    whole world; its private global _SEQUENCE_DATA_PARALLEL_GROUP is set to the replica's ranks (its
    sequence-parallel groups, consecutive ranks, are inside a replica already). Everything else is the module's,
    so DeepSpeed still sees Ulysses' state (initialize_sequence_parallel), except two methods DeepSpeed asks an mpu
    for only when it has them: get_data_parallel_world_size (DeepSpeedConfig's batch arithmetic, runtime/config.py,
    otherwise the whole world over sp: every replica's ranks) and get_data_parallel_group (below)."""

    def __init__(self, unit):
        self.unit, self.state = unit, sequence_parallel_state()
        self.state._SEQUENCE_DATA_PARALLEL_GROUP = unit.replica_group

    def __getattr__(self, name):
        return getattr(self.state, name)

    def get_data_parallel_world_size(self) -> int:
        return self.unit.layout.replica_data_parallel

    def get_data_parallel_group(self):
        """ZeRO-3 partitions a model built whole over this group (runtime/zero/parameter_offload.py asks an mpu that
        has it; Ulysses' module has not, and the world group is taken: every replica's ranks)."""
        return self.unit.replica_group


class ReplicaUnit:
    """DiLoCo's `mpu`: DeepSpeed's data-parallel group is this rank's replica (world / replicas consecutive ranks;
    under AutoTP, the replica's ranks with this rank's tensor-parallel rank), so its gradient averaging, ZeRO
    partitions, clipping norm and checkpoint file names stay inside the replica. The methods are the ones DeepSpeed
    0.19 calls on an mpu (deepspeed/utils/groups.py, runtime/engine.py, runtime/utils.py). `across` is the group of
    the ranks that hold the same position in every replica: where the outer step's pseudo-gradients are
    averaged."""

    def __init__(self, layout):
        global _REPLICA_UNIT
        dist = torch.distributed
        size, tp, self.layout = layout.replica_size, layout.tensor_parallel, layout
        self.replica_group = self.across = None
        self.replica_ranks: list[int] = []
        for k in range(layout.replicas):  # every rank creates every group, in the same order
            same = {}  # the replica's ranks by (pipeline stage, tensor-parallel rank): its data-parallel groups
            for r in range(k * size, (k + 1) * size):
                at = replace(layout, rank=r)
                same.setdefault((at.pipeline_stage, at.tensor_parallel_rank), []).append(r)
            for ranks in same.values():
                group = dist.new_group(ranks)
                if layout.rank in ranks:
                    self.replica_group, self.replica_ranks = group, ranks
        for i in range(size):
            group = dist.new_group(list(range(i, layout.world_size, size)))
            if layout.rank % size == i:
                self.across = group
        self.tensor_group = None
        if tp > 1:  # AutoTP's groups: tp consecutive ranks (inside one replica: tp divides its size)
            for first in range(0, layout.world_size, tp):
                group = dist.new_group(list(range(first, first + tp)))
                if first <= layout.rank < first + tp:
                    self.tensor_group = group
        # no model parallelism: a group of this rank alone, made by it alone (not world-size groups by every rank)
        self.single = dist.new_group([layout.rank], use_local_synchronization=True)
        _REPLICA_UNIT = self

    def get_data_parallel_group(self):
        return self.replica_group

    def get_data_parallel_world_size(self) -> int:
        return len(self.replica_ranks)

    def get_data_parallel_rank(self) -> int:
        return self.replica_ranks.index(self.layout.rank)

    def get_data_parallel_group_ranks(self) -> list[int]:
        return list(self.replica_ranks)

    def get_model_parallel_group(self):
        return self.single

    def get_model_parallel_world_size(self) -> int:
        return 1

    def get_model_parallel_rank(self) -> int:
        return 0


def data_parallel_rank(engine) -> int:
    """DeepSpeed's own idea of this rank's data-parallel index (public: the engine's group)."""
    return torch.distributed.get_rank(group=engine.data_parallel_group) if torch.distributed.is_initialized() else 0


def bind_groups(engine, layout):
    """The layout with DeepSpeed's data-parallel group bound. A bug, not a user error, when dstrain.parallel.layout's
    rank arithmetic and DeepSpeed's groups disagree: the data would be split differently from the gradients.
    Under Ulysses DeepSpeed has no data-parallel group of its own (engine.data_parallel_group is None: ZeRO runs
    over the sequence-data-parallel group, dp x sp): its sequence-parallel rank and group size are checked."""
    if layout.sequence_parallel > 1:
        state = sequence_parallel_state()
        sp = state.get_sequence_parallel_world_size()
        theirs = (sp, state.get_sequence_parallel_rank(),
                  torch.distributed.get_rank(group=state.get_sequence_data_parallel_group()) // sp)
        ours = (layout.sequence_parallel, layout.sequence_parallel_rank, layout.engine_data_parallel_rank)
        if theirs != ours:
            raise RuntimeError(f"rank {layout.rank}: DeepSpeed's sequence-parallel groups give {theirs} but dstrain."
                               f"layout computed {ours} (size, rank, data-parallel rank) for {layout.describe()}")
        # DiLoCo: a replica's gradient is normalised by its own label tokens, counted over its ranks (dp x sp)
        group = state.get_sequence_data_parallel_group() if layout.replicas > 1 else None
        return replace(layout, gradient_divisor=sequence_parallel_gradient_divisor(engine, layout),
                       data_parallel_group=group)
    theirs = data_parallel_rank(engine)
    if theirs != layout.engine_data_parallel_rank:
        raise RuntimeError(f"rank {layout.rank}: DeepSpeed's data-parallel rank is {theirs} but "
                           f"dstrain.parallel.layout computed {layout.engine_data_parallel_rank} for "
                           f"{layout.describe()}")
    return replace(layout, data_parallel_group=engine.data_parallel_group)


def sequence_parallel_gradient_divisor(engine, layout) -> int:
    """What DeepSpeed 0.19 divides summed gradients by under Ulysses. The sp ranks hold disjoint parts of one
    loss, so their gradients must be summed: ZeRO-0/1/2 divide by dp x sp / sp = dp. ZeRO-3's reduce-scatter
    (runtime/comm/coalesced_collectives.reduce_scatter_coalesced) pre-divides by its whole group, dp x sp:
    measured as a pre-clip gradient norm of exactly 1/sp of the reference's (tests/e2e/test_sequence_parallel.py).
    Its other path (reduce_scatter false, a bucket within reduce_bucket_size) divides by dp, so the sequence-
    parallel component requires reduce_scatter on under ZeRO-3 and every bucket takes the first. train_step's
    loss scale makes up for the divisor. A ring's ranks are data-parallel ones to DeepSpeed: they count in both."""
    if engine.zero_optimization_stage() == 3:
        if not engine.zero_reduce_scatter():
            raise RuntimeError("sequence parallelism under ZeRO-3 needs reduce_scatter (components/sequence_parallel)")
        return layout.replica_data_parallel * layout.context_parallel * layout.sequence_parallel
    # DiLoCo: a replica's ranks (the whole world without it)
    return layout.replica_data_parallel * layout.context_parallel


def engine_config(engine):
    """The parsed DeepSpeedConfig the engine runs with (flops profiler switches). DeepSpeedEngine._config."""
    return engine._config


def profile_one_step(engine, wall_clock_breakdown: bool = False) -> None:
    """Once on, DeepSpeed's flops profiler also turns on wall_clock_breakdown (step timers printed every step);
    after the profiled step, turn both back to what the config asked so the rest of the run is as fast and
    quiet. No public switch exists: the engine's _config and its EngineTimers are replaced after that step."""
    from deepspeed.runtime.engine import EngineTimers

    config, step = engine_config(engine), engine.step

    def step_then_maybe_stop(*args, **kwargs):
        result = step(*args, **kwargs)
        if config.flops_profiler_config.enabled and engine.global_steps > config.flops_profiler_config.profile_step:
            config.flops_profiler_config.enabled = False
            config.wall_clock_breakdown = wall_clock_breakdown
            engine.engine_timers = EngineTimers(wall_clock_breakdown, wall_clock_breakdown)
        return result

    engine.step = step_then_maybe_stop


def record_fp32_grad_norm(engine) -> None:
    """Without ZeRO and without bf16/fp16, DeepSpeedEngine._take_model_step clips through
    engine.clip_fp32_gradients(), which drops the pre-clip norm that deepspeed.runtime.utils.clip_grad_norm_
    returns, so get_global_grad_norm() stays None. Keep it in engine._global_grad_norm, where every other path
    leaves its norm (the log compares it with the reference's: a gradient scale bug shows only there)."""
    from deepspeed.runtime.utils import clip_grad_norm_

    def clip_fp32_gradients():
        norm = clip_grad_norm_(parameters=engine.module.parameters(), max_norm=engine.gradient_clipping(),
                               mpu=engine.mpu)
        engine._global_grad_norm = float(norm)
    engine.clip_fp32_gradients = clip_fp32_gradients


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


def settle_flags(builder) -> None:
    """The op's compiler flags, computed once for this builder. DeepSpeed's CPU builders probe the CPU (py-cpuinfo)
    in every cxx_args() call, 2.3 s each here (CPUAdam, AsyncIO), and a JIT load asked twice: the build key, then
    DeepSpeed's own build; every rank of an offload run paid it. The AsyncIO op (NVMe offload) compiles its 12
    files with -g at -O0: 175 s of `make setup` on 2 cores, 119 s without -g (measured); debug info changes no code,
    and the flags are part of the build key (jit_build_key), so that build has its own directory."""
    if "cxx_args" in vars(builder):
        return
    flags = builder.cxx_args()
    if builder.name == "async_io":
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


@contextmanager
def universal_load_repairs(engine, universal: bool, folder: Path | None = None) -> Iterator[None]:
    """Around engine.load_checkpoint of a universal checkpoint (`folder`), mend two slips of DeepSpeed's ZeRO-3
    universal loader: every param group gets group 0's hyperparameters (each group's own restored here: its saved
    ones from the folder's zero/optimizer_state.pt when it has them, else its weight decay as built), and one `step`
    tensor is shared by all sub-groups, each adding 1 (cloned here). A Muon checkpoint's momentum is put where
    DeepSpeed's Muon keeps it (muon_universal_load)."""
    groups = getattr(engine.optimizer, "optimizer", engine.optimizer).param_groups
    decays = [group.get("weight_decay") for group in groups]
    yield
    if not universal:
        return
    saved = None
    if folder is not None and (folder / "zero" / "optimizer_state.pt").is_file():
        saved = torch.load(folder / "zero" / "optimizer_state.pt", weights_only=False).get("param_groups")
    for index, (group, decay) in enumerate(zip(groups, decays)):
        if saved and len(saved) == len(groups):  # the hyperparameters this group was saved with (Muon's differ)
            group.update({key: value for key, value in saved[index].items() if key != "params"})
        else:
            group["weight_decay"] = decay
    inner = getattr(engine.optimizer, "optimizer", engine.optimizer)
    for state in inner.state.values():
        if torch.is_tensor(state.get("step")):
            state["step"] = state["step"].clone()
    if folder is not None:
        muon_universal_load(engine, folder)


_MODEL_STATES = ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_model_states.pt")


def universal_for_any_stage(folder: Path) -> None:
    """Make a universal folder (ds_to_universal's output) loadable under every ZeRO stage, not only its source's.
    DeepSpeed 0.19.8 writes two things in the source stage's own form:
      - the model-states file, from which the universal loader reads only step counters, the LR schedule and the
        client state (the weights come from zero/): ZeRO-0/1/2 look for mp_rank_00_..., ZeRO-3 for
        zero_pp_rank_0_mp_rank_00_..., so a folder from another stage is found by neither (an empty AssertionError
        in state_dict_factory). Both names are given here, hard links to one file;
      - zero/optimizer_state.pt: ZeRO-1/2's loader reads its top-level `param_groups` and `ds_version`, ZeRO-3's its
        nested `optimizer_state_dict` ('state'[0]['step'], 'param_groups'; KeyError otherwise). Each form is
        completed with the other's keys, the step from the parameters' own step.pt;
      - each parameter's state: from ZeRO-1/2 a {'param': tensor of the parameter's shape} per file and a step.pt,
        from ZeRO-3 a bare flat tensor and no step.pt. ZeRO-3's loader reads both forms, ZeRO-1/2's only the first
        (IndexError: too many indices), so ZeRO-3's are rewritten in it, shaped by the model-states file's
        param_shapes, with the optimizer's step beside them."""
    import deepspeed

    present = [name for name in _MODEL_STATES if (folder / name).is_file()]
    for name in _MODEL_STATES:
        if present and not (folder / name).exists():
            os.link(folder / present[0], folder / name)
    path = folder / "zero" / "optimizer_state.pt"
    if not path.is_file():
        return
    sd = torch.load(path, weights_only=False)
    nested = sd.get("optimizer_state_dict")
    groups = sd.get("param_groups") or (nested or {}).get("param_groups")
    changed = False
    if nested is None and groups is not None:
        steps = sorted(folder.glob("zero/*/step.pt"))
        step = torch.load(steps[0], weights_only=False) if steps else None
        sd["optimizer_state_dict"] = {"state": {0: {"step": step}}, "param_groups": groups}
        changed = True
    step = ((sd.get("optimizer_state_dict") or {}).get("state") or {}).get(0, {}).get("step")
    shapes = _param_shapes(folder) if present else {}
    for name, shape in shapes.items():
        where = folder / "zero" / name
        for key in ("fp32", "exp_avg", "exp_avg_sq"):
            file = where / f"{key}.pt"
            if not file.is_file():
                continue
            value = torch.load(file, weights_only=False)
            if torch.is_tensor(value):
                numel = math.prod(shape)
                _save_replacing(file, {"param": value.reshape(-1)[:numel].reshape(tuple(shape))})
        if step is not None and (where / "exp_avg.pt").is_file() and not (where / "step.pt").exists():
            _save_replacing(where / "step.pt", torch.as_tensor(step).clone())
    if "param_groups" not in sd and groups is not None:
        sd["param_groups"] = groups
        changed = True
    if not sd.get("ds_version"):
        sd["ds_version"] = deepspeed.__version__
        changed = True
    if changed:
        _save_replacing(path, sd)


def _save_replacing(path: Path, obj) -> None:
    tmp = path.with_name(path.name + ".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def _universal_tensor(file: Path) -> torch.Tensor:
    value = torch.load(file, weights_only=False)
    return value["param"] if isinstance(value, dict) else value


def load_universal_into_plain_optimizer(engine, folder: Path) -> str:
    """Load a universal checkpoint (DeepSpeed's ds_to_universal output) into an engine whose optimizer is the plain
    PyTorch one (ZeRO-0 in fp32). DeepSpeed's universal loader lives in its ZeRO and BF16 optimizers only: under
    ZeRO-0 `engine.load_checkpoint` skips the weights of a universal folder and hands the PyTorch optimizer `None`
    (AttributeError: 'NoneType' object has no attribute 'copy'). Each parameter's fp32 weight and Adam moments are
    read from zero/<name>/, the step count, the LR schedule and the engine's counters from the folder's
    mp_rank_00_model_states.pt, and each group's learning rate is the schedule's last one (DeepSpeed steps the
    schedule after the optimizer, so the first resumed step uses what the group holds). Returns the folder."""
    states = torch.load(folder / "mp_rank_00_model_states.pt", map_location="cpu", weights_only=False)
    optimizer = engine.optimizer
    names = {id(p): name for name, p in engine.module.named_parameters()}
    for group in optimizer.param_groups:
        for param in group["params"]:
            name = names[id(param)]
            where = folder / "zero" / name
            if not (where / "fp32.pt").is_file():
                raise FileNotFoundError(f"{where / 'fp32.pt'}: the universal checkpoint lacks parameter {name}")
            with torch.no_grad():
                param.copy_(_universal_tensor(where / "fp32.pt").view_as(param))
            if (where / "exp_avg.pt").is_file():
                step = torch.load(where / "step.pt", weights_only=False) if (where / "step.pt").is_file() else None
                optimizer.state[param] = {
                    "step": torch.tensor(float(step if step is not None else states["global_steps"])),
                    "exp_avg": _universal_tensor(where / "exp_avg.pt").view_as(param).clone(),
                    "exp_avg_sq": _universal_tensor(where / "exp_avg_sq.pt").view_as(param).clone()}
    if engine.lr_scheduler is not None and states.get("lr_scheduler") is not None:
        engine.lr_scheduler.load_state_dict(states["lr_scheduler"])
        for group, lr in zip(optimizer.param_groups, engine.lr_scheduler.get_last_lr()):
            group["lr"] = lr
    engine.global_steps = states["global_steps"]
    engine.global_samples = states.get("global_samples", engine.global_steps * engine.train_batch_size())
    engine.skipped_steps = states["skipped_steps"]
    return str(folder)


MUON_UNIVERSAL = "muon.json"  # in a universal folder: the parameters whose exp_avg.pt is Muon's momentum


def muon_universal_input(checkpoint: Path, shadow: Path) -> list[str] | None:
    """DeepSpeed 0.19.8's universal converter (ds_to_universal) reads `exp_avg` and `exp_avg_sq` from every
    optimizer group and fails on Muon's (`KeyError: 'exp_avg'`): its groups hold one `momentum_buffer`. For a
    checkpoint with Muon state this writes `shadow`, the checkpoint's files linked, its optimizer files rewritten
    so the converter accepts them, and returns the Muon parameters' names (None: no Muon state, convert the
    checkpoint itself). The converted folder then holds each Muon parameter's full momentum as its exp_avg.pt
    (muon_universal_output) and zeros as exp_avg_sq.pt.

    ZeRO-3, and ZeRO-1/2 with CPU offload, keep Muon's momentum laid out as the fp32 partition
    (stage3._muon_update_sub_group, stage_1_and_2._apply_muon_updates_cpu_offload): it becomes the group's exp_avg
    as it is. ZeRO-1/2 without offload keep, per Muon group, the FULL momentum of every parameter that has any
    element in the rank's partition, one after another in the partition's order (stage_1_and_2.get_flat_partition:
    Newton-Schulz needs whole matrices): the group gets zeros of the partition's size, and the full momenta are
    cut from the buffer by the parameters' shapes (the model states' param_shapes) and written afterwards."""
    files = sorted(checkpoint.glob("*optim_states.pt"))
    first = torch.load(files[0], map_location="cpu", weights_only=False) if files else None
    if first is None or not any("momentum_buffer" in s for s in _optimizer_states(first).values()):  # every rank
        return None  # has the same groups
    shadow.mkdir(parents=True)
    for item in checkpoint.iterdir():
        if item not in files:
            (shadow / item.name).symlink_to(item.resolve())
    shapes = _param_shapes(checkpoint)
    momenta = shadow / "muon_momenta"  # one file per parameter: a rank's file at a time in memory
    momenta.mkdir()
    names = []
    for file in files:
        sd, first = first or torch.load(file, map_location="cpu", weights_only=False), None  # the first read once
        osd = sd["optimizer_state_dict"]
        states = _optimizer_states(sd)
        for index, state in list(states.items()):
            if "momentum_buffer" not in state:
                continue
            buffer = state.pop("momentum_buffer")
            partition = osd["single_partition_of_fp32_groups"][index] if "base_optimizer_state" in osd else None
            if partition is not None and buffer.numel() == partition.numel():  # ZeRO-1/2 with CPU offload
                names += list(osd["param_slice_mappings"][index])  # (_apply_muon_updates_cpu_offload): as the
                state.update(exp_avg=buffer, exp_avg_sq=torch.zeros_like(buffer))  # partition, like ZeRO-3
            elif partition is not None:  # ZeRO-1/2: full momenta of the partition's parameters
                offset = 0
                for name in osd["param_slice_mappings"][index]:
                    numel = shapes[name].numel()
                    if name not in names:
                        torch.save(buffer[offset:offset + numel].clone(), momenta / f"{len(names)}.pt")
                        names.append(name)
                    offset += numel
                state.update(exp_avg=torch.zeros_like(partition), exp_avg_sq=torch.zeros_like(partition))
            else:  # ZeRO-3: the momentum is laid out as the partition; its loader reads sub-group 0's `step`
                names += [name for name in _zero3_group_names(checkpoint, file, index)]
                step = next((s["step"] for s in states.values() if "step" in s), torch.tensor(0.0))
                state.update(exp_avg=buffer, exp_avg_sq=torch.zeros_like(buffer), step=step)
        torch.save(sd, shadow / file.name)
        del sd, osd, states
    (momenta / "names.json").write_text(json.dumps(names))
    return sorted(set(names))


def muon_universal_output(shadow: Path, out: Path, names: list[str]) -> None:
    """After ds_to_universal converted `shadow`: ZeRO-1/2's full momenta written as the Muon parameters'
    exp_avg.pt, and the list of Muon parameters saved beside them (muon.json)."""
    momenta = shadow / "muon_momenta"
    for index, name in enumerate(json.loads((momenta / "names.json").read_text())):
        if not (momenta / f"{index}.pt").is_file():  # laid out as the partition: converted as it was
            continue
        momentum = torch.load(momenta / f"{index}.pt", weights_only=False)
        path = out / "zero" / name / "exp_avg.pt"
        entry = torch.load(path, weights_only=False)
        assert entry["param"].numel() == momentum.numel(), (name, entry["param"].shape, momentum.shape)
        entry["param"] = momentum.view(entry["param"].shape).to(entry["param"].dtype)
        torch.save(entry, path)
    (out / MUON_UNIVERSAL).write_text(json.dumps(names))


def muon_universal_load(engine, folder: Path) -> None:
    """After DeepSpeed's universal loader filled a Muon group's state as AdamW's (exp_avg = the momentum,
    exp_avg_sq = zeros): the momentum put where DeepSpeed's Muon reads it. ZeRO-3 and ZeRO-1/2 with CPU
    offload: the group's `momentum_buffer`, in the partition's layout, as loaded. ZeRO-1/2: the full momentum of
    every parameter of the rank's partition, concatenated in the partition's order (read whole from the folder:
    a rank holds only a fragment of a parameter that straddles two partitions)."""
    listed = folder / MUON_UNIVERSAL
    if not listed.is_file():
        return
    optimizer = engine.optimizer
    inner = optimizer.optimizer
    if hasattr(optimizer, "sub_groups_using_muon"):  # ZeRO-3
        for index, muon in enumerate(optimizer.sub_groups_using_muon):
            if muon:
                state = inner.state[optimizer.fp32_partitioned_groups_flat[index]]
                state["momentum_buffer"] = state.pop("exp_avg")
                state.pop("exp_avg_sq", None)
        return
    for index, params in enumerate(optimizer.params_in_partition):
        if not params or not getattr(params[0], "use_muon", False):
            continue
        flat = inner.param_groups[index]["params"][0]
        state = inner.state[flat]
        momentum = state.pop("exp_avg", None)
        state.pop("exp_avg_sq", None)
        if optimizer.cpu_offload:  # laid out as the partition (_apply_muon_updates_cpu_offload), as loaded
            state["momentum_buffer"] = momentum
            continue
        state["momentum_buffer"] = torch.cat([
            torch.load(folder / "zero" / optimizer.param_names[p] / "exp_avg.pt", weights_only=False)["param"]
            .flatten().float() for p in params]).to(flat.device)


def _optimizer_states(sd: dict) -> dict:
    osd = sd["optimizer_state_dict"]
    return (osd["base_optimizer_state"] if "base_optimizer_state" in osd else osd["optimizer_state_dict"])["state"]


def _param_shapes(checkpoint: Path) -> dict:
    shapes = {}
    for file in sorted(checkpoint.glob("*model_states.pt")):
        for group in torch.load(file, map_location="cpu", weights_only=False)["param_shapes"]:
            shapes.update(group)
        break  # ZeRO-1/2 have one; ZeRO-3's first rank lists every parameter too
    return shapes


def _zero3_group_names(checkpoint: Path, optim_file: Path, index: int) -> list[str]:
    model_file = optim_file.with_name(optim_file.name.replace("optim_states", "model_states"))
    return list(torch.load(model_file, map_location="cpu", weights_only=False)["param_shapes"][index])


def checkpoint_engine_base() -> type:
    """DeepSpeed's plain checkpoint engine class (torch.save per file), for a subclass that writes differently
    (dstrain/run/background_save.py). deepspeed.runtime.checkpoint_engine is undocumented."""
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine
    return TorchCheckpointEngine


@contextmanager
def using_checkpoint_engine(engine, checkpoint_engine) -> Iterator[None]:
    """engine.save_checkpoint writes every file through engine.checkpoint_engine.save(state_dict, path): swapped
    for one save, then the engine's own put back. DeepSpeedEngine.checkpoint_engine is not public."""
    own = engine.checkpoint_engine
    engine.checkpoint_engine = checkpoint_engine
    try:
        yield
    finally:
        engine.checkpoint_engine = own


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


def dataset_fingerprint(dataset) -> str:
    """The datasets library's content fingerprint of a Dataset (changes when its files or transforms do):
    Dataset._fingerprint; no public accessor exists."""
    return dataset._fingerprint


def drop_frozen_aliases(engine) -> None:
    """Checkpoints of a model with a frozen base (LoRA) must not hold that base. DeepSpeedEngine.module_state_dict
    (exclude_frozen_parameters=True) deletes the frozen names named_parameters() lists, which skips a tied
    weight's second name: lm_head.weight (= embed_tokens.weight) stayed in every checkpoint of a tied model, the
    whole embedding table. Wraps the engine's bound method (save_checkpoint calls it through self) to drop every
    name of a frozen parameter, aliases included (by name: ZeRO-3's partitioned tensors are all empty)."""
    original = engine.module_state_dict

    def module_state_dict(*args, exclude_frozen_parameters: bool = False, **kwargs):
        state = original(*args, exclude_frozen_parameters=exclude_frozen_parameters, **kwargs)
        if exclude_frozen_parameters and state is not None:
            prefix = kwargs.get("prefix", "")
            for name, param in engine.module.named_parameters(remove_duplicate=False):
                if not param.requires_grad:
                    state.pop(prefix + name, None)
        return state

    engine.module_state_dict = module_state_dict


MUON_MODULE = "deepspeed.runtime.zero.muon.original_muon"


def defer_muon_compile() -> None:
    """DeepSpeed's ZeRO optimizers (stage_1_and_2, stage3, bf16_optimizer) import its Muon module at construction,
    only for an isinstance check, and that module decorates three functions with torch.compile at import
    (`@deepspeed.runtime.compiler.compile()`), which imports TorchInductor's compiler: 1.7 s of CPU per rank here,
    in every run, with Muon or not. Imported here first, with each decorator applied at the function's first call
    instead (torch.compile compiles at the first call anyway), so the check costs nothing and a Muon run compiles
    the same kernels when it first uses them."""
    import sys

    if MUON_MODULE in sys.modules:
        return
    import functools

    from deepspeed.runtime import compiler

    def compile_at_first_call(fn):
        compiled = None

        @functools.wraps(fn)
        def call(*args, **kwargs):
            nonlocal compiled
            if compiled is None:
                compiled = compiler.compile()(fn)
            return compiled(*args, **kwargs)
        return call

    original = compiler.compile
    compiler.compile = lambda: compile_at_first_call
    try:
        import deepspeed.runtime.zero.muon.muon_optimizer  # noqa: F401 -- imports MUON_MODULE
    finally:
        compiler.compile = original


@contextmanager
def keep_muon_tags():
    """deepspeed.initialize calls `deepspeed.set_optimizer_flags`, which sets `use_muon` on every parameter by name
    (2-D and no "embed"/"lm_head" in it) over whatever the model carried: GPT-2's `wte` and any head not named
    lm_head would take Muon's update. dstrain tags where the model is built (components/muon.py, by what the
    parameter is: `dstrain_muon`); inside this context DeepSpeed's own tagging still runs (its per_head_muon
    option needs it), then each parameter that carries our tag gets it back. Restored on exit."""
    import deepspeed

    original = deepspeed.set_optimizer_flags

    def flags(config_class, model) -> None:
        original(config_class, model)
        for param in model.parameters():
            if hasattr(param, "dstrain_muon"):
                param.use_muon = param.dstrain_muon

    deepspeed.set_optimizer_flags = flags  # deepspeed/__init__.py's initialize looks the name up at call time
    try:
        yield
    finally:
        deepspeed.set_optimizer_flags = original


MUON_UPDATE_MODULES = (MUON_MODULE, "deepspeed.runtime.zero.muon.muon_optimizer")


def count_muon_updates(shapes: list) -> Callable[[], None]:
    """Record the shape of every matrix DeepSpeed's Muon orthogonalises (appended to `shapes`) until the returned
    function undoes it. Every path of DeepSpeed 0.19.8 goes through `original_muon.muon_update` (momentum, then
    Newton-Schulz): ZeRO-1/2 (stage_1_and_2's get_flat_partition and its CPU-offload path, imported at call
    time), ZeRO-3 (stage3._muon_update_sub_group, at call time) and ZeRO-0 (muon_optimizer.MuonWithAuxAdam.step,
    imported into muon_optimizer at its import): the name is replaced in both modules."""
    import sys

    defer_muon_compile()
    import deepspeed.runtime.zero.muon.muon_optimizer  # noqa: F401 -- imports MUON_MODULE
    modules = [sys.modules[name] for name in MUON_UPDATE_MODULES]
    originals = [module.muon_update for module in modules]

    def counting(original):
        @functools.wraps(original)
        def muon_update(grad, *args, **kwargs):
            shapes.append(tuple(grad.shape))
            return original(grad, *args, **kwargs)
        return muon_update

    for module, original in zip(modules, originals):
        module.muon_update = counting(original)

    def undo() -> None:
        for module, original in zip(modules, originals):
            module.muon_update = original
    return undo


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


def gate_optimizer_step(engine, decide: Callable[[float], bool]) -> Callable[[], None]:
    """Let `decide(grad_norm)` skip an optimizer step through DeepSpeed's own overflow path (no weight, optimizer
    state or schedule change; engine.skipped_steps counts it). Returns the function that undoes this.

    DeepSpeed's ZeRO-1/2 (DeepSpeedZeroOptimizer.step), ZeRO-3 (DeepSpeedZeroOptimizer_Stage3.step) and bf16
    (BF16_Optimizer.step; FP16_UnfusedOptimizer.step, which DeepSpeed picks for bf16 at ZeRO-0) optimizers each call
    their module's `is_invalid_grad_norm(norm)` on the step's global gradient norm and, when it answers True,
    discard the step (clear the gradients, keep the weights; the engine
    then leaves the LR scheduler alone). That name, looked up in the optimizer's own module, is replaced by one
    that asks `decide` with the norm as a float (every rank gets the same all-reduced norm, so every rank decides
    the same). Under fp16 nothing is replaced: there a non-finite step is the loss scaler's (it lowers the scale).
    ZeRO-0 in fp32 has no wrapper: the engine holds the torch optimizer itself, whose step() is wrapped to take the
    norm (engine._global_grad_norm when clipping has set it this step, else the norm of the local gradients, which
    ZeRO-0 has all-reduced) and to set `optimizer.overflow`, the attribute DeepSpeedEngine._take_model_step reads."""
    import sys

    optimizer = engine.optimizer
    module = sys.modules.get(type(optimizer).__module__)
    if engine.fp16_enabled():
        return lambda: None
    if module is not None and hasattr(module, "is_invalid_grad_norm"):
        original = module.is_invalid_grad_norm

        def gated(norm) -> bool:
            return decide(float(norm))
        module.is_invalid_grad_norm = gated

        def undo() -> None:
            module.is_invalid_grad_norm = original
        return undo
    if isinstance(optimizer, torch.optim.Optimizer):
        step = optimizer.step

        @functools.wraps(step)  # keeps the LR scheduler's mark on it (torch warns of an overridden step otherwise)
        def gated_step(*args, **kwargs):
            norm = engine._global_grad_norm if engine.gradient_clipping() > 0 else None
            if norm is None:  # tensor-parallel shards' norms are combined over `mpu`, as the clipping does
                from deepspeed.runtime.utils import get_global_norm_of_tensors
                norm = get_global_norm_of_tensors([p.grad for g in optimizer.param_groups for p in g["params"]
                                                   if p.grad is not None], mpu=engine.mpu)
            optimizer.overflow = decide(float(norm))
            if optimizer.overflow:
                optimizer.zero_grad(set_to_none=True)
                return None
            return step(*args, **kwargs)
        optimizer.step = gated_step
        optimizer.overflow = False

        def undo_step() -> None:
            optimizer.step = step
            del optimizer.overflow
        return undo_step
    return lambda: None
