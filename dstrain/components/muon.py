"""Muon (train.optimizer=muon): DeepSpeed's MuonWithAuxAdam, with the parameters tagged by what they are and the
update proven to have happened.

Muon (Jordan et al. 2024) keeps one momentum buffer per matrix and replaces each step's update with that
momentum orthogonalised by a Newton-Schulz iteration, scaled by sqrt(max(1, rows / cols)); it is defined for the
2-D hidden matrices (attention and MLP projections). Everything else (the token embeddings, the LM head, norms
and biases) keeps AdamW. DeepSpeed 0.19.8 ships it for every ZeRO stage (ds_config.resolve fills its learning
rates from the recipe and refuses the combinations it gets wrong); what it leaves to its user, and this module
does:
  * which parameters take Muon: deepspeed.initialize decides by name ("embed", "lm_head"), so a GPT-2 `wte` or
    a head with another name would be orthogonalised. Here a parameter takes Muon when it trains, is a matrix as a
    layer (`ds_shape` under zero.Init, where every local tensor is flat) and is not an embedding (any
    nn.Embedding's weight, or the model's output embeddings, by identity); ds_internals.keep_muon_tags keeps
    these tags through initialize.
  * proof: DeepSpeed's silent failures (every parameter left on AdamW under zero.Init, DeepSpeed #8438; plain SGD
    at ZeRO-0, #8441) train without a word. Until the first optimizer step that is not skipped, every call of
    Muon's update is recorded (the shape of each matrix it orthogonalised, on each rank); at that step the ranks'
    records are added up and every tagged matrix must be among them, or the run stops with one line. The run log
    says how many parameters and elements took each update.
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Callable

from ..errors import UserError
from . import Component, Setup


def layer_shape(param) -> tuple[int, ...]:
    """The parameter's shape as a layer (ZeRO-3 under zero.Init holds a flat partition and keeps it in ds_shape)."""
    return tuple(getattr(param, "ds_shape", None) or param.shape)


def tag(model) -> dict:
    """Set `dstrain_muon` on every parameter (True: Muon's update) and count what each update covers."""
    import torch

    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is not None and getattr(head, "weight", None) is not None:
        embeddings.add(id(head.weight))
    counts = {"muon_tensors": 0, "muon_elements": 0, "adamw_tensors": 0, "adamw_elements": 0}
    shapes: Counter = Counter()
    for param in model.parameters():
        shape = layer_shape(param)
        param.dstrain_muon = bool(param.requires_grad and len(shape) == 2 and id(param) not in embeddings)
        if not param.requires_grad:
            continue
        side = "muon" if param.dstrain_muon else "adamw"
        counts[f"{side}_tensors"] += 1
        counts[f"{side}_elements"] += int(torch.Size(shape).numel())
        if param.dstrain_muon:
            shapes[shape] += 1
    return {"counts": counts, "shapes": shapes}


class Muon(Component):
    name = "muon"

    def __init__(self, train) -> None:
        self.train = train
        self.counts: dict = {}
        self.expected: Counter = Counter()
        self.seen: list = []
        self.undo: Callable[[], None] | None = None
        self.engine = None
        self.skipped = 0
        self.proven_at: int | None = None

    def validate(self, setup: Setup) -> None:
        recipe = setup.recipe
        if recipe.lora.r:
            raise UserError("train.optimizer=muon with LoRA (lora.r>0) is not supported: Muon orthogonalises whole "
                            "hidden matrices, and an adapter's factors are rank-r slivers of one; use "
                            "train.optimizer=adamw with LoRA")
        offload = ((setup.ds_cfg.get("zero_optimization") or {}).get("offload_optimizer") or {}).get("device")
        if setup.saved_world and offload == "nvme":
            raise UserError(f"this Muon run's checkpoint was saved on {setup.saved_world} ranks: resuming it on "
                            "another world size with the optimizer on NVMe is not supported (Muon's momentum is "
                            f"put back in host memory only); resume on {setup.saved_world} ranks")
        if recipe.diloco.enabled:
            raise UserError("train.optimizer=muon with DiLoCo is not supported (its inner optimizer is AdamW, and "
                            "Muon there is untested); use one of the two")

    def convert(self, model, setup: Setup):
        from ..run import faults

        tagged = tag(model)
        self.counts, self.expected = tagged["counts"], tagged["shapes"]
        if faults.active("muon", "untag"):  # the proof's test: Muon silently off, every parameter on AdamW
            for param in model.parameters():
                param.dstrain_muon = False
        if not self.expected:
            raise UserError(f"train.optimizer=muon but {setup.recipe.model.name_or_path} has no trainable 2-D hidden "
                            "matrix for Muon; use train.optimizer=adamw")
        return model

    def attach(self, engine, setup: Setup) -> None:
        from ..parallel import ds_internals

        self.engine, self.skipped = engine, engine.skipped_steps
        self.undo = ds_internals.count_muon_updates(self.seen)

    def after_step(self, step: int, say: Callable[[str], None]) -> None:
        if self.proven_at is not None or self.engine is None:
            return
        if self.engine.skipped_steps != self.skipped:  # a skipped step (overflow, a non-finite one) proves nothing
            self.skipped = self.engine.skipped_steps
            return
        self.undo()
        done = _gather(self.seen)
        self.seen.clear()
        missing = {shape: n - done[shape] for shape, n in self.expected.items() if done[shape] < n}
        c = self.counts
        if missing:
            lacking = ", ".join(f"{n} x {list(shape)}" for shape, n in sorted(missing.items()))
            raise UserError(f"train.optimizer=muon but Muon's update did not run on every tagged matrix in step "
                            f"{step} ({sum(done.values())} orthogonalised over the ranks; missing {lacking}): "
                            f"DeepSpeed trained them with another update; train.optimizer=adamw trains without Muon")
        self.proven_at = step
        total = c["muon_elements"] + c["adamw_elements"]
        say(f"muon: step {step} orthogonalised {c['muon_tensors']} matrices ({c['muon_elements']:,} elements, "
            f"{100 * c['muon_elements'] / total:.0f}% of the trained ones; Newton-Schulz ran "
            f"{sum(done.values())} times over the ranks); AdamW updated {c['adamw_tensors']} tensors "
            f"({c['adamw_elements']:,} elements: embeddings, head, norms, biases)")

    def describe(self) -> dict:
        return {"muon_lr": self.train.muon_lr, "adamw_lr": self.train.lr, "momentum": self.train.muon_momentum}


def _gather(shapes: list) -> Counter:
    """Every rank's orthogonalised shapes, added up (all ranks take part)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return Counter(shapes)
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, shapes)
    return Counter(shape for part in everyone for shape in part)


def make(recipe, raw_ds: dict) -> Muon | None:
    from ..parallel.ds_config import optimizer_of

    return Muon(recipe.train) if optimizer_of(raw_ds, recipe.train) == "muon" else None
