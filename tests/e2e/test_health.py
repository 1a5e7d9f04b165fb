"""Failures that make no noise, made to happen in real 2-rank runs through the real launcher (dstrain/faults.py
injects them inside a module, as a bad kernel or an activation outlier would) and checked against the plain
single-process loop (tests/helpers.reference_losses) with the bad steps' updates left out.

Seen failing with the detection off (ds_internals.gate_optimizer_step made a no-op): the NaN gradient reaches
the weights and every later loss is NaN; the spike's update is applied and the losses after it leave the
reference by more than 1e-2; the stopped run trains on (exit 0) over NaN weights.
"""
from __future__ import annotations

import json

import pytest
import torch

from tests.e2e.test_vs_reference import COMMON, LR, MIN_LR, RTOL, STEPS, WARMUP
from tests.helpers import launch, metrics, reference_losses


def test_a_nonfinite_gradient_and_a_loss_spike_are_skipped_and_the_run_equals_one_without_them(
        tmp_path, cache, tiny_llama):
    """ZeRO-3 (parameters built under zero.Init): rank 1's gradient turns NaN inside layer 0's MLP at step 3, and
    the LM head's output is 30x too large at step 6 (a loss spike; fault.on_spike=skip over a 3-step window).
    Both steps change nothing; every other step's loss equals the reference's with those updates left out."""
    run_dir = tmp_path / "run"
    faults = "backward:nan:rank=1:step=3:module=model.layers.0.mlp;forward:scale:step=6:factor=30:module=lm_head"
    proc = launch(COMMON + [f"--model.name_or_path={tiny_llama}", "--ds_config", "ds_configs/zero3.json",
                            "--output_dir", str(run_dir), "--fault.on_spike=skip", "--fault.spike_window=3"],
                  cache, DSTRAIN_FAULT=faults)
    got, _ = metrics(run_dir)
    want, _ = reference_losses(tiny_llama, run_dir, STEPS, LR, WARMUP, MIN_LR, weight_decay=0.1, skip=(3, 6))
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "loss" in r]
    assert [r.get("skipped") for r in rows] == [None, None, "non-finite", None, None, "loss spike", None, None]
    assert rows[-1]["skipped_steps"] == 2 and rows[-1]["spikes"] == 1
    assert got[5] > 3 * want[5], "the injected spike should show in the logged loss"
    kept = [i for i in range(STEPS) if i != 5]
    assert [got[i] for i in kept] == pytest.approx([want[i] for i in kept], rel=RTOL)
    assert "first non-finite module: rank 1: model.layers.0.mlp (gradient)" in proc.stderr
    assert "step 6: loss spike" in proc.stderr
    summary = json.loads((run_dir / "summary.json").read_text())
    checks = {k: v for k, v in summary["health"].items() if not k.endswith("_s")}
    assert checks == {"skipped_steps": {"non-finite": 1, "loss spike": 1}, "spikes": {"loss spike": 1},
                      "first_nonfinite_module": "rank 1: model.layers.0.mlp (gradient)"}
    assert 0 < summary["health"]["search_s"] < 30 and summary["health"]["check_s"] < 0.1
    assert "health      steps skipped: 1 non-finite, 1 loss spike; spikes: 1 loss spike" in proc.stderr


def test_nonfinite_steps_in_a_row_stop_the_run_with_the_last_good_weights_checkpointed(tmp_path, cache, tiny_llama):
    """ZeRO-0 fp32 (the engine holds the torch optimizer itself): layer 1's attention output is NaN at steps 3
    and 4 on both ranks; fault.max_skipped_steps=2 stops the run there, exit 65, and the checkpoint it leaves
    holds the weights after step 2, equal to the reference's, finite."""
    run_dir = tmp_path / "run"
    faults = ";".join(f"forward:nan:step={s}:module=model.layers.1.self_attn" for s in (3, 4))
    proc = launch(COMMON + [f"--model.name_or_path={tiny_llama}", "--ds_config", "ds_configs/zero0.json",
                            "--output_dir", str(run_dir), "--fault.max_skipped_steps=2"],
                  cache, check=False, DSTRAIN_FAULT=faults)
    assert proc.returncode == 65, proc.stderr[-3000:]
    assert "first non-finite module: rank 0: model.layers.1.self_attn (output)" in proc.stderr
    assert "stopping: 2 steps in a row (3-4) were not finite" in proc.stderr
    got, _ = metrics(run_dir)
    want, model = reference_losses(tiny_llama, run_dir, STEPS, LR, WARMUP, MIN_LR, weight_decay=0.1, stop_after=2)
    assert got[:2] == pytest.approx(want, rel=RTOL) and all(v != v for v in got[2:])  # NaN at 3 and 4
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "stopped (fault.max_skipped_steps)" and summary["steps"] == 4
    newest = sorted((run_dir / "checkpoints").glob("step_*"))[-1]
    assert newest.name == "step_00000004"
    state = torch.load(newest / "mp_rank_00_model_states.pt", map_location="cpu", weights_only=False)["module"]
    want_state = model.state_dict()
    assert all(torch.isfinite(t).all() for t in state.values())
    worst = max((state[k].float() - want_state[k]).abs().max().item() for k in state)
    assert worst < 1e-5, f"the checkpoint's weights differ from the last good step's by {worst:.1e}"
