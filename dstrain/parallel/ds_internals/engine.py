"""The engine's private state: its config object, the 16-bit state dict, the profiler's timers, the fp32 gradient norm,
frozen aliases in checkpoints, and the gate on the optimizer step (the non-finite and spike checks)."""
from __future__ import annotations

import functools
from collections.abc import Callable

import torch


def consolidated_16bit_state_dict(engine) -> dict:
    """The full 16-bit weights, gathered: every rank must call it; rank 0 receives the dict. No public API
    returns it (save_16bit_model writes a file instead). DeepSpeedEngine._consolidated_16bit_state_dict."""
    return engine._consolidated_16bit_state_dict()


def engine_config(engine):
    """The parsed DeepSpeedConfig the engine runs with (flops profiler switches). DeepSpeedEngine._config."""
    return engine._config


def profile_one_step(engine, wall_clock_breakdown: bool = False) -> None:
    """Once on, DeepSpeed's flops profiler also turns on wall_clock_breakdown (step timers printed every step);
    after the profiled step, turn both back to what the config asked so the rest of the run is as fast and
    quiet. No public switch exists: the engine's _config and its EngineTimers are replaced after that step."""
    from deepspeed.runtime.engine import EngineTimers

    config, step = engine_config(engine), engine.step

    def step_then_maybe_stop(*args, **kwargs):
        result = step(*args, **kwargs)
        if config.flops_profiler_config.enabled and engine.global_steps > config.flops_profiler_config.profile_step:
            config.flops_profiler_config.enabled = False
            config.wall_clock_breakdown = wall_clock_breakdown
            engine.engine_timers = EngineTimers(wall_clock_breakdown, wall_clock_breakdown)
        return result

    engine.step = step_then_maybe_stop


def record_fp32_grad_norm(engine) -> None:
    """Without ZeRO and without bf16/fp16, DeepSpeedEngine._take_model_step clips through
    engine.clip_fp32_gradients(), which drops the pre-clip norm that deepspeed.runtime.utils.clip_grad_norm_
    returns, so get_global_grad_norm() stays None. Keep it in engine._global_grad_norm, where every other path
    leaves its norm (the log compares it with the reference's: a gradient scale bug shows only there).

    With expert-parallel parameters (AutoEP's, `allreduce=False`: each rank holds other experts) clip_grad_norm_
    averages the ranks' norms, sqrt(dense^2 + own experts^2), which is not the norm of the whole gradient: a tiny
    Mixtral under EP 2 clipped by a norm 2.1e-3 off the single-process one. There the norm is the dense part
    (equal on every rank after the all-reduce) plus the experts' squares summed over their expert-parallel group."""
    from deepspeed.runtime.utils import clip_grad_norm_

    def clip_fp32_gradients():
        params = [p for p in engine.module.parameters() if p.grad is not None]
        experts = [p for p in params if not getattr(p, "allreduce", True)]
        if not experts:
            norm = clip_grad_norm_(parameters=engine.module.parameters(), max_norm=engine.gradient_clipping(),
                                   mpu=engine.mpu)
        else:
            norm = _norm_with_experts(params, experts)
            coef = min(1.0, engine.gradient_clipping() / (norm + 1e-6))  # clip_grad_norm_'s own rule
            for p in params:
                p.grad.mul_(coef)
        engine._global_grad_norm = float(norm)
    engine.clip_fp32_gradients = clip_fp32_gradients


def _norm_with_experts(params, experts) -> float:
    import deepspeed.comm as dist
    from deepspeed.utils import groups

    expert_ids = {id(p) for p in experts}
    squares = sum(p.grad.detach().float().pow(2).sum() for p in params if id(p) not in expert_ids)
    by_group = {}
    for p in experts:
        by_group.setdefault(p.group_name, []).append(p)
    for name, members in by_group.items():
        own = torch.stack([p.grad.detach().float().pow(2).sum() for p in members]).sum()
        dist.all_reduce(own, group=groups._get_expert_parallel_group(name))
        squares = squares + own
    return float(torch.as_tensor(squares).sqrt())


def drop_frozen_aliases(engine) -> None:
    """Checkpoints of a model with a frozen base (LoRA) must not hold that base. DeepSpeedEngine.module_state_dict
    (exclude_frozen_parameters=True) deletes the frozen names named_parameters() lists, which skips a tied
    weight's second name: lm_head.weight (= embed_tokens.weight) stayed in every checkpoint of a tied model, the
    whole embedding table. Wraps the engine's bound method (save_checkpoint calls it through self) to drop every
    name of a frozen parameter, aliases included (by name: ZeRO-3's partitioned tensors are all empty)."""
    original = engine.module_state_dict

    def module_state_dict(*args, exclude_frozen_parameters: bool = False, **kwargs):
        state = original(*args, exclude_frozen_parameters=exclude_frozen_parameters, **kwargs)
        if exclude_frozen_parameters and state is not None:
            prefix = kwargs.get("prefix", "")
            for name, param in engine.module.named_parameters(remove_duplicate=False):
                if not param.requires_grad:
                    state.pop(prefix + name, None)
        return state

    engine.module_state_dict = module_state_dict


