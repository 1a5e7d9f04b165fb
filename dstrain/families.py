"""What a model family allows: the invariants the layouts that cut sequences rely on, checked on a small random copy
of the run's own config, in process, on CPU, before anything is built (issue 85).

Packing and sequence parallelism (Ulysses, ring attention) assume that only attention moves information between
positions, and that the attention honours what the run gives it (position_ids that restart per document, the layer's
sliding window). Families whose layers carry state across positions (Mamba and other state-space layers, short
convolutions, linear attention, RWKV) break both without an error: a packed document reads the one before it, a
sequence-parallel rank's slice misses the tokens before it. No peer checks this; transformers' Mamba2-based layers
take sequence indices only in their CUDA kernels (`seq_idx`), not on the CPU path, so here such a family is refused
the layout in one line rather than made exact.

The checks:
  - packing: two documents in one row (position_ids restarting at the second); the second document's logits must
    equal its logits alone;
  - a sequence split (what Ulysses and the ring do to every layer that is not attention): the row cut into two
    halves, each run through the model separately with the attention exchanged between them in process (two
    threads meeting at every attention call: the all-to-all without processes), the attention done by the function
    the run registers (components/sequence_parallel.packed_sdpa); the halves' logits must equal the whole row's under
    the model's own attention.
Both to fp32 rounding (TOLERANCE). A cell that does not hold names the first module whose output moved.
"""
from __future__ import annotations

import copy
import hashlib
import json
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from .errors import UserError

TOLERANCE = 1e-4  # largest logit difference that counts as equal (fp32, random init: dense families ~2e-7)
LENGTH = 64  # the probe row; the copy's windows and chunks are cut below it so that they cut
FIRST = 24  # the first document of the packed row
WIDTH = 64  # the copy's hidden size
PROBE_ATTENTION = "dstrain_split_probe"


@dataclass
class Cell:
    layout: str  # a key of CHECKS: "packing", "sequence split", "chunked loss", "activation checkpointing", "pipeline"
    difference: float
    culprit: str | None  # "layer 0's mamba (BambaMixer)": the first module whose output moved (or the error)

    @property
    def holds(self) -> bool:
        return self.difference <= TOLERANCE


# ---------------------------------------------------------------------------------------------- the small copy
_NARROW = {  # attribute: value in the copy (where the config has the attribute and it is set)
    "hidden_size": WIDTH, "n_embd": WIDTH, "d_model": WIDTH,
    "intermediate_size": 2 * WIDTH, "ffn_hidden_size": 2 * WIDTH, "n_inner": 2 * WIDTH, "ffn_dim": 2 * WIDTH,
    "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32, "expert_intermediate_size": 32,
    "num_attention_heads": 4, "n_head": 4, "num_heads": 4, "head_dim": 16, "attention_head_dim": 16,
    "kv_lora_rank": 16, "q_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 16,
    "qk_head_dim": 16,
    "mamba_d_state": 8, "ssm_state_size": 8, "state_size": 8, "mamba_d_head": 16, "mamba_n_groups": 1,
    "n_groups": 1, "mamba_chunk_size": 16, "chunk_size": 16, "time_step_rank": 8,
    "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16, "linear_value_head_dim": 16,
    "num_experts_per_tok": 2, "moe_topk": 2, "n_group": 1, "topk_group": 1, "hidden_size_per_layer_input": 16,
}
_CAPPED = {"num_experts": 4, "num_local_experts": 4, "n_routed_experts": 4, "moe_num_experts": 4,
           "n_shared_experts": 1, "num_shared_experts": 1, "sliding_window": 16, "attention_chunk_size": 16,
           "local_window_size": 16, "attention_window_size": 16}


