"""What a Mixture-of-Experts model holds, read from the built model rather than from its config's names (which
differ by family: num_local_experts, num_experts, n_routed_experts; moe_intermediate_size; decoder_sparse_step,
mlp_only_layers, first_k_dense_replace). transformers 5 keeps every family's routed experts the same way: a sparse
block holds `experts`, one module of 3-D tensors (`gate_up_proj [E, 2F, H]`, `down_proj [E, H, F]`) with
`num_experts`, beside its router `gate` with `top_k`; shared experts, when a family has them, are a plain MLP
beside them and always run. A token runs top_k of a block's num_experts routed experts, so that share of the
experts' parameters is the part of the model a token's FLOPs count (flops.flops_per_token's `inactive`).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from .errors import UserError


@dataclass(frozen=True)
class MoeBlock:
    name: str  # the module holding the routed experts, e.g. model.layers.1.mlp.experts
    experts: int  # routed experts in the block
    top_k: int  # routed experts each token runs
    expert_parameters: int  # the routed experts' parameters, all of them

    @property
    def inactive_parameters(self) -> float:
        """Parameters a token does not run through: the experts it was not routed to."""
        return self.expert_parameters * (self.experts - self.top_k) / self.experts


def _numel(param: torch.nn.Parameter) -> int:
    return param.ds_numel if hasattr(param, "ds_tensor") else param.numel()  # zero.Init: the whole tensor's size


def moe_blocks(model: torch.nn.Module) -> list[MoeBlock]:
    """The model's routed-expert blocks: an `experts` module with `num_experts`, whose sibling `gate` has
    `top_k` (every transformers 5 MoE family: Mixtral, Qwen2/3-MoE, Qwen3.5-MoE, DeepSeek-V2/V3, OLMoE, gpt-oss)."""
    found = []
    for name, module in model.named_modules():
        experts = _unwrapped(getattr(module, "experts", None))
        gate = _unwrapped(getattr(module, "gate", None))
        if isinstance(experts, torch.nn.Module) and hasattr(experts, "num_experts") and hasattr(gate, "top_k"):
            found.append(MoeBlock(f"{name}.experts" if name else "experts", int(experts.num_experts),
                                  int(gate.top_k), sum(_numel(p) for p in experts.parameters())))
    return found


def _unwrapped(module):
    """The module under peft's adapter wrappers (LoRA on a router or on the fused experts: ParamWrapper, nested
    once per adapted tensor), which do not pass num_experts / top_k through."""
    while module is not None and isinstance(getattr(module, "base_layer", None), torch.nn.Module):
        module = module.base_layer
    return module


def inactive_parameters(model: torch.nn.Module) -> int:
    """Routed-expert parameters a token does not run through, over the whole model (0 for a dense model)."""
    return round(sum(block.inactive_parameters for block in moe_blocks(model)))


def router_aux_coefficient(recipe_value: float | None, model_config) -> float:
    """The weight of the router's load-balancing loss a run trains with: the recipe's `model.router_aux_loss_coef`,
    else the model config's. transformers computes the loss (Switch Transformer's, load_balancing_loss_func) for
    exactly the families whose config names `router_aux_loss_coef` (Mixtral, Qwen2/3-MoE, Qwen3.5-MoE, OLMoE,
    gpt-oss, ...); DeepSeek-V3 has none (its router balances with a bias, not a loss), nor has a dense model."""
    config = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
    own = getattr(config, "router_aux_loss_coef", None)
    if own is None:
        if recipe_value:
            raise UserError(f"model.router_aux_loss_coef={recipe_value}: {config.model_type} has no router "
                            "load-balancing loss in transformers (only models whose config names "
                            "router_aux_loss_coef do); remove the key")
        return 0.0
    value = own if recipe_value is None else recipe_value
    if value < 0:
        raise UserError(f"model.router_aux_loss_coef={value}: a weight is 0 (off) or more")
    return float(value)


def routed_per_token(model_config) -> int:
    """top_k of the model's routers, from its config (every family names it num_experts_per_tok); 0 if dense."""
    config = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
    return int(getattr(config, "num_experts_per_tok", 0) or 0)


def routed_experts(model_config) -> int:
    """The routed experts of each MoE layer, by the config's name for them (num_local_experts: Mixtral, gpt-oss;
    num_experts: Qwen2/3-MoE, Qwen3.5-MoE, OLMoE; n_routed_experts: DeepSeek-V2/V3); 0 if dense."""
    config = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
    return int(next((getattr(config, name) for name in ("num_local_experts", "num_experts", "n_routed_experts")
                     if getattr(config, name, None)), 0))


