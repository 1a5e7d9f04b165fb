"""expert_parallel.enabled in the DeepSpeed JSON: DeepSpeed's AutoEP splits each Mixture-of-Experts block's routed
experts over the ranks of an expert-parallel group of `autoep_size` (tokens travel to their experts by all-to-all);
attention, norms, routers and shared experts stay data-parallel. The engine does the replacing from the JSON; this
component checks the model and the layout first, mends the one transformers incompatibility AutoEP has
(ds_internals.let_autoep_use_the_output_registry), and proves afterwards that every MoE block was replaced: AutoEP
itself only warns and trains densely when it detects nothing.

What AutoEP or this project cannot combine is one line before anything is built: tensor or sequence parallelism and
pipelines beside it, QLoRA, gradient compression, DiLoCo and Muon (not yet), LoRA under ZeRO-0 or ZeRO-3, a model
without routed experts or a preset, an expert count or data-parallel size the EP size does not divide, the
load-balancing loss where AutoEP hides the router logits. Every ZeRO stage trains (tests/e2e/test_moe.py). LoRA
beside it adapts the layers outside the MoE blocks (components/lora.py); the frozen experts are split over the ranks
all the same.
"""
from __future__ import annotations

from ..errors import UserError
from ..parallel import ds_config, ds_internals
from ..parallel.layout import parallel_sizes
from . import Component, Setup

# the families whose router logits transformers still records once AutoEP replaced their blocks, so that their
# load-balancing loss is the model's (the e2e checks Mixtral's, Qwen3-MoE's and Qwen2-MoE's against the
# single-process loop; DeepSpeed re-points Qwen3.5-MoE's recorder too); for any other family it is refused rather
# than assumed
ROUTER_LOGITS_UNDER_AUTOEP = ("mixtral", "qwen3_moe", "qwen2_moe", "qwen3_5_moe_text")