def small_copy(config, narrow: bool = True):
    """A copy of the (text) config that builds in well under a second: WIDTH wide, 4 heads of 16, a few experts,
    windows of 16, enough layers to hold each layer kind the config lists (at most 8 otherwise), its vocabulary
    kept (token ids in the config stay valid)."""
    c = copy.deepcopy(config.get_text_config() if hasattr(config, "get_text_config") else config)
    if narrow:
        _narrow(c)
    for key, value in _CAPPED.items():
        if isinstance(_get(c, key), int) and not isinstance(getattr(c, key), bool):
            setattr(c, key, min(getattr(c, key), value))
    layers = _get(c, "num_hidden_layers") or _get(c, "n_layer")
    keep = min(layers or 8, 8)
    kinds = _get(c, "layer_types")
    if isinstance(kinds, (list, tuple)) and kinds:
        firsts = {kind: kinds.index(kind) for kind in dict.fromkeys(kinds)}  # enough layers for each kind
        try:
            c.layer_types = list(kinds[:max(2, max(firsts.values()) + 1)])
            keep = len(c.layer_types)
        except AttributeError:  # derived from other keys (a property): those are cut below
            pass
    for key, value in c.to_dict().items():  # patterns given another way: every kind within the kept layers
        if key.endswith("_period") and isinstance(value, int) and value > 2:  # Jamba: attention every 8th layer
            setattr(c, key, 2)
            if isinstance(_get(c, key[:-len("period")] + "offset"), int):
                setattr(c, key[:-len("period")] + "offset", 1)
        elif key.endswith(("_indices", "_idxs")) and isinstance(value, list) and value \
                and all(isinstance(i, int) for i in value):  # Bamba's attention layers, LFM2's
            setattr(c, key, [i for i in value if i < keep] or [min(value[0], keep - 1)])
    for key in ("num_hidden_layers", "n_layer"):
        if _get(c, key) is not None:
            setattr(c, key, keep)
    if isinstance(_get(c, "per_layer_config"), dict):  # Gemma 4's overrides of layers the copy does not have
        c.per_layer_config = {k: v for k, v in c.per_layer_config.items() if not k.isdigit() or int(k) < keep}
    if isinstance(_get(c, "num_kv_shared_layers"), int):  # Gemma 3n/4: later layers reuse earlier ones' keys
        c.num_kv_shared_layers = min(c.num_kv_shared_layers, max(0, keep - len(set(_get(c, "layer_types") or []))))
    for key in ("max_position_embeddings", "n_positions"):
        if isinstance(_get(c, key), int) and getattr(c, key) < LENGTH:
            setattr(c, key, LENGTH)
    for key in ("attention_dropout", "hidden_dropout", "dropout", "resid_pdrop", "embd_pdrop", "attn_pdrop"):
        if isinstance(_get(c, key), float):
            setattr(c, key, 0.0)
    c.use_cache = False
    return c


def runnable_copy(config, limit: int = 200_000_000):
    """(config, model) of the copy, checked to run a plain forward. Where the narrow copy does not (a family whose
    sizes are tied in ways _NARROW does not know), the copy keeps the model's own widths and only cuts its depth,
    experts and windows, if that stays under `limit` parameters; else the narrow copy's error is raised."""
    small = small_copy(config)
    try:
        model = build(small)
        _plain_forward(model, small)
        return small, model
    except Exception as narrow:  # noqa: BLE001 - retried wide, else this error is the one reported
        wide = small_copy(config, narrow=False)
        try:
            model = build(wide, limit=limit)
        except ValueError:
            raise narrow from None
        _plain_forward(model, wide)
        return wide, model


def _plain_forward(model, config) -> None:
    with torch.no_grad():
        model(input_ids=_rows(config, torch.Generator().manual_seed(0))[:, :8])


_STATE_SPACE_HEADS = (("mamba_n_heads", "mamba_d_head", "mamba_expand"),  # Bamba, Falcon-H1
                      ("num_heads", "head_dim", "expand"),  # Mamba-2
                      ("n_mamba_heads", "mamba_headdim", "mamba_expand"))  # Zamba2


