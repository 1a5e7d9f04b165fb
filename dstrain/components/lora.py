"""lora: low-rank adapters (peft's LoRA) on a frozen base, under every ZeRO stage and offload.

peft builds and runs the adapters; what this component adds is what peft leaves to the training script:
  - the base is loaded first (under ZeRO-3 inside zero.Init by transformers: partitioned as it loads), then the
    adapters are added; only trainable parameters reach the optimizer (models.param_groups skips frozen ones);
  - the adapters' initial weights are a function of the seed alone: torch.manual_seed(seed) right before
    get_peft_model on every rank (peft draws lora_A from torch's RNG), so every strategy starts from the same
    adapters and one global batch gives the same losses under ZeRO-0/1/2/3 and on one rank;
  - checkpoints hold what is trained: the Checkpointer leaves frozen parameters out (DeepSpeed's
    exclude_frozen_parameters) and resume re-reads the base from where it was loaded;
  - model_config/lora/adapter_config.json (peft's format, naming the base) lets export rebuild base + trained
    adapters offline from any checkpoint: adapter/ in PEFT's format and hf/ merged (dstrain/run/export.py). The
    adapters come from the checkpoint's fp32 partitions, never from a ZeRO-3 module's state_dict, which is
    empty on every rank for partitioned adapters.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from .. import vision
from ..config import LoraSection, Recipe
from ..errors import UserError, closest
from . import Component, Setup

LORA_DIR = "lora"  # under model_config/: adapter_config.json


class Lora(Component):
    name = "lora"

    def __init__(self, section: LoraSection):
        self.section = section

    def validate(self, setup: Setup) -> None:
        from .. import model as models

        layout = setup.layout
        if layout.is_pipeline or layout.tensor_parallel > 1:
            what = "pipeline stages" if layout.is_pipeline else "tensor parallelism (AutoTP)"
            raise UserError(f"lora is not supported with {what}: they split the base model's layers that peft wraps; "
                            f"use a ZeRO config (zero3.json shards the frozen base too)")
        location = models.load_config(setup.recipe.model, setup.recipe.train.seq_len)[0]
        if models.from_scratch(setup.recipe.model, location) and setup.init_from is None:
            raise UserError(f"lora.r={self.section.r} on {setup.recipe.model.name_or_path}, which has no weights: the "
                            f"frozen base would be random; point model.name_or_path at a trained model, or set "
                            f"lora.r=0 to train every weight")
        if self.section.quantize:
            check_quantize(setup.precision)
        vocab = vision.text_config(setup.model_config).vocab_size
        tokens = len(models.load_tokenizer(setup.recipe.model))
        if tokens > vocab:  # train.py would resize the embeddings: new random rows, frozen, lost at export
            raise UserError(f"the tokenizer has {tokens:,} tokens and the base's embeddings {vocab:,} rows: LoRA keeps "
                            f"the embeddings frozen, so the new rows would stay random; use the base's own tokenizer "
                            f"(model.tokenizer), or train in full (lora.r=0)")
        self.section = language_model_only(setup.model_config, self.section)
        if (setup.ds_cfg.get("expert_parallel") or {}).get("enabled"):
            self.section = adapters_beside_experts(setup.model_config, self.section, setup.log)
        self.total, self.trainable, _ = count_parameters(setup.model_config, self.section)
        if self.trainable == 0:  # e.g. a regular expression that matches nothing trainable
            raise UserError(f"lora.target_modules={self.section.target_modules!r} matched no module of the model; "
                            f"name its linear layers (e.g. q_proj, v_proj) or use all-linear")

    def load_kwargs(self, setup: Setup) -> dict:
        if not self.section.quantize:
            return {}
        quantization = quantization_config(setup.precision)
        return {"quantization_config": quantization, "dtype": quantization.bnb_4bit_compute_dtype}

    def convert(self, model, setup: Setup):
        import peft

        base = _base_location(model)
        config = self.section.peft_config(base=base)
        torch.manual_seed(setup.recipe.train.seed)  # the adapters' init: the seed alone, on every rank
        # adapters in the base's dtype: DeepSpeed's 16-bit optimizer keeps their fp32 masters, as for full training.
        # peft's default (fp32 adapters on a 16-bit base) casts every adapted layer's input to fp32 and keeps that
        # copy for backward: measured +53% activation memory on a 100M Llama, 40 GB more at 8B x 8k tokens/rank
        model = peft.get_peft_model(model, config, autocast_adapter_dtype=False)
        # peft records the base as the model's own name_or_path (a relative path resolves only from where the run
        # started: issue 54): keep the absolute location, which adapter/ and hf/ carry
        model.peft_config["default"].base_model_name_or_path = config.base_model_name_or_path = base
        trainable = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters() if p.requires_grad)
        total = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())
        if setup.ctx.is_main:
            config.save_pretrained(setup.run_dir / "model_config" / LORA_DIR)
        setup.log(f"lora: r={self.section.r} on {self.section.target_modules}: {trainable:,} trainable parameters "
                  f"({trainable / total:.2%} of {total:,}); the base ({base}) stays frozen")
        return model

    def attach(self, engine, setup: Setup) -> None:
        from ..parallel import ds_internals
        ds_internals.drop_frozen_aliases(engine)  # a tied head is frozen base too

    def describe(self) -> dict:
        return {"r": self.section.r, "alpha": self.section.alpha, "target_modules": self.section.target_modules,
                "quantize": self.section.quantize, "trainable_parameters": self.trainable,
                "parameters_with_adapters": self.total}

    def trained_parameters(self) -> int | None:
        return self.trainable


def language_model_only(model_config, section: LoraSection) -> LoraSection:
    """The section a vision-language model's adapters follow: the language model's layers only (peft's
    exclude_modules over the vision tower and projector), unless lora.vision_tower or an exclude_modules of the
    recipe's own says otherwise. The run and the planners' counts (--preflight, --plan) take the same one: the
    preflight of a Qwen2.5-VL-7B LoRA recipe counted 51.8M adapters where the run trains 40.4M."""
    if vision.is_vision(model_config) and not section.vision_tower and "exclude_modules" not in section.options:
        return dataclasses.replace(section, options={**section.options, "exclude_modules": vision.NOT_LANGUAGE_MODEL})
    return section


def count_parameters(model_config, section: LoraSection) -> tuple[int, int, int]:
    """(parameters with adapters, adapter parameters, base weights of linear layers but the head: what QLoRA
    stores in 4 bit) of the model a config describes: built on the meta device, adapters added by peft (a 70B
    model takes under a second, no memory)."""
    import peft

    with torch.device("meta"):
        base = vision.model_class(model_config).from_config(model_config)
        head = base.get_output_embeddings()
        linear = sum(m.weight.numel() for m in base.modules() if isinstance(m, torch.nn.Linear) and m is not head)
        check_targets(section.target_modules, [name for name, _ in base.named_modules()])
        try:
            model = peft.get_peft_model(base, section.peft_config())
        except ValueError as e:  # e.g. target modules not found in the model
            raise UserError(f"lora: peft cannot add these adapters to {type(base).__name__}: "
                            f"{str(e).splitlines()[0][:200]}") from None
    return (sum(p.numel() for p in model.parameters()),
            sum(p.numel() for p in model.parameters() if p.requires_grad), linear)


def check_targets(targets, module_names: list[str]) -> None:
    """Each name of a target list names a module of the model. peft matches a list by name suffix and passes over
    a name that matches nothing while another matches (issue 85: [q_proj, vv_proj] trained q_proj alone, and the
    run listed vv_proj as a target); a regular expression (a string) or all-linear is peft's to match."""
    if isinstance(targets, str):
        return
    leaves = {name.rsplit(".", 1)[-1] for name in module_names if name}
    for target in targets:
        if target not in leaves and not any(name == target or name.endswith("." + target) for name in module_names):
            raise UserError(f"lora.target_modules names {target!r}, which is no module of the model"
                            f"{closest(target, sorted(leaves))}; name its linear layers (e.g. q_proj, v_proj) or "
                            f"use all-linear")


