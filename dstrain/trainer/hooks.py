"""Step hooks: what runs around every optimizer step besides the step itself, in one ordered list.

The loop (trainer.py) calls each point of this protocol once per step, for every hook in the list's order, on
every rank; a hook that makes a collective therefore makes it in the same order everywhere. A hook implements
every method (no optional parts, so nothing is found by hasattr):

  name                        the key its state_dict is kept under in a checkpoint's manifest
  stopping                    True once the hook wants the run to end now (the same value on every rank)
  before_step(step)           before the step's first micro-batch (the SDC check compares the replicas' weights)
  after_update(step, say)     right after the optimizer step, as part of it: its time and bytes count in the step's
                              figures (DiLoCo's outer step, compile's switch to compiled blocks, Muon's proof,
                              the trace's window)
  after_step(result)          the step measured (StepResult: loss, pre-clip grad norm, seconds, seconds in
                              collectives); adds its metrics columns to result.columns (stragglers; the
                              non-finite/spike gate, whose grad_norm is the one it judged)
  before_save(step) -> bool   before a checkpoint, called on every hook (every rank); False: nothing may be saved
  state_dict() / load_state_dict(state)   what a checkpoint keeps for it, by name (None: nothing); a resumed run
                              hands back what was kept, or None for a checkpoint written without it
  close()                     once, after the loop (before the final save): what it installed is removed
  summary() -> dict           its part of summary.json's `health` section
A hook that can stop the run (the gate) also offers `why` (the status the run ends with), `advice(step)` (what to
do next) and `exit_code`.

The order is the list's (trainer.Trainer._hooks): the components' hooks (their own order, components.build), the
objective's own (objectives' optional step_hooks: the MoE routing watch), the slow-rank check, then the gate.
The gate also acts inside the step, through the optimizer's norm check
(ds_internals.gate_optimizer_step) and the SDC replay (steps.train_step's `checks`).
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable


@dataclass
class StepResult:
    """A finished step as the hooks see it after it was measured."""
    step: int
    loss: float
    grad_norm: float | None  # pre-clip, as the engine reported it
    seconds: float  # the step's wall time, the hooks' after_update work included
    comm_s: float  # of it, the time this rank spent in collectives
    columns: dict = field(default_factory=dict)  # the metrics row's extra fields: the objective's, then the hooks'


@runtime_checkable
class StepHook(Protocol):
    name: str
    stopping: bool

    def before_step(self, step: int) -> None: ...

    def after_update(self, step: int, say: Callable[[str], None]) -> None: ...

    def after_step(self, result: StepResult) -> None: ...

    def before_save(self, step: int) -> bool: ...

    def state_dict(self) -> dict | None: ...

    def load_state_dict(self, state: dict | None) -> None: ...

    def close(self) -> None: ...

    def summary(self) -> dict: ...


class ComponentHooks:
    """The components' part of a step (components/__init__.py's after_step) as one hook: their own per-rank
    checkpoint state goes through the checkpointer (components.stateful), so nothing of theirs is in the manifest."""
    name = "components"
    stopping = False

    def __init__(self, components: list):
        self.components = components

    def before_step(self, step: int) -> None:
        pass

    def after_update(self, step: int, say: Callable[[str], None]) -> None:
        for component in self.components:
            component.after_step(step, say)

    def after_step(self, result: StepResult) -> None:
        pass

    def before_save(self, step: int) -> bool:
        return True

    def state_dict(self) -> None:
        return None

    def load_state_dict(self, state) -> None:
        pass

    def close(self) -> None:
        pass

    def summary(self) -> dict:
        return {}


class Hooks:
    """The ordered list, called point by point. `in_step`: the hook train_step also consults inside the step (the
    gate: the loss before the update when a spike is to be skipped, the SDC replay at its check steps)."""

    def __init__(self, hooks: Iterable[StepHook], in_step=None):
        self.hooks, self.in_step = list(hooks), in_step
        for hook in self.hooks:
            assert isinstance(hook, StepHook), f"{hook!r} does not implement the step-hook protocol"

    def before_step(self, step: int) -> None:
        for hook in self.hooks:
            hook.before_step(step)

    def after_update(self, step: int, say: Callable[[str], None]) -> None:
        for hook in self.hooks:
            hook.after_update(step, say)

    def after_step(self, result: StepResult) -> None:
        for hook in self.hooks:
            hook.after_step(result)

    def before_save(self, step: int) -> bool:
        answers = [hook.before_save(step) for hook in self.hooks]  # every hook asked: some make collectives
        return all(answers)

    def close(self) -> None:
        for hook in self.hooks:
            hook.close()

    @property
    def stopping(self):
        """The first hook that wants the run to end now, or None."""
        return next((hook for hook in self.hooks if hook.stopping), None)

    def state_dict(self) -> dict:
        return {hook.name: state for hook in self.hooks if (state := hook.state_dict()) is not None}

    def load_state_dict(self, manifest: dict | None) -> None:
        for hook in self.hooks:
            hook.load_state_dict((manifest or {}).get(hook.name))

    def summary(self) -> dict:
        """summary.json's `health`: each hook's part; the host seconds the checks took (`check_s`) are summed."""
        out: dict = {}
        for hook in self.hooks:
            for key, value in hook.summary().items():
                out[key] = round(out.get(key, 0.0) + value, 6) if key == "check_s" else value
        return out
