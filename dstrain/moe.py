"""What a Mixture-of-Experts model holds, read from the built model rather than from its config's names (which
differ by family: num_local_experts, num_experts, n_routed_experts; moe_intermediate_size; decoder_sparse_step,
mlp_only_layers, first_k_dense_replace). transformers 5 keeps every family's routed experts the same way: a sparse
block holds `experts`, one module of 3-D tensors (`gate_up_proj [E, 2F, H]`, `down_proj [E, H, F]`) with
`num_experts`, beside its router `gate` with `top_k`; shared experts, when a family has them, are a plain MLP
beside them and always run. A token runs top_k of a block's num_experts routed experts, so that share of the
experts' parameters is the part of the model a token's FLOPs count (flops.flops_per_token's `inactive`).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


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
        experts = getattr(module, "experts", None)
        gate = getattr(module, "gate", None)
        if isinstance(experts, torch.nn.Module) and hasattr(experts, "num_experts") and hasattr(gate, "top_k"):
            found.append(MoeBlock(f"{name}.experts" if name else "experts", int(experts.num_experts),
                                  int(gate.top_k), sum(_numel(p) for p in experts.parameters())))
    return found


def inactive_parameters(model: torch.nn.Module) -> int:
    """Routed-expert parameters a token does not run through, over the whole model (0 for a dense model)."""
    return round(sum(block.inactive_parameters for block in moe_blocks(model)))