def adapters_beside_experts(model_config, section: LoraSection, log=print) -> LoraSection:
    """The section whose adapters leave every MoE block alone, for expert parallelism: AutoEP replaces each block
    (router and routed experts) with its own layer, which would drop an adapter on them, and splits the experts
    over the ranks. peft's all-linear on a transformers-5 MoE model also adapts the router and the fused experts
    (through target_parameters, peft/utils/transformers_weight_conversion.py); here it becomes the linear layers
    outside the MoE blocks whose names peft does not map onto the experts (the attention projections; a dense MLP's
    gate_proj shares its name with the experts' and is left out too). A list or pattern that adapts anything
    inside an MoE block is refused in one line."""

    import peft
    from transformers import AutoModelForCausalLM

    from .. import moe

    with torch.device("meta"):
        base = AutoModelForCausalLM.from_config(model_config)
    blocks = [b.name.removesuffix("experts") for b in moe.moe_blocks(base)]  # "model.layers.1.mlp."
    head = base.get_output_embeddings()
    inside = {name.rsplit(".", 1)[-1] for name, _ in [*base.named_modules(), *base.named_parameters()]
              if name.startswith(tuple(blocks))} | {"gate", "gate_proj", "up_proj", "down_proj", "w1", "w2", "w3"}
    if isinstance(section.target_modules, str) and section.target_modules.lower() == "all-linear":
        leaves = sorted({name.rsplit(".", 1)[-1] for name, m in base.named_modules()
                         if isinstance(m, torch.nn.Linear) and m is not head and not name.startswith(tuple(blocks))}
                        - inside)
        section = dataclasses.replace(section, target_modules=leaves)
        log(f"lora: under expert parallelism all-linear adapts {leaves} (the linear layers outside the MoE blocks, "
            f"whose routers and experts AutoEP replaces)")
    with torch.device("meta"):
        wrapped = peft.get_peft_model(base, section.peft_config())
    adapted = sorted({name.removeprefix("base_model.model.").split(".lora_")[0]
                      for name, p in wrapped.named_parameters() if p.requires_grad})
    within = [name for name in adapted if name.startswith(tuple(blocks))]
    if within and "shared_expert" in str(section.target_modules):
        # peft 0.21 turns every gate_proj/up_proj/down_proj target of these families into the routed experts'
        # fused parameters (peft/utils/transformers_weight_conversion.py), a shared expert's Linear layers included
        raise UserError(f"lora.target_modules={section.target_modules!r}: peft maps a shared expert's gate_proj, "
                        f"up_proj and down_proj onto the routed experts of {model_config.model_type} ({within[0]}), "
                        f"which expert parallelism replaces; adapt the attention projections (all-linear), or train "
                        f"without expert_parallel")
    if within:
        raise UserError(f"lora.target_modules={section.target_modules!r} adapts {within[0]} inside an MoE block, "
                        f"which expert parallelism replaces (AutoEP); name layers outside the blocks, e.g. "
                        f"[q_proj, k_proj, v_proj, o_proj], or use all-linear")
    return section