class ExpertParallel(Component):
    name = "expert_parallel"

    def __init__(self, size: int, section: dict):
        self.size = size
        self.section = section
        self.blocks: list[str] = []

    def validate(self, setup: Setup) -> None:
        from .. import moe
        experts = moe.routed_experts(setup.model_config)
        size = self.size
        if not experts:
            raise UserError(f"expert_parallel.autoep_size={size} but the model has no routed experts; use a "
                            f"DeepSpeed JSON without expert_parallel for a dense model")
        if experts % size:
            raise UserError(f"expert_parallel.autoep_size={size} does not divide the model's {experts} routed "
                            f"experts; choose a size that divides {experts}")
        config = setup.model_config.get_text_config() if hasattr(setup.model_config, "get_text_config") \
            else setup.model_config
        model_type = getattr(config, "model_type", None)
        preset, note = ds_internals.autoep_preset_for(model_type)
        named = self.section.get("preset_model")
        if named is not None and named not in ds_internals.autoep_preset_names():
            raise UserError(f"expert_parallel.preset_model={named!r} is not one of DeepSpeed's AutoEP presets "
                            f"({', '.join(ds_internals.autoep_preset_names())}); use one of them or leave it out")
        if named is not None and preset is not None and named != preset:
            # another family's preset replaces the blocks by its own names: DeepSeek-V3 under "mixtral" trained
            # without its shared experts (attach's check below names that too)
            raise UserError(f"expert_parallel.preset_model={named!r} is DeepSpeed's AutoEP preset for another "
                            f"family; this model is {model_type!r}, whose preset is {preset!r}: set that, or leave "
                            f"preset_model out (AutoEP finds it)")
        if named is None and preset is None and not self.section.get("moe_layer_pattern"):
            # AutoEP would warn, find no MoE layer and train every expert on every rank (gpt-oss does so)
            raise UserError(f"DeepSpeed's AutoEP has no preset for model type {model_type!r}"
                            + (f" ({note})" if note else "") + f" (presets: "
                            f"{', '.join(ds_internals.autoep_preset_names())}); set expert_parallel.preset_model, or "
                            f"expert_parallel.moe_layer_pattern and its patterns, or drop expert_parallel")
        coef = moe.router_aux_coefficient(setup.recipe.model.router_aux_loss_coef, setup.model_config)
        if coef and model_type not in ROUTER_LOGITS_UNDER_AUTOEP:
            raise UserError(f"the router load-balancing loss cannot be added to {model_type} under expert "
                            f"parallelism yet (DeepSpeed's AutoEP hides its router logits from transformers); set "
                            f"model.router_aux_loss_coef=0 or drop expert_parallel")
        recipe = setup.recipe
        for what, on, why in (
                ("lora.quantize", bool(recipe.lora.r and recipe.lora.quantize), "not tried: a 4-bit base beside "
                 "AutoEP's expert weights"),
                ("compression", recipe.compression.enabled, "it replaces the gradient all-reduce, experts included"),
                ("diloco", recipe.diloco.enabled, "its replicas average every weight, each rank's own experts too"),
                # tried: every step after the first differed from the plain loop with Muon by up to 2.4e-2 (the
                # loop orthogonalises each 2-D matrix the model holds, AutoEP's experts and routers are its own)
                ("train.optimizer=muon", ds_config.optimizer_of(setup.ds_cfg, recipe.train) == "muon",
                 "DeepSpeed's Muon beside AutoEP's experts trained apart from Muon's definition")):
            if on:
                raise UserError(f"expert_parallel with {what} is not supported yet ({why}); drop expert_parallel "
                                f"from the DeepSpeed JSON or turn {what} off")
        stage = ds_config.zero_stage(setup.ds_cfg)
        if recipe.lora.r and stage not in (1, 2):
            # ZeRO-3: DeepSpeed's AutoEP checkpoint raises on frozen experts ("does not support frozen expert
            # parameters yet", engine._save_moe_checkpoint); ZeRO-0 not tried
            raise UserError(f"lora beside expert_parallel trains under ZeRO-1 or ZeRO-2 here, not ZeRO-{stage} "
                            f"(DeepSpeed's AutoEP checkpoint cannot hold frozen experts under ZeRO-3); use "
                            f"ep2_zero2.json or set zero_optimization.stage to 2")
        sizes = parallel_sizes(setup.ds_cfg)
        for what, other in (("tensor_parallel.autotp_size", sizes.tensor), ("sequence_parallel_size", sizes.sequence),
                            ("pipeline stages", sizes.pipeline)):
            if other > 1:
                raise UserError(f"expert_parallel with {what}={other}: DeepSpeed's AutoEP runs beside data "
                                f"parallelism only; drop one of them from the DeepSpeed JSON")
        dp = setup.layout.data_parallel
        if dp % size:
            raise UserError(f"expert_parallel.autoep_size={size} does not divide the {dp} data-parallel ranks; "
                            f"launch a multiple of {size} ranks or choose autoep_size={_divisor(dp, experts)}")

    def configure(self, ds_cfg: dict, setup: Setup) -> None:
        ds_internals.let_autoep_use_the_output_registry()
        if setup.recipe.lora.r:
            # peft's wrapper puts the model under base_model.model.: AutoEP's preset patterns name the bare
            # model's blocks (model.layers.N.mlp) and match no module of it (AutoEP found 0 MoE layers)
            section = ds_cfg["expert_parallel"]
            model_type = getattr(setup.model_config.get_text_config(), "model_type", None)
            pattern = section.get("moe_layer_pattern") or ds_internals.autoep_preset_pattern(
                section.get("preset_model") or ds_internals.autoep_preset_for(model_type)[0])
            section["moe_layer_pattern"] = r"base_model\.model\." + pattern.removeprefix(r"base_model\.model\.")
            # the experts are frozen base: no optimizer group holds one (components/lora.py keeps the adapters
            # outside the MoE blocks under expert parallelism)
            ds_internals.let_zero_train_beside_frozen_experts()

    def convert(self, model, setup: Setup):
        from .. import moe
        self.blocks = [block.name for block in moe.moe_blocks(model)]
        self.beside = {block.removesuffix(".experts"): _beside_experts(model, block.removesuffix(".experts"))
                       for block in self.blocks}
        if not self.blocks:
            raise UserError("expert_parallel is on but no Mixture-of-Experts block was found in the model (an "
                            "`experts` module beside a router `gate`); use a DeepSpeed JSON without expert_parallel")
        return model

    def attach(self, engine, setup: Setup) -> None:
        from .. import moe
        replaced = ds_internals.autoep_layers(engine.module)
        # an AutoEP layer keeps the block's `experts` and `gate`: a block outside every AutoEP layer stayed dense
        left = [block.name for block in moe.moe_blocks(engine.module)
                if not any(block.name.startswith(name + ".") for name in replaced)]
        if left or len(replaced) != len(self.blocks):
            raise RuntimeError(f"AutoEP replaced {len(replaced)} of the model's {len(self.blocks)} MoE blocks "
                               f"(still dense: {left[:3]}); the run would train without expert parallelism")
        for name in replaced:  # what else the block held (shared experts) is still there
            kept = _beside_experts(engine.module, name)
            held = self.beside.get(name.removeprefix("base_model.model."), 0)  # named before peft wrapped it
            if kept < held:
                raise RuntimeError(f"AutoEP's replacement of {name} holds {kept} parameters beside its routed "
                                   f"experts and router where the model's block held {held} (its shared "
                                   f"experts?); set expert_parallel.has_shared_experts and shared_experts_pattern")
        setup.log(f"expert parallelism: {len(replaced)} MoE blocks, their experts split over {self.size} ranks "
                  f"({ds_internals.autoep_local_experts(next(iter(replaced.values())))} per rank)")

    def describe(self) -> dict:
        return {"autoep_size": self.size, "moe_blocks": len(self.blocks), "preset_model": self.section.get(
            "preset_model")}


def _beside_experts(model, block: str) -> int:
    """Parameters of an MoE block other than its routed experts and its router (its shared experts)."""
    module = model.get_submodule(block)
    return sum(p.numel() for name, p in module.named_parameters()
               if not name.startswith(("experts.", "gate.", "router.")))


def _divisor(dp: int, experts: int) -> int:
    return max(d for d in range(1, dp + 1) if dp % d == 0 and experts % d == 0)


def make(raw_ds: dict) -> ExpertParallel | None:
    section = raw_ds.get("expert_parallel") or {}
    if not section.get("enabled"):
        return None
    return ExpertParallel(int(section.get("autoep_size", 1)), section)
