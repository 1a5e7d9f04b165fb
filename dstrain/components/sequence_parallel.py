"""sequence_parallel_size > 1: DeepSpeed Ulysses sequence parallelism for Hugging Face models (Arctic Long
Sequence Training, deepspeed.runtime.sequence_parallel.ulysses_sp).

DeepSpeed does the parallel attention: UlyssesSPAttentionHF.register_with_transformers makes the groups (sp
consecutive ranks) and replaces the model's attention function with one that exchanges heads for sequence
(all-to-all), attends over the whole sequence with 1/sp of the heads, and exchanges back. What is left to the
training script, and done here and in dstrain.data / dstrain.trainer.steps:
  - the sp ranks of a group read the same samples (Layout.data_parallel_rank) and each keeps its 1/sp slice of
    every sequence with position_ids and labels shifted before slicing (data.shard_sequence). This replaces
    DeepSpeed's UlyssesSPDataLoaderAdapter, which all-gathers each rank's batch to shard it: our batches are a
    pure function of (seed, step), so every rank can cut its slice without any communication;
  - the loss: each rank sums cross-entropy over its slice's labels; DeepSpeed sums gradients over the sp ranks
    and averages over data parallelism, and steps.train_step divides by the label tokens of the global batch;
  - packing without cross-document attention: Ulysses hands the attention function no mask (the model built one
    for the local slice only), so sdpa would attend across packed documents. Before registering, the sdpa entry
    is wrapped (packed_sdpa) to build the block-diagonal causal mask from the gathered position_ids. Flash
    attention takes position_ids itself (varlen) and needs no wrapper.

context_parallel_size > 1: ring attention (components/ring_attention.py) over rings of that many ranks, each
holding two zigzag chunks of every sequence. Its function takes the place of the model's attention entry in
transformers' ALL_ATTENTION_FUNCTIONS (as Ulysses does, so every code path keyed on the implementation's name
still runs); with Ulysses too, Ulysses is registered after it and captures it as its core attention: Ulysses
exchanges heads for sequence inside its group of consecutive ranks (a node), the ring passes key/value blocks
between groups (across nodes). DeepSpeed knows nothing of the ring: its ranks are data-parallel ones to it, and
Layout counts them so (batch arithmetic, gradient divisor, ZeRO partitions).
"""
from __future__ import annotations

import torch

from ..errors import UserError
from ..parallel.layout import parallel_sizes
from . import Component, Setup

SUPPORTED_ATTENTION = ("sdpa", "flash_attention_2", "flash_attention_3", "flex_attention")
RING_ATTENTION = ("sdpa", "flash_attention_2", "flash_attention_3")  # what the ring takes the place of


def text_config(setup: Setup):
    """The language model's config (a multimodal config's text part)."""
    config = setup.model_config
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def attention_of(setup: Setup) -> str:
    """The attention implementation the model will load with: the recipe's, else transformers' default (sdpa)."""
    return setup.recipe.model.attn_implementation or "sdpa"


