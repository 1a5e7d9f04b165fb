"""tensor_parallel.autotp_size > 1: DeepSpeed's AutoTP splits every attention and MLP layer over the ranks of a
tensor-parallel group (the engine does the splitting from the JSON; this component checks the model first).

AutoTP splits attention by heads, so the sizes must divide the model's head counts. Checked in the one validation
pass, from the model's config alone, before any checkpoint is set aside or anything is built (issue 30: it was
checked while the model was being built, after a damaged newer checkpoint had already been renamed).
"""
from __future__ import annotations

import functools
import json
from pathlib import Path

from ..errors import UserError
from ..parallel.layout import parallel_sizes
from . import Component, Setup

# what every tensor-parallel refusal here advises instead
_INSTEAD = "use a ds_config without tensor_parallel (ZeRO-3 shards the weights instead)"


def check_heads(config, tp: int) -> None:
    """AutoTP splits attention by heads: the sizes must divide evenly."""
    for key in ("num_attention_heads", "num_key_value_heads", "n_head"):
        heads = getattr(config, key, None)
        if heads is not None and heads % tp:
            raise UserError(f"tensor_parallel.autotp_size={tp} does not divide the model's {key}={heads}; "
                            f"choose a size that divides it")


def check_plan(config, tp_section: dict) -> None:
    """AutoTP shards by transformers' tensor-parallel plan where the model has one; a plan with a style DeepSpeed
    cannot apply (OLMo 2, Phi-3, GLM-4, DeepSeek-V3) is one line here instead of a traceback from every rank once
    the model is built. The families it takes were held to fp32 rounding against the unsharded forward on 2 gloo
    ranks (docs/models.md)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    from ..parallel import ds_internals
    try:
        model_class = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    except KeyError:  # remote code: the config's own plan alone
        model_class = None
    why = ds_internals.autotp_plan_problem(config, model_class, tp_section)
    if why:
        family = getattr(config, "model_type", type(config).__name__)
        raise UserError(f"tensor_parallel with {family}: DeepSpeed's AutoTP cannot apply the model's tensor-parallel "
                        f"plan ({why}); {_INSTEAD}")


# Each family's verdict from scripts/family_tensor_parallel.py --all --write: its small random copy (the matrix's,
# dstrain/families.py) split by AutoTP over 2 gloo ranks against the whole copy's logits. A cell needs two processes,
# so it is not asked again at a run as the in-process layout cells are: a run with tensor_parallel reads it.
VERDICTS = Path(__file__).with_name("tensor_parallel_families.json")


@functools.cache
def verdicts() -> dict:
    return json.loads(VERDICTS.read_text())


def _apart(row: dict) -> str:
    """How far a differing split is from the whole model: its largest logit difference, or another shape."""
    return "logits of another shape" if row.get("difference") is None else f"{row['difference']:.2g} apart"


def said(row: dict) -> str:
    """A verdict in words: docs/models.md's table cell."""
    kind = row["verdict"]
    if kind == "exact":
        return f"exact ({row['difference']:.0e}), {row['split']:.0%} of the weights between embedding and head split"
    if kind == "plan":
        return f"refused before the build: {row['why']}"
    if kind == "splits nothing":
        return "refused before the build: AutoTP splits no layer between the embedding and the head"
    if kind == "differs":
        return f"refused before the build: its split's logits differ from the whole model's ({_apart(row)})"
    return f"refused before the build: AutoTP fails on it ({row['why']})"


def table(verdict_table: dict) -> str:
    lines = [f"{sum(r['verdict'] == 'exact' for r in verdict_table['rows'])} of {len(verdict_table['rows'])} "
             f"families exact under AutoTP on 2 ranks (deepspeed {verdict_table['deepspeed']}, transformers "
             f"{verdict_table['transformers']}); the others are refused before anything is built.", "",
             "| family | tensor parallelism (autotp_size 2) |", "|---|---|"]
    lines += [f"| {r['family']} | {said(r).replace('|', '/')} |" for r in verdict_table["rows"]]
    return "\n".join(lines)


