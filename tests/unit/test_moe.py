"""Mixture-of-Experts models (issue 71), in-process: their routed experts are found in the built model for every
family's layout, and a token's FLOPs count the experts it runs (top_k of each block's), checked against torch's
own FLOP counter on a real forward of tiny Mixtral, Qwen3-MoE (a dense first layer) and DeepSeek-V3 (shared
experts, a dense first layer) models."""
from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode
from transformers import AutoConfig, AutoModelForCausalLM

from dstrain import flops, moe

SHAPE = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=4, num_experts_per_tok=2)
FAMILIES = {
    "mixtral": dict(num_local_experts=4),
    "qwen3_moe": dict(num_experts=4, moe_intermediate_size=48, decoder_sparse_step=1, mlp_only_layers=[0]),
    "deepseek_v3": dict(n_routed_experts=4, moe_intermediate_size=48, n_shared_experts=1, first_k_dense_replace=1,
                        kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8,
                        n_group=1, topk_group=1),
}
TOKENS = 16


def tiny(family: str):
    config = AutoConfig.for_model(family, **SHAPE, **FAMILIES[family])
    torch.manual_seed(0)
    return config, AutoModelForCausalLM.from_config(config)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_routed_experts_are_found_and_a_token_counts_only_those_it_runs(family):
    config, model = tiny(family)
    blocks = moe.moe_blocks(model)
    moe_layers = 3 if family == "mixtral" else 2  # the others keep their first layer dense
    ffn = 64 if family == "mixtral" else 48
    assert [(b.experts, b.top_k) for b in blocks] == [(4, 2)] * moe_layers
    # SwiGLU experts: gate_up [E, 2F, H] and down [E, H, F]; a token skips E - k of them in each MoE layer
    assert all(b.expert_parameters == 4 * 3 * ffn * 32 for b in blocks)
    assert moe.inactive_parameters(model) == moe_layers * (4 - 2) * 3 * ffn * 32
    # the reference: torch counts every matmul of a forward in which each token runs exactly top_k experts (the
    # per-expert loop, whose matmuls the counter sees; grouped_mm it does not count)
    model.set_experts_implementation("eager")
    with FlopCounterMode(display=False) as counter:
        model(input_ids=torch.randint(0, 64, (1, TOKENS)))
    matmuls = counter.get_flop_counts()["Global"][torch.ops.aten.mm]  # DeepSeek's attention bmm aside
    params = sum(p.numel() for p in model.parameters())
    norms = sum(p.numel() for p in model.parameters() if p.dim() == 1)  # counted in N by PaLM's convention
    attention = 12.0 * 3 * TOKENS * config.num_attention_heads * (getattr(config, "head_dim", None) or 8)
    counted = flops.flops_per_token(config, params, TOKENS, inactive=moe.inactive_parameters(model))
    assert counted - attention - 6 * norms == pytest.approx(3 * matmuls / TOKENS)  # forward x 3 = fwd + bwd
    every_expert = flops.flops_per_token(config, params, TOKENS)  # what the progress bar's MFU counted before
    assert every_expert - counted == 6 * moe.inactive_parameters(model) > 0


def test_a_dense_model_has_no_moe_blocks():
    config = AutoConfig.for_model("llama", **{k: v for k, v in SHAPE.items() if k != "num_experts_per_tok"})
    model = AutoModelForCausalLM.from_config(config)
    assert moe.moe_blocks(model) == [] and moe.inactive_parameters(model) == 0