class SequenceParallel(Component):
    name = "sequence_parallel"

    def __init__(self, size: int, ring: int = 1):
        self.size, self.ring = size, ring

    def validate(self, setup: Setup) -> None:
        if self.ring > 1:
            self.validate_ring(setup)
        if self.size > 1:
            self.validate_ulysses(setup)

    def validate_ring(self, setup: Setup) -> None:
        recipe, cp = setup.recipe, self.ring
        attention = attention_of(setup)
        if attention not in RING_ATTENTION:
            raise UserError(f"context_parallel_size={cp} (ring attention) takes the place of sdpa or flash "
                            f"attention, not {attention}; set model.attn_implementation=sdpa")
        unit = 2 * cp * self.size
        if recipe.train.seq_len % unit:
            raise UserError(f"train.seq_len={recipe.train.seq_len} does not split into 2 zigzag chunks per ring rank "
                            f"(2 x context_parallel_size {cp} x sequence_parallel_size {self.size} = {unit}); "
                            f"choose a multiple of {unit}")
        config = text_config(setup)
        window = getattr(config, "sliding_window", None)
        if window and getattr(config, "use_sliding_window", True) and window < recipe.train.seq_len:
            raise UserError(f"context_parallel_size={cp}: the model attends within a sliding window of {window} "
                            f"tokens, which ring attention does not mask; set train.seq_len <= {window} or drop "
                            f"context_parallel_size")
        for key in ("attn_logit_softcapping", "attention_logit_softcapping"):
            if getattr(config, key, None):
                raise UserError(f"context_parallel_size={cp}: the model caps attention logits ({key}), which ring "
                                f"attention does not do; drop context_parallel_size")
        if getattr(config, "attention_dropout", 0.0):
            raise UserError(f"context_parallel_size={cp}: ring attention has no attention dropout and the model's is "
                            f"{config.attention_dropout}; set model.config_overrides: {{attention_dropout: 0}} in the "
                            f"recipe or drop context_parallel_size")
        if recipe.train.compile:
            raise UserError(f"train.compile with context_parallel_size={cp} is not supported (the ring's point-to-"
                            f"point passes inside compiled blocks are untested here); set train.compile=false")

    def validate_ulysses(self, setup: Setup) -> None:
        recipe, sp = setup.recipe, self.size
        attention = attention_of(setup)
        if attention not in SUPPORTED_ATTENTION:
            raise UserError(f"sequence_parallel_size={sp} needs model.attn_implementation sdpa or flash_attention_2 "
                            f"(Ulysses drops the 4D masks {attention} attention needs); set "
                            f"model.attn_implementation=sdpa")
        config = text_config(setup)
        heads = getattr(config, "num_attention_heads", None)
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        if not heads or heads % sp:
            raise UserError(f"sequence_parallel_size={sp} must divide the model's {heads} attention heads (Ulysses "
                            f"gives each rank heads/sp of them); choose a divisor of {heads}")
        if kv_heads % sp and sp % kv_heads:
            raise UserError(f"sequence_parallel_size={sp} and the model's {kv_heads} key/value heads: one must divide "
                            f"the other; choose a sequence_parallel_size that divides {kv_heads} or a multiple of it")
        if recipe.train.seq_len % sp:
            raise UserError(f"train.seq_len={recipe.train.seq_len} is not divisible by sequence_parallel_size={sp} "
                            f"(each rank holds seq_len/sp tokens); choose a multiple of {sp}")
        zero = setup.ds_cfg.get("zero_optimization") or {}
        if int(zero.get("stage", 0)) == 3 and zero.get("reduce_scatter", True) is False:
            raise UserError(f"sequence_parallel_size={sp} with ZeRO-3 needs zero_optimization.reduce_scatter true "
                            f"(DeepSpeed averages the sp ranks' gradients differently without it); remove that key")
        if recipe.train.compile:
            raise UserError(f"train.compile with sequence_parallel_size={sp} is not supported yet (Ulysses' "
                            f"all-to-all inside compiled blocks is untested here); set train.compile=false")

    def convert(self, model, setup: Setup):
        from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        global _SHARDS
        attention = model.config._attn_implementation
        if self.ring > 1:
            from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
            _SHARDS = Shards(setup.layout)
            ALL_ATTENTION_FUNCTIONS[attention] = ring_attention_function(make_ring(setup.layout))
            # and no mask built for it: a zigzag slice's positions jump (chunk k, then chunk 2C-1-k), which
            # transformers takes for packed documents and answers with a [tokens x tokens] mask the ring drops
            # (measured: the peak of a ring of 2 at 16k tokens grew from 95 MiB at 8k to 232, past whole sequences)
            ALL_MASK_ATTENTION_FUNCTIONS[attention] = no_mask
            per_rank = setup.recipe.train.seq_len // (self.ring * self.size)
            setup.log(f"context parallelism: ring attention over {self.ring} ranks in place of {attention}; each "
                      f"holds 2 zigzag chunks, {per_rank} of {setup.recipe.train.seq_len} tokens per sequence")
            if self.size == 1:
                return model
        if attention == "sdpa" and self.ring == 1 and not getattr(ALL_ATTENTION_FUNCTIONS["sdpa"], "dstrain_packed",
                                                                  False):
            # wrapped before Ulysses captures it (see the module docstring)
            ALL_ATTENTION_FUNCTIONS["sdpa"] = packed_sdpa(ALL_ATTENTION_FUNCTIONS["sdpa"])
        # seq_length_is_variable: evaluation and the last packed rows may be shorter than the configured length
        UlyssesSPAttentionHF.register_with_transformers(
            model_name_or_path=model, core_attn_implementation=attention, sequence_parallel_size=self.size,
            micro_batch_size=setup.recipe.train.micro_batch_size, seq_length_is_variable=True)
        core = "the ring's attention" if self.ring > 1 else f"{attention} attention"
        setup.log(f"sequence parallelism: Ulysses over {self.size} ranks ({core}); each holds "
                  f"{setup.recipe.train.seq_len // (self.size * self.ring)} of {setup.recipe.train.seq_len} tokens "
                  f"per sequence")
        return model

    def describe(self) -> dict:
        return {"size": self.size, **({"context_parallel": self.ring} if self.ring > 1 else {})}