def _narrow(c) -> None:
    """WIDTH wide, 4 heads of 16 (grouped-query attention stays grouped: 1, 2 or 4 key/value heads)."""
    kv, heads = _get(c, "num_key_value_heads"), _get(c, "num_attention_heads")
    for key, value in _NARROW.items():
        if _get(c, key) is not None:
            _set(c, key, value)
    for key in ("num_key_value_heads", "num_kv_heads"):
        if kv is not None and _get(c, key) is not None:
            _set(c, key, 4 if heads is None or kv >= heads else 1 if kv == 1 else 2)
    per_layer = _get(c, "per_layer_config")  # Gemma 4: some layers' own head_dim and the like
    if isinstance(per_layer, dict):
        for overrides in per_layer.values():
            if isinstance(overrides, dict):
                overrides.update({k: _NARROW[k] for k in overrides if k in _NARROW})
    for key, value in (("head_dim", 16), ("num_key_value_heads", 4)):  # left unset (None) where the code reads them
        if key in c.to_dict() and _get(c, key) is None:
            _set(c, key, value)
    if _get(c, "qk_rope_head_dim") is not None and _get(c, "head_dim") is not None:
        _set(c, "head_dim", c.qk_rope_head_dim)  # multi-head latent attention: its rotary part
    if isinstance(_get(c, "rotary_dim"), int):  # GPT-J, CodeGen: rotary on part of each head
        _set(c, "rotary_dim", 8)
    for heads_key, dim_key, expand_key in _STATE_SPACE_HEADS:  # the state-space heads span the expanded width
        if isinstance(_get(c, heads_key), int) and _get(c, expand_key):
            setattr(c, dim_key, 16)
            setattr(c, heads_key, int(getattr(c, expand_key) * WIDTH) // 16)
    if _get(c, "mamba_d_ssm") is not None:
        c.mamba_d_ssm = int(c.mamba_expand * WIDTH)
    if _get(c, "attention_hidden_size") is not None:  # Zamba's attention on [hidden, original hidden]
        c.attention_hidden_size = 2 * WIDTH


def _get(c, key: str):
    """A config's value, or None (also where it is per layer and reading it whole raises, as in Gemma 4)."""
    try:
        return getattr(c, key, None)
    except Exception:  # noqa: BLE001 - transformers' AmbiguousGlobalPerLayerAttributeError and the like
        return c.__dict__.get(key)


def _set(c, key: str, value) -> None:
    """Set where the config lets it (a key derived from others is a property without a setter: left to them)."""
    try:
        setattr(c, key, value)
    except AttributeError:
        pass


def build(config, attention: str = "sdpa", limit: int = 100_000_000):
    """The copy, random, fp32, in eval mode (no dropout); eager attention where the family has no sdpa. Counted on
    the meta device first: a copy over `limit` parameters (sizes this module does not know how to cut, such as
    Byte Latent Transformer's hash embeddings) is not built."""
    from transformers import AutoModelForCausalLM

    # a config read with the run's trust_remote_code names its own classes (auto_map): the copy is built from them
    remote = "AutoModelForCausalLM" in (getattr(config, "auto_map", None) or {})
    with torch.device("meta"):
        try:
            size = sum(p.numel() for p in AutoModelForCausalLM.from_config(config, trust_remote_code=remote)
                       .parameters())
        except ValueError:
            size = 0  # refused for sdpa on meta too: counted below when built eager
    if size > limit:
        raise ValueError(f"the small copy still has {size / 1e6:.0f}M parameters")
    torch.manual_seed(0)
    try:
        model = AutoModelForCausalLM.from_config(config, attn_implementation=attention, dtype=torch.float32,
                                                 trust_remote_code=remote)
    except ValueError as e:
        if "does not support an attention implementation" not in str(e):
            raise
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32,
                                                 trust_remote_code=remote)
    return model.eval()


# ---------------------------------------------------------------------------------------------- the checks
def _rows(config, generator: torch.Generator) -> torch.Tensor:
    vocab = getattr(config, "vocab_size", None) or 1000
    return torch.randint(min(10, vocab - 1), min(vocab, 5000), (1, LENGTH), generator=generator)


class _Recorder:
    """Outputs of every decoder layer and of each layer's direct children, in the order they ran."""

    def __init__(self, model, when=None):
        self.when = when  # records only while this says so (the probe's slices run in threads)
        self.outputs: dict[str, list[torch.Tensor]] = {}
        self.order: list[str] = []
        self.handles = []
        layers = _decoder_layers(model)
        for i, layer in enumerate(layers):
            self._watch(f"layer {i}", layer)
            for name, child in layer.named_children():
                self._watch(f"layer {i}'s {name} ({type(child).__name__})", child)

    def _watch(self, label, module):
        def hook(_module, _args, out):
            if self.when is not None and not self.when():
                return
            t = out[0] if isinstance(out, (tuple, list)) else out
            if isinstance(t, torch.Tensor) and t.dim() >= 2:
                if label not in self.outputs:
                    self.order.append(label)
                self.outputs.setdefault(label, []).append(t.detach())
        self.handles.append(module.register_forward_hook(hook))

    def close(self):
        for h in self.handles:
            h.remove()


