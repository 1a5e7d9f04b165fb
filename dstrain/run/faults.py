"""Failure injection for the fault-tolerance tests; does nothing unless DSTRAIN_FAULT is set.

    DSTRAIN_FAULT="<point>:<action>[:rank=R][:step=S]"   several separated by ';'

points   validate (before the validation pass, step 0), step (before a training step), save:copy (a background
         save's deferred copy of the engine's state), save:write (a background save's file), save:shards (files
         written, not yet listed), save:manifest
         (complete.json written, not yet published), save:publish (renamed, `latest` not yet written),
         save:prune (published, old checkpoints not yet pruned)
         compute (a training step's micro-batches: `compute:slower:factor=F`, see stretch()), params (a
         training step's weights before its forward: `params:flip[:param=NAME][:bit=B]` flips one bit),
         forward, backward (a training step's module, `module=NAME` of engine.module, e.g. model.layers.0.mlp:
         its output, or the gradient flowing back through it; armed by arm()), muon (`muon:untag`: every
         parameter's Muon tag cleared after tagging, as DeepSpeed #8438 left them: everything on AdamW)
actions  kill (SIGKILL this process), stall (sleep forever, like a stuck data loader), enospc (raise
         "No space left on device", like a full disk), slow (sleep `seconds=N`, default 30, then go on:
         a slow data loader or file system; with `until=EVENT` only until the code calls release(EVENT):
         `step:slow:seconds=10:until=compiled` slows the steps while train.compile works in the background;
         `until=signalled`: until a signal asks the rank to stop, dstrain/run/preempt.py);
         for forward/backward: nan (the module's output, or its input's gradient, made NaN), scale (the module's
         output times `factor=F`, default 30: an activation outlier, a loss spike; `times=N`: only the first N
         calls of the step, a transient fault)

Real failures are used where a test can make them (kill -9 from outside, a full tmpfs); injection covers
the points in between that no outside timing can hit reliably.
"""
from __future__ import annotations

import errno
import os
import signal
import threading
import time
from collections.abc import Callable

from .. import env


def _parse(spec: str) -> list[tuple[str, str, dict[str, int]]]:
    rules = []
    for item in filter(None, (s.strip() for s in spec.split(";"))):
        parts = item.split(":")
        point_parts, where = [], {}
        for part in parts:
            key, sep, value = part.partition("=")
            if sep:
                where[key] = int(value) if value.lstrip("-").isdigit() else value
            else:
                point_parts.append(part)
        *point, action = point_parts
        rules.append((":".join(point), action, where))
    return rules


# Parsed when first asked, not at import: the suite's warm ranks (tests/warm.py) are forks of a process that imported
# this module before their own DSTRAIN_FAULT was set (read at import, no fault fired in them).
_RULES: list | None = None
_RELEASED: dict[str, threading.Event] = {}


def _rules() -> list[tuple[str, str, dict[str, int]]]:
    global _RULES
    if _RULES is None:
        _RULES = _parse(env.fault_spec())
    return _RULES


def release(event: str) -> None:
    """The code reached `event` (e.g. "compiled"): a `slow ... until=event` fault stops slowing."""
    if _rules():
        _RELEASED.setdefault(event, threading.Event()).set()


def _nan_gradient(x):
    """Identity forward; the gradient passed back is NaN (a backward that went wrong inside a module). torch is
    imported here: this module is imported before anything heavy (bad input answers without torch)."""
    import torch

    class NaNGradient(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.view_as(x)

        @staticmethod
        def backward(ctx, grad):
            return torch.full_like(grad, float("nan"))
    return NaNGradient.apply(x)


def _first_tensor(output):
    return output[0] if isinstance(output, tuple) else output


def _replace_first(output, tensor):
    return (tensor, *output[1:]) if isinstance(output, tuple) else tensor


def arm(model, rank: int, step: int) -> Callable[[], None]:
    """Hooks for the `forward`/`backward` rules of this rank and step on `model`'s named modules (nothing when
    DSTRAIN_FAULT is unset); returns their removal. Applied inside the module: its own output is changed, so a
    hook registered after it (run/health.py's search) sees the module as the origin."""
    if not _rules():
        return _nothing
    handles = []
    for where, action, cond in _rules():
        if where not in ("forward", "backward", "params") or cond.get("rank", rank) != rank \
                or cond.get("step", step) != step:
            continue
        if where == "params" and action == "flip":
            _flip(model, cond)
            continue
        module = model.get_submodule(cond["module"])
        if where == "backward" and action == "nan":
            def hook(_module, _inputs, output):
                return _replace_first(output, _nan_gradient(_first_tensor(output)))
        elif where == "forward" and action in ("nan", "scale"):
            factor = float("nan") if action == "nan" else float(cond.get("factor", 30))
            left = [cond.get("times", -1)]  # `times=N`: only the first N calls (a transient fault)

            def hook(_module, _inputs, output, factor=factor, left=left):
                if left[0] == 0:
                    return None
                left[0] -= 1
                return _replace_first(output, _first_tensor(output) * factor)
        else:
            raise ValueError(f"DSTRAIN_FAULT: {where}:{action} is not a fault (forward:nan, forward:scale, "
                             f"backward:nan)")
        handles.append(module.register_forward_hook(hook))
    return lambda: [h.remove() for h in handles]


def _flip(model, cond: dict) -> None:
    """Flip bit `bit` (default 20 of fp32, 4 of 16-bit: a mantissa bit, the loss barely moves) of element 0 of
    parameter `param` (default the first) in place: the memory error silent data corruption checks are for."""
    import torch

    name = cond.get("param")
    param = model.get_parameter(name) if name else next(iter(model.parameters()))
    with torch.no_grad():
        bits = param.data.view(-1)[:1].view({2: torch.int16, 4: torch.int32}[param.element_size()])
        bits ^= 1 << int(cond.get("bit", 20 if param.element_size() == 4 else 4))


def active(name: str, action: str) -> bool:
    """Whether DSTRAIN_FAULT holds a `<name>:<action>` rule (a condition of the run, not of a rank or step)."""
    return any(where == name and what == action for where, what, _ in _rules())


def _nothing() -> None:
    pass


def stretch(rank: int, step: int, seconds: float) -> None:
    """A `compute:slower:factor=F` rule (any step, or `step=S`) makes this rank's micro-batch take F times as long:
    it sleeps (F - 1) x the `seconds` the micro-batch's forward and backward took (a slow device, not a slow
    network: the other ranks wait for it in their collectives)."""
    for where, action, cond in _rules():
        if where == "compute" and action == "slower" and cond.get("rank", rank) == rank \
                and cond.get("step", step) == step:
            time.sleep((float(cond.get("factor", 2)) - 1) * seconds)


def point(name: str, rank: int, step: int) -> None:
    """Fail here when DSTRAIN_FAULT asks for it at this point, rank and step."""
    for where, action, cond in _rules():
        if where != name or cond.get("rank", rank) != rank or cond.get("step", step) != step:
            continue
        if action == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif action == "stall":
            while True:
                time.sleep(3600)
        elif action == "slow":
            until = _RELEASED.setdefault(cond["until"], threading.Event()) if "until" in cond else None
            if until is None:
                time.sleep(cond.get("seconds", 30))
            else:
                until.wait(cond.get("seconds", 30))
        elif action == "enospc":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        else:
            raise ValueError(f"DSTRAIN_FAULT: unknown action {action!r} (kill, stall, slow, enospc)")