def document_mask(position_ids: torch.Tensor, window: int | None = None) -> torch.Tensor | None:
    """[b, 1, s, s] boolean mask (True: may attend) that is causal within each document of a packed row, the
    documents found as transformers finds them (a new one wherever position_ids do not continue by one), and within
    `window` tokens back where the layer attends in a sliding window (transformers' sliding_window_overlay: a query
    sees the keys less than `window` before it); None when no row holds more than one document and no window cuts."""
    from transformers.masking_utils import find_packed_sequence_indices

    length = position_ids.shape[1]
    document = find_packed_sequence_indices(position_ids)
    cut = window is not None and window < length
    if document is None and not cut:
        return None
    query = torch.arange(length, device=position_ids.device)
    allowed = (query[None, :] <= query[:, None])[None]  # causal
    if cut:
        allowed = allowed & (query[:, None] - query[None, :] < window)[None]
    if document is not None:
        allowed = allowed & (document[:, :, None] == document[:, None, :])
    return allowed.expand(position_ids.shape[0], length, length)[:, None]


def packed_sdpa(sdpa):
    """transformers' sdpa attention, with the mask built from position_ids when it gets none (Ulysses drops the
    model's, built for the local slice): packed documents and the layer's sliding window. sdpa itself ignores the
    `sliding_window` argument (transformers carries the window in the mask): without this, a sliding-window family
    (Gemma 3, Mistral's configs with a window) attended over the whole sequence under Ulysses (issue 85)."""
    def attend(module, query, key, value, attention_mask, *args, **kwargs):
        if attention_mask is None and kwargs.get("position_ids") is not None:
            attention_mask = document_mask(kwargs["position_ids"], kwargs.get("sliding_window"))
        return sdpa(module, query, key, value, attention_mask, *args, **kwargs)
    attend.dstrain_packed = True
    return attend


class Shards:
    """The ranks that hold disjoint parts of the same sequences (Ulysses x ring, sample-sharing), for an objective
    that cuts its own rows (objectives/preference.py) and sums per-sequence values over them."""

    def __init__(self, layout):
        import torch.distributed as dist
        self.size, self.rank, self.ring = layout.sequence_shards, layout.sequence_shard, layout.context_parallel
        self.group = None
        for d in range(layout.world_size // self.size):  # collective: every group made on every rank
            group = dist.new_group(list(range(d * self.size, (d + 1) * self.size)))
            if layout.rank // self.size == d:
                self.group = group

    @property
    def unit(self) -> int:
        """A sequence length must be a multiple of this to split (two zigzag chunks per ring rank)."""
        return self.size * 2 if self.ring > 1 else self.size

    def columns(self, t: torch.Tensor) -> torch.Tensor:
        """This rank's part of [rows, length] tensors, as data.shard_sequence cuts a batch."""
        from ..parallel.layout import zigzag_order
        length = t.shape[1]
        if self.ring > 1:
            t = t[:, zigzag_order(length, self.ring).to(t.device)]
        chunk = length // self.size
        return t[:, self.rank * chunk:(self.rank + 1) * chunk]

    def sum(self, t: torch.Tensor) -> torch.Tensor:
        """The sum over the shards of a per-sequence value; its gradient reaches each shard's part unchanged (each
        rank's loss is the whole sequences' and DeepSpeed sums the ranks' gradients)."""
        return _SumOverShards.apply(t, self.group)


class _SumOverShards(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t, group):
        import torch.distributed as dist
        out = t.detach().clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad, None


_SHARDS: Shards | None = None


def shards() -> Shards | None:
    """The sequence shards of this process once the component converted the model, else None."""
    return _SHARDS


def make_ring(layout):
    """This rank's ring; every ring's group is made on every rank, in one order (new_group is collective)."""
    import torch.distributed as dist

    from .ring_attention import Ring
    mine = None
    for ranks in layout.ring_groups():
        group = dist.new_group(ranks)
        if layout.rank in ranks:
            mine = Ring(group, ranks, layout.rank)
    return mine


def no_mask(*args, **kwargs):
    """transformers' mask builder for the attention the ring replaces: none (the ring masks from positions)."""
    return None


def ring_attention_function(ring):
    """An entry for transformers' ALL_ATTENTION_FUNCTIONS: its arguments, the ring's attention, sdpa's output
    layout ([batch, tokens, heads, dim], no weights). The 4-D mask the model built for the local tokens is
    dropped: the ring masks from positions (causal by global index, documents from position ids)."""
    from .ring_attention import ring_attention

    def attend(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
        positions = kwargs.get("position_ids")
        if positions is None:
            raise RuntimeError(f"ring attention needs position_ids passed to the attention function; "
                               f"{type(module).__name__} does not pass them")
        if dropout:
            raise RuntimeError("ring attention has no attention dropout (components/sequence_parallel refuses it)")
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        positions = positions.expand(query.shape[0], -1) if positions.shape[0] == 1 else positions
        out = ring_attention(query, key, value, positions.to(query.device), ring, scale)
        return out.transpose(1, 2).contiguous(), None
    attend.dstrain_ring = True
    return attend


def make(raw_ds: dict) -> SequenceParallel | None:
    sizes = parallel_sizes(raw_ds)
    return SequenceParallel(sizes.sequence, sizes.context) if sizes.sequence * sizes.context > 1 else None