def gate_optimizer_step(engine, decide: Callable[[float], bool]) -> Callable[[], None]:
    """Let `decide(grad_norm)` skip an optimizer step through DeepSpeed's own overflow path (no weight, optimizer
    state or schedule change; engine.skipped_steps counts it). Returns the function that undoes this.

    DeepSpeed's ZeRO-1/2 (DeepSpeedZeroOptimizer.step), ZeRO-3 (DeepSpeedZeroOptimizer_Stage3.step) and bf16
    (BF16_Optimizer.step; FP16_UnfusedOptimizer.step, which DeepSpeed picks for bf16 at ZeRO-0) optimizers each call
    their module's `is_invalid_grad_norm(norm)` on the step's global gradient norm and, when it answers True,
    discard the step (clear the gradients, keep the weights; the engine
    then leaves the LR scheduler alone). That name, looked up in the optimizer's own module, is replaced by one
    that asks `decide` with the norm as a float (every rank gets the same all-reduced norm, so every rank decides
    the same). Under fp16 nothing is replaced: there a non-finite step is the loss scaler's (it lowers the scale).
    ZeRO-0 in fp32 has no wrapper: the engine holds the torch optimizer itself, whose step() is wrapped to take the
    norm (engine._global_grad_norm when clipping has set it this step, else the norm of the local gradients, which
    ZeRO-0 has all-reduced) and to set `optimizer.overflow`, the attribute DeepSpeedEngine._take_model_step reads."""
    import sys

    optimizer = engine.optimizer
    module = sys.modules.get(type(optimizer).__module__)
    if engine.fp16_enabled():
        return lambda: None
    if module is not None and hasattr(module, "is_invalid_grad_norm"):
        original = module.is_invalid_grad_norm

        def gated(norm) -> bool:
            return decide(float(norm))
        module.is_invalid_grad_norm = gated

        def undo() -> None:
            module.is_invalid_grad_norm = original
        return undo
    if isinstance(optimizer, torch.optim.Optimizer):
        step = optimizer.step

        @functools.wraps(step)  # keeps the LR scheduler's mark on it (torch warns of an overridden step otherwise)
        def gated_step(*args, **kwargs):
            norm = engine._global_grad_norm if engine.gradient_clipping() > 0 else None
            if norm is None:  # tensor-parallel shards' norms are combined over `mpu`, as the clipping does
                from deepspeed.runtime.utils import get_global_norm_of_tensors
                norm = get_global_norm_of_tensors([p.grad for g in optimizer.param_groups for p in g["params"]
                                                   if p.grad is not None], mpu=engine.mpu)
            optimizer.overflow = decide(float(norm))
            if optimizer.overflow:
                optimizer.zero_grad(set_to_none=True)
                return None
            return step(*args, **kwargs)
        optimizer.step = gated_step
        optimizer.overflow = False

        def undo_step() -> None:
            optimizer.step = step
            del optimizer.overflow
        return undo_step
    return lambda: None


def autotp_plan_problem(model_config, model_class, tp_section: dict) -> str | None:
    """What deepspeed.initialize would raise about transformers' tensor-parallel plan of this model, asked from the
    config and the class alone, before anything is built; None when AutoTP would take it. DeepSpeed's
    engine._apply_autotp_partitioning takes a custom partition_config or preset_model first, then the model's HF
    tp_plan (runtime.tensor_parallel.config._get_hf_tp_plan: the config's base_model_tp_plan merged with the class's
    _tp_plan) through module_inject.tp_plan_converter.TPPlanConverter.convert, which raises ValueError for a style
    it cannot apply (OLMo 2, Phi-3, GLM-4: `rowwise_split_input`; DeepSeek-V3: `mla_kv_a_proj`): a rank's traceback
    after the model was built, before."""
    if tp_section.get("partition_config") or tp_section.get("preset_model"):
        return None
    from deepspeed.module_inject.tp_plan_converter import TPPlanConverter
    from deepspeed.runtime.tensor_parallel.config import _get_hf_tp_plan

    plan_only = type("PlanOnly", (), {"_tp_plan": getattr(model_class, "_tp_plan", None)})()
    plan_only.config = model_config
    plan = _get_hf_tp_plan(plan_only)
    if not plan:
        return None
    try:
        TPPlanConverter.convert(plan)
    except ValueError as e:
        return str(e).split(". ")[0]
    return None


def autotp_split_weights(module, excluding: tuple = ()) -> tuple[int, int]:
    """(weights this rank holds in layers AutoTP split, weights in the rest), not counting the parameters of the
    modules in `excluding`: AutoTP's replacements all derive from deepspeed.module_inject.layers.TensorParallel_Layer
    (LinearLayer, LinearAllreduce, their fused variants)."""
    from deepspeed.module_inject.layers import TensorParallel_Layer

    inside = {id(p) for m in module.modules() if isinstance(m, TensorParallel_Layer) for p in m.parameters()}
    left_out = {id(p) for m in excluding if m is not None for p in m.parameters()}
    split = whole = 0
    for p in {id(p): p for p in module.parameters() if id(p) not in left_out}.values():
        if id(p) in inside:
            split += p.numel()
        else:
            whole += p.numel()
    return split, whole