def check_family(config, tp_section: dict, check_layouts: bool, log) -> None:
    """The family's verdict on 2 ranks (VERDICTS), before anything is built: a split that differs from the whole
    model (CodeGen's fused qkv_proj: 0.89 apart on its small copy, exit 0 before), that fails at the first forward or
    AutoTP's parse (its traceback from every rank, after the build), or that splits nothing is one line; a family
    the table has not seen is refused unless model.check_layouts=false, said in the log. A custom partition_config or
    preset_model is the user's own split: said, not checked."""
    family = getattr(config, "model_type", type(config).__name__)
    if tp_section.get("partition_config") or tp_section.get("preset_model"):
        log(f"tensor parallelism: {family} split by the JSON's own partition_config / preset_model (not verified "
            f"against the whole model here)")
        return
    row = next((r for r in verdicts()["rows"] if r["family"] == family), None)
    if row is None:
        if not check_layouts:
            log(f"tensor parallelism: {family} has not been verified under AutoTP (model.check_layouts=false)")
            return
        raise UserError(f"tensor_parallel with {family}: AutoTP has not been verified on this family "
                        f"(`python scripts/family_tensor_parallel.py {family}` checks it on 2 CPU ranks in seconds); "
                        f"set model.check_layouts=false to train unverified, or {_INSTEAD}")
    if row["verdict"] == "exact":
        log(f"tensor parallelism: {family} verified under AutoTP (2 ranks, a small copy: {said(row)}){_stale()}")
        return
    if row["verdict"] == "plan":  # check_plan says it from the model's own plan
        return
    problem = {"splits nothing": "AutoTP finds no layer to split between the embedding and the head, so every "
               "rank would hold and compute the whole model",
               "differs": f"AutoTP's split gives other logits than the whole model ({_apart(row)} on a small copy "
               "over 2 ranks): the run would train a wrong model",
               "fails": f"AutoTP fails on it ({row.get('why')})"}[row["verdict"]]
    raise UserError(f"tensor_parallel with {family}: {problem}; {_INSTEAD}")


def _stale() -> str:
    """Where the installed deepspeed or transformers is not the one the verdicts were found with: said."""
    from importlib.metadata import version
    made = {name: verdicts()[name] for name in ("deepspeed", "transformers")}
    now = {name: version(name) for name in made}
    if made == now:
        return ""
    return (f"; found with deepspeed {made['deepspeed']} and transformers {made['transformers']}, this is "
            f"{now['deepspeed']} and {now['transformers']}: `make family-tensor-parallel` checks again")


def refusal(config, tp_section: dict, check_layouts: bool) -> str | None:
    """The line a run with tensor_parallel on this model is refused with before anything is built, else None (the
    planner offers tensor-parallel layouts only where it is None)."""
    try:
        check_plan(config, tp_section)
        check_family(config, tp_section, check_layouts, lambda line: None)
    except UserError as e:
        return str(e)
    return None


class TensorParallel(Component):
    name = "tensor_parallel"

    def __init__(self, size: int):
        self.size = size

    def validate(self, setup: Setup) -> None:
        check_heads(setup.model_config, self.size)
        section = setup.ds_cfg.get("tensor_parallel") or {}
        check_plan(setup.model_config, section)
        check_family(setup.model_config, section, setup.recipe.model.check_layouts, setup.log)

    def attach(self, engine, setup: Setup) -> None:
        """What AutoTP split, said; nothing split is refused. AutoTP leaves a layer it does not recognise whole on
        every rank: LFM2's convolution layers and Falcon-H1's or GraniteMoeHybrid's Mamba layers, with nothing or one
        head split (on 2 gloo ranks, issue 85), trained exactly but as a replicated model, with autotp_size taken
        and no word."""
        from ..parallel import ds_internals
        module = engine.module
        ends = [getattr(module, f"get_{end}_embeddings", lambda: None)() for end in ("input", "output")]
        split, whole = ds_internals.autotp_split_weights(module, excluding=tuple(ends))
        family = getattr(setup.model_config, "model_type", "the model")
        if not split:
            raise UserError(f"tensor_parallel.autotp_size={self.size} with {family}: AutoTP found no layer to split "
                            f"between the embedding and the head, so every rank would hold and compute the whole "
                            f"model; {_INSTEAD}")
        share = split * self.size / (split * self.size + whole)
        setup.log(f"tensor parallelism: AutoTP split {share:.0%} of {family}'s weights between the embedding and the "
                  f"head over {self.size} ranks ({whole:,} weights stay whole on every rank)")

    def describe(self) -> dict:
        return {"autotp_size": self.size}


def make(raw_ds: dict) -> TensorParallel | None:
    size = parallel_sizes(raw_ds).tensor
    return TensorParallel(size) if size > 1 else None
