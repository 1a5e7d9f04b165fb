"""DeepSpeed's Muon: its compile deferred, its by-name tags kept, its updates counted."""
from __future__ import annotations

import functools
from collections.abc import Callable
from contextlib import contextmanager

MUON_MODULE = "deepspeed.runtime.zero.muon.original_muon"


def defer_muon_compile() -> None:
    """DeepSpeed's ZeRO optimizers (stage_1_and_2, stage3, bf16_optimizer) import its Muon module at construction,
    only for an isinstance check, and that module decorates three functions with torch.compile at import
    (`@deepspeed.runtime.compiler.compile()`), which imports TorchInductor's compiler: 1.7 s of CPU per rank here,
    in every run, with Muon or not. Imported here first, with each decorator applied at the function's first call
    instead (torch.compile compiles at the first call anyway), so the check costs nothing and a Muon run compiles
    the same kernels when it first uses them."""
    import sys

    if MUON_MODULE in sys.modules:
        return
    import functools

    from deepspeed.runtime import compiler

    def compile_at_first_call(fn):
        compiled = None

        @functools.wraps(fn)
        def call(*args, **kwargs):
            nonlocal compiled
            if compiled is None:
                compiled = compiler.compile()(fn)
            return compiled(*args, **kwargs)
        return call

    original = compiler.compile
    compiler.compile = lambda: compile_at_first_call
    try:
        import deepspeed.runtime.zero.muon.muon_optimizer  # noqa: F401 -- imports MUON_MODULE
    finally:
        compiler.compile = original


@contextmanager
def keep_muon_tags():
    """deepspeed.initialize calls `deepspeed.set_optimizer_flags`, which sets `use_muon` on every parameter by name
    (2-D and no "embed"/"lm_head" in it) over whatever the model carried: GPT-2's `wte` and any head not named
    lm_head would take Muon's update. dstrain tags where the model is built (components/muon.py, by what the
    parameter is: `dstrain_muon`); inside this context DeepSpeed's own tagging still runs (its per_head_muon
    option needs it), then each parameter that carries our tag gets it back. Restored on exit."""
    import deepspeed

    original = deepspeed.set_optimizer_flags

    def flags(config_class, model) -> None:
        original(config_class, model)
        for param in model.parameters():
            if hasattr(param, "dstrain_muon"):
                param.use_muon = param.dstrain_muon

    deepspeed.set_optimizer_flags = flags  # deepspeed/__init__.py's initialize looks the name up at call time
    try:
        yield
    finally:
        deepspeed.set_optimizer_flags = original


MUON_UPDATE_MODULES = (MUON_MODULE, "deepspeed.runtime.zero.muon.muon_optimizer")


def count_muon_updates(shapes: list) -> Callable[[], None]:
    """Record the shape of every matrix DeepSpeed's Muon orthogonalises (appended to `shapes`) until the returned
    function undoes it. Every path of DeepSpeed 0.19.8 goes through `original_muon.muon_update` (momentum, then
    Newton-Schulz): ZeRO-1/2 (stage_1_and_2's get_flat_partition and its CPU-offload path, imported at call
    time), ZeRO-3 (stage3._muon_update_sub_group, at call time) and ZeRO-0 (muon_optimizer.MuonWithAuxAdam.step,
    imported into muon_optimizer at its import): the name is replaced in both modules."""
    import sys

    defer_muon_compile()
    import deepspeed.runtime.zero.muon.muon_optimizer  # noqa: F401 -- imports MUON_MODULE
    modules = [sys.modules[name] for name in MUON_UPDATE_MODULES]
    originals = [module.muon_update for module in modules]

    def counting(original):
        @functools.wraps(original)
        def muon_update(grad, *args, **kwargs):
            shapes.append(tuple(grad.shape))
            return original(grad, *args, **kwargs)
        return muon_update

    for module, original in zip(modules, originals):
        module.muon_update = counting(original)

    def undo() -> None:
        for module, original in zip(modules, originals):
            module.muon_update = original
    return undo