class RoutingCounter:
    """The experts each token of a forward was sent to, read where the routing is decided: a forward hook on every
    MoE block's router. transformers 5's routers return (logits, weights, indices [tokens, k]); AutoEP's
    TokenChoiceTopKRouter (expert parallelism) returns (scores, selected experts [tokens, k], counts). Exact for
    every family, with or without the load-balancing loss (DeepSeek-V3 routes by sigmoid scores plus a bias within
    groups: the top-k of its logits is not its routing), and no router logits kept. A forward's entries are taken
    right after it (take); activation checkpointing's recomputation in backward adds entries that the next
    forward's clear() drops. Evaluation (the routers in eval mode) is not counted."""

    def __init__(self, model: torch.nn.Module):
        self.chosen: list[torch.Tensor] = []
        self.handles = []
        routers = [m for m in model.modules() if type(m).__name__ == "TokenChoiceTopKRouter"]  # AutoEP's
        if not routers:
            routers = [model.get_submodule(block.name.removesuffix("experts") + "gate") for block in moe_blocks(model)]
        self.layers = len(routers)
        for router in routers:
            index = 1 if type(router).__name__ == "TokenChoiceTopKRouter" else 2
            self.handles.append(router.register_forward_hook(functools.partial(self._keep, index)))

    def _keep(self, index: int, module, _args, out) -> None:
        if module.training:  # evaluation's forwards are not counted (nor kept: thousands of them between steps)
            self.chosen.append(out[index].detach())

    def clear(self) -> None:
        self.chosen.clear()

    def take(self, experts: int, mask: torch.Tensor | None) -> torch.Tensor:
        """[MoE layers, experts]: how many of the forward's tokens each layer sent to each expert (a token counts
        once in each of its k), padding left out."""
        chosen, self.chosen = self.chosen[:self.layers], []
        weight = mask.reshape(-1).to(torch.float32) if mask is not None else None
        rows = []
        for picked in chosen:
            k = picked.shape[-1]
            ones = weight.repeat_interleave(k) if weight is not None else \
                torch.ones(picked.numel(), dtype=torch.float32, device=picked.device)
            counts = torch.zeros(experts, dtype=torch.float32, device=picked.device)
            rows.append(counts.scatter_add_(0, picked.reshape(-1).long(), ones.to(picked.device)))
        return torch.stack(rows)

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []


def load_figures(load: list[float], experts: int) -> dict[str, float]:
    """The global batch's routing figures, from RoutingCounter's tables summed over it: per MoE layer the busiest
    expert's tokens over the mean (1 when balanced, experts / top_k when every token goes to the same top_k) and
    the coefficient of variation of the experts' tokens (std / mean: 0 when balanced); logged is the worst layer
    of each, and which layer that is."""
    table = torch.tensor(load, dtype=torch.float64).reshape(-1, experts)
    mean = table.mean(dim=1).clamp(min=1e-12)
    peak = table.max(dim=1).values / mean
    cv = table.std(dim=1, correction=0) / mean
    return {"expert_load_max": float(peak.max()), "expert_load_cv": float(cv.max()),
            "expert_load_worst_layer": int(cv.argmax())}


def without_router_loss(setup, objective: str) -> None:
    """For the objectives that do not add the load-balancing loss yet (preference, RL: their micro-batches hold a
    pair's or a prompt group's rows, and their losses are not token means): a weight the recipe set is refused, a
    model config's own is said to go unused."""
    if not router_aux_coefficient(setup.recipe.model.router_aux_loss_coef, setup.model_config):
        return
    if setup.recipe.model.router_aux_loss_coef:
        raise UserError(f"model.router_aux_loss_coef: {objective} does not add the router's load-balancing loss "
                        "yet; remove the key")
    setup.log(f"note: {objective} trains this Mixture-of-Experts model without its router's load-balancing loss "
              "(not added to that objective yet)")


class RouterWatch:
    """A step hook (trainer/hooks.py) over the routing figures the objective logs (load_figures): says once when a
    layer's busiest expert has taken more than halfway from its balanced share (top_k / experts) to every token (a
    token counted once per expert it runs) for `patience` steps in a row, which is a router collapsing onto a few
    experts, and gives summary.json the figures' first, last and worst values. No collective: the figures are the
    step's, already summed over the ranks."""
    name = "router"
    stopping = False

    def __init__(self, experts: int, top_k: int, say, patience: int = 20):
        self.experts, self.top_k, self.say, self.patience = experts, top_k, say, patience
        # Balanced routing gives the busiest expert top_k / experts of the tokens, total collapse all of them. A
        # fixed share cannot serve every shape: 50% is perfectly balanced for 4 experts and top-2 (20 balanced
        # steps warned "collapsed"), so the line is halfway between the two, and with top_k == experts never met.
        balanced = min(1.0, top_k / experts)
        self.collapsed_above = balanced + (1 - balanced) / 2
        self.streak, self.said_at, self.first, self.last, self.worst = 0, None, None, None, None

    def before_step(self, step: int) -> None:
        pass

    def after_update(self, step: int, say) -> None:
        pass

    def after_step(self, result) -> None:
        cv, peak = result.columns.get("expert_load_cv"), result.columns.get("expert_load_max")
        if cv is None:
            return
        self.first = self.first if self.first is not None else cv
        self.last, self.worst = cv, max(cv, self.worst if self.worst is not None else cv)
        busiest = peak * self.top_k / self.experts  # the busiest expert's tokens over the layer's tokens
        self.streak = self.streak + 1 if busiest > self.collapsed_above else 0
        if self.streak >= self.patience and self.said_at is None:
            self.said_at = result.step
            layer = result.columns.get("expert_load_worst_layer")
            self.say(f"warning: routing collapsed: in MoE layer {layer} one expert has taken {busiest:.0%} of the "
                     f"tokens for {self.streak} steps in a row (expert_load_max {peak:.2f}, balanced 1.00); a "
                     "larger model.router_aux_loss_coef or a lower learning rate usually helps")

    def before_save(self, step: int) -> bool:
        return True

    def state_dict(self) -> dict:
        return {"streak": self.streak, "said_at": self.said_at, "first": self.first, "worst": self.worst}

    def load_state_dict(self, state: dict | None) -> None:
        if state:
            self.streak, self.said_at, self.first, self.worst = (state[k] for k in ("streak", "said_at", "first",
                                                                                     "worst"))

    def close(self) -> None:
        pass

    def summary(self) -> dict:
        if self.last is None:
            return {}
        return {"expert_load_cv": {"first": round(self.first, 4), "last": round(self.last, 4),
                                   "worst": round(self.worst, 4)}, "routing_collapsed_at": self.said_at}
