"""DiLoCo: data parallelism that talks every H steps, not every step (Douillard et al. 2023, "DiLoCo: Distributed
Low-Communication Training of Language Models"; INTELLECT-1 trained a 10B model across continents this way).

The ranks form `diloco.replicas` replicas of world / replicas consecutive ranks (by default one per node, so the
slow link is the one between replicas). Inside a replica the DeepSpeed config trains as it always does: DeepSpeed's
data-parallel group is the replica (ds_internals.ReplicaUnit; pipeline stages: ds_internals.pipeline_in_replicas;
each rank syncs with the ranks at its place in the other replicas), so its gradient averaging, ZeRO partitions and
gradient clipping stay inside it, and every replica keeps its own inner optimizer state (AdamW's moments). Every
`diloco.every` (H) optimizer steps, and at the run's last step, each replica's pseudo-gradient (the shared weights
of the last sync minus its own weights now) is averaged over the replicas, and an outer SGD with Nesterov momentum
moves the shared weights by it; every replica continues from them. Bytes across replicas: one model's worth per
H steps instead of one per step. With `diloco.warmup_steps` W, the first W steps each end with a sync that
averages the replicas' weights (outer lr 1, no momentum: the outer SGD and its momentum start after them; sent in
bf16 where the run sends int8/int4, see warmup_wire), which tracks synchronous training while the weights move
fastest, for W more syncs' bytes.

What a step means: a step still consumes one global batch (micro x accumulation x every data-parallel rank of
every replica), read in the same order as without DiLoCo, each replica its ranks' shares; each replica's gradient
is the mean over its own share (normalised by its own token count). The logged loss is the global batch's mean;
evaluations and checkpoints happen at syncs (eval.every and checkpoint.every are multiples of H), where every
replica holds the shared weights. A checkpoint holds each replica's DeepSpeed state (checkpoints/step_N/replica_K/)
and each rank's slice of the outer state (the shared weights, the momentum, the rounding carried over: a rank of
a replica of S ranks keeps 1/S of the model's); it resumes exactly
on the same world and replicas, and on more or fewer replicas of the same size (resume.adapt_to_world says what
is kept and what starts afresh).

Written here because no library does it for DeepSpeed: torchtitan's DiLoCo lives in torchft (FSDP, its own
process groups and quorum), and DeepSpeed has no local-SGD mode. The inner steps are DeepSpeed's own; the outer step
reads and writes the fp32 master weights through deepspeed.utils' safe_get/set_full_fp32_param (every ZeRO stage)
and the module's working weights (which DeepSpeed refreshes from the masters only at its next step).
"""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as tdist

from ..config import DilocoSection, Recipe
from ..errors import UserError
from . import Component, Setup


