"""run/health.py's judgement of each step, driven as train.py drives it (begin, the optimizer's question with the
step's norm, after), without an engine: the optimizer's side is tested by test_ds_internals.test_optimizer_step_gate
and the whole loop by tests/e2e/test_health.py."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from dstrain.config import FaultConfig
from dstrain.errors import UserError
from dstrain.parallel.layout import Layout
from dstrain.run import health
from dstrain.run.health import StepHealth


class Engine(SimpleNamespace):
    def fp16_enabled(self) -> bool:
        return False


def judge(checks: StepHealth, engine, step: int, loss: float, norm: float, said: list, searched: list | None = None):
    """One step: the optimizer asks (as DeepSpeed's norm check does) and skips when told to."""
    checks.begin(step)
    if checks.loss_hook:
        checks.loss_hook(loss)
    if checks._decide(norm):
        engine.skipped_steps += 1
    return checks.after(step, loss, norm, lambda s: (searched if searched is not None else []).append(s) or "m (x)")


def make(said: list, fp16: bool = False, **fault) -> tuple[StepHealth, Engine]:
    engine = Engine(skipped_steps=0, optimizer=object())
    return StepHealth(FaultConfig(**fault), fp16, said.append).attach(engine), engine


def test_a_logged_spike_is_said_and_counted_but_trains_and_stays_out_of_the_window():
    said: list = []
    checks, engine = make(said, spike_window=4)
    for step, loss in enumerate([5.0, 4.9, 4.8, 4.7], 1):
        assert judge(checks, engine, step, loss, 1.0, said)["spikes"] == 0
    row = judge(checks, engine, 5, 9.0, 1.0, said)
    assert row["spike"] == "loss spike" and "skipped" not in row and engine.skipped_steps == 0
    assert list(checks.losses) == [5.0, 4.9, 4.8, 4.7]  # the spike is not the new normal
    assert "step 5: loss spike: 9 against a mean of 4.85" in said[-1] and "logged only" in said[-1]
    row = judge(checks, engine, 6, 1.0, 50.0, said)  # a grad-norm spike over norms of 1.0 (sd 0)
    assert row["spike"] == "grad-norm spike" and checks.summary()["spikes"] == {"loss spike": 1, "grad-norm spike": 1}
    assert not any("keeps spiking" in line for line in said)
    judge(checks, engine, 7, 9.0, 1.0, said)  # a third spike within the window of 4 steps
    assert "the run keeps spiking: 3 spikes in the last 4 steps (steps 5, 6, 7)" in said[-1]
    judge(checks, engine, 8, 9.0, 1.0, said)  # said once a window, not at every spike
    assert sum("keeps spiking" in line for line in said) == 1


def test_skipped_spikes_need_a_full_window_and_end_the_run_when_they_never_stop():
    said: list = []
    checks, engine = make(said, spike_window=3, on_spike="skip", max_skipped_steps=2)
    assert judge(checks, engine, 1, 5.2, 1.0, said).get("skipped") is None  # no window yet: nothing to judge
    for step, loss in [(2, 5.0), (3, 5.1)]:
        judge(checks, engine, step, loss, 1.0, said)
    assert judge(checks, engine, 4, 50.0, 1.0, said)["skipped"] == "loss spike" and not checks.stopping
    assert judge(checks, engine, 5, 50.0, 1.0, said)["skipped"] == "loss spike" and checks.stopping
    assert engine.skipped_steps == 2
    assert "stopping: 2 steps in a row (4-5) were a spike" in said[-1] and "fault.on_spike=log" in said[-1]


def test_nonfinite_steps_are_searched_once_and_a_good_step_resets_the_count():
    said, searched = [], []
    checks, engine = make(said, max_skipped_steps=2)
    assert judge(checks, engine, 1, 5.0, float("nan"), said, searched)["skipped"] == "non-finite"
    assert searched == [1] and "first non-finite module: m (x)" in said[-1]
    judge(checks, engine, 2, 4.9, 1.0, said, searched)
    assert checks.in_a_row == 0
    judge(checks, engine, 3, float("nan"), float("nan"), said, searched)
    assert searched == [1] and not checks.stopping  # searched only the first time
    judge(checks, engine, 4, 4.8, float("inf"), said, searched)
    assert checks.stopping and checks.summary()["skipped_steps"] == {"non-finite": 3}
    assert "(first non-finite module: m (x))" in said[-1] and "train.lr" in said[-1]


def test_fp16_overflow_is_the_loss_scalers_and_never_stops_the_run():
    said, searched = [], []
    checks, engine = make(said, fp16=True, max_skipped_steps=1)
    for step in range(1, 4):
        assert judge(checks, engine, step, 5.0, float("inf"), said, searched)["skipped"] == "fp16 overflow"
    assert not checks.stopping and searched == [] and said == []


def test_an_update_applied_with_a_nonfinite_loss_stops_without_a_checkpoint():
    """An optimizer that never asks (none of DeepSpeed's ZeRO or bf16 ones) took a step whose loss was NaN."""
    said: list = []
    checks, engine = make(said)
    checks.begin(1)
    checks.after(1, float("nan"), 1.0, lambda s: None)
    assert checks.stopping and checks.weights_bad and "without a checkpoint" in said[-1]


def test_the_window_travels_in_the_checkpoint():
    said: list = []
    checks, engine = make(said, spike_window=3)
    for step, loss in enumerate([5.0, 4.0, 3.0], 1):
        judge(checks, engine, step, loss, 1.0, said)
    again, _ = make(said, spike_window=3)
    again.restore(checks.state())
    assert again.state() == checks.state() and list(again.losses) == [5.0, 4.0, 3.0]


@pytest.mark.parametrize("fault, message", [
    ({"max_skipped_steps": 0}, "fault.max_skipped_steps=0 must be at least 1"),
    ({"spike_sigma": 0}, "fault.spike_sigma=0 must be positive"),
    ({"spike_window": 1}, "fault.spike_window=1 at least 2"),
    ({"on_spike": "drop"}, "fault.on_spike='drop' must be log or skip"),
])
def test_bad_fault_settings_are_one_line(fault, message):
    with pytest.raises(UserError, match=message.replace("(", r"\(").replace(")", r"\)")):
        FaultConfig(**fault)


def test_skipping_spikes_is_refused_where_it_cannot_work():
    with pytest.raises(UserError, match="fault.on_spike=skip needs bf16 or fp32"):
        health.check(FaultConfig(on_spike="skip"), "fp16", Layout(2))
    health.check(FaultConfig(on_spike="log"), "fp16", Layout(2))
    health.check(FaultConfig(on_spike="skip"), "bf16", Layout(2))
