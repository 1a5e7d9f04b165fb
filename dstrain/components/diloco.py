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

Streaming DiLoCo (Douillard et al. 2025, "Streaming DiLoCo with overlapping communication"): diloco.fragments P
cuts the trained parameters laid end to end (consecutive layers) into P fragments, each synced every H steps at its
own step (fragment_bounds, due), so one sync sends 1/P of the model: the same bytes, P times lower peak. With
diloco.overlap tau, a fragment's collectives are asynchronous and its outer step lands tau steps after it was sent,
while training goes on; the replica's weights of the fragment then become mix x its own + (1 - mix) x the new
shared ones. The last step lands what is in flight and syncs the whole model. No step has every replica on the
shared weights then: an evaluation swaps them in for its batches (evaluated), and a checkpoint keeps the syncs in
flight (their replicas' mean pseudo-gradients), which land at their step after a resume. torchft's streaming DiLoCo
(FSDP, no DeepSpeed) has no mix but 0 (the replica takes the shared weights, dropping tau steps of its own).

Written here because no library does it for DeepSpeed: torchtitan's DiLoCo lives in torchft (FSDP, its own
process groups and quorum), and DeepSpeed has no local-SGD mode. The inner steps are DeepSpeed's own; the outer step
reads and writes the fp32 master weights through deepspeed.utils' safe_get/set_full_fp32_param (every ZeRO stage)
and the module's working weights (which DeepSpeed refreshes from the masters only at its next step).
"""
from __future__ import annotations

import contextlib
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
        self.bounds = [0, 0]  # diloco.fragments: fragment p is elements [bounds[p], bounds[p + 1])
        self.flights: list[_Flight] = []  # diloco.overlap: syncs sent, their outer steps still to land
        self.engine = None  # the DeepSpeed engine (attach)
        self._offsets: list[tuple] | None = None

    def validate(self, setup: Setup) -> None:
        cfg, recipe, layout = self.cfg, setup.recipe, setup.layout
        train, self.replicas = recipe.train, layout.replicas
        if layout.context_parallel > 1:
            raise UserError(f"diloco with context_parallel_size={layout.context_parallel} is not supported (a ring's "
                            f"ranks would have to stay inside one replica); drop one of the two")
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
        if cfg.fragments > cfg.every:
            raise UserError(f"diloco.fragments={cfg.fragments} is more than diloco.every={cfg.every}: each fragment "
                            f"syncs at its own step of the {cfg.every}; choose diloco.fragments <= {cfg.every}")
        if cfg.overlap >= cfg.every:
            raise UserError(f"diloco.overlap={cfg.overlap} is not less than diloco.every={cfg.every}: a fragment's "
                            f"sync must land before its next one is sent; choose diloco.overlap < {cfg.every}")
        if recipe.compression.enabled:
            raise UserError(f"compression.method={recipe.compression.method} compresses the every-step gradient "
                            f"all-reduce, which under DiLoCo stays inside a replica; set compression.method=none "
                            f"(diloco.dtype=bf16 halves the bytes DiLoCo sends)")
        for key, value in (("eval.every", recipe.eval.every), ("checkpoint.every", recipe.checkpoint.every)):
            if cfg.streaming:
                break
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

        from ..parallel import ds_internals

        self.engine, self.max_steps, self.unit = engine, setup.recipe.train.max_steps, ds_internals.replica_unit()
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
        self.bounds = fragment_bounds(self.numel, self.cfg.fragments)
        chunk = slice_length(self.numel, size)
        self.mine = slice(min(self.numel, index * chunk), min(self.numel, (index + 1) * chunk))
        self.comm = torch.device(get_accelerator().current_device_name())
        zero = setup.ds_cfg.get("zero_optimization") or {}
        offloaded = (zero.get("offload_optimizer") or {}).get("device", "none") in ("cpu", "nvme")
        self.home = torch.device("cpu") if offloaded else self.comm
        self.anchor = self._read()  # a resumed run's comes with the checkpoint (load_state_dict, after this)

    # ---------------------------------------------------------------- the outer step
    def after_step(self, step: int, say: Callable[[str], None]) -> None:
        cfg = self.cfg
        if step <= cfg.warmup_steps:
            self.sync(average=True)
            return
        for flight in [f for f in self.flights if f.lands == step]:  # diloco.overlap: sent `overlap` steps ago
            self._land(flight)
        if step == self.max_steps:  # the run ends on the shared weights: what is in flight lands, then all syncs
            for flight in list(self.flights):
                self._land(flight)
            self.sync()
            return
        for frag in due(step, cfg.every, cfg.fragments):
            lo, hi = self.bounds[frag], self.bounds[frag + 1]
            flight = self._send(lo, hi, lands=step + cfg.overlap if cfg.overlap else 0,
                                mix=cfg.mix if cfg.overlap else 0.0)
            if cfg.overlap:
                self.flights.append(flight)
            else:
                self._land(flight)

    def sync(self, average: bool = False) -> None:
        """The whole model's sync, waited for (every sync without diloco.fragments / overlap; the warmup's and the
        last step's with them). average: the plain average of the replicas (diloco.warmup_steps), not the outer
        step; its momentum is left as it is."""
        self._land(self._send(0, self.numel, lands=0, average=average))

    def _send(self, lo: int, hi: int, lands: int, average: bool = False, mix: float = 0.0) -> _Flight:
        """Sends this rank's part of elements [lo, hi)'s pseudo-gradient (the shared weights of the last sync minus
        its replica's now) across the replicas, to land after step `lands` (0: now, waited for here); _land takes
        the outer step.

        Each rank of a replica owns one slice of the model (slice i of S, INT8_BLOCK-aligned so that int8/int4's
        blocks are the whole vector's): it keeps the shared weights, the momentum and the carried rounding of that
        slice only, sends its part of the pseudo-gradient across the replicas, takes the outer step on it, and the
        replica's ranks then put the new shared weights together over their own link. One model's worth crosses
        the slow link per replica and sync, not one per rank; the outer state is 1/S of the model per rank (a 7B
        model's fp32 shared weights and momentum are 56 GB, which a rank of a replica of 8 keeps 7 GB of), in host
        memory when the optimizer is offloaded. Memory at the sync (memory.py counts it): this slice's
        pseudo-gradient, what crosses of it (in flight for diloco.overlap steps: the replicas' int4 codes of it
        take replicas x 0.53 bytes an element), a few buckets and one parameter's full weight at a time."""
        cfg, replicas, unit, home, comm = self.cfg, self.unit.layout.replicas, self.unit, self.home, self.comm
        a, b = self._part(lo, hi)
        pseudo = self._read(lo, hi)
        torch.sub(self.anchor[a:b], pseudo, out=pseudo)  # this rank's part of the pseudo-gradient
        wire = warmup_wire(cfg.dtype) if average else cfg.dtype
        if wire != "fp32":  # compressed on the wire, the rounding carried to the next sync (error feedback)
            if self.carry is None:
                self.carry = torch.zeros_like(self.anchor)
            pseudo += self.carry[a:b]
        # with diloco.overlap the next steps train while it crosses (asynchronous collectives: each process group has
        # its own connections, so DeepSpeed's inside the replica do not queue behind it); waited for here otherwise,
        # a bucket at a time: the accelerator holds buckets, not slices, of what crosses
        flight = _Flight(lo, hi, lands, average, mix, wire, pseudo, [])
        for k in range(0, pseudo.numel(), BUCKET):  # a bucket at a time (INT8_BLOCK-aligned: the same blocks)
            part = pseudo[k:k + BUCKET]
            if wire == "fp32":
                sent = part.to(comm)
                work = tdist.all_reduce(sent, group=unit.across, async_op=True)
                flight.works.append((k, [work], sent))
            else:
                payload = [t.to(comm) for t in encode(part, wire)]
                self.carry[a + k:a + k + part.numel()] = part - decode([t.to(home) for t in payload], wire,
                                                                       part.numel())
                gathered = [[torch.empty_like(t) for _ in range(replicas)] for t in payload]
                works = [tdist.all_gather(parts, t, group=unit.across, async_op=True)  # summed in fp32, not on the wire
                         for parts, t in zip(gathered, payload)]
                flight.works.append((k, works, (payload, gathered)))
            if not lands:
                self._arrived(flight, flight.works.pop())
        return flight

    def _arrived(self, f: _Flight, bucket: tuple) -> None:
        """Waits for one bucket of a flight and puts the replicas' sum of it in place of this replica's."""
        k, works, wire = bucket
        for work in works:
            work.wait()
        part, home, replicas = f.pseudo[k:k + BUCKET], self.home, self.unit.layout.replicas
        if f.wire == "fp32":
            if wire.device != part.device:
                part.copy_(wire)
            return
        gathered = wire[1]
        part.copy_(decode([parts[0].to(home) for parts in gathered], f.wire, part.numel()))
        for r in range(1, replicas):  # one replica's at a time, in replica order
            part += decode([parts[r].to(home) for parts in gathered], f.wire, part.numel())

    def _finish(self, f: _Flight) -> torch.Tensor:
        """Waits for a flight and returns the replicas' mean pseudo-gradient of this rank's part (once)."""
        if f.works is not None:
            for bucket in f.works:
                self._arrived(f, bucket)
            f.pseudo /= self.unit.layout.replicas
            f.works = None
        return f.pseudo

    def _land(self, f: _Flight) -> None:
        """The outer step on [f.lo, f.hi) (the plain average for diloco.warmup_steps' syncs); this replica's
        weights there become the new shared weights, or with f.mix, mix x its own + (1 - mix) x the shared."""
        cfg = self.cfg
        pseudo = self._finish(f)
        if f in self.flights:
            self.flights.remove(f)
        a, b = self._part(f.lo, f.hi)
        mu = 0.0 if f.average else cfg.outer_momentum
        if mu > 0:  # torch.optim.SGD's Nesterov: buf = mu buf + g (g itself at first: buf starts at 0), step g + mu buf
            if self.momentum is None:
                self.momentum = torch.zeros_like(self.anchor)
            buf = self.momentum[a:b].mul_(mu).add_(pseudo)
            pseudo.add_(buf, alpha=mu)
        anchor = self.anchor[a:b].add_(pseudo, alpha=-(1.0 if f.average else cfg.outer_lr))
        del pseudo
        target = anchor
        if f.mix:  # this replica trained on while the sync crossed: keep part of that
            target = self._read(f.lo, f.hi).mul_(f.mix).add_(anchor, alpha=1 - f.mix)
        self._write(target, f.lo, f.hi)
        self._tied()

    @contextlib.contextmanager
    def evaluated(self):
        """Streaming (diloco.fragments / overlap): no step has every replica on the shared weights, so an evaluation
        swaps them in (this rank's slice of its replica's weights kept aside, written back after: the masters
        exactly, and the working copy is their cast as before) and measures the model the run exports. Without
        streaming, evaluations come at the syncs (validate), where the replicas hold the shared weights already."""
        if not self.cfg.streaming or self.anchor is None:
            yield
            return
        own = self._read()
        self._write(self.anchor, 0, self.numel)
        self._tied()
        try:
            yield
        finally:
            # ZeRO-3: the evaluation's forward leaves parameters prefetched for a next forward (in flight, which
            # GatheredParameters cannot re-partition); DeepSpeed's public call waits for them and partitions all
            self.engine.empty_partition_cache()
            self._write(own, 0, self.numel)
            self._tied()

    # ---------------------------------------------------------------- DeepSpeed's weights
    def _spans(self) -> list[tuple]:
        """(parameter, first element, elements) of each trained parameter laid end to end."""
        if self._offsets is None:
            self._offsets, start = [], 0
            for p in self.params:
                self._offsets.append((p, start, _numel(p)))
                start += _numel(p)
        return self._offsets

    def _part(self, lo: int, hi: int) -> tuple[int, int]:
        """This rank's part of elements [lo, hi), as positions in its slice (anchor, momentum, carry)."""
        a, b = max(lo, self.mine.start), min(hi, self.mine.stop)
        return a - self.mine.start, max(a, b) - self.mine.start

    def _read(self, lo: int = 0, hi: int | None = None) -> torch.Tensor:
        """This rank's part of elements [lo, hi) of the trained parameters' full fp32 master weights, laid end to
        end (DeepSpeed's optimizer holds the master under ZeRO-1/2/3 and bf16; under ZeRO-0 in fp32 the parameter
        is the master). Every rank of the replica reads every parameter in [lo, hi) (under ZeRO-1/2/3 the read is a
        collective of the replica), one at a time, and keeps the part inside its slice."""
        hi = self.numel if hi is None else hi
        a, b = self._part(lo, hi)
        out, base = torch.empty(b - a, device=self.home), self.mine.start + a
        for p, start, n in self._spans():
            if start + n <= lo or start >= hi:
                continue
            value = _full(p)
            x, y = max(base, start), min(self.mine.start + b, start + n)
            if x < y:
                out[x - base:y - base].copy_(value[x - start:y - start])
            del value
        return out

    def _write(self, source: torch.Tensor, lo: int, hi: int) -> None:
        """New weights for elements [lo, hi) into the masters and the module's working copy (DeepSpeed copies
        masters to it only after its next step); source is this rank's part. The replica's ranks broadcast their
        parts in turn over their own link, a bucket at a time, and each parameter is written once its last piece in
        [lo, hi) has arrived (one cut by a fragment's end keeps the rest of its weights: read first): a bucket and
        one parameter's full weight exist at a time (gathering the slices into a full fp32 vector took 4 bytes a
        parameter: 30 GiB a rank for Llama-3.1-8B)."""
        unit, home, comm = self.unit, self.home, self.comm
        size, index = unit.get_data_parallel_world_size(), unit.get_data_parallel_rank()
        group, chunk = unit.get_data_parallel_group(), slice_length(self.numel, size)
        spans = iter([span for span in self._spans() if span[1] < hi and span[1] + span[2] > lo])

        def begin():
            span = next(spans, None)
            if span is None:
                return None, 0, 0, None
            p, start, n = span
            whole = lo <= start and start + n <= hi
            value = torch.empty(n, device=home) if whole else _full(p).to(home, copy=True)
            return p, start, min(hi, start + n), value

        p, start, end, value = begin()  # p's full weight; p starts at `start`; its last element written: end - 1
        mine = self.mine.start + self._part(lo, hi)[0]  # where source starts
        for j in range(size):
            for first in range(max(lo, j * chunk), min(hi, (j + 1) * chunk), BUCKET):
                x, y = first, min(hi, (j + 1) * chunk, first + BUCKET)
                if j == index:
                    piece = source[x - mine:y - mine]
                    piece = piece.to(comm) if size > 1 else piece
                else:
                    piece = torch.empty(y - x, device=comm)
                if size > 1:
                    tdist.broadcast(piece, src=tdist.get_global_rank(group, j), group=group)
                while x < y and p is not None:  # the parameters this piece continues or completes
                    stop = min(y, end)
                    value[x - start:stop - start].copy_(piece[x - first:stop - first])
                    x = stop
                    if stop == end:
                        self._write_one(p, value)
                        p, start, end, value = begin()
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
                "warmup_steps": self.cfg.warmup_steps, "fragments": self.cfg.fragments, "overlap": self.cfg.overlap,
                "mix": self.cfg.mix}

    def state_dict(self) -> dict:
        """flights: diloco.overlap's syncs sent and not landed; a checkpoint waits for them to cross and keeps the
        replicas' mean pseudo-gradient (this rank's part), which lands at its step after a resume."""
        flights = [{"lo": f.lo, "hi": f.hi, "lands": f.lands, "mix": f.mix, "mean": self._finish(f)}
                   for f in self.flights]
        return {"anchor": self.anchor, "momentum": self.momentum, "carry": self.carry, "flights": flights}

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
        self.flights = [_Flight(f["lo"], f["hi"], f["lands"], False, f["mix"], self.cfg.dtype, f["mean"].to(device),
                                None) for f in state.get("flights", ())]  # the same in every replica


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


def fragment_bounds(n: int, fragments: int) -> list[int]:
    """diloco.fragments: fragment p is elements [b[p], b[p + 1]) of the trained parameters laid end to end (a
    pipeline stage's, per stage), b[p] = p n / fragments rounded down to a multiple of INT8_BLOCK (int8/int4's
    blocks stay the whole vector's); consecutive elements are consecutive layers."""
    return [min(n, (p * n // fragments) // INT8_BLOCK * INT8_BLOCK) for p in range(fragments)] + [n]


def due(step: int, every: int, fragments: int) -> list[int]:
    """The fragments whose sync is sent after `step`: fragment p at steps (p + 1) every / fragments (rounded down)
    past each multiple of `every`, so the last fragment (the whole model, with one) at the multiples themselves."""
    return [p for p in range(fragments) if step % every == (p + 1) * every // fragments % every]


class _Flight:
    """A sync of elements [lo, hi) sent and not yet landed: this rank's part of the pseudo-gradient (the replicas'
    mean once _finish has waited for the collectives), landing after step `lands` (diloco.overlap)."""

    def __init__(self, lo, hi, lands, average, mix, wire, pseudo, works):
        self.lo, self.hi, self.lands, self.average, self.mix, self.wire = lo, hi, lands, average, mix, wire
        self.pseudo, self.works = pseudo, works  # works: (offset, collectives, buffers) of each bucket not arrived


def _full(p) -> torch.Tensor:
    """p's full fp32 weight, flat: the master (a collective of the replica under ZeRO), or p itself."""
    from deepspeed.utils import safe_get_full_fp32_param

    return (safe_get_full_fp32_param(p) if _has_master(p) else p.detach().float()).reshape(-1)


def _numel(p) -> int:
    return p.ds_numel if hasattr(p, "ds_numel") else p.numel()  # ZeRO-3's p: a partition of ds_numel


def _has_master(p) -> bool:
    """Whether DeepSpeed's optimizer keeps a separate fp32 master of p (ZeRO-1/2/3, bf16), public attributes of
    deepspeed.utils.tensor_fragment's accessors."""
    return hasattr(p, "ds_id") or hasattr(p, "_hp_mapping")


def make(recipe: Recipe) -> Diloco | None:
    return Diloco(recipe.diloco) if recipe.diloco.enabled else None