def check_quantize(precision: str) -> None:
    """QLoRA's 4-bit base needs bitsandbytes' CUDA kernels: refused elsewhere before anything starts."""
    if not torch.cuda.is_available():
        raise UserError("lora.quantize=4bit (QLoRA) needs a CUDA GPU (bitsandbytes' 4-bit kernels); this machine "
                        "has none: drop lora.quantize to train LoRA on the full-precision base")
    try:
        import bitsandbytes  # noqa: F401
    except ImportError:
        raise UserError("lora.quantize=4bit needs bitsandbytes: pip install -e '.[qlora]' "
                        "(or pip install bitsandbytes)") from None
    if precision == "fp32":
        raise UserError("lora.quantize=4bit computes in the training precision: use bf16 (train.precision=bf16)")


def quantization_config(precision: str):
    """NF4 with double quantization (the QLoRA paper's setting); storage dtype = compute dtype, which peft's
    DeepSpeed guide requires under ZeRO-3 (it partitions the packed 4-bit weights as tensors of that dtype)."""
    from transformers import BitsAndBytesConfig

    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                              bnb_4bit_compute_dtype=dtype, bnb_4bit_quant_storage=dtype)


def _base_location(model) -> str:
    """Where the base was loaded from, absolute when local: export reloads it from there."""
    name = getattr(model, "name_or_path", None) or model.config._name_or_path
    return str(Path(name).resolve()) if Path(name).exists() else name


def make(recipe: Recipe) -> Lora | None:
    return Lora(recipe.lora) if recipe.lora.enabled else None
