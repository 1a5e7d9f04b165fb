"""Failures that make no noise, made to happen in real 2-rank runs through the real launcher (dstrain/run/faults.py
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
    Both steps change nothing; every other step's loss equals the reference's with those updates left out.
    The same run: rank 1 computes 3x slower throughout and is named as slow by step 4 (windows of 2 steps, 2 in a
    row), rank 0 never; the replays of steps 4 and 8 (fault.sdc_check_every=4) find the honest ranks honest."""
    run_dir = tmp_path / "run"
    faults = ("backward:nan:rank=1:step=3:module=model.layers.0.mlp;forward:scale:step=6:factor=30:module=lm_head;"
              "compute:slower:factor=3:rank=1")
    proc = launch(COMMON + [f"--model.name_or_path={tiny_llama}", "--ds_config", "ds_configs/zero3.json",
                            "--output_dir", str(run_dir), "--fault.on_spike=skip", "--fault.spike_window=3",
                            "--fault.straggler_every=2", "--fault.straggler_checks=2", "--fault.sdc_check_every=4"],
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
    slow = checks.pop("slow_ranks")
    assert checks == {"skipped_steps": {"non-finite": 1, "loss spike": 1}, "spikes": {"loss spike": 1},
                      "first_nonfinite_module": "rank 1: model.layers.0.mlp (gradient)", "sdc_replica_checks": 0,
                      "sdc_replays": 2, "sdc_found": None}
    assert [(r["rank"], r["step"]) for r in slow] == [(1, 4)] and slow[0]["ratio"] > 1.5, slow
    assert f"slow rank: rank 1 on {slow[0]['host']}" in proc.stderr
    assert [r["slowest_rank"] for r in rows if "slowest_rank" in r] == [1, 1, 1, 1]
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    assert [e["rank"] for e in events if e["event"] == "slow_rank"] == [1]
    assert 0 < summary["health"]["search_s"] < 30 and summary["health"]["check_s"] < 5
    assert "health      steps skipped: 1 non-finite, 1 loss spike; spikes: 1 loss spike" in proc.stderr


def test_nonfinite_steps_in_a_row_stop_the_run_with_the_last_good_weights_checkpointed(tmp_path, cache, tiny_llama):
    """ZeRO-0 fp32 (the engine holds the torch optimizer itself): layer 1's attention output is NaN at steps 3
    and 4 on both ranks; fault.max_skipped_steps=2 stops the run there, exit 65, and the checkpoint it leaves
    holds the weights after step 2, equal to the reference's, finite."""
    run_dir = tmp_path / "run"
    faults = ";".join(f"forward:nan:step={s}:module=model.layers.1.self_attn" for s in (3, 4))
    proc = launch(COMMON + [f"--model.name_or_path={tiny_llama}", "--ds_config", "ds_configs/zero0.json",
                            "--output_dir", str(run_dir), "--fault.max_skipped_steps=2"],
                  cache, launcher="warm", check=False, DSTRAIN_FAULT=faults)
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


def test_a_flipped_bit_in_one_ranks_weights_is_found_named_and_never_checkpointed(tmp_path, cache, tiny_llama):
    """ZeRO-0 on 3 ranks (every rank holds the whole model; a majority can say who is wrong): one bit of rank 2's
    embedding flips during step 3 (after the checkpoint of step 2). The check at the start of step 4
    (fault.sdc_check_every=2) names rank 2, skips the update, writes no checkpoint, exits 1 (launch/ retries)."""
    run_dir = tmp_path / "run"
    proc = launch(COMMON + [f"--model.name_or_path={tiny_llama}", "--ds_config", "ds_configs/zero0.json",
                            "--output_dir", str(run_dir), "--fault.sdc_check_every=2", "--checkpoint.every=2"],
                  cache, launcher="warm", nproc=3, check=False, DSTRAIN_FAULT="params:flip:rank=2:step=3")
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "silent data corruption: the weights of rank 2 (" in proc.stderr
    assert "differ from the other ranks' at the start of step 4" in proc.stderr
    assert sorted(p.name for p in (run_dir / "checkpoints").glob("step_*")) == ["step_00000002"]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "stopped (silent data corruption)" and summary["checkpoint"] is None
    assert summary["health"]["sdc_replica_checks"] == 2  # at the start of step 2 (its checkpoint's too), of step 4


def test_a_step_one_rank_computes_wrongly_is_found_by_its_replay(tmp_path, cache, tiny_llama):
    """ZeRO-2 in bf16: at step 4 rank 1's layer-0 MLP output is 5% off in the step itself (a transient fault: the
    replay computes it right). The replay of step 4 (fault.sdc_check_every=2) names rank 1 before the update; step
    2's replay passed (bf16 rounds the replay as it rounded the step: replayed with the step's loss scaling, or
    every honest bf16 step differed by up to 15% in the gradient's signed sum). No checkpoint holds step 4; the
    run exits 1."""
    run_dir = tmp_path / "run"
    proc = launch(COMMON + [f"--model.name_or_path={tiny_llama}", "--ds_config", "ds_configs/zero2.json",
                            "--output_dir", str(run_dir), "--fault.sdc_check_every=2", "--checkpoint.every=2",
                            "--train.precision=bf16"], cache, launcher="warm", check=False,
                  DSTRAIN_FAULT="forward:scale:rank=1:step=4:factor=1.05:times=1:module=model.layers.0.mlp")
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "silent data corruption: step 4 replayed on the same weights gave other numbers on rank 1 (" \
        in proc.stderr
    assert sorted(p.name for p in (run_dir / "checkpoints").glob("step_*")) == ["step_00000002"]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r.get("skipped") for r in rows if "loss" in r] == [None, None, None, "silent data corruption"]