def replicas_for(recipe: Recipe, world_size: int, ranks_per_node: int) -> int:
    """How many replicas the ranks form: 1 without DiLoCo; diloco.replicas, or one per node when it is 0."""
    cfg = recipe.diloco
    if not cfg.enabled:
        return 1
    return cfg.replicas or max(1, world_size // max(1, ranks_per_node))


class Diloco(Component):
    name = "diloco"
    stateful = True

    def __init__(self, cfg: DilocoSection):
        self.cfg = cfg
        self.params: list[torch.nn.Parameter] = []
        self.tied: list[dict] = []  # pipeline stages: the tied layers' groups of this rank (PipelineModule.tied_comms)
        # flat fp32 vectors over this rank's slice of the trained parameters (in the module's order, cut into a
        # replica's S slices: slice_length), the slice this rank sends across and updates
        self.anchor: torch.Tensor | None = None  # the shared weights of the last sync
        self.momentum: torch.Tensor | None = None  # the outer SGD's buffer
        self.carry: torch.Tensor | None = None  # bf16/int8/int4: what rounding the pseudo-gradient dropped
        self.max_steps = self.replicas = self.numel = 0
        self.mine = slice(0, 0)  # this rank's slice of the flat model
        # where the outer state lives (host memory when the DeepSpeed config offloads the optimizer: a user who
        # offloads has no accelerator memory to spare for 8-12 bytes a parameter of it) and where the collectives
        # run (the accelerator: NCCL takes no host tensors)
        self.home = self.comm = torch.device("cpu")

    def validate(self, setup: Setup) -> None:
        cfg, recipe, layout = self.cfg, setup.recipe, setup.layout
        train, self.replicas = recipe.train, layout.replicas
        if layout.replicas < 2:
            raise UserError(f"diloco.every={cfg.every} needs at least 2 replicas, but the {layout.world_size} ranks "
                            f"form {layout.replicas} (diloco.replicas=0 makes one per node); set diloco.replicas=N "
                            f"with N dividing the world size, or diloco.every=0")
        if cfg.warmup_steps >= train.max_steps:
            raise UserError(f"diloco.warmup_steps={cfg.warmup_steps} is not less than train.max_steps="
                            f"{train.max_steps}: every step would sync; choose fewer, or diloco.every=1")
        if cfg.every > train.max_steps:
            raise UserError(f"diloco.every={cfg.every} is more than train.max_steps={train.max_steps}: the replicas "
                            f"would never sync; choose diloco.every <= {train.max_steps}")
        if recipe.compression.enabled:
            raise UserError(f"compression.method={recipe.compression.method} compresses the every-step gradient "
                            f"all-reduce, which under DiLoCo stays inside a replica; set compression.method=none "
                            f"(diloco.dtype=bf16 halves the bytes DiLoCo sends)")
        for key, value in (("eval.every", recipe.eval.every), ("checkpoint.every", recipe.checkpoint.every)):
            if value == "auto" or (isinstance(value, int) and value % cfg.every):
                raise UserError(f"{key}={value} must be a multiple of diloco.every={cfg.every} (evaluations and "
                                f"checkpoints happen where the replicas hold the shared weights); e.g. {key}="
                                f"{cfg.every * max(1, (value if isinstance(value, int) else 0) // cfg.every)}")

    def configure(self, ds_cfg: dict, setup: Setup) -> None:
        # each replica's engine saves under its own tag (replica_K, checkpoint.py): DeepSpeed's check that every
        # rank passes the same tag would warn on every save
        ds_cfg.setdefault("checkpoint", {})["tag_validation"] = "Ignore"

    def attach(self, engine, setup: Setup) -> None:
        from deepspeed.accelerator import get_accelerator

        from .. import ds_internals

        self.max_steps, self.unit = setup.recipe.train.max_steps, ds_internals.replica_unit()
        if not isinstance(self.unit, ds_internals.ReplicaUnit):
            raise RuntimeError("diloco: the engine was not built with the replica groups (ds_internals.ReplicaUnit)")
        # pipeline stages: a tied layer's copy on a later stage (the LM head tied to the first stage's embedding,
        # ds_pipe_replicated) is not synced itself but given the first stage's shared weights after each sync
        # (_tied): the slow link carries the embedding once (a second copy: 21% more bytes for Llama-3.2-1B) and
        # the copies cannot drift apart however each stage's vector is cut into blocks
        self.params = [p for p in engine.module.parameters()
                       if p.requires_grad and not getattr(p, "ds_pipe_replicated", False)]
        self.tied = list(getattr(engine.module, "tied_comms", {}).values())
        size, index = self.unit.get_data_parallel_world_size(), self.unit.get_data_parallel_rank()
        self.numel = sum(_numel(p) for p in self.params)
        chunk = slice_length(self.numel, size)
        self.mine = slice(min(self.numel, index * chunk), min(self.numel, (index + 1) * chunk))
        self.comm = torch.device(get_accelerator().current_device_name())
        zero = setup.ds_cfg.get("zero_optimization") or {}
        offloaded = (zero.get("offload_optimizer") or {}).get("device", "none") in ("cpu", "nvme")
        self.home = torch.device("cpu") if offloaded else self.comm
        self.anchor = self._read()  # a resumed run's comes with the checkpoint (load_state_dict, after this)

    # ---------------------------------------------------------------- the outer step
    def after_step(self, step: int, say: Callable[[str], None]) -> None:
        if step <= self.cfg.warmup_steps:
            self.sync(average=True)
        elif step % self.cfg.every == 0 or step == self.max_steps:
            self.sync()

    def sync(self, average: bool = False) -> None:
        """Each rank of a replica owns one slice of the model (slice i of S, INT8_BLOCK-aligned so that int8/int4's
        blocks are the whole vector's): it keeps the shared weights, the momentum and the carried rounding of that
        slice only, sends that slice of the pseudo-gradient across the replicas, takes the outer step on it, and
        the replica's ranks then put the new shared weights together over their own link. One model's worth crosses
        the slow link per replica and sync, not one per rank; the outer state is 1/S of the model per rank (a
        7B model's fp32 shared weights and momentum are 56 GB, which a rank of a replica of 8 keeps 7 GB of), in host
        memory when the optimizer is offloaded. Memory at the sync (memory.py counts it): this slice's
        pseudo-gradient, a few buckets and one parameter's full weight at a time, no copy of the whole model.
        average: the plain average of the replicas (diloco.warmup_steps), not the outer step; its momentum is left
        as it is."""
        cfg, replicas, unit, home, comm = self.cfg, self.unit.layout.replicas, self.unit, self.home, self.comm
        pseudo = self._read()
        torch.sub(self.anchor, pseudo, out=pseudo)  # this slice's pseudo-gradient
        wire = warmup_wire(cfg.dtype) if average else cfg.dtype
        if wire != "fp32":  # compressed on the wire, the rounding carried to the next sync (error feedback)
            if self.carry is not None:
                pseudo += self.carry
            else:
                self.carry = torch.empty_like(pseudo)
        for lo in range(0, pseudo.numel(), BUCKET):  # a bucket at a time (INT8_BLOCK-aligned: the same blocks)
            part = pseudo[lo:lo + BUCKET]
            if wire == "fp32":
                sent = part.to(comm)
                tdist.all_reduce(sent, group=unit.across)
                if sent is not part:
                    part.copy_(sent)
                continue
            payload = encode(part, wire)
            self.carry[lo:lo + BUCKET] = part - decode(payload, wire, part.numel())
            gathered = [[torch.empty_like(t, device=comm) for _ in range(replicas)] for t in payload]
            for parts, t in zip(gathered, payload):
                tdist.all_gather(parts, t.to(comm), group=unit.across)  # summed in fp32 below, not on the wire
            part.copy_(decode([parts[0].to(home) for parts in gathered], wire, part.numel()))
            for k in range(1, replicas):  # one replica's at a time, in replica order
                part += decode([parts[k].to(home) for parts in gathered], wire, part.numel())
            del gathered
        pseudo /= replicas
        mu = 0.0 if average else cfg.outer_momentum
        if mu > 0:  # torch.optim.SGD's Nesterov: buf = mu buf + g (g itself at first), step g + mu buf
            self.momentum = pseudo.clone() if self.momentum is None else self.momentum.mul_(mu).add_(pseudo)
            pseudo.add_(self.momentum, alpha=mu)
        self.anchor.add_(pseudo, alpha=-(1.0 if average else cfg.outer_lr))
        del pseudo
        self._write()
        self._tied()

    # ---------------------------------------------------------------- DeepSpeed's weights
    def _read(self) -> torch.Tensor:
        """This rank's slice of every trained parameter's full fp32 master weight, laid end to end (DeepSpeed's
        optimizer holds the master under ZeRO-1/2/3 and bf16; under ZeRO-0 in fp32 the parameter is the master).
        Every rank of the replica reads every parameter (under ZeRO-1/2/3 the read is a collective of the
        replica), one at a time, and keeps the part inside its slice."""
        from deepspeed.utils import safe_get_full_fp32_param

        out, offset = None, 0
        for p in self.params:
            value = (safe_get_full_fp32_param(p) if _has_master(p) else p.detach()).reshape(-1)
            if out is None:
                out = torch.empty(self.mine.stop - self.mine.start, device=self.home)
            lo, hi = max(self.mine.start, offset), min(self.mine.stop, offset + value.numel())
            if lo < hi:
                out[lo - self.mine.start:hi - self.mine.start].copy_(value[lo - offset:hi - offset])
            offset += value.numel()
            del value
        return out

    def _write(self) -> None:
        """The new shared weights into the masters and the module's working copy (DeepSpeed copies masters to it
        only after its next step). The replica's ranks broadcast their slices in turn over their own link, a bucket
        at a time, and each parameter is written once its last piece has arrived: a bucket and one parameter's full
        weight exist at a time (gathering the slices into a full fp32 vector took 4 bytes a parameter: 30 GiB a
        rank for Llama-3.1-8B)."""
        unit, home, comm = self.unit, self.home, self.comm
        size, index = unit.get_data_parallel_world_size(), unit.get_data_parallel_rank()
        group, chunk = unit.get_data_parallel_group(), slice_length(self.numel, size)
        params = iter(self.params)
        p = next(params)
        value, start = torch.empty(_numel(p), device=home), 0  # p's full weight; p starts at `start`
        for j in range(size):
            for first in range(min(self.numel, j * chunk), min(self.numel, (j + 1) * chunk), BUCKET):
                lo, hi = first, min(self.numel, (j + 1) * chunk, first + BUCKET)
                if j == index:
                    piece = self.anchor[lo - self.mine.start:hi - self.mine.start]
                    piece = piece.to(comm) if size > 1 else piece
                else:
                    piece = torch.empty(hi - lo, device=comm)
                if size > 1:
                    tdist.broadcast(piece, src=tdist.get_global_rank(group, j), group=group)
                while lo < hi:  # the parameters this piece continues or completes
                    end = min(hi, start + value.numel())
                    value[lo - start:end - start].copy_(piece[lo - first:end - first])
                    lo = end
                    if end == start + value.numel():
                        self._write_one(p, value)
                        start, p = end, next(params, None)
                        if p is None:
                            break
                        value = torch.empty(_numel(p), device=home)
                del piece

    def _tied(self) -> None:
        """Pipeline stages: each tied layer's copies (one per stage that holds it, a group of this replica's ranks)
        take the first stage's new shared weights, broadcast over the replica's own link. DeepSpeed keeps them
        equal only through their gradients."""
        from deepspeed.utils import safe_get_full_fp32_param

        for comm in self.tied:
            owner = min(comm["ranks"])
            for p in comm["module"].parameters():
                if not p.requires_grad:
                    continue
                if tdist.get_rank() == owner:  # every owner of the stage's data-parallel group reads: a collective
                    value = (safe_get_full_fp32_param(p) if _has_master(p) else p.detach().float()).to(self.comm)
                else:
                    value = torch.empty(p.shape, device=self.comm)
                tdist.broadcast(value, src=owner, group=comm["group"])
                if tdist.get_rank() != owner:
                    self._write_one(p, value.to(self.home))

    def _write_one(self, p, value: torch.Tensor) -> None:
        from deepspeed import zero
        from deepspeed.utils import safe_set_full_fp32_param

        value = value.view(p.ds_shape if hasattr(p, "ds_shape") else p.shape)  # ZeRO-3's p: a partition
        if _has_master(p):  # DeepSpeed copies the master's part out of it, whichever device each is on
            safe_set_full_fp32_param(p, value)
        with torch.no_grad():
            if hasattr(p, "ds_id"):  # ZeRO-3: gathered (every rank of the replica, parameter by parameter in the
                # same order), written by the replica's first rank (its rank in the parameters' group), partitioned
                # again on exit
                with zero.GatheredParameters([p], modifier_rank=0):
                    if self.unit.get_data_parallel_rank() == 0:
                        p.data.copy_(value.to(p.dtype))
            else:
                p.data.copy_(value.to(p.dtype))

    # ---------------------------------------------------------------- record
    def describe(self) -> dict:
        return {"every": self.cfg.every, "replicas": self.replicas,
                "outer_lr": self.cfg.outer_lr, "outer_momentum": self.cfg.outer_momentum, "dtype": self.cfg.dtype,
                "warmup_steps": self.cfg.warmup_steps}

    def state_dict(self) -> dict:
        return {"anchor": self.anchor, "momentum": self.momentum, "carry": self.carry}

    def source_rank(self, rank: int) -> int:
        """On another world (whole replicas joined or left: resume.adapt_to_world, replicas of the same size), the
        rank whose saved state this rank takes: the one that held the same slice (and tensor-parallel shard) in
        replica 0 (replicas are consecutive ranks, so that is this rank's index in its replica)."""
        return rank % self.unit.layout.replica_size

    def load_state_dict(self, state: dict, same_world: bool) -> None:
        """The shared weights and the outer momentum of this rank's slice are the same in every replica; the carried
        rounding is its replica's and, on another world, starts again from zero. A checkpoint from before the outer
        state was cut into slices holds the whole model's: this rank keeps its slice of it. On this rank's device,
        whichever device the saving rank used."""
        device = self.home

        def mine(t):
            if t is None:
                return None
            return (t[self.mine] if t.numel() == self.numel else t).to(device).clone()

        if state["anchor"].numel() not in (self.numel, self.mine.stop - self.mine.start):
            raise RuntimeError(f"diloco: the checkpoint's shared weights have {state['anchor'].numel()} elements; "
                               f"this rank's slice has {self.mine.stop - self.mine.start} of {self.numel}")
        self.anchor, self.momentum = mine(state["anchor"]), mine(state["momentum"])
        self.carry = mine(state["carry"]) if same_world else None  # always slice-sized


INT8_BLOCK = 128  # int8/int4: elements sharing one fp32 scale (int8: 1 + 4/128 bytes per element, 3.9x fewer than
# fp32; int4: 0.5 + 4/128, 7.5x fewer)
LEVELS = {"int8": 127, "int4": 7}  # codes -LEVELS..LEVELS, the block's largest magnitude at the ends
BUCKET = 1 << 25  # elements a sync's collective carries at a time (INT8_BLOCK-aligned): the accelerator holds
# buckets, not slices, of what crosses (128 MiB in fp32), whether the outer state is there or in host memory
WIRE_BYTES = {"fp32": 4.0, "bf16": 2.0, "int8": 1 + 4 / INT8_BLOCK, "int4": 0.5 + 4 / INT8_BLOCK}  # per element sent


def warmup_wire(dtype: str) -> str:
    """The wire type of diloco.warmup_steps' syncs: bf16 where the run sends int8/int4. One step's change of the
    weights is small against its block's largest, so int4 codes round most of it to zero; the replicas restart from
    the rounded average each step and the carried remainder arrives steps late (bench/slow_links.py, data order 42:
    10 averaged int4 steps put H = 25 int4 8.6% above the synchronous run at step 300, against 2.2% without them)."""
    return "bf16" if dtype in LEVELS else dtype


def slice_length(n: int, size: int) -> int:
    """Elements of the pseudo-gradient each of a replica's `size` ranks sends across (INT8_BLOCK-aligned)."""
    return -(-n // size // INT8_BLOCK) * INT8_BLOCK if size > 1 else n


def encode(values: torch.Tensor, dtype: str) -> list[torch.Tensor]:
    """What one replica sends of its pseudo-gradient: bf16 values, or int8/int4 codes with one fp32 scale (the
    block's largest magnitude) per INT8_BLOCK elements; int4's codes two to a byte (code + 8 in each half)."""
    if dtype == "bf16":
        return [values.to(torch.bfloat16)]
    padded = torch.nn.functional.pad(values, (0, -values.numel() % INT8_BLOCK)).view(-1, INT8_BLOCK)
    scales = padded.abs().amax(1).clamp_min(1e-30)
    codes = torch.round(padded / scales[:, None] * LEVELS[dtype]).to(torch.int8)
    if dtype == "int4":
        halves = (codes + 8).to(torch.uint8).view(-1, INT8_BLOCK // 2, 2)
        codes = halves[..., 0] | (halves[..., 1] << 4)
    return [codes, scales]


def decode(payload: list[torch.Tensor], dtype: str, numel: int) -> torch.Tensor:
    if dtype == "bf16":
        return payload[0].float()
    codes, scales = payload
    if dtype == "int4":
        codes = torch.stack([codes & 15, codes >> 4], -1).view(-1, INT8_BLOCK).to(torch.int8) - 8
    return (codes.float() * (scales[:, None] / LEVELS[dtype])).reshape(-1)[:numel]


def _numel(p) -> int:
    return p.ds_numel if hasattr(p, "ds_numel") else p.numel()  # ZeRO-3's p: a partition of ds_numel


def _has_master(p) -> bool:
    """Whether DeepSpeed's optimizer keeps a separate fp32 master of p (ZeRO-1/2/3, bf16), public attributes of
    deepspeed.utils.tensor_fragment's accessors."""
    return hasattr(p, "ds_id") or hasattr(p, "_hp_mapping")


def make(recipe: Recipe) -> Diloco | None:
    return Diloco(recipe.diloco) if recipe.diloco.enabled else None
