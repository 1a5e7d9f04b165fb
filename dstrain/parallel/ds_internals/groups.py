"""DeepSpeed's and torch's process groups: the model-parallel unit handed to deepspeed.initialize, Ulysses' and AutoTP's
groups, groups inside DiLoCo replicas, and the check of our rank arithmetic against DeepSpeed's own groups."""
from __future__ import annotations

import functools
from dataclasses import replace

import torch


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