def _decoder_layers(model) -> list:
    found = None
    for _name, module in model.named_modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) and (found is None or len(module) > len(found)):
            found = module
    return list(found) if found is not None else []


def _culprit(got: _Recorder, want: _Recorder, pick_got, pick_want) -> str | None:
    """The first watched module (in the order they ran) whose output differs."""
    for label in want.order:
        if label not in got.outputs:
            continue
        a, b = pick_got(got.outputs[label]), pick_want(want.outputs[label])
        if a is not None and b is not None and a.shape == b.shape and _moved(a, b):
            if not label.endswith(")") and any(other.startswith(label + "'s") for other in want.order):
                continue  # a layer whose children are watched: name the child
            return label
    return None


def _moved(a: torch.Tensor, b: torch.Tensor) -> bool:
    """An output that moved beyond fp32 rounding of its own scale (a small leak grows through later layers: the
    culprit is where it starts, however small it is there)."""
    return (a - b).abs().max().item() > max(1e-6, 1e-5 * b.abs().max().item())


def check_packing(model, config) -> Cell:
    """The second of two documents packed in one row against the same document alone."""
    ids = _rows(config, torch.Generator().manual_seed(1))
    positions = torch.cat([torch.arange(FIRST), torch.arange(LENGTH - FIRST)])[None]
    with torch.no_grad():
        packed_rec = _Recorder(model)
        packed = model(input_ids=ids, position_ids=positions).logits[:, FIRST:]
        packed_rec.close()
        alone_rec = _Recorder(model)
        alone = model(input_ids=ids[:, FIRST:], position_ids=positions[:, FIRST:]).logits
        alone_rec.close()
    diff = (packed - alone).abs().max().item()
    culprit = _culprit(packed_rec, alone_rec, lambda ts: _tail(ts[0], LENGTH - FIRST), lambda ts: ts[0]) \
        if diff > TOLERANCE else None
    return Cell("packing", diff, culprit)


def check_head(model, config) -> Cell:
    """train.loss_chunk_tokens computes the loss from the output head applied to the base model's last hidden state
    (components/chunked_loss.py, without the full logits): those must be the model's own logits. Families that scale,
    cap or shift their logits after the head otherwise train on another loss than the model's."""
    from .components import chunked_loss

    why = chunked_loss.check(model)
    if why:
        return Cell("chunked loss", float("inf"), why)
    ids = _rows(config, torch.Generator().manual_seed(2))
    with torch.no_grad():
        theirs = model(input_ids=ids).logits
        ours = model.get_output_embeddings()(model.base_model(input_ids=ids)[0])
    diff = (theirs - ours).abs().max().item() if theirs.shape == ours.shape else float("inf")
    return Cell("chunked loss", diff, None if diff <= TOLERANCE else
                "its logits are not the head applied to the last hidden state")


