"""DeepSpeed's AutoEP (expert parallelism) against transformers' private output-capturing registry.

AutoEP replaces each MoE block with its own layer and re-points transformers' `router_logits` recorder at it, so
`output_router_logits=True` still returns the router's logits (the load-balancing loss needs them). For that it
reads and writes `transformers.utils.output_capturing._CAN_RECORD_REGISTRY` by class-name string
(deepspeed/module_inject/auto_ep_presets/base.py: `registry.get(key, default)`, `registry[key] = entry`), the way
transformers 5.0-5.23 keyed it. transformers 5.24 made the registry a dict subclass whose `get(model)` takes the
model and whose `__setitem__` keys by `str(model.__class__)`: DeepSpeed's two-argument `get` raises TypeError,
its one-argument `get` of a string silently finds nothing, and its restore writes every entry under
"<class 'str'>". Neither project has a fix released (DeepSpeed 0.19.8, transformers 5.25), so the registry is
given a class that takes either a model or the string key: the same dict, the same entries, both callers served.
"""
from __future__ import annotations

_MISSING = object()


def _tolerant_registry_class(base: type) -> type:
    class CanRecordRegistryByModelOrName(base):
        """transformers' registry, also keyed by the class-name string DeepSpeed's AutoEP passes."""

        def __setitem__(self, key, value) -> None:
            if isinstance(key, str):
                dict.__setitem__(self, key, value)
            else:
                super().__setitem__(key, value)

        def get(self, key, default=_MISSING):
            if isinstance(key, str):
                return dict.get(self, key, None if default is _MISSING else default)
            return super().get(key)

    return CanRecordRegistryByModelOrName


def let_autoep_use_the_output_registry() -> bool:
    """Make transformers' output-capturing registry take AutoEP's string keys (module docstring); idempotent.
    False where transformers has no such registry or it is still a plain dict (nothing to mend)."""
    try:
        from transformers.utils import output_capturing
    except ImportError:
        return False
    registry = getattr(output_capturing, "_CAN_RECORD_REGISTRY", None)
    if registry is None or type(registry) is dict:
        return False
    if type(registry).__name__ != "CanRecordRegistryByModelOrName":
        # the same object (modeling_utils holds it too), given the subclass; a dict subclass without slots
        registry.__class__ = _tolerant_registry_class(type(registry))
    return True


def autoep_layers(model) -> dict:
    """The AutoEP layers deepspeed.initialize put in the model in place of its MoE blocks, by module name
    (deepspeed.module_inject.auto_ep_layer.AutoEPMoELayer: not exported from DeepSpeed's package root)."""
    from deepspeed.module_inject.auto_ep_layer import AutoEPMoELayer
    return {name: m for name, m in model.named_modules() if isinstance(m, AutoEPMoELayer)}


def autoep_local_experts(layer) -> int:
    """The routed experts one rank of the expert-parallel group holds in an AutoEP layer."""
    return int(layer.num_local_experts)


def autoep_preset_for(model_type: str | None) -> tuple[str | None, str | None]:
    """(AutoEP's preset for this transformers model_type, or None; DeepSpeed's note when it names the family as
    unsupported): deepspeed/module_inject/auto_ep_presets/registry.py, whose lookups are not re-exported."""
    from deepspeed.module_inject.auto_ep_presets import registry
    if model_type is None:
        return None, None
    unsupported = registry.unsupported_preset_for_hf_model_type(model_type)
    note = unsupported[1].unsupported_hf_model_type_notes[model_type] if unsupported else None
    return registry.preset_name_for_hf_model_type(model_type), note


def autoep_preset_names() -> list[str]:
    from deepspeed.module_inject.auto_ep_config import PRESET_MODELS
    return sorted(PRESET_MODELS)


def autoep_preset_pattern(preset: str) -> str:
    """The module-name pattern AutoEP's preset finds a model's MoE blocks by (e.g. `model\\.layers\\.\\d+\\.mlp`)."""
    from deepspeed.module_inject.auto_ep_config import PRESET_MODELS
    return PRESET_MODELS[preset].moe_layer_pattern


def autoep_shared_names(model_type: str | None) -> dict[str, str]:
    """AutoEP's layer keeps a block's shared experts and their gate under its own attribute names (`shared_experts`,
    `shared_experts_gate`, deepspeed/module_inject/auto_ep_layer.py), so its checkpoint names them so; the model's
    names are its preset's patterns (Qwen2/3.5-MoE: `shared_expert`, `shared_expert_gate`). AutoEP's name -> the
    model's, for the names that differ."""
    from deepspeed.module_inject.auto_ep_config import PRESET_MODELS
    preset = PRESET_MODELS.get(autoep_preset_for(model_type)[0] or "")
    if preset is None or not preset.has_shared_experts:
        return {}
    names = {"shared_experts": preset.shared_experts_pattern, "shared_experts_gate": preset.shared_experts_gate_pattern}
    return {ours: theirs for ours, theirs in names.items() if theirs and theirs != ours}


def let_zero_train_beside_frozen_experts() -> bool:
    """LoRA under AutoEP: every routed expert is frozen base, so no parameter group holds an expert, and ZeRO-1/2's
    _configure_moe_settings asserts that one does ("The model has moe layers, but None of the param groups are
    marked as MoE", deepspeed/runtime/zero/stage_1_and_2.py). With no trainable expert there is nothing to reduce
    over the expert groups: the optimizer is told the model has no MoE layers and reduces what trains (the
    adapters, all outside the MoE blocks) over the data-parallel group as for a dense model. A model whose experts
    do train is left to DeepSpeed's own check. Idempotent; True once patched."""
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
    original = DeepSpeedZeroOptimizer._configure_moe_settings
    if getattr(original, "_dstrain_frozen_experts", False):
        return True

    def configure_moe_settings(self):
        if not any(self.is_moe_group(group) for group in self.optimizer.param_groups) and not any(
                p.requires_grad and not getattr(p, "allreduce", True)
                for group in self.optimizer.param_groups for p in group["params"]):
            self.has_moe_layers = False
            return None
        return original(self)

    configure_moe_settings._dstrain_frozen_experts = True
    DeepSpeedZeroOptimizer._configure_moe_settings = configure_moe_settings
    return True
