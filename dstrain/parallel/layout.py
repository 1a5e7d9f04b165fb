"""ONE object for how the ranks are split, in the spirit of torchtitan's ParallelDims.

world = data-parallel x pipeline stages x tensor-parallel x context-parallel (ring) x sequence-parallel (Ulysses).
Built once from the DeepSpeed JSON and the world size, it answers every question other modules used to derive
on their own: sizes, this rank's coordinates, how many ranks see the same samples, whether the engine is a
pipeline. Rank order follows DeepSpeed's own groups, so no module has to ask the engine:
  - pipeline (deepspeed.pipe's PipeDataParallelTopology, axes [pipe, data]): rank = stage * dp + dp_rank; in DiLoCo
    replicas (ds_internals.pipeline_in_replicas, axes [replica, pipe, data]) the same inside each replica of
    consecutive ranks: rank = replica * replica_size + stage * replica_dp + dp_rank_in_replica
  - AutoTP (deepspeed.utils.groups' device mesh (data_parallel, tensor_parallel)): rank = dp_rank * tp + tp_rank
  - Ulysses (deepspeed.runtime.sequence_parallel.parallel_state_sp: groups of sp consecutive ranks):
    rank = dp_rank * sp + sp_rank. The sp ranks of a group read the same samples, each a 1/sp slice of every
    sequence; ZeRO partitions and gradient reductions span all dp x sp ranks.
  - ring attention (context_parallel_size C, components/ring_attention.py): rings across Ulysses groups,
    rank = (dp_rank * C + ring_rank) * sp + sp_rank. The C x sp ranks read the same samples; DeepSpeed knows
    nothing of the ring and counts its ranks as data-parallel (its train_batch_size, gradient averaging and
    ZeRO partitions span dp x C x sp).
ds_internals.bind_groups compares the formula with DeepSpeed's groups once the engine exists.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import UserError


@dataclass(frozen=True)
class ParallelSizes:
    """The model-parallel sizes a DeepSpeed JSON asks for (data parallelism is what the world leaves)."""
    pipeline: int = 1  # pipeline.stages
    tensor: int = 1  # tensor_parallel.autotp_size (AutoTP)
    sequence: int = 1  # sequence_parallel_size (Ulysses)
    context: int = 1  # context_parallel_size (ring attention)
    # expert_parallel.autoep_size when expert_parallel.enabled, else 0: routed experts split over that many of the
    # data-parallel ranks (AutoEP), which still read their own samples: not a model-parallel size
    expert: int = 0

    @property
    def model(self) -> int:
        return self.pipeline * self.tensor * self.sequence * self.context


def parallel_sizes(cfg: dict) -> ParallelSizes:
    """The one reader of the parallel sizes in a DeepSpeed JSON: every other module asks this or a Layout.
    A size that is not a positive integer is a UserError naming the key."""
    sizes = {}
    for name, section, key in (("pipeline", "pipeline", "stages"), ("tensor", "tensor_parallel", "autotp_size"),
                               ("sequence", None, "sequence_parallel_size"),
                               ("context", None, "context_parallel_size")):
        value = (cfg.get(section) or {}).get(key, 1) if section else cfg.get(key, 1)
        value = 1 if value is None else value
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            where = f"{section}.{key}" if section else key
            raise UserError(f"{where}={value!r} must be a positive integer; use e.g. 2, or 1 for none")
        sizes[name] = value
    experts = cfg.get("expert_parallel") or {}
    if experts.get("enabled"):
        value = experts.get("autoep_size", 1)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise UserError(f"expert_parallel.autoep_size={value!r} must be a positive integer; use e.g. 2")
        sizes["expert"] = value
    return ParallelSizes(**sizes)


@dataclass(frozen=True)
class Layout:
    world_size: int
    pipeline_stages: int = 1
    tensor_parallel: int = 1
    sequence_parallel: int = 1  # Ulysses: DeepSpeed's sequence_parallel_size
    rank: int = 0
    # DiLoCo replicas (components/diloco.py): groups of world / replicas consecutive ranks. Every rank still reads
    # its own share of the global batch (data_parallel counts all of them); the engine's data-parallel group, over
    # which DeepSpeed averages gradients and partitions ZeRO states, is the replica's
    replicas: int = 1
    # DeepSpeed's data-parallel process group, bound once the engine exists (ds_internals.bind_groups)
    data_parallel_group: Any = field(default=None, compare=False, repr=False)
    # how many ranks DeepSpeed divides the summed gradients by, when not data_parallel (ds_internals.bind_groups)
    gradient_divisor: int | None = field(default=None, compare=False)
    context_parallel: int = 1  # ring attention: context_parallel_size (last: positional callers predate it)
    expert_parallel: int = 0  # AutoEP's autoep_size, 0 when off (components/expert_parallel.py)

    def __post_init__(self) -> None:
        if min(self.pipeline_stages, self.tensor_parallel, self.sequence_parallel, self.context_parallel) < 1:
            raise UserError(f"parallel sizes must be positive (pipeline {self.pipeline_stages}, tensor "
                            f"{self.tensor_parallel}, sequence {self.sequence_parallel}, context "
                            f"{self.context_parallel})")
        if self.world_size % self.model_parallel:
            ring = f" x context-parallel size ({self.context_parallel})" if self.context_parallel > 1 else ""
            raise UserError(f"world size {self.world_size} is not divisible by pipeline stages ({self.pipeline_stages})"
                            f" x tensor-parallel size ({self.tensor_parallel}) x sequence-parallel size "
                            f"({self.sequence_parallel}){ring}; launch a multiple of {self.model_parallel} ranks")
        if self.replicas < 1 or self.data_parallel % self.replicas:
            raise UserError(f"diloco.replicas={self.replicas} does not divide the {self.data_parallel} data-parallel "
                            f"ranks of world size {self.world_size}; choose a divisor of {self.data_parallel}")

    @classmethod
    def from_ds_config(cls, cfg: dict, world_size: int, rank: int = 0, replicas: int = 1) -> Layout:
        sizes = parallel_sizes(cfg)
        return cls(world_size, sizes.pipeline, sizes.tensor, sizes.sequence, rank, replicas,
                   context_parallel=sizes.context, expert_parallel=sizes.expert)

    def global_batch(self, micro_batch_size: int, grad_accum_steps: int) -> int:
        """Samples per optimizer step: micro batch x accumulation x data-parallel size (the one place it is
        computed; a sequence-parallel group reads one sample, so it counts once)."""
        return micro_batch_size * grad_accum_steps * self.data_parallel

    def replica_batch(self, micro_batch_size: int, grad_accum_steps: int) -> int:
        """DeepSpeed's train_batch_size: samples per optimizer step of one DiLoCo replica (its engine is the
        replica's; the global batch when there is one), counted once per ring rank (DeepSpeed takes the ring's
        ranks for data-parallel ones)."""
        return self.global_batch(micro_batch_size, grad_accum_steps) // self.replicas * self.context_parallel

    def accumulation_for(self, global_batch: int, micro_batch_size: int) -> int | None:
        """grad_accum_steps that makes up global_batch with this micro batch on these ranks; None when none can."""
        per_step = micro_batch_size * self.data_parallel
        return None if global_batch % per_step else global_batch // per_step

    @property
    def model_parallel(self) -> int:
        """Ranks that hold parts of one model replica: they read the same samples."""
        return self.pipeline_stages * self.tensor_parallel * self.sequence_parallel * self.context_parallel

    @property
    def data_parallel(self) -> int:
        return self.world_size // self.model_parallel

    @property
    def samples_shared_by(self) -> int:
        """How many ranks read each sample (a sequence-parallel group reads one sample, a slice on each rank)."""
        return self.model_parallel

    @property
    def token_replicas(self) -> int:
        """How many ranks hold each token: counts summed over the world are divided by this. Pipeline stages and
        tensor-parallel peers see whole sequences; sequence-parallel peers hold disjoint slices."""
        return self.pipeline_stages * self.tensor_parallel

    @property
    def zero_shards(self) -> int:
        """Ranks over which ZeRO partitions states and averages gradients (DeepSpeed's sequence-data-parallel
        group under Ulysses: dp x sp; a DiLoCo replica's ranks only)."""
        return self.replica_data_parallel * self.sequence_parallel * self.context_parallel

    @property
    def sequence_parallel_rank(self) -> int:
        return self.rank % self.sequence_parallel

    @property
    def context_parallel_rank(self) -> int:
        """This rank's place in its ring (which two zigzag chunks of every sequence it holds)."""
        return self.rank // self.sequence_parallel % self.context_parallel

    @property
    def sequence_shards(self) -> int:
        """Ranks that hold disjoint parts of each sequence: Ulysses x ring."""
        return self.sequence_parallel * self.context_parallel

    @property
    def sequence_shard(self) -> int:
        """Which of the sequence_shards parts this rank holds (data.shard_sequence)."""
        return self.context_parallel_rank * self.sequence_parallel + self.sequence_parallel_rank

    def ring_groups(self) -> list[list[int]]:
        """Every ring's global ranks, in one order on all ranks (torch's new_group is collective)."""
        c, sp = self.context_parallel, self.sequence_parallel
        return [[(d * c + k) * sp + u for k in range(c)] for d in range(self.data_parallel) for u in range(sp)]

    @property
    def engine_data_parallel_rank(self) -> int:
        """This rank's index among the ranks DeepSpeed counts as data-parallel (a ring's ranks are among them)."""
        return self.replica_data_parallel_rank * self.context_parallel + self.context_parallel_rank

    @property
    def gradients_averaged_over(self) -> int:
        """DeepSpeed sums each gradient over the ranks and divides by this: the loss scale makes up for it."""
        return self.gradient_divisor or self.replica_data_parallel * self.context_parallel

    @property
    def replica_size(self) -> int:
        """Ranks in one DiLoCo replica (the world when there is one)."""
        return self.world_size // self.replicas

    @property
    def replica(self) -> int:
        """This rank's DiLoCo replica."""
        return self.rank // self.replica_size

    @property
    def replica_data_parallel(self) -> int:
        """The engine's data-parallel size: the ranks of one replica that read different samples."""
        return self.data_parallel // self.replicas

    @property
    def replica_data_parallel_rank(self) -> int:
        """This rank's index in the engine's data-parallel group (its replica's)."""
        return self.data_parallel_rank % self.replica_data_parallel

    @property
    def is_pipeline(self) -> bool:
        return self.pipeline_stages > 1

    @property
    def splits_model(self) -> bool:
        """Pipeline stages or tensor-parallel shards: heads and checkpoints are split by layout."""
        return self.pipeline_stages > 1 or self.tensor_parallel > 1

    @property
    def data_parallel_rank(self) -> int:
        if self.pipeline_stages > 1:  # DiLoCo: the replica's first data-parallel index + the index inside it
            inside = self.rank % self.replica_size
            return self.replica * self.replica_data_parallel + inside % self.replica_data_parallel
        return self.rank // (self.tensor_parallel * self.sequence_parallel * self.context_parallel)

    @property
    def pipeline_stage(self) -> int:
        return self.rank % self.replica_size // self.replica_data_parallel if self.pipeline_stages > 1 else 0

    @property
    def tensor_parallel_rank(self) -> int:
        return self.rank % self.tensor_parallel

    def describe(self) -> str:
        text = (f"world {self.world_size} = data-parallel {self.data_parallel} x pipeline {self.pipeline_stages} x "
                f"tensor-parallel {self.tensor_parallel}")
        if self.replicas > 1:
            text += f" (DiLoCo: {self.replicas} replicas of {self.replica_size} ranks)"
        text += f" x context-parallel (ring) {self.context_parallel}" if self.context_parallel > 1 else ""
        return text + (f" x sequence-parallel {self.sequence_parallel}" if self.sequence_parallel > 1 else "")


def batch_hint(global_batch: int, data_parallel: int) -> str:
    """How to make up global_batch samples per step on data_parallel ranks (micro batch x accumulation)."""
    if global_batch % data_parallel:
        fits = [n for n in range(1, min(global_batch, 1024) + 1) if global_batch % n == 0]
        return (f"{global_batch} samples do not split over {data_parallel} data-parallel ranks; launch a "
                f"data-parallel size among {', '.join(map(str, fits[-8:]))} (or a divisor of {global_batch})")
    per_rank = global_batch // data_parallel
    sizes = [n for n in range(1, per_rank + 1) if per_rank % n == 0]
    return f"choose train.micro_batch_size among {', '.join(map(str, sizes[:8]))} (divisors of {per_rank})"


def keep_global_batch(micro_batch_size: int, grad_accum_steps: int, written_for: Layout, layout: Layout) -> int:
    """grad_accum_steps that keeps the global batch a recipe was written for (its world_size) on this world: the
    global batch is a hyper-parameter. UserError when no accumulation can."""
    global_batch = written_for.global_batch(micro_batch_size, grad_accum_steps)
    accum = layout.accumulation_for(global_batch, micro_batch_size)
    if accum is None:
        raise UserError(f"the recipe was written for world_size {written_for.world_size} (global batch "
                        f"{global_batch}); on {layout.world_size} ranks no grad_accum_steps keeps it: "
                        f"{batch_hint(global_batch, layout.data_parallel)}, or pass --world_size="
                        f"{layout.world_size} to train with the batch as written")
    return accum


def recipe_accumulation(layout: Layout, raw_ds: dict, micro_batch_size: int, grad_accum_steps: int,
                        written_world: int | None, accepted_world: int | None) -> tuple[int, str | None]:
    """The one batch policy for a recipe launched on a world (train.py and the cluster check both use it):
    (grad_accum_steps to train with, the note to print or None). A recipe written for world_size W and launched
    on another world keeps its global batch (grad_accum_steps re-derived; UserError when no accumulation can),
    unless --world_size=<this world> accepts the batch as written."""
    if not written_world or layout.world_size in (written_world, accepted_world):
        return grad_accum_steps, None
    written_for = Layout.from_ds_config(raw_ds, written_world)
    accum = keep_global_batch(micro_batch_size, grad_accum_steps, written_for, layout)
    return accum, (f"the recipe was written for world_size {written_world}; on {layout.world_size} grad_accum_steps "
                   f"{grad_accum_steps} -> {accum} keeps its global batch of "
                   f"{layout.global_batch(micro_batch_size, accum)}")


# ring attention's token layout (components/ring_attention.py): which tokens of a sequence each ring rank holds
def zigzag_index(index: int, size: int, length: int, device=None) -> torch.Tensor:
    """Global token indices of the `length` tokens ring rank `index` of `size` holds: chunks index, 2*size-1-index."""
    chunk = length // 2
    first = torch.arange(index * chunk, (index + 1) * chunk, device=device)
    return torch.cat([first, first + (2 * size - 1 - 2 * index) * chunk])


def zigzag_order(length: int, size: int) -> torch.Tensor:
    """The permutation of a sequence's positions that puts ring rank 0's tokens first, then rank 1's, ...:
    slicing the permuted sequence into `size` equal parts gives each ring rank its two chunks."""
    local = 2 * (length // (2 * size))
    return torch.cat([zigzag_index(k, size, local) for k in range(size)])