def check_checkpointing(model, config) -> Cell:
    """train.activation_checkpointing recomputes each layer's forward in backward (transformers' own, non-reentrant):
    the gradients must be those of the plain backward (a layer whose forward draws random numbers or keeps state
    would differ)."""
    if not getattr(model, "supports_gradient_checkpointing", False):
        return Cell("activation checkpointing", float("inf"), f"{type(model).__name__} does not support it in "
                                                              f"transformers")
    ids = _rows(config, torch.Generator().manual_seed(3))

    def gradients(checkpointed: bool) -> list[torch.Tensor]:
        model.zero_grad(set_to_none=True)
        if checkpointed:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
        try:
            torch.manual_seed(0)
            logits = model(input_ids=ids).logits[:, :-1]  # the loss as train.py takes it (from the logits)
            torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1)).backward()
        finally:
            model.eval()
            if checkpointed:
                model.gradient_checkpointing_disable()
        return [p.grad.clone() for p in model.parameters() if p.grad is not None]

    want, got = gradients(False), gradients(True)
    model.zero_grad(set_to_none=True)
    if len(want) != len(got):
        return Cell("activation checkpointing", float("inf"), "it leaves some parameters without a gradient")
    diff = max(((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item() for a, b in zip(got, want))
    return Cell("activation checkpointing", diff, None if diff <= TOLERANCE else
                "its recomputed forward differs from the first")


def check_pipeline(model, config) -> Cell:
    """Pipeline stages pass hidden states only: each decoder layer's wrapper rebuilds positions, rotary embeddings and
    its mask (components/pipeline.py). The stages run one after another must give the model's own logits: a window
    the wrapper left out (Mistral's, a Qwen's sliding layers) trained with full attention past it (issue 85)."""
    from .components import pipeline

    family = getattr(config, "model_type", type(config).__name__)
    if family not in pipeline.SUPPORTED:
        built = ", ".join(sorted(pipeline.SUPPORTED))
        return Cell("pipeline", float("inf"), f"no stage layout (stages are built for {built} only)")
    ids = _rows(config, torch.Generator().manual_seed(4))
    with torch.no_grad():
        want = model(input_ids=ids).logits
        got = pipeline.stages_chained(model, ids)
    diff = (got - want).abs().max().item() if got.shape == want.shape else float("inf")
    return Cell("pipeline", diff, None if diff <= TOLERANCE else "its decoder layers cut into stages")


def _tail(t: torch.Tensor, n: int) -> torch.Tensor | None:
    """The last n positions of a [batch, seq, ...] output (None when it is not laid out so)."""
    return t[:, -n:] if t.dim() >= 2 and t.shape[1] >= n and t.shape[0] == 1 else None


def check_sequence_split(model, config, shards: int = 2) -> Cell:
    """The row cut into `shards` slices run as separate forwards that meet at every attention call, against the
    whole row under the model's own attention."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from .components.sequence_parallel import packed_sdpa

    ids = _rows(config, torch.Generator().manual_seed(2))
    positions = torch.arange(LENGTH)[None]
    own = model.config._attn_implementation
    with torch.no_grad():
        whole_rec = _Recorder(model)
        whole = model(input_ids=ids, position_ids=positions).logits
        whole_rec.close()
    core = packed_sdpa(ALL_ATTENTION_FUNCTIONS["sdpa"])
    barrier = threading.Barrier(shards, timeout=120)
    slots: list = [None] * shards
    local = threading.local()

    def exchanged(module, query, key, value, attention_mask, *args, **kwargs):
        rank = local.rank
        slots[rank] = (query, key, value, kwargs.get("position_ids"))
        barrier.wait()
        q, k, v = (torch.cat([s[i] for s in slots], dim=2) for i in range(3))
        gathered = dict(kwargs)
        if slots[0][3] is not None:
            gathered["position_ids"] = torch.cat([s[3] for s in slots], dim=1)
        barrier.wait()  # every slice read before any writes its next layer's
        out, weights = core(module, q, k, v, None, *args, **gathered)
        chunk = query.shape[2]
        return out[:, rank * chunk:(rank + 1) * chunk], weights

    chunk = LENGTH // shards
    results: list = [None] * shards

    def run(rank):
        local.rank = rank
        try:
            with torch.no_grad():
                part = slice(rank * chunk, (rank + 1) * chunk)
                results[rank] = model(input_ids=ids[:, part], position_ids=positions[:, part]).logits
        except BaseException as e:  # noqa: BLE001 - reported by the caller; the other slice must not wait forever
            results[rank] = e
            barrier.abort()

    # the last slice is the one that needs what came before it: its modules' outputs name the culprit
    last = _Recorder(model, when=lambda: getattr(local, "rank", None) == shards - 1)
    ALL_ATTENTION_FUNCTIONS[PROBE_ATTENTION] = exchanged
    ALL_MASK_ATTENTION_FUNCTIONS[PROBE_ATTENTION] = _no_mask
    _set_attention(model, PROBE_ATTENTION)
    try:
        threads = [threading.Thread(target=run, args=(r,)) for r in range(shards)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        _set_attention(model, own)
        last.close()
        del ALL_ATTENTION_FUNCTIONS[PROBE_ATTENTION]
        del ALL_MASK_ATTENTION_FUNCTIONS[PROBE_ATTENTION]
    failed = [r for r in results if isinstance(r, BaseException)]
    if failed:  # the slice whose forward failed, not the one left waiting at the barrier it broke
        raise next((e for e in failed if not isinstance(e, threading.BrokenBarrierError)), failed[0])
    split = torch.cat(results, dim=1)
    diff = (split - whole).abs().max().item()
    culprit = _culprit(last, whole_rec, lambda ts: ts[0], lambda ts: _tail(ts[0], chunk)) \
        if diff > TOLERANCE else None
    return Cell("sequence split", diff, culprit)


def _no_mask(*args, **kwargs):
    return None


def _set_attention(model, name: str) -> None:
    for module in model.modules():
        config = getattr(module, "config", None)
        if config is not None and hasattr(config, "_attn_implementation"):
            config._attn_implementation = name


# ---------------------------------------------------------------------------------------------- the run's check
def layouts_of(recipe, layout) -> list[str]:
    """The layouts of this run that cut sequences."""
    wanted = []
    if recipe.data.packing:
        wanted.append("packing")
    if layout.sequence_parallel > 1 or layout.context_parallel > 1:
        wanted.append("sequence split")
    if recipe.train.loss_chunk_tokens:
        wanted.append("chunked loss")
    if recipe.train.activation_checkpointing:
        wanted.append("activation checkpointing")
    if layout.pipeline_stages > 1:
        wanted.append("pipeline")
    return wanted


def check(setup) -> None:
    """Before a run that packs or splits sequences: the invariants on a small random copy of its config (rank 0
    and every other rank alike: the same seconds, the same verdict, no collective), one line in the log; a cell
    that does not hold is refused in one line naming the family, the module and what to use instead."""
    recipe, layout = setup.recipe, setup.layout
    wanted = layouts_of(recipe, layout)
    if not wanted:
        return
    config = setup.model_config
    family = getattr(config, "model_type", type(config).__name__)
    if not recipe.model.check_layouts:
        setup.log(f"layout check skipped (model.check_layouts=false): {' and '.join(wanted)} not verified for "
                  f"{family}")
        return
    began = time.perf_counter()
    saved = _saved_path(config, wanted)
    if saved.is_file():  # the same copy checked before (a resume, the other ranks, a relaunch)
        cells = [Cell(**c) for c in json.loads(saved.read_text())["cells"]]
        layers, how = json.loads(saved.read_text())["layers"], "checked before: " + str(saved.parent)
    else:
        try:
            small, model = runnable_copy(config)
        except Exception as e:  # noqa: BLE001 - any failure to build the copy is reported the same way
            raise UserError(f"{' and '.join(_names(wanted, layout))} with {family}: a small copy of its config to "
                            f"verify the layout could not be run ({_said(e)}); turn the layout off, or set "
                            f"model.check_layouts=false to train unverified") from None
        cells = [run_check(name, model, small) for name in wanted]
        layers, how = _decoder_count(model), f"in {time.perf_counter() - began:.1f} s"
        _save(saved, {"cells": [vars(c) for c in cells], "layers": layers})
    for cell in cells:
        if not cell.holds:
            raise UserError(refusal(family, cell, layout))
    setup.log(f"layout check: {family} on a small random copy ({layers} layers, {WIDTH} wide): "
              + ", ".join(f"{c.layout} exact ({c.difference:.0e})" for c in cells)
              + f" ({how}; model.check_layouts=false skips it)")


def _saved_path(config, wanted: list[str]) -> Path:
    """Where the verdict of this config's copy under these layouts is kept: keyed by the copy, the layouts, the
    versions of torch and transformers and this file, so any change to what is checked checks again."""
    import transformers

    from . import env
    fields = {k: v for k, v in small_copy(config).to_dict().items()
              if k not in ("_name_or_path", "transformers_version")}  # where it was read from does not matter
    key = hashlib.sha256("\n".join([json.dumps(fields, sort_keys=True, default=str), ",".join(wanted),
                                     torch.__version__, transformers.__version__,
                                     hashlib.sha256(Path(__file__).read_bytes()).hexdigest()]).encode()).hexdigest()
    return env.cache_root() / "layout_checks" / f"{key[:32]}.json"


def _save(path: Path, verdict: dict) -> None:
    """Written whole or not at all (ranks checking at once each write the same verdict)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(verdict))
        os.replace(tmp, path)
    except OSError:  # a read-only cache: checked again next time
        pass


def run_check(name: str, model, config) -> Cell:
    """One cell; a forward that fails under the layout (sdpa refusing Gemma 2's soft-capping) does not hold."""
    try:
        return CHECKS[name](model, config)
    except Exception as e:  # noqa: BLE001 - the model's own error is what the refusal says
        return Cell(name, float("inf"), f"its forward ({_said(e)})")


CHECKS = {"packing": check_packing, "sequence split": check_sequence_split, "chunked loss": check_head,
          "activation checkpointing": check_checkpointing, "pipeline": check_pipeline}


def _said(e: BaseException) -> str:
    lines = str(e).splitlines()
    return f"{type(e).__name__}: {lines[0][:140]}" if lines else type(e).__name__


def _decoder_count(model) -> int:
    return len(_decoder_layers(model))


def _names(wanted, layout) -> list[str]:
    keys = {"packing": "data.packing", "chunked loss": "train.loss_chunk_tokens",
            "activation checkpointing": "train.activation_checkpointing", "pipeline": "pipeline.stages"}
    return [keys.get(w) or _split_name(layout) for w in wanted]


def _split_name(layout) -> str:
    return (f"sequence_parallel_size={layout.sequence_parallel}" if layout.sequence_parallel > 1
            else f"context_parallel_size={layout.context_parallel}")


def refusal(family: str, cell: Cell, layout=None) -> str:
    what = cell.culprit or "a layer"
    if cell.layout == "packing":
        return (f"data.packing with {family}: {what} moves information between packed documents (the second "
                f"document's logits differ from the same document alone by {cell.difference:.1e}); set "
                f"data.packing=false")
    if cell.layout in ("chunked loss", "activation checkpointing"):
        key, off, measure = (("train.loss_chunk_tokens", "set train.loss_chunk_tokens=0", "largest logit difference")
                             if cell.layout == "chunked loss" else
                             ("train.activation_checkpointing", "set train.activation_checkpointing=false",
                              "largest relative gradient difference"))
        by = f" ({measure} {cell.difference:.1e})" if cell.difference != float("inf") else ""
        return f"{key} with {family}: {what}{by}; {off}"
    if cell.layout == "pipeline":
        by = f" (largest logit difference {cell.difference:.1e} against the model's forward)" \
            if cell.difference != float("inf") else ""
        return (f"pipeline stages with {family}: {what}{by}; use a ds_config without a pipeline section (ZeRO) or "
                f"tensor_parallel")
    name = _split_name(layout) if layout is not None else "sequence parallelism"
    return (f"{name} with {family}: {what} does not give the same output on a sequence cut between ranks (largest "
            f"logit difference {cell.difference:.1e} against the whole sequence); train it without sequence or "
            f"context parallelism")


# ---------------------------------------------------------------------------------------------- the matrix
# families whose default config does not show the layer kinds of their released models
REPRESENTATIVE = {"lfm2": {"full_attn_idxs": [1]}, "lfm2_moe": {"full_attn_idxs": [1]}}


def verdict(family: str) -> dict:
    """docs/family_matrix.json's row of a family (scripts/family_matrix.py): its default config (with
    REPRESENTATIVE's keys) made small, both cells; a family whose copy cannot be built or run says why."""
    import traceback

    from transformers import AutoConfig
    began = time.perf_counter()
    try:
        small, model = runnable_copy(AutoConfig.for_model(family, **REPRESENTATIVE.get(family, {})))
        row = {"family": family, "built": True, "attention": model.config._attn_implementation}
        for layout in CHECKS:
            cell = run_check(layout, model, small)
            row[layout] = {"holds": cell.holds, "culprit": cell.culprit, "difference": None
                           if cell.difference == float("inf") else float(f"{cell.difference:.2e}")}
    except Exception as e:  # noqa: BLE001 - a family that cannot be built small is a row too
        frame = traceback.extract_tb(e.__traceback__)[-1]
        row = {"family": family, "built": False, "why": _said(e),
               "where": f"{frame.filename.rsplit('/', 1)[-1]}:{frame.lineno}"}
    row["seconds"] = round(time.perf_counter() - began, 2)
    return row


def table(rows: list[dict]) -> str:
    """docs/models.md's table of the matrix."""
    def cell(c: dict) -> str:
        return "verified" if c["holds"] else f"refused: {c['culprit'] or 'differs'}".replace("|", "/")
    lines = ["| family | packing | Ulysses / ring | chunked loss | activation checkpointing | pipeline |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        if r["built"]:
            lines.append(f"| {r['family']} | " + " | ".join(cell(r[name]) for name in CHECKS) + " |")
        else:
            why = r["why"][:80].replace("|", "/")
            lines.append(f"| {r['family']} | not built small ({why}) | checked at the run | checked at the run | "
                         f"checked at the run | checked at the run |")
    return "\n".join(lines)
